"""The compose and swarm tests share one build of the stack's images per session."""

from __future__ import annotations

import os
import shutil

import pytest

from services.cli.stack_images import StackImages, build_stack_images, prune_superseded
from services.rollout_worker.sandbox.client import default_client


@pytest.fixture(scope="session")
def images() -> StackImages:
    if os.geteuid() != 0 or shutil.which("debootstrap") is None:
        pytest.skip("building the base image needs root and debootstrap")
    images = build_stack_images()
    prune_superseded(default_client(), images)  # a CI disk holds one service image, not one per commit
    return images
