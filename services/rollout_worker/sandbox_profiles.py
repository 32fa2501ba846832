"""Language profiles: the sandbox image a task gets from its ``language``.

Recipes are ``images/profiles/<profile>/Dockerfile``: each is ``FROM ${BASE}`` (a local Debian
bookworm base, normally the debootstrap ``conveyor/python-base``; nothing is pulled from a
registry) and installs its toolchain from Debian packages (the base's mirror must be reachable
from ``docker build``). An optional extra CA bundle (PEM) is installed before apt runs, for
TLS-intercepting proxies.

Invariant: a tag names exactly one recipe: ``conveyor/profile-<profile>:<sha256 of (Dockerfile,
base image id, CA bundle)>[:12]``. An existing tag is reused, never rebuilt; a changed Dockerfile,
a rebuilt base or another CA bundle gives a new tag. Blocking: call from async code through
``sandbox.blocking.run_blocking``.
"""

from __future__ import annotations

import io
import tarfile
from pathlib import Path

import docker
import docker.errors

from .sandbox.images import IMAGES_DIR, content_hash, image_exists, image_labels

PROFILES_DIR = IMAGES_DIR / "profiles"
PROFILES = ("dev-base", "python", "node", "rust", "go", "c")
DEFAULT_PROFILE = "dev-base"
BASE_PROFILE = "dev-base"  # every other profile builds on it (it holds the extra CA bundle)
PROFILE_REPOSITORY = "conveyor/profile-{profile}"

_ALIASES = {
    "python": "python", "python3": "python", "py": "python",
    "node": "node", "nodejs": "node", "javascript": "node", "js": "node", "typescript": "node", "ts": "node",
    "rust": "rust", "rs": "rust",
    "go": "go", "golang": "go",
    "c": "c", "c++": "c", "cpp": "c", "cxx": "c", "cc": "c",
    "dev-base": "dev-base",
}


def profile_for_language(language: str | None) -> str:
    """The profile for a task's ``language`` (case and surrounding space ignored); unknown or
    missing languages get the generic ``dev-base``."""
    if not language:
        return DEFAULT_PROFILE
    return _ALIASES.get(language.strip().lower(), DEFAULT_PROFILE)


def dockerfile_path(profile: str) -> Path:
    if profile not in PROFILES:
        raise ValueError(f"unknown profile {profile!r}; expected one of {', '.join(PROFILES)}")
    return PROFILES_DIR / profile / "Dockerfile"


def profile_tag(client: docker.DockerClient, profile: str, base_image: str,
                ca_bundle: Path | str | bytes | None = None) -> str:
    """The tag ``build_profile_image`` would produce, without building: a hash of the profile's
    Dockerfile (and dev-base's, for the profiles built on it), the base image id and the CA
    bundle. Raises if the base is missing."""
    recipes = [dockerfile_path(profile).read_bytes()]
    if profile != BASE_PROFILE:
        recipes.append(dockerfile_path(BASE_PROFILE).read_bytes())
    base_id = _base_image_id(client, base_image)
    digest = content_hash(*recipes, base_id.encode(), _ca_bytes(ca_bundle))
    return f"{PROFILE_REPOSITORY.format(profile=profile)}:{digest}"


def build_profile_image(client: docker.DockerClient, profile: str, base_image: str,
                        ca_bundle: Path | str | bytes | None = None, *, timeout_s: float | None = None) -> str:
    """Build (or reuse) the image of ``profile`` on ``base_image`` and return its tag.

    ``ca_bundle``: a PEM file path (or its bytes) trusted inside the build and the image.
    ``timeout_s``: HTTP read timeout of the build call; None (default) waits as long as apt takes
    (the client's default 60 s would cut a quiet ``apt-get install`` short).
    """
    tag = profile_tag(client, profile, base_image, ca_bundle)
    if image_exists(client, tag):
        return tag
    if profile != BASE_PROFILE:  # language profiles build on dev-base, which holds the CA bundle
        base_image = build_profile_image(client, BASE_PROFILE, base_image, ca_bundle, timeout_s=timeout_s)
    dockerfile = dockerfile_path(profile).read_bytes()
    ca = _ca_bytes(ca_bundle)
    base_id = _base_image_id(client, base_image)
    context = io.BytesIO()
    with tarfile.open(fileobj=context, mode="w") as tar:
        info = tarfile.TarInfo("Dockerfile")
        info.size = len(dockerfile)
        tar.addfile(info, io.BytesIO(dockerfile))
    context.seek(0)
    buildargs = {"BASE": base_id}  # the immutable id: a retagged base cannot change what we build
    if ca.strip():
        buildargs["EXTRA_CA_PEM"] = ca.decode("ascii")
    try:
        client.images.build(fileobj=context, custom_context=True, tag=tag, rm=True, forcerm=True, pull=False,
                            buildargs=buildargs, timeout=timeout_s,
                            labels={**image_labels(f"profile-{profile}"), "conveyor.profile.base": base_id})
    except docker.errors.BuildError as exc:
        tail = "".join(str(chunk.get("stream", chunk.get("error", ""))) for chunk in exc.build_log)[-2000:]
        raise RuntimeError(f"building profile {profile!r} on {base_image} failed: {exc.msg}\n{tail}") from exc
    return tag


def _base_image_id(client: docker.DockerClient, base_image: str) -> str:
    try:
        return client.images.get(base_image).id
    except docker.errors.ImageNotFound as exc:
        raise RuntimeError(f"base image {base_image!r} is not present locally; build it first "
                           "(services.rollout_worker.sandbox.images.build_python_base_image)") from exc


def _ca_bytes(ca_bundle: Path | str | bytes | None) -> bytes:
    if ca_bundle is None:
        return b""
    if isinstance(ca_bundle, bytes):
        data = ca_bundle
    else:
        data = Path(ca_bundle).read_bytes()
    if data.strip() and b"-----BEGIN CERTIFICATE-----" not in data:
        raise ValueError("ca_bundle must be PEM (-----BEGIN CERTIFICATE-----)")
    return data
