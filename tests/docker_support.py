"""For test suites that create containers: a Docker client that skips the suite without a daemon
and at the end removes, and fails on, any container the suite left behind under its run label;
and a maker of labelled coding environments that checks each test left no container."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import docker
import pytest


@contextmanager
def leak_checked_docker_client(run_label: str, suite: str) -> Iterator[docker.DockerClient]:
    try:
        client = docker.from_env(max_pool_size=64)
        client.ping()
    except Exception as exc:  # no daemon, no socket, no permission
        pytest.skip(f"needs a running Docker daemon (docker.from_env().ping() failed: {exc})")
    yield client
    leftovers = client.api.containers(all=True, filters={"label": run_label})
    for info in leftovers:
        client.api.remove_container(info["Id"], force=True, v=True)
    assert not leftovers, f"containers left behind by the {suite} tests: {[c['Names'] for c in leftovers]}"


@contextmanager
def coding_env_maker(client: docker.DockerClient, image: str, cache_dir: str, run_id: str, test_name: str):
    """Yields ``make(**env_config)``: a CodingEnv on ``image``, labelled for one test. On exit every
    env is closed, and the test's trajectories must have no container left."""
    import asyncio
    import re

    from services.rollout_worker.environments.coding import CodingEnv

    made: list[CodingEnv] = []

    def make(**config) -> CodingEnv:
        env = CodingEnv({"image": image, "workspace_cache_dir": cache_dir, "command_timeout_s": 20,
                         "test_timeout_s": 60, **config})
        trajectory = re.sub(r"[^A-Za-z0-9_.-]", "-", f"{run_id}-{test_name}")[:180] + f"-{len(made)}"
        env.bind_trajectory(run_id=run_id, group_id="g0", trajectory_id=trajectory)
        made.append(env)
        return env

    yield make
    for env in made:
        asyncio.run(env.close())
        left = client.api.containers(all=True, filters={
            "label": [f"conveyor.run_id={run_id}", f"conveyor.trajectory_id={env.labels.trajectory_id}"]})
        assert not left, f"{env.labels.trajectory_id} left containers behind: {[c['Names'] for c in left]}"
