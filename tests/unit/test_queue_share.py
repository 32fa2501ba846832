"""Fair share between runs on the same rollout workers (``intake.max_queued_groups``,
services/intake/queue_share.py), with real Redis and the real intake: two runs' intakes publish
into one first-in-first-out queue that a stand-in worker drains in order, claiming each group's
trajectories in the real ledger as a rollout worker does."""

from __future__ import annotations

import threading
import time
import uuid
from collections import deque

from services.intake.datasets import Row
from services.intake.publisher import run_intake
from shared.schemas import RolloutRequest
from shared.settings import Settings
from shared.state.ledger import Ledger

GROUPS = 6


def rows() -> list[Row]:
    return [Row(f"mem:{i}", {"task_data": {"low": 1, "high": 9, "target": 5}}) for i in range(GROUPS)]


def drain_two_runs(redis_client, redis_url, max_queued_groups: int | None, rollout_s: float) -> list[str]:  # noqa: ANN001
    """Run A's intake starts first, run B's once A published what it may; then a worker takes the
    queue's groups in order. Returns the run of each group in the order the worker took them."""
    queue: deque[list[RolloutRequest]] = deque()
    lock = threading.Lock()
    ledger = Ledger(redis_client)
    runs = [f"share-{name}-{uuid.uuid4().hex[:6]}" for name in "AB"]

    def publish(requests: list[RolloutRequest]) -> None:
        with lock:
            queue.append(requests)

    def intake(run: str) -> threading.Thread:
        settings = Settings(run_id=run, redis={"url": redis_url}, rollout={"group_size": 2},
                            intake={"max_queued_groups": max_queued_groups, "wait_log_every_s": 1.0})
        thread = threading.Thread(target=run_intake, args=(settings, rows(), redis_client, publish), daemon=True)
        thread.start()
        return thread

    first = intake(runs[0])
    time.sleep(1.0)  # A publishes all it may before B starts: the case that is unfair without a share
    second = intake(runs[1])
    time.sleep(1.0)
    taken: list[str] = []
    deadline = time.time() + 60
    while len(taken) < 2 * GROUPS and time.time() < deadline:
        with lock:
            group = queue.popleft() if queue else None
        if group is None:
            time.sleep(0.05)
            continue
        claims = ledger.claim_many([(r.trajectory_id, uuid.uuid4().hex, "") for r in group], lease_ttl_s=60)
        assert all(ok for ok, _ in claims)
        taken.append(group[0].run_id)
        time.sleep(rollout_s)  # one group's rollout; intake polls its share every 0.2 s
    first.join(10)  # every group was published: both intakes are done
    second.join(10)
    assert len(taken) == 2 * GROUPS, taken
    assert not first.is_alive() and not second.is_alive()
    return ["A" if run == runs[0] else "B" for run in taken]


def most_ahead(order: list[str]) -> int:
    """The most groups one run was ahead of the other at any point of the order."""
    lead, most = 0, 0
    for run in order:
        lead += 1 if run == "A" else -1
        most = max(most, abs(lead))
    return most


def test_with_a_share_two_runs_take_turns_on_the_workers_and_without_one_the_first_takes_them_all(
        redis_client, redis_url, caplog):
    caplog.set_level("WARNING", logger="services.intake.admission_wait")
    shared = drain_two_runs(redis_client, redis_url, max_queued_groups=2, rollout_s=0.4)
    print("with a share of 2:", "".join(shared))
    assert most_ahead(shared) <= 2, shared  # the queue never held more than 2 groups of A
    assert shared[:2] == ["A", "A"] and "B" in shared[2:4]  # B's first group waited behind A's 2, no more
    # a wait longer than intake.wait_log_every_s (1 s here) said why
    assert any("wait in the rollout queue unclaimed, the share intake.max_queued_groups 2 x 2 members allows 4" in r.message
               for r in caplog.records), [r.message for r in caplog.records]
    unshared = drain_two_runs(redis_client, redis_url, max_queued_groups=None, rollout_s=0.0)
    print("without:", "".join(unshared))
    assert unshared == ["A"] * GROUPS + ["B"] * GROUPS  # A published its whole dataset first
