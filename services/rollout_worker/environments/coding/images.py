"""Which image a coding task's sandboxes start from, and the Python language profile's image.

Resolution order: ``env_config.image``, the task's own ``image``, ``env_config.images[language]``,
then the built-in profile for the language, built on first use: ``python`` here, and
``node``/``rust``/``go``/``c``/``dev-base`` from ``images/profiles`` on top of the Python image
(``sandbox_profiles``; any other language gets ``dev-base``).

The Python profile (``images/python/packages.txt``): Debian bookworm minbase via debootstrap with
python3, pytest (Debian's ``python3-pytest``, so tests run without network), git and CA
certificates, imported with ``docker import`` by the sandbox package's ``build_python_base_image``.
Its tag is the content hash of that recipe: reused when present, never rebuilt.

Invariant: an image is built at most once per process (a lock per language); an unknown language
without a configured image is an error naming the setting to add.

Run ``python -m services.rollout_worker.environments.coding.images [--ca-bundle FILE]`` (or
``images/python/build.sh``) to build it ahead of time; it prints the tag.
"""

from __future__ import annotations

import argparse
import asyncio
import threading
import time
from pathlib import Path
from collections.abc import Callable

import docker

from services.rollout_worker.sandbox.images import IMAGES_DIR, build_python_base_image

from .config import CodingConfig

PYTHON_PACKAGES = IMAGES_DIR / "python" / "packages.txt"
PYTHON_REPOSITORY = "conveyor/python"


class NoImage(LookupError):
    pass


def python_packages() -> tuple[str, ...]:
    lines = (line.split("#", 1)[0].strip() for line in PYTHON_PACKAGES.read_text().splitlines())
    return tuple(line for line in lines if line)


def build_python_image(client: docker.DockerClient | None = None, *, ca_bundle: Path | str | None = None) -> str:
    """The Python profile's image tag, built (about a minute, needs root and a Debian mirror) if absent."""
    return build_python_base_image(client, include=python_packages(), repository=PYTHON_REPOSITORY,
                                   ca_bundle=ca_bundle)


def build_language_image(profile: str) -> str:
    """A language profile (``images/profiles/<profile>``) on top of the Python image, which
    brings git and pytest; built once, tagged by content hash."""
    from services.rollout_worker.sandbox.client import default_client
    from services.rollout_worker.sandbox_profiles import build_profile_image

    return build_profile_image(default_client(), profile, build_python_image())


BUILDERS: dict[str, Callable[[], str]] = {"python": build_python_image}
_built: dict[str, str] = {}
_lock = threading.Lock()


def _build_profile(profile: str) -> str:
    with _lock:
        if profile not in _built:
            builder = BUILDERS.get(profile)
            _built[profile] = builder() if builder else build_language_image(profile)
        return _built[profile]


async def resolve_image(language: str, task_image: str | None, config: CodingConfig) -> str:
    from services.rollout_worker.sandbox_profiles import profile_for_language

    configured = config.image or task_image or config.images.get(language)
    if configured:
        return configured
    if config.build_missing_images:
        return await asyncio.to_thread(_build_profile, profile_for_language(language))
    raise NoImage(f"no sandbox image for language {language!r}: set env_config.images.{language} "
                  "or allow build_missing_images")


def main() -> None:
    parser = argparse.ArgumentParser(description="Build the coding environment's Python sandbox image.")
    parser.add_argument("--ca-bundle", help="extra CA bundle to trust (TLS-intercepting proxies)")
    args = parser.parse_args()
    started = time.monotonic()
    tag = build_python_image(ca_bundle=args.ca_bundle)
    print(f"{tag}  ({time.monotonic() - started:.1f} s)")


if __name__ == "__main__":
    main()
