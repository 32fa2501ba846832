"""A Docker client for test suites that create containers: skips the suite without a daemon,
and at the end removes, and fails on, any container the suite left behind under its run label."""

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
