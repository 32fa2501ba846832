"""Scoring in the rollout worker (``services.rollout_worker.worker_scoring``). Where every reward
function is declared cheap and ``rewards.in_worker`` is ``auto``, the worker that uploaded a
trajectory scores it, and the ledger, the trainer's stream and the stored ScoredTrajectory hold
what the scorer service would have left; a reward function not declared cheap leaves scoring to
the scorer; and a worker killed between its upload and the score loses and duplicates nothing:
the scoring worker's reaper (a real Celery process) finishes each trajectory exactly once.
Real Redis, a local object store."""

from __future__ import annotations

import asyncio
import json
import os
import time
from typing import Callable
from unittest import mock

import pytest
from test_ledger import assert_counts_consistent, requests_for, stream_events
from test_runner_failures import Harness, chat  # noqa: F401 (chat: the tokenizer fixture)

from services.cli.local_stack import LocalStack, ManagedProcess
from services.rollout_worker.runner import RolloutContext, upload_and_score
from services.rollout_worker.worker_scoring import WorkerScoring, worker_scoring_for
from shared.celery_app import make_celery, publish_scoring
from shared.names import RedisKeys, scored_bundle_key
from shared.object_bundles import member_ref
from shared.redis_clients import redis_for
from shared.schemas import RolloutRequest, ScoredEvent, ScoredTrajectory, ScoringTask, StopReason, Trajectory
from shared.scoring.rewards import RewardCombiner, in_worker
from shared.scoring.scorer import Scorer
from shared.settings import Settings, load_settings
from shared.state.dead_letters import DeadLetters
from shared.state.leases import LeaseKeeper
from shared.state.ledger import SCORING, Ledger
from shared.storage import ObjectStore, get_model, open_store


class ProcessKilled(BaseException):
    """Stands for a SIGKILL in the middle of scoring: no handler of the code under test takes it."""


@in_worker
def killed_mid_scoring(_trajectory: Trajectory) -> float:
    raise ProcessKilled


@in_worker
def declared_but_raises(_trajectory: Trajectory) -> float:
    raise ZeroDivisionError("a reward's own bug")


def undeclared_reward(_trajectory: Trajectory) -> float:  # a judge model, say: not declared cheap
    return 0.5


def finished(request: RolloutRequest, token: str, env_reward: float = 0.75) -> tuple[Trajectory, str]:
    return Trajectory(request=request, turns=[], stop_reason=StopReason.done, attempt=1, env_reward=env_reward), token


def claimed(ledger: Ledger, requests: list[RolloutRequest]) -> list[str]:
    """The requests registered and claimed by a rollout worker; their lease tokens."""
    ledger.register(requests)
    tokens = [f"worker{n}" for n in range(len(requests))]
    for request, token in zip(requests, tokens):
        assert ledger.claim(request.trajectory_id, token, 30)[0]
    return tokens


def scorer_service(settings: Settings, ledger: Ledger, store: ObjectStore) -> Scorer:
    """What ``services.scorer.tasks`` builds."""
    combiner = RewardCombiner(settings.rewards.weights, settings.rollout.max_episode_tokens)
    return Scorer(store, combiner, LeaseKeeper(ledger, 30, 5, SCORING), DeadLetters(ledger.redis))


def context(harness: Harness, settings: Settings, worker_scoring: WorkerScoring | None) -> RolloutContext:
    ctx = asyncio.run(harness.context())
    ctx.settings, ctx.worker_scoring = settings, worker_scoring
    return ctx


@pytest.fixture
def harness(ledger, store, chat, run_id):  # noqa: F811
    return Harness(ledger, store, chat, run_id)


def scored_record(ledger: Ledger, store: ObjectStore, run_id: str, tid: str) -> tuple[ScoredEvent, ScoredTrajectory, dict]:
    [event] = [e for e in stream_events(ledger.redis, run_id) if e.trajectory_id == tid]
    assert isinstance(event, ScoredEvent)
    state, failure, _task = ledger.record(tid)
    marks = {"state": state, "failure": failure, "scoring attempts": ledger.attempts(tid, SCORING),
             "scoring lease": ledger.lease_owner(tid, SCORING), "deadline": ledger.lease_deadline(tid, SCORING)}
    return event, get_model(store, event.scored_key, ScoredTrajectory), marks


def test_the_worker_scores_a_trajectory_as_the_scorer_service_would(harness, ledger, store, run_id):
    requests = requests_for(run_id, size=2)
    in_the_worker, on_the_scorer = (r.trajectory_id for r in requests)
    tokens = claimed(ledger, requests)
    settings = load_settings(run_id=run_id, rewards={"in_worker": "auto"})  # the default weights: verifier, format
    worker_scoring = worker_scoring_for(settings, ledger, store, ledger.redis)
    assert worker_scoring is not None
    try:
        handed_on = upload_and_score(context(harness, settings, worker_scoring), [finished(requests[0], tokens[0])])
    finally:
        worker_scoring.scorer.leases.stop()
    assert [(str(result), task) for result, task in handed_on] == [("uploaded", None)]  # no scoring message to send

    [(result, task)] = upload_and_score(context(harness, settings, None), [finished(requests[1], tokens[1])])
    assert str(result) == "uploaded" and isinstance(task, ScoringTask)  # in_worker unset: the task goes to the scorer
    assert scorer_service(settings, ledger, store).score(task) == "scored"

    worker_event, worker_scored, worker_marks = scored_record(ledger, store, run_id, in_the_worker)
    scorer_event, scorer_scored, scorer_marks = scored_record(ledger, store, run_id, on_the_scorer)
    assert worker_marks == scorer_marks == {"state": "scored", "failure": None, "scoring attempts": 1,
                                            "scoring lease": None, "deadline": None}
    assert worker_event.scored_key == member_ref(scored_bundle_key(run_id, 0, in_the_worker, 1), 0)
    ids = {"trajectory_id", "scored_key", "trajectory_key", "at"}
    assert worker_event.model_dump(exclude=ids) == scorer_event.model_dump(exclude=ids)
    assert worker_event.reward == 0.75
    assert worker_scored.model_dump(exclude={"trajectory_id", "trajectory_key", "scored_at", "timings"}) == \
        scorer_scored.model_dump(exclude={"trajectory_id", "trajectory_key", "scored_at", "timings"})
    assert worker_scored.timings.keys() == scorer_scored.timings.keys()
    assert get_model(store, worker_scored.trajectory_key, Trajectory).trajectory_id == in_the_worker  # what the trainer reads
    assert json.loads(ledger.redis.hget(RedisKeys.scoring_tasks(run_id), in_the_worker))["trajectory_key"] == \
        worker_scored.trajectory_key  # the stored task a re-dispatch would send
    assert assert_counts_consistent(ledger, run_id, 2)["scored"] == 2


def test_a_reward_that_raises_fails_the_trajectory_in_the_worker_as_on_the_scorer(harness, ledger, store, run_id):
    requests = requests_for(run_id, size=2)
    tokens = claimed(ledger, requests)
    settings = load_settings(run_id=run_id, rewards={"in_worker": "auto", "weights": {
        "verifier": 1.0, f"{__name__}:declared_but_raises": 1.0}})
    worker_scoring = worker_scoring_for(settings, ledger, store, ledger.redis)
    assert worker_scoring is not None
    try:
        assert [task for _, task in upload_and_score(context(harness, settings, worker_scoring),
                                                     [finished(requests[0], tokens[0])])] == [None]
    finally:
        worker_scoring.scorer.leases.stop()
    [(_, task)] = upload_and_score(context(harness, settings, None), [finished(requests[1], tokens[1])])
    assert task is not None and scorer_service(settings, ledger, store).score(task) == "failed"
    reasons = ledger.failure_reasons(run_id)
    assert reasons[requests[0].trajectory_id] == reasons[requests[1].trajectory_id]
    assert reasons[requests[0].trajectory_id].startswith("scoring_error: reward function")
    assert [e.kind for e in stream_events(ledger.redis, run_id)] == ["failed", "failed"]


def test_a_reward_not_declared_cheap_or_in_worker_never_leaves_every_score_to_the_scorer(harness, ledger, store, run_id):
    undeclared = f"{__name__}:undeclared_reward"
    with_a_judge = load_settings(run_id=run_id, rewards={"in_worker": "auto", "weights": {"verifier": 1.0, undeclared: 0.5}})
    assert RewardCombiner(with_a_judge.rewards.weights).not_in_worker == [undeclared]
    assert RewardCombiner({"verifier": 1.0, "format": 0.1, "brevity": 0.1}).not_in_worker == []  # the built-ins qualify
    assert worker_scoring_for(with_a_judge, ledger, store, ledger.redis) is None
    assert worker_scoring_for(load_settings(run_id=run_id, rewards={"in_worker": "never"}), ledger, store, ledger.redis) is None
    assert load_settings().rewards.in_worker == "never"  # the default: the scorer scores

    [request] = requests_for(run_id, size=1)
    [token] = claimed(ledger, [request])
    [(result, task)] = upload_and_score(context(harness, with_a_judge, worker_scoring_for(with_a_judge, ledger, store, ledger.redis)),
                                        [finished(request, token)])
    assert str(result) == "uploaded" and task is not None  # sent to the scorer (the scoring outbox)
    assert ledger.state(request.trajectory_id) == "uploaded" and ledger.attempts(request.trajectory_id, SCORING) == 0
    assert scorer_service(with_a_judge, ledger, store).score(task) == "scored"
    assert [e.reward for e in stream_events(ledger.redis, run_id)] == [0.75 + 0.5 * 0.5]


def wait_for(condition: Callable[[], bool], worker: ManagedProcess, timeout_s: float = 60) -> None:
    deadline = time.time() + timeout_s
    while not condition():
        assert worker.alive() and time.time() < deadline, worker.log_path.read_text()[-4000:]
        time.sleep(0.2)


def test_a_worker_killed_between_upload_and_score_loses_and_duplicates_nothing(tmp_path, run_id, chat):  # noqa: F811
    """Three workers' trajectories, with a real Celery scoring worker running: one killed after its
    upload's move, before the scoring claim (its send-by entry brings the task to the scorer), one
    killed holding the scoring lease (the lease runs out; the scorer's reaper re-dispatches it),
    and one scored in its worker, whose task the scorer then receives anyway (a no-op)."""
    env = {"CONVEYOR_LEDGER__LEASE_TTL_S": "2", "CONVEYOR_LEDGER__HEARTBEAT_S": "0.5",
           "CONVEYOR_LEDGER__REAPER_INTERVAL_S": "0.5", "CONVEYOR_ROLLOUT__SCORING_LINGER_S": "0.1",
           "CONVEYOR_REWARDS__WEIGHTS": json.dumps({"verifier": 1.0}), "CONVEYOR_REWARDS__IN_WORKER": "auto"}
    with LocalStack(tmp_path / "stack", run_id=run_id, env=env) as stack:
        stack.start_redis()
        stack.start_object_store()
        with mock.patch.dict(os.environ, stack.env):
            settings = load_settings()
        ledger, store = Ledger(redis_for(settings.redis.url)), open_store(settings.storage)
        scoring_worker = stack.start_scoring_worker()
        # ready first: a lease taken within a second of Redis' start would be forgiven its attempt
        wait_for(lambda: " ready." in scoring_worker.log_path.read_text(), scoring_worker)
        # ...and past the reaper's forgiveness: a lease whose deadline falls within 1 s (plus the
        # whole-second uptime's rounding) of Redis' start does not count its attempt (leases._forgive_before)
        wait_for(lambda: ledger.server_uptime_s() >= 3, scoring_worker)
        harness = Harness(ledger, store, chat, run_id)
        requests = requests_for(run_id, size=3)
        before_claim, holding_lease, scored_here = (r.trajectory_id for r in requests)
        tokens = claimed(ledger, requests)

        # killed after the upload's move: its scoring was never sent nor claimed
        [(_, task)] = upload_and_score(context(harness, settings, None), [finished(requests[0], tokens[0])])
        assert task is not None and ledger.state(before_claim) == "uploaded"

        # killed while scoring: its scoring lease is claimed and no longer renewed
        dying = settings.model_copy(update={"rewards": settings.rewards.model_copy(update={
            "weights": {"verifier": 1.0, f"{__name__}:killed_mid_scoring": 0.0}})})
        killed = WorkerScoring(scorer_service(dying, ledger, store))
        killed.scorer.leases = LeaseKeeper(ledger, 2, 0.5, SCORING)  # its heartbeat dies with it: never started
        with pytest.raises(ProcessKilled):
            upload_and_score(context(harness, settings, killed), [finished(requests[1], tokens[1])])
        dead_token = ledger.lease_owner(holding_lease, SCORING)
        assert dead_token and ledger.state(holding_lease) == "uploaded" and ledger.attempts(holding_lease, SCORING) == 1

        live = worker_scoring_for(settings, ledger, store, ledger.redis)
        assert live is not None
        try:
            [(_, task)] = upload_and_score(context(harness, settings, live), [finished(requests[2], tokens[2])])
        finally:
            live.scorer.leases.stop()
        assert task is None and ledger.state(scored_here) == "scored"

        wait_for(lambda: {ledger.state(r.trajectory_id) for r in requests} == {"scored"}, scoring_worker)
        publish_scoring(make_celery(settings), ScoringTask.model_validate_json(
            ledger.redis.hget(RedisKeys.scoring_tasks(run_id), scored_here)))  # a copy reaches the scorer anyway
        wait_for(lambda: f"scoring {scored_here}: skipped:scored" in scoring_worker.log_path.read_text(), scoring_worker)

        events = stream_events(ledger.redis, run_id)
        assert sorted(e.trajectory_id for e in events) == sorted([before_claim, holding_lease, scored_here])  # once each
        assert {e.trajectory_id: e.reward for e in events} == {t: 0.75 for t in (before_claim, holding_lease, scored_here)}
        assert [ledger.attempts(t, SCORING) for t in (before_claim, holding_lease, scored_here)] == [1, 2, 1]
        scored_keys = {e.trajectory_id: e.scored_key for e in events if isinstance(e, ScoredEvent)}
        assert scored_keys[holding_lease] == member_ref(scored_bundle_key(run_id, 0, holding_lease, 2), 0)  # the scorer's attempt
        late = ScoredEvent(trajectory_id=holding_lease, run_id=run_id, group_id=0, reward=0.75, scored_key="late",
                           at=time.time(), trajectory_key="late", stop_reason=StopReason.done)
        assert not ledger.mark_scored(holding_lease, late, token=dead_token).ok  # the dead worker, were it only frozen
        assert len(stream_events(ledger.redis, run_id)) == 3
        assert assert_counts_consistent(ledger, run_id, 3)["scored"] == 3
        assert ledger.expired_leases(time.time() + 1e6, stage=SCORING) == []  # nothing left for a reaper
