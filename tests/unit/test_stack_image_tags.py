"""The service and worker images come from one recipe (``compose/images/conveyor``) and still get
distinct, stable content-hash tags: each tag hashes the image's requirements and build args as
well as the shared recipe and source. Every build arg an image passes is declared by the recipe
(docker ignores an undeclared one, with only a warning)."""

from __future__ import annotations

import re

from services.cli.stack_images import PYTHON_IMAGES, PYTHON_RECIPE, RECIPES, PythonImage, python_image_tag

REQUIREMENTS = ["redis==5.0.0", "celery==5.4.0"]


def test_the_two_images_of_one_recipe_get_distinct_stable_tags() -> None:
    service, worker = PYTHON_IMAGES["service"], PYTHON_IMAGES["worker"]
    tags = {name: python_image_tag(image, "sha256:base", REQUIREMENTS) for name, image in PYTHON_IMAGES.items()}
    assert tags["service"].startswith("conveyor/service:") and tags["worker"].startswith("conveyor/worker:")
    assert tags["service"].split(":")[1] != tags["worker"].split(":")[1]  # the build args differ
    assert python_image_tag(service, "sha256:base", REQUIREMENTS) == tags["service"]  # stable
    assert python_image_tag(worker, "sha256:base", REQUIREMENTS[:1]) != tags["worker"]  # requirements count
    assert python_image_tag(worker, "sha256:other", REQUIREMENTS) != tags["worker"]  # so does the base
    compiler = PythonImage("worker", worker.requirements, {"EXTRA_APT_PACKAGES": "g++"})
    assert python_image_tag(compiler, "sha256:base", REQUIREMENTS) != tags["worker"]


def test_every_build_arg_is_declared_by_the_recipe_and_only_the_service_image_has_a_compiler() -> None:
    declared = set(re.findall(r"^ARG (\w+)", (RECIPES / PYTHON_RECIPE / "Dockerfile").read_text(), re.M))
    for image in PYTHON_IMAGES.values():
        assert set(image.buildargs) <= declared, (image.name, image.buildargs)
    assert "g++" in PYTHON_IMAGES["service"].buildargs["EXTRA_APT_PACKAGES"].split()
    assert "g++" not in " ".join(PYTHON_IMAGES["worker"].buildargs.values()).split()
