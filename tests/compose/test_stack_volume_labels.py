"""The compose stack's named volumes carry its stack id (``conveyor.stack``), like its images and
sandboxes: compose creates them for one service (the busybox image stands in for Redis, and
nothing starts), and ``down -v`` removes them."""

from __future__ import annotations

import subprocess
import uuid
from pathlib import Path

import pytest

from compose_support import Stack, compose_command, example_env, write_env
from services.rollout_worker.sandbox.client import default_client
from services.rollout_worker.sandbox.images import build_busybox_image

pytestmark = [pytest.mark.docker, pytest.mark.timeout(120)]


def test_the_named_volumes_carry_the_stack_id(tmp_path: Path) -> None:
    project = f"stkidvol{uuid.uuid4().hex[:6]}"
    images = {"CONVEYOR_SERVICE_IMAGE": "unused:test", "CONVEYOR_WORKER_IMAGE": "unused:test", "CONVEYOR_S3_IMAGE": "unused:test",
              "CONVEYOR_REDIS_IMAGE": build_busybox_image(default_client())}
    env_file = write_env(tmp_path / "stack.env", {**example_env(), **images, "CONVEYOR_STACK_ID": project})
    stack = Stack(project, env_file, {}, compose_command())
    try:
        stack.dc("up", "--no-start", "redis", timeout=90)
        labelled = subprocess.run(["docker", "volume", "ls", "-q", "--filter", f"label=conveyor.stack={project}"],
                                  capture_output=True, text=True, check=True).stdout.split()
        volumes = ["models", *(f"redis-cluster-{n}" for n in range(1, 7)), "redis-data", "run-data", "s3-data"]
        assert sorted(labelled) == [f"{project}_{v}" for v in volumes]  # the cluster profile's too (created unused)
    finally:
        stack.tear_down()
