"""`docker stack deploy` on a single-node swarm, from the same compose file
(``services/cli/swarm_file.py`` renders what ``docker stack deploy`` reads), by docs/compose.md's
two lines run as written (``docker swarm init``, ``scripts/stack.sh swarm``): the demo experiment
runs end to end, and removing the stack leaves no container, network or volume behind.

The swarm is created for the test when the daemon is not in one, and left at the end.
Marked ``slow`` and ``docker``.
"""

from __future__ import annotations

import json
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from compose_support import (HEAD_ADDRESS, SECRETS, Stack, compose_command, doc_commands, run_as_written, stack_env,
                             write_env)

from services.cli.local_stack import free_port
from services.cli.stack_images import StackImages
from shared.state.ledger import Ledger

pytestmark = [pytest.mark.slow, pytest.mark.docker]


def docker(*args: str, check: bool = True, timeout: float = 300) -> str:
    result = subprocess.run(["docker", *args], capture_output=True, text=True, timeout=timeout)
    if check and result.returncode != 0:
        raise AssertionError(f"docker {' '.join(args)} failed: {result.stderr.strip()}")
    return result.stdout


SWARM_INIT, SWARM_DEPLOY = doc_commands("scripts/stack.sh swarm")


@pytest.fixture(scope="module")
def swarm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """The daemon in a swarm: docs/compose.md's `docker swarm init` line, as written, when it is
    in none yet (left at the end); a swarm it is in already is used as it is."""
    joined = docker("info", "--format", "{{.Swarm.LocalNodeState}}").strip() == "active"
    if not joined:
        run_as_written(None, SWARM_INIT, tmp_path_factory.mktemp("swarm"), examples={"10.0.0.5": HEAD_ADDRESS})
    try:
        yield
    finally:
        if not joined:
            docker("swarm", "leave", "--force", check=False)


def service_logs(service: str) -> str:
    result = subprocess.run(["docker", "service", "logs", "--raw", service], capture_output=True, text=True, timeout=60)
    return result.stdout + result.stderr


def stack_resources(name: str) -> dict[str, list[str]]:
    label = f"label=com.docker.stack.namespace={name}"
    return {kind: docker(*cmd, "-q", "--filter", label).split()
            for kind, cmd in (("service", ["service", "ls"]), ("container", ["ps", "-a"]),
                              ("network", ["network", "ls"]), ("volume", ["volume", "ls"]))}


def remove_stack(name: str) -> dict[str, list[str]]:
    """``docker stack rm``, then the volumes (a stack keeps them); returns what is left.

    Swarm removes a stack's networks once, right after its services: a network whose last task
    container is still stopping then stays ("has active endpoints"). Once the containers are
    gone, ``docker stack rm`` again removes it, as a user would do."""
    docker("stack", "rm", name, check=False)
    deadline, again_at = time.time() + 180, 0.0
    while time.time() < deadline:
        left = stack_resources(name)
        if not any(left[k] for k in ("service", "container", "network")):
            break
        if left["network"] and not left["service"] and not left["container"] and time.time() >= again_at:
            docker("stack", "rm", name, check=False)
            again_at = time.time() + 10
        time.sleep(2)
    for volume in stack_resources(name)["volume"]:
        docker("volume", "rm", volume, check=False)
    return {kind: ids for kind, ids in stack_resources(name).items() if ids}


def test_the_demo_runs_from_docker_stack_deploy(swarm: None, images: StackImages, tmp_path: Path) -> None:
    ports = {name: free_port() for name in ("redis", "s3", "inference", "flower")}
    name = f"conveyorswarm{uuid.uuid4().hex[:6]}"
    env_file = write_env(tmp_path / "stack.env", stack_env(images, ports, CONVEYOR_MAX_STEPS="2",
                                                           CONVEYOR_NUM_GROUPS="4", CONVEYOR_GROUPS_PER_STEP="2",
                                                           CONVEYOR_STACK_ID=name))
    try:  # the doc's line, as written: the stack file goes to the test's settings folder (ENV_DIR)
        run_as_written(Stack(name, env_file, ports, compose_command()), SWARM_DEPLOY, tmp_path, timeout=900)
        ledger = Ledger.from_url(f"redis://:{SECRETS['REDIS_PASSWORD']}@127.0.0.1:{ports['redis']}/0")
        deadline, counts, trainer_state = time.time() + 1500, {}, ""
        while time.time() < deadline:
            trainer_state = docker("service", "ps", f"{name}_trainer", "--format", "{{.CurrentState}}").splitlines()
            if trainer_state and trainer_state[0].startswith("Complete"):
                break
            time.sleep(5)
        counts = ledger.counts("demo")
        logs = {svc: service_logs(f"{name}_{svc}")[-3000:] for svc in ("trainer", "inference", "rollout-worker", "intake")}
        assert trainer_state and trainer_state[0].startswith("Complete"), (trainer_state, logs)
        # the digit demo as under compose, shortened: 4 groups of 8, every trajectory consumed, weights synced
        assert counts == {"queued": 0, "running": 0, "uploaded": 0, "scored": 0, "consumed": 32, "failed": 0}, logs
        assert "serving version 1" in service_logs(f"{name}_inference"), logs
        services = json.loads(docker("service", "inspect", f"{name}_rollout-worker"))[0]
        mounts = services["Spec"]["TaskTemplate"]["ContainerSpec"].get("Mounts", [])
        assert any(m.get("Target") == "/var/run/docker.sock" for m in mounts)
    finally:
        left = remove_stack(name)
    assert not left, f"docker stack rm left {left} behind"
