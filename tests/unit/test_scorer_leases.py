"""The scorer under its lease, against a real Redis and a local object store: a trajectory whose
scorer died is re-scored once by the reaper's re-dispatch, and every other copy of the task
(a live scorer's, the broker's late redelivery) is a no-op; and a scoring message that is not a
``ScoringTask`` is dead-lettered, failing the trajectory it names if nothing else would score it."""

from __future__ import annotations

import time

import pytest
from test_ledger import requests_for, stream_events

from shared.scoring.rewards import RewardCombiner
from shared.scoring.scorer import Scorer
from shared.celery_app import scoring_tasks_of
from shared.state.dead_letters import DeadLetters
from shared.state.leases import LeaseKeeper, LeaseReaper, one_by_one
from shared.state.ledger import SCORING, Ledger
from shared.names import scored_bundle_key, trajectory_key
from shared.object_bundles import member_ref
from shared.schemas import BadMessage, ScoredTrajectory, ScoringTask, StopReason, Trajectory, parse_message
from shared.storage import LocalStore, get_model, put_model


ON_BOTH_TOPOLOGIES = True  # each test using redis_client runs on the standalone Redis and a Redis Cluster


@pytest.fixture
def scorer(ledger, store, redis_client) -> Scorer:
    return Scorer(store, RewardCombiner({"verifier": 1.0}), LeaseKeeper(ledger, 30, 5, SCORING), DeadLetters(redis_client))


def upload(ledger: Ledger, store: LocalStore, run_id: str) -> tuple[str, ScoringTask]:
    """One trajectory as a rollout worker leaves it: object written, ledger ``uploaded``."""
    req = requests_for(run_id, size=1)[0]
    ledger.register([req])
    ledger.claim(req.trajectory_id, "rollout", 30)
    key = trajectory_key(run_id, req.group_id, req.trajectory_id)
    put_model(store, key, Trajectory(request=req, turns=[], stop_reason=StopReason.done, env_reward=0.75))
    assert ledger.mark_uploaded(req.trajectory_id, "rollout").ok
    return req.trajectory_id, ScoringTask(trajectory_id=req.trajectory_id, trajectory_key=key, upload_s=0.25)


def test_a_dead_scorers_trajectory_is_rescored_once_and_late_copies_are_no_ops(ledger, store, scorer, run_id):
    tid, task = upload(ledger, store, run_id)
    # a scorer claimed it and died: its lease is never renewed again
    assert ledger.claim(tid, "dead-scorer", 0.01, SCORING, task.model_dump_json())[0]
    assert scorer.score(task) == "skipped:leased"  # a second copy while the lease holds
    time.sleep(0.05)
    outcomes = []
    reaper = LeaseReaper(ledger, SCORING, 3, 1.0, one_by_one(lambda _tid, payload: outcomes.append(scorer.score(parse_message(ScoringTask, payload)))))
    assert reaper.sweep() == {"requeued": 1, "resent": 0, "failed": 0}
    assert outcomes == ["scored"]
    [event] = stream_events(ledger.redis, run_id)
    assert (event.kind, event.trajectory_id, event.reward) == ("scored", tid, 0.75)
    assert event.scored_key == member_ref(scored_bundle_key(run_id, 0, tid, 2), 0) != member_ref(scored_bundle_key(run_id, 0, tid, 1), 0)
    assert get_model(store, event.scored_key, ScoredTrajectory).reward == 0.75
    assert ledger.attempts(tid, SCORING) == 2

    # the dead scorer's original message, redelivered by the broker later, changes nothing
    assert scorer.score(task) == "skipped:scored"
    assert ledger.mark_consumed(tid).ok
    assert scorer.score(task) == "skipped:consumed"
    assert reaper.sweep() == {"requeued": 0, "resent": 0, "failed": 0}
    assert len(stream_events(ledger.redis, run_id)) == 1
    assert ledger.attempts(tid, SCORING) == 2 and ledger.state(tid) == "consumed"


def test_scoring_ends_the_lease_and_keeps_nothing_renewed(ledger, store, scorer, run_id):
    tid, task = upload(ledger, store, run_id)
    assert scorer.score(task) == "scored"
    assert ledger.lease_owner(tid, SCORING) is None and ledger.expired_leases(time.time() + 1e6, stage=SCORING) == []
    assert scorer.leases.beat() == 0
    [event] = stream_events(ledger.redis, run_id)
    assert event.scored_key == member_ref(scored_bundle_key(run_id, 0, tid, 1), 0)  # a first attempt's key
    assert (event.trajectory_key, event.stop_reason) == (task.trajectory_key, StopReason.done)  # the trainer reads no more
    assert get_model(store, event.scored_key, ScoredTrajectory).timings["upload"] == 0.25


def test_an_unreadable_trajectory_fails_with_its_reason(ledger, store, scorer, run_id):
    tid, task = upload(ledger, store, run_id)
    task = task.model_copy(update={"trajectory_key": "trajectories/missing.json.gz"})
    assert scorer.score(task) == "failed"
    assert ledger.state(tid) == "failed" and ledger.failure_reasons(run_id)[tid].startswith("scoring_error: ")
    assert ledger.lease_owner(tid, SCORING) is None
    assert scorer.score(task) == "skipped:failed"


def scoring_task_of(args: list, kwargs: dict):
    """The one task of a message that must carry exactly one; its BadMessage raised."""
    [task] = scoring_tasks_of(args, kwargs)
    if isinstance(task, BadMessage):
        raise task
    return task


def test_a_scoring_message_is_one_scoring_task_and_anything_else_is_a_bad_message(ledger, store, run_id):
    tid, task = upload(ledger, store, run_id)
    assert scoring_task_of([task.model_dump(mode="json")], {}) == task
    bad = [
        ([tid, task.trajectory_key, 0.25], {}, "expected one ScoringTask"),  # the old positional arguments
        ([], {"task": task.model_dump(mode="json")}, "expected one ScoringTask"),
        ([{"trajectory_id": tid}], {}, "trajectory_key: Field required"),
        ([{**task.model_dump(mode="json"), "upload_s": "slow"}], {}, "upload_s: Input should be a valid number"),
        ([{**task.model_dump(mode="json"), "schema_version": "2.0"}], {}, "schema_version"),
        (["not an object"], {}, "expected one ScoringTask object"),
    ]
    for args, kwargs, problem in bad:
        with pytest.raises(BadMessage, match=problem) as info:
            scoring_task_of(args, kwargs)
        assert str(info.value).startswith("bad scoring task: ")


def test_a_batch_of_scoring_tasks_reads_each_and_a_bad_element_does_not_spoil_the_others(ledger, store, run_id):
    tid, task = upload(ledger, store, run_id)
    good = task.model_dump(mode="json")
    read = scoring_tasks_of([[good, {"trajectory_id": tid}, "text", good]], {})
    assert read[0] == task and read[3] == task
    assert isinstance(read[1], BadMessage) and str(read[1]).startswith("bad scoring task 1 of 4: trajectory_key: Field required")
    assert isinstance(read[2], BadMessage) and "expected a ScoringTask object" in str(read[2])
    assert scoring_tasks_of([[]], {}) == []


def test_a_bad_scoring_message_is_dead_lettered_and_fails_the_waiting_trajectory(ledger, store, scorer, run_id):
    tid, task = upload(ledger, store, run_id)
    with pytest.raises(BadMessage) as info:
        scoring_task_of([{"trajectory_id": tid, "trajectory_key": 7}], {})
    assert scorer.reject(info.value, tid) == "failed:bad_message"
    assert ledger.state(tid) == "failed"
    assert ledger.failure_reasons(run_id)[tid] == "bad_message: trajectory_key: Input should be a valid string"
    [event] = stream_events(ledger.redis, run_id)  # the trainer hears of it: the group still completes
    assert (event.kind, event.trajectory_id) == ("failed", tid)
    [letter] = DeadLetters(ledger.redis).newest()
    assert letter["source"] == "queue scoring" and "trajectory_key" in letter["problems"] and tid in letter["message"]
    # a bad copy for a trajectory that is already decided, or names none, is only dead-lettered
    assert scorer.reject(info.value, tid) == "rejected:bad_message"
    assert scorer.reject(info.value, "no trajectory id") == "rejected:bad_message"
    assert len(DeadLetters(ledger.redis).newest()) == 3


def test_a_bad_copy_of_a_task_another_scorer_holds_does_not_fail_it(ledger, store, scorer, run_id):
    tid, task = upload(ledger, store, run_id)
    assert ledger.claim(tid, "live-scorer", 30, SCORING, task.model_dump_json())[0]
    with pytest.raises(BadMessage) as info:
        scoring_task_of([tid], {})
    assert scorer.reject(info.value, tid) == "rejected:bad_message"
    assert ledger.state(tid) == "uploaded" and ledger.lease_owner(tid, SCORING) == "live-scorer"
