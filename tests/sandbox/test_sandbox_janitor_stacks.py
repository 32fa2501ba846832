"""Two stacks on one Docker daemon: each worker janitor removes its own stack's expired
sandboxes and never another stack's, nor a sandbox with no stack label (made before the label),
which it reports once instead."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid

import pytest

from services.rollout_worker.sandbox import Sandbox, SandboxLabels
from services.rollout_worker.sandbox.deployment import LABEL_CREATED_AT, LABEL_RUN_ID, LABEL_TRAJECTORY_ID, LABEL_TTL
from services.rollout_worker.sandbox.janitor import legacy_sandboxes
from services.rollout_worker.sandbox.worker_janitor import SandboxJanitor
from shared.state.ledger import Ledger
from shared.stack_id import LABEL_STACK

pytestmark = [pytest.mark.docker, pytest.mark.timeout(120)]


def test_each_stacks_janitor_removes_only_its_own_expired_sandboxes(make_spec, docker_client, busybox_image,
                                                                   sandbox_run_id, redis_client, caplog):
    stacks = [f"sbtest-{uuid.uuid4().hex[:8]}-{name}" for name in ("a", "b")]
    ledger = Ledger(redis_client)  # these trajectories are not in it: only their time to live ends them

    def spec_of(stack_id: str):
        trajectory = f"{sandbox_run_id}_stacks_{stack_id}_{uuid.uuid4().hex[:4]}"
        return make_spec(ttl_s=1, labels=SandboxLabels(run_id=sandbox_run_id, group_id="g0",
                                                       trajectory_id=trajectory, stack_id=stack_id))

    def containers_of_stack(stack_id: str) -> set[str]:
        filters = {"label": [f"{LABEL_RUN_ID}={sandbox_run_id}", f"{LABEL_STACK}={stack_id}"]}
        return {c["Id"] for c in docker_client.api.containers(all=True, filters=filters)}

    async def scenario() -> None:
        sandboxes = [await Sandbox.provision(spec_of(stack_id)) for stack_id in stacks for _ in range(2)]
        try:
            await asyncio.to_thread(sweeps_touch_only_their_own_stack)
        finally:
            for sandbox in sandboxes:
                await sandbox.teardown()  # a reaped one is already gone: fine

    def sweeps_touch_only_their_own_stack() -> None:
        assert {len(containers_of_stack(s)) for s in stacks} == {2}
        time.sleep(1.2)  # every sandbox is past its time to live
        janitor_a, janitor_b = (SandboxJanitor(ledger, stack_id=s) for s in stacks)
        with caplog.at_level(logging.WARNING, logger="services.rollout_worker.sandbox.worker_janitor"):
            assert janitor_a.sweep() == 2
        assert containers_of_stack(stacks[0]) == set()
        assert len(containers_of_stack(stacks[1])) == 2  # stack b's expired sandboxes are b's to remove
        assert legacy in legacy_sandboxes(docker_client)
        assert docker_client.api.inspect_container(legacy)["Id"] == legacy  # left alone...
        assert "without a conveyor.stack label" in caplog.text and legacy[:12] in caplog.text  # ...and reported
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="services.rollout_worker.sandbox.worker_janitor"):
            assert janitor_a.sweep() == 0
        assert "without a conveyor.stack label" not in caplog.text  # reported once per janitor
        assert janitor_b.sweep() == 2
        assert containers_of_stack(stacks[1]) == set()
        assert docker_client.api.inspect_container(legacy)["Id"] == legacy

    # a sandbox as an older Conveyor labelled it: run and trajectory, no stack; expired long ago.
    # The busybox image carries its builder's conveyor.stack, and a container inherits its image's
    # labels; it can only blank that one (LABEL_STACK ""), which counts as no stack
    legacy = docker_client.api.create_container(busybox_image, command=["sleep", "60"], labels={
        LABEL_RUN_ID: sandbox_run_id, LABEL_TRAJECTORY_ID: f"{sandbox_run_id}_legacy", LABEL_CREATED_AT: "1.0",
        LABEL_TTL: "1", LABEL_STACK: ""})["Id"]
    try:
        asyncio.run(scenario())
    finally:
        docker_client.api.remove_container(legacy, force=True)
