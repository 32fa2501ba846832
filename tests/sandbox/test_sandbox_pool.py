"""The warm pool against the real Docker daemon: pre-started sandboxes go to one trajectory
each, with a fresh episode clock; the pool refills, falls back to a fresh sandbox when empty,
and leaves nothing behind."""

from __future__ import annotations

import asyncio

import pytest

from services.rollout_worker.sandbox import WarmPool

pytestmark = pytest.mark.docker


def test_pool_hands_out_prestarted_sandboxes_once_and_refills(make_spec, sandbox_run_id, docker_client):
    async def scenario() -> None:
        spec = make_spec()
        async with WarmPool(spec, size=2) as pool:
            assert pool.idle == 2
            prestarted = {s.container_id for s in pool._idle}
            first = await pool.acquire(run_id=sandbox_run_id, group_id="7", trajectory_id="traj-a")
            second = await pool.acquire(run_id=sandbox_run_id, group_id="7", trajectory_id="traj-b")
            assert {first.container_id, second.container_id} == prestarted  # no provisioning on the way
            assert (first.assigned_to, second.assigned_to) == ("traj-a", "traj-b")
            assert first.remaining_s > spec.timeouts.episode_s - 5  # the clock started on acquire
            await first.exec("echo mine > /workspace/note")
            assert (await second.exec("cat /workspace/note 2>&1 || echo absent")).output.strip().endswith("absent")
            for _ in range(200):  # both refills land in the background
                if pool.idle == 2:
                    break
                await asyncio.sleep(0.05)
            assert pool.idle == 2
            labels = docker_client.containers.get(first.container_id).labels
            assert labels["conveyor.group_id"] == "pool" and labels["conveyor.trajectory_id"].startswith("pool-")
            await first.teardown()
            await second.teardown()
            drained = [await pool.acquire(run_id=sandbox_run_id, group_id="7", trajectory_id=f"t{i}") for i in range(3)]
            fresh = drained[-1]  # the pool had two: the third was provisioned for its trajectory
            assert docker_client.containers.get(fresh.container_id).labels["conveyor.trajectory_id"] == "t2"
            await asyncio.gather(*(s.teardown() for s in drained))
        assert pool.idle == 0

    asyncio.run(scenario())
