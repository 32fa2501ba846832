"""Scoring messages go out in batches (``services.rollout_worker.scoring_outbox``), and nothing a
batch holds lives only in the worker's memory: the upload stores each scoring task with a
send-by entry in the same ledger call, the scoring reaper sends what a dead worker never sent,
and a sent batch moves its deadlines ahead without touching a scorer's lease. Real Redis."""

from __future__ import annotations

import asyncio
import time

from test_ledger import requests_for
from test_scorer_leases import upload

from services.rollout_worker.scoring_outbox import ScoringOutbox
from shared.scoring.rewards import RewardCombiner
from shared.scoring.scorer import Scorer
from shared.state.dead_letters import DeadLetters
from shared.state.leases import LeaseKeeper, LeaseReaper, one_by_one
from shared.state.ledger import SCORING, Ledger
from shared.names import trajectory_key
from shared.schemas import ScoringTask, StopReason, Trajectory, parse_message
from shared.storage import LocalStore, put_model


ON_BOTH_TOPOLOGIES = True  # each test using redis_client runs on the standalone Redis and a Redis Cluster


def uploaded_with_send_by(ledger: Ledger, run_id: str, size: int, send_within_s: float) -> list[ScoringTask]:
    """``size`` trajectories as a rollout worker leaves them before its batch goes out."""
    tasks = []
    for request in requests_for(run_id, size=size):
        ledger.register([request])
        assert ledger.claim(request.trajectory_id, "rollout", 30)[0]
        task = ScoringTask(trajectory_id=request.trajectory_id, trajectory_key=f"k/{request.trajectory_id}")
        assert ledger.mark_uploaded(request.trajectory_id, "rollout", task.model_dump_json(), send_within_s).ok
        tasks.append(task)
    return tasks


def test_a_batch_its_worker_never_sent_is_sent_by_the_scoring_reaper_once_its_send_by_passes(ledger, run_id):
    tasks = uploaded_with_send_by(ledger, run_id, size=4, send_within_s=0.2)
    sent: list[ScoringTask] = []
    reaper = LeaseReaper(ledger, SCORING, 3, 1.0, one_by_one(lambda _tid, payload: sent.append(parse_message(ScoringTask, payload))))
    assert reaper.sweep() == {"requeued": 0, "resent": 0, "failed": 0}  # within the send-by: the worker may still send it
    time.sleep(0.3)  # the worker died with the batch in memory
    assert reaper.sweep() == {"requeued": 0, "resent": 4, "failed": 0}
    assert sorted(sent, key=lambda t: t.trajectory_id) == sorted(tasks, key=lambda t: t.trajectory_id)
    assert {ledger.state(t.trajectory_id) for t in tasks} == {"uploaded"}  # still waiting for a scorer, no attempt spent
    assert {ledger.attempts(t.trajectory_id, SCORING) for t in tasks} == {0}
    assert reaper.sweep() == {"requeued": 0, "resent": 0, "failed": 0}  # sent once; the next deadline is ahead


def test_a_sent_batch_moves_its_deadlines_ahead_but_not_a_lease_a_scorer_already_holds(ledger, run_id):
    first, second = uploaded_with_send_by(ledger, run_id, size=2, send_within_s=0.2)
    # a scorer took the first from the message before the worker cleared its entry
    assert ledger.claim(first.trajectory_id, "scorer", 0.2, SCORING, first.model_dump_json())[0]
    assert ledger.scoring_sent([first.trajectory_id, second.trajectory_id]) == 1  # only the second's deadline moved
    time.sleep(0.3)  # and the scorer died: its lease, not the send-by entry, expires
    resent: list[str] = []
    reaper = LeaseReaper(ledger, SCORING, 3, 1.0, one_by_one(lambda tid, _payload: resent.append(tid)))
    assert reaper.sweep() == {"requeued": 1, "resent": 0, "failed": 0}
    assert resent == [first.trajectory_id]
    assert ledger.scoring_sent([]) == 0


def test_an_upload_without_a_scoring_task_leaves_no_send_by_entry(ledger, store, run_id):
    tid, _task = upload(ledger, store, run_id)  # the ledger-only path some tools take
    assert ledger.lease_deadline(tid, SCORING) is None


def test_the_outbox_sends_at_the_end_of_a_task_at_its_size_limit_and_after_its_linger():
    batches: list[list[str]] = []

    def send(batch: list[ScoringTask]) -> None:
        batches.append([t.trajectory_id for t in batch])

    def task(n: int) -> ScoringTask:
        return ScoringTask(trajectory_id=f"t{n}", trajectory_key=f"k{n}")

    async def go() -> None:
        outbox = ScoringOutbox(send, linger_s=0.2, max_batch=3)
        for n in range(2):
            await outbox.add(task(n))
        assert batches == []  # lingering
        await outbox.flush()  # the rollout task ended
        assert batches == [["t0", "t1"]]
        for n in range(2, 5):
            await outbox.add(task(n))
        assert batches[-1] == ["t2", "t3", "t4"]  # full
        await outbox.add(task(5))
        await asyncio.sleep(0.4)
        assert batches[-1] == ["t5"]  # the linger ran out
        await outbox.flush()
        assert len(batches) == 3  # nothing left to send

    asyncio.run(go())


def test_a_batch_that_cannot_be_sent_is_logged_and_left_to_the_reaper(caplog):
    def send(_batch: list[ScoringTask]) -> None:
        raise ConnectionError("broker down past outage.limit_s")

    async def go() -> None:
        outbox = ScoringOutbox(send, linger_s=0.1)
        await outbox.add(ScoringTask(trajectory_id="t0", trajectory_key="k0"))
        await outbox.flush()

    asyncio.run(go())
    assert "a scoring batch of 1 trajectories (t0, ...) was not sent" in caplog.text
    assert "ConnectionError: broker down past outage.limit_s" in caplog.text


def test_the_send_by_deadline_is_a_unix_time(ledger, run_id):
    [task] = uploaded_with_send_by(ledger, run_id, size=1, send_within_s=0.0)
    deadline = ledger.lease_deadline(task.trajectory_id, SCORING)
    assert deadline is not None and abs(deadline - time.time()) < 5


def test_a_scorer_claims_a_whole_batch_before_scoring_any_of_it(ledger, redis_client, store, run_id):
    """A scorer that dies mid-batch must leave a lease on every task it has not finished (the
    reaper re-dispatches each); so when the first one is scored, all of them are held."""
    tasks = []
    for request in requests_for(run_id, size=3):
        ledger.register([request])
        assert ledger.claim(request.trajectory_id, "rollout", 30)[0]
        key = trajectory_key(run_id, request.group_id, request.trajectory_id)
        put_model(store, key, Trajectory(request=request, turns=[], stop_reason=StopReason.done, env_reward=0.5))
        assert ledger.mark_uploaded(request.trajectory_id, "rollout").ok
        tasks.append(ScoringTask(trajectory_id=request.trajectory_id, trajectory_key=key))
    held_at_first_read: list[list[str | None]] = []

    class Watching(LocalStore):
        def get_bytes(self, key: str) -> bytes:
            if not held_at_first_read:
                held_at_first_read.append([ledger.lease_owner(t.trajectory_id, SCORING) for t in tasks])
            return super().get_bytes(key)

    scorer = Scorer(Watching(store.root), RewardCombiner({"verifier": 1.0}), LeaseKeeper(ledger, 30, 5, SCORING), DeadLetters(redis_client))
    assert scorer.score_batch(tasks) == ["scored"] * 3
    assert None not in held_at_first_read[0]
    assert [ledger.lease_owner(t.trajectory_id, SCORING) for t in tasks] == [None] * 3  # released after


def test_a_scoring_message_that_waits_in_the_scoring_queue_is_not_copied_past_its_deadline(ledger, run_id):
    ledger.dispatch_ttl_s = 0.3
    tasks = uploaded_with_send_by(ledger, run_id, size=2, send_within_s=0.2)
    ledger.redis.lpush(SCORING.queue, "a message ahead of them")  # e.g. the scorers stalled by an outage of Redis
    sent: list[str] = []
    reaper = LeaseReaper(ledger, SCORING, 3, 1.0, one_by_one(lambda tid, _payload: sent.append(tid)))
    time.sleep(0.3)
    assert reaper.sweep() == {"requeued": 0, "resent": 0, "failed": 0} and sent == []  # their batch may be in the queue
    ledger.redis.delete(SCORING.queue)  # the queue drained and they were not claimed: their batch was lost
    time.sleep(0.4)  # the deadline moved one dispatch TTL ahead
    assert reaper.sweep() == {"requeued": 0, "resent": 2, "failed": 0}
    assert sorted(sent) == sorted(t.trajectory_id for t in tasks)
