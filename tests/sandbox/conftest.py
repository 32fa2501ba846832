"""Fixtures for the sandbox tests: a real Docker daemon, the busybox image, a host Redis.

Every container a test creates is labelled ``conveyor.run_id=<RUN_ID>`` of this pytest session.
The session finalizer removes any that remain and fails the run if there were some: no
container is left behind, even when a test fails.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
import uuid

import pytest
from docker_support import leak_checked_docker_client

from services.cli import local_stack
from services.rollout_worker.sandbox import SandboxLabels, SandboxSpec
from services.rollout_worker.sandbox.images import build_busybox_image

RUN_ID = "sbtest-" + uuid.uuid4().hex[:8]
RUN_LABEL = f"conveyor.run_id={RUN_ID}"


@pytest.fixture(scope="session")
def docker_client():
    with leak_checked_docker_client(RUN_LABEL, "sandbox") as client:
        yield client


@pytest.fixture(scope="session")
def busybox_image(docker_client) -> str:
    return build_busybox_image(docker_client)


@pytest.fixture
def make_spec(busybox_image, request):
    """``make_spec(**overrides)``: a SandboxSpec on the busybox image, labelled for this test."""
    def make(**overrides) -> SandboxSpec:
        trajectory = f"{RUN_ID}_{request.node.name}_{uuid.uuid4().hex[:4]}"[:150]
        labels = SandboxLabels(run_id=RUN_ID, group_id="g0", trajectory_id=trajectory)
        fields = {"image": busybox_image, "labels": labels, **overrides}
        return SandboxSpec(**fields)
    return make


@pytest.fixture(scope="session")
def sandbox_run_id() -> str:
    """The ``conveyor.run_id`` label of every container this test session creates."""
    return RUN_ID


@pytest.fixture
def containers_of(docker_client):
    """``containers_of(trajectory_id)``: this session's containers of one trajectory, removed or not."""
    def find(trajectory_id: str) -> list[dict]:
        labels = [RUN_LABEL, f"conveyor.trajectory_id={trajectory_id}"]
        return docker_client.api.containers(all=True, filters={"label": labels})
    return find


def free_port() -> int:
    return local_stack.free_port("0.0.0.0")


@pytest.fixture(scope="session")
def host_redis():
    """A real redis-server bound to every host address; yields its port."""
    binary = shutil.which("redis-server")
    if binary is None:
        pytest.skip("redis-server is not installed (apt-get install -y redis-server)")
    port = free_port()
    proc = subprocess.Popen([binary, "--port", str(port), "--bind", "0.0.0.0", "--protected-mode", "no",
                             "--save", "", "--appendonly", "no"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 10
        while True:
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=1) as conn:
                    conn.sendall(b"PING\r\n")
                    if conn.recv(16).startswith(b"+PONG"):
                        break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)
        yield port
    finally:
        proc.terminate()
        proc.wait(10)
