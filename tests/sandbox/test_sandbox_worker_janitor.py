"""The rollout worker's janitor against the real Docker daemon and a real ledger: it removes
the sandboxes of trajectories that are no longer running and leaves running ones alone."""

from __future__ import annotations

import asyncio
import time

import pytest

from services.rollout_worker.sandbox.worker_janitor import SandboxJanitor
from services.rollout_worker.sandbox import Sandbox
from services.rollout_worker.sandbox.spec import SandboxLabels
from services.intake.publisher import build_group
from shared.state.ledger import Ledger
from shared.schemas import TaskProfile
from shared.settings import Settings

pytestmark = pytest.mark.docker


def test_janitor_removes_sandboxes_of_finished_trajectories_only(make_spec, sandbox_run_id, containers_of, redis_client, redis_url):
    settings = Settings(run_id=sandbox_run_id, redis={"url": redis_url}, rollout={"group_size": 2})
    task = TaskProfile(task_id="t", env_name="guess_number", task_data={"low": 1, "high": 3, "target": 2})
    running, finished = build_group(settings, 0, task)
    ledger = Ledger(redis_client)
    ledger.register([running, finished])
    assert ledger.claim(running.trajectory_id, "tok-a", 60)[0]
    assert ledger.claim(finished.trajectory_id, "tok-b", 60)[0]
    ledger.fail(finished.trajectory_id, "env_error: test", token="tok-b")

    async def provision(trajectory_id: str) -> Sandbox:
        labels = SandboxLabels(run_id=sandbox_run_id, group_id="0", trajectory_id=trajectory_id)
        return await Sandbox.provision(make_spec(labels=labels))

    async def scenario() -> None:
        kept = await provision(running.trajectory_id)
        await provision(finished.trajectory_id)  # its worker "died": never torn down
        try:
            removed = await asyncio.to_thread(SandboxJanitor(ledger).sweep)
            assert removed >= 1
            assert containers_of(finished.trajectory_id) == []
            assert len(containers_of(running.trajectory_id)) == 1
            assert (await kept.exec("echo still here")).output.strip() == "still here"
        finally:
            await kept.teardown()

    started = time.monotonic()
    asyncio.run(scenario())
    assert time.monotonic() - started < 60
