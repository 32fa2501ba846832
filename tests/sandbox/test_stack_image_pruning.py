"""Image pruning (``make up``'s ``stack_images --prune``) removes only its own stack's superseded
images: two stacks' images on one daemon, pruning one leaves the other's, and an image from
before the stack label is left to the user."""

from __future__ import annotations

import io
import uuid

import pytest

from services.cli.stack_images import StackImages, prune_superseded
from services.rollout_worker.sandbox.images import LABEL_IMAGE, image_labels

pytestmark = [pytest.mark.docker, pytest.mark.timeout(120)]


def test_pruning_one_stack_leaves_the_other_stacks_images(docker_client, busybox_image):
    test_label = f"conveyor.test-prune={uuid.uuid4().hex[:8]}"
    stacks = [f"prunetest-{test_label[-8:]}-{name}" for name in ("a", "b")]

    def build(tag: str, labels: dict[str, str]) -> str:
        """A tiny image of its own (the tag is in its labels, so every id differs)."""
        dockerfile = f"FROM {busybox_image}\n".encode()
        key, value = test_label.split("=")
        docker_client.images.build(fileobj=io.BytesIO(dockerfile), tag=tag, rm=True, pull=False,
                                   labels={**labels, key: value, "conveyor.test-tag": tag})
        return tag

    def tags_left() -> set[str]:
        return {t for image in docker_client.images.list(filters={"label": test_label}) for t in image.tags}

    def tag_of(stack_id: str, what: str) -> str:
        return f"conveyor/redis:{stack_id}-{what}"

    try:
        for stack_id in stacks:
            for what in ("current", "superseded"):
                build(tag_of(stack_id, what), image_labels("redis", stack_id))
        legacy = build(f"conveyor/redis:{stacks[0]}-legacy", {LABEL_IMAGE: "redis"})  # before the stack label

        def keep(stack_id: str) -> StackImages:
            return StackImages(base=busybox_image, service="conveyor/service:none", worker="conveyor/worker:none",
                               redis=tag_of(stack_id, "current"),
                               s3="conveyor/s3:none")

        assert prune_superseded(docker_client, keep(stacks[0]), stack_id=stacks[0]) == [tag_of(stacks[0], "superseded")]
        assert tags_left() == {tag_of(stacks[0], "current"), tag_of(stacks[1], "current"),
                               tag_of(stacks[1], "superseded"), legacy}
        assert prune_superseded(docker_client, keep(stacks[1]), stack_id=stacks[1]) == [tag_of(stacks[1], "superseded")]
        assert tags_left() == {tag_of(stacks[0], "current"), tag_of(stacks[1], "current"), legacy}
    finally:
        for image in docker_client.images.list(filters={"label": test_label}):
            for tag in image.tags:
                docker_client.images.remove(tag, force=True)
        assert tags_left() == set()
