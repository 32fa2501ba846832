"""docs/compose.md's "Redis Cluster" block, run as written: its two settings lines in the
stack's settings file, then `scripts/stack.sh up` by the shell. The script starts the `cluster`
profile's six nodes and joins them before the services, and the demo run trains to its end with
its ledger on the cluster: every trajectory consumed, the cluster `ok`, the run's keys on one
master of the cluster (one hash tag, one slot) and its replica, none on the stack's own `redis`
(the Celery broker).

A stack of its own (its own compose project, ports and volumes), brought down with its volumes
and the cluster's nodes at the end. Marked ``slow`` and ``docker``.
"""

from __future__ import annotations

import json
import uuid
from pathlib import Path

import pytest
from compose_support import Stack, compose_command, doc_commands, run_as_written, stack_env, write_env

from services.cli.local_stack import free_port
from services.cli.stack_images import StackImages
from shared.names import RedisKeys

pytestmark = [pytest.mark.slow, pytest.mark.docker]

NODES = [f"redis-cluster-{n}" for n in range(1, 7)]


def redis_cli(stack: Stack, node: str, *args: str) -> str:
    """``redis-cli`` on the stack network, from the first node's container (no port is published)."""
    command = 'redis-cli --no-auth-warning -a "$REDIS_PASSWORD" -h "$0" "$@"'
    return stack.dc("exec", "-T", "redis-cluster-1", "sh", "-c", command, node, *args).stdout


def test_the_demo_trains_with_its_ledger_on_the_cluster_profile_as_written_in_the_docs(images: StackImages,
                                                                                           tmp_path: Path) -> None:
    *settings, up = doc_commands("LEDGER_REDIS_SCHEME=")
    assert up.startswith("scripts/stack.sh up") and all("=" in line and " " not in line for line in settings), settings
    ports = {name: free_port() for name in ("redis", "s3", "inference", "flower", "viewer")}
    project = f"conveyorcluster{uuid.uuid4().hex[:6]}"
    # the digit demo, shortened as in the swarm test: 4 groups of 8, 2 steps of 2 groups
    env = stack_env(images, ports, CONVEYOR_MAX_STEPS="2", CONVEYOR_NUM_GROUPS="4", CONVEYOR_GROUPS_PER_STEP="2",
                    CONVEYOR_STACK_ID=project, **dict(line.split("=", 1) for line in settings))
    stack = Stack(project, write_env(tmp_path / "stack.env", env), ports, compose_command(),
                  profiles=("cpu", "cluster"))  # what the script adds, so that the teardown takes the nodes too
    try:
        output = run_as_written(stack, up, tmp_path, timeout=1500)
        assert "[stack] the ledger's Redis Cluster" in output and "trainer exited with 0" in output, output[-3000:]

        counts = json.loads(stack.conveyor("status", "--json", "--run", "demo"))["runs"]["demo"]
        assert counts == {"queued": 0, "running": 0, "uploaded": 0, "scored": 0, "consumed": 32, "failed": 0}, counts
        assert "cluster_state:ok" in redis_cli(stack, "redis-cluster-1", "cluster", "info")
        holding = {}
        for node in NODES:
            role = redis_cli(stack, node, "role").split()[0]
            keys = redis_cli(stack, node, "--scan", "--pattern", "conveyor:{demo}:*").split()
            holding[node] = (role, len(keys))
        # one hash tag: every key of the run in one slot, on one master and its replica
        assert len([n for n, (role, keys) in holding.items() if role == "master" and keys]) == 1, holding
        assert sum(1 for role, keys in holding.values() if role == "master") == 3, holding
        states = redis_cli(stack, "redis-cluster-1", "-c", "hlen", RedisKeys.states("demo")).strip()
        assert states == "32", states
        broker = stack.ledger().redis  # the stack's own `redis`, through its published port
        assert list(broker.scan_iter(match="conveyor:{demo}:*")) == [], "the run's keys on the broker's Redis"
    finally:
        for service in ("trainer", "inference", "redis-cluster-create"):
            print(f"----- {service} -----\n{stack.logs(service)[-3000:]}")
        stack.tear_down()
