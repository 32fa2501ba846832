"""The trajectory ledger against a real Redis: atomic, guarded, idempotent transitions."""

from __future__ import annotations

import time

import pytest

from shared.state.ledger import STATES, Ledger
from shared.names import RedisKeys
from shared.schemas import RolloutRequest, ScoredEvent, TaskProfile, TrainerEvent, parse_message


ON_BOTH_TOPOLOGIES = True  # each test using redis_client runs on the standalone Redis and a Redis Cluster


def requests_for(run_id: str, group_id: int = 0, size: int = 3, base_seed: int = 100) -> list[RolloutRequest]:
    task = TaskProfile(task_id="t", env_name="guess_number", task_data={"low": 1, "high": 9, "target": 3})
    out = []
    for i in range(size):
        seed = base_seed + group_id + i
        out.append(
            RolloutRequest(
                run_id=run_id, group_id=group_id, episode_index=i, episode_seed=seed,
                trajectory_id=f"{run_id}_{group_id}_{i}_{seed}", group_size=size, task=task, dispatched_at=time.time(),
            )
        )
    return out


def scored_event(tid: str, run_id: str, group_id: int = 0, reward: float = 1.0) -> ScoredEvent:
    return ScoredEvent(trajectory_id=tid, run_id=run_id, group_id=group_id, reward=reward, scored_key=f"scored/{tid}", at=time.time())


def stream_events(redis_client, run_id: str) -> list[TrainerEvent]:
    return [parse_message(TrainerEvent, f["event"]) for _, f in redis_client.xrange(RedisKeys.trainer_stream(run_id))]


def assert_counts_consistent(ledger: Ledger, run_id: str, registered: int) -> dict[str, int]:
    counts = ledger.counts(run_id)
    assert sum(counts.values()) == registered
    assert all(v >= 0 for v in counts.values())
    by_state = {s: 0 for s in STATES}
    for state in ledger.states(run_id).values():
        by_state[state] += 1
    assert counts == by_state
    return counts


def test_register_is_idempotent(ledger, run_id):
    reqs = requests_for(run_id)
    assert ledger.register(reqs) == 3
    assert ledger.register(reqs) == 0
    assert ledger.register([]) == 0
    assert ledger.counts(run_id)["queued"] == 3
    assert run_id in ledger.runs()
    assert ledger.request(reqs[1].trajectory_id) == reqs[1]
    assert {ledger.state(r.trajectory_id) for r in reqs} == {"queued"}


def test_register_leaves_known_trajectories_in_their_state(ledger, run_id):
    reqs = requests_for(run_id)
    ledger.register(reqs)
    assert ledger.claim(reqs[0].trajectory_id, "tok", 30)[0]
    assert ledger.register(reqs + requests_for(run_id, group_id=1)) == 3  # only group 1 is new
    assert ledger.state(reqs[0].trajectory_id) == "running"
    assert_counts_consistent(ledger, run_id, 6)


def test_unknown_request_raises_key_error(ledger, run_id):
    with pytest.raises(KeyError):
        ledger.request(f"{run_id}_0_0_0")


def test_claim_only_once(ledger, run_id):
    tid = requests_for(run_id)[0].trajectory_id
    ledger.register(requests_for(run_id))
    assert ledger.claim(tid, "token-a", 30) == (True, "1")
    assert ledger.claim(tid, "token-b", 30) == (False, "running")
    assert ledger.state(tid) == "running"
    assert ledger.attempts(tid) == 1
    assert ledger.redis.hget(RedisKeys.owners(run_id), tid) == "token-a"
    assert ledger.claim(f"{run_id}_9_0_0", "t", 30) == (False, "unknown")


def test_heartbeat_renews_only_for_the_owner(ledger, run_id):
    reqs = requests_for(run_id)
    ledger.register(reqs)
    tid = reqs[0].trajectory_id
    ledger.claim(tid, "owner", 10)
    before = ledger.lease_deadline(tid)
    assert ledger.heartbeat({tid: "intruder"}, 1000) == 0
    assert ledger.lease_deadline(tid) == before
    assert ledger.heartbeat({tid: "owner"}, 1000) == 1
    assert ledger.lease_deadline(tid) > before + 900
    # not running any more -> nothing to renew, and no lease re-created
    assert ledger.mark_uploaded(tid, "owner").ok
    assert ledger.heartbeat({tid: "owner"}, 1000) == 0
    assert ledger.lease_deadline(tid) is None


def test_mark_uploaded_by_non_owner_is_rejected(ledger, run_id):
    reqs = requests_for(run_id)
    ledger.register(reqs)
    tid = reqs[0].trajectory_id
    assert not ledger.mark_uploaded(tid, "owner").ok  # still queued
    ledger.claim(tid, "owner", 30)
    result = ledger.mark_uploaded(tid, "stale-worker")
    assert (result.ok, result.state) == (False, "not_owner")
    assert ledger.state(tid) == "running"
    result = ledger.mark_uploaded(tid, "owner")
    assert (result.ok, result.state) == (True, "running")
    assert ledger.state(tid) == "uploaded"
    assert ledger.lease_deadline(tid) is None
    assert ledger.redis.hget(RedisKeys.owners(run_id), tid) is None


def test_mark_scored_appends_exactly_one_event(ledger, run_id):
    reqs = requests_for(run_id)
    ledger.register(reqs)
    tid = reqs[0].trajectory_id
    event = scored_event(tid, run_id, reward=0.75)
    assert not ledger.mark_scored(tid, event).ok  # queued: not yet uploaded
    assert stream_events(ledger.redis, run_id) == []
    ledger.claim(tid, "tok", 30)
    ledger.mark_uploaded(tid, "tok")
    assert ledger.mark_scored(tid, event).ok
    second = ledger.mark_scored(tid, event)
    assert (second.ok, second.state) == (False, "scored")
    assert stream_events(ledger.redis, run_id) == [event]
    assert ledger.mark_consumed(tid).ok
    assert not ledger.mark_consumed(tid).ok
    assert ledger.state(tid) == "consumed"
    assert_counts_consistent(ledger, run_id, 3)


def _drive_to(ledger: Ledger, tid: str, state: str) -> None:
    if state == "queued":
        return
    assert ledger.claim(tid, "tok", 30)[0]
    if state == "running":
        return
    assert ledger.mark_uploaded(tid, "tok").ok
    if state == "uploaded":
        return
    assert ledger.mark_scored(tid, scored_event(tid, ledger_run(tid))).ok


def ledger_run(tid: str) -> str:
    return tid.split("_")[0]


@pytest.mark.parametrize("state", ["queued", "running", "uploaded", "scored"])
def test_fail_from_each_non_terminal_state(ledger, run_id, state):
    reqs = requests_for(run_id)
    ledger.register(reqs)
    tid = reqs[0].trajectory_id
    _drive_to(ledger, tid, state)
    result = ledger.fail(tid, "broken env")
    assert (result.ok, result.state) == (True, state)
    assert ledger.state(tid) == "failed"
    assert ledger.failure_reasons(run_id) == {tid: "broken env"}
    failed = [e for e in stream_events(ledger.redis, run_id) if e.kind == "failed"]
    assert len(failed) == 1
    assert (failed[0].trajectory_id, failed[0].group_id, failed[0].failure_reason) == (tid, 0, "broken env")
    assert ledger.lease_deadline(tid) is None
    # terminal: a second fail is a no-op and adds no event
    assert not ledger.fail(tid, "again").ok
    assert len([e for e in stream_events(ledger.redis, run_id) if e.kind == "failed"]) == 1
    counts = assert_counts_consistent(ledger, run_id, 3)
    assert counts["failed"] == 1


def test_fail_with_token_only_by_the_lease_owner(ledger, run_id):
    reqs = requests_for(run_id)
    ledger.register(reqs)
    tid = reqs[0].trajectory_id
    assert not ledger.fail(tid, "x", token="tok").ok  # queued: a token-holder may only fail a running one
    ledger.claim(tid, "tok", 30)
    assert ledger.fail(tid, "x", token="other").state == "not_owner"
    assert ledger.state(tid) == "running"
    assert ledger.fail(tid, "env_error: boom", token="tok").ok
    assert ledger.state(tid) == "failed"


def test_consumed_trajectory_cannot_fail(ledger, run_id):
    reqs = requests_for(run_id)
    ledger.register(reqs)
    tid = reqs[0].trajectory_id
    _drive_to(ledger, tid, "scored")
    ledger.mark_consumed(tid)
    assert (ledger.fail(tid, "late").ok, ledger.state(tid)) == (False, "consumed")


def test_counts_always_sum_to_registered(ledger, run_id):
    reqs = requests_for(run_id, size=6)
    ledger.register(reqs)
    tids = [r.trajectory_id for r in reqs]
    steps = [
        lambda: ledger.claim(tids[0], "a", 30),
        lambda: ledger.claim(tids[1], "b", 30),
        lambda: ledger.claim(tids[1], "c", 30),  # skipped
        lambda: ledger.mark_uploaded(tids[0], "a"),
        lambda: ledger.mark_uploaded(tids[1], "wrong"),  # skipped
        lambda: ledger.requeue(tids[1], "b"),
        lambda: ledger.mark_scored(tids[0], scored_event(tids[0], run_id)),
        lambda: ledger.fail(tids[2], "x"),
        lambda: ledger.fail(tids[2], "x"),  # skipped
        lambda: ledger.mark_consumed(tids[0]),
        lambda: ledger.claim(tids[3], "d", 30),
        lambda: ledger.expire(tids[3], max_attempts=1, now=time.time() + 100),
    ]
    for step in steps:
        step()
        assert_counts_consistent(ledger, run_id, 6)
    assert ledger.counts(run_id) == {"queued": 3, "running": 0, "uploaded": 0, "scored": 0, "consumed": 1, "failed": 2}


def test_requeue_by_owner_allows_a_fresh_claim(ledger, run_id):
    reqs = requests_for(run_id)
    ledger.register(reqs)
    tid = reqs[0].trajectory_id
    ledger.claim(tid, "a", 30)
    assert not ledger.requeue(tid, "b").ok
    assert ledger.requeue(tid, "a").ok
    assert ledger.state(tid) == "queued" and ledger.lease_owner(tid) is None
    # the lease became a dispatch deadline: the owner publishes next, and if that is lost the reaper does
    assert ledger.lease_deadline(tid) > time.time() + ledger.dispatch_ttl_s - 5
    assert ledger.claim(tid, "b", 30) == (True, "2")


def test_expire_requeues_then_fails_after_max_attempts(ledger, run_id):
    reqs = requests_for(run_id)
    ledger.register(reqs)
    tid = reqs[0].trajectory_id
    ledger.claim(tid, "a", 30)
    assert ledger.expire(tid, max_attempts=2) == "skip"  # lease still valid
    later = time.time() + 60
    assert tid in ledger.expired_leases(now=later)
    assert tid not in ledger.expired_leases()
    assert ledger.expire(tid, max_attempts=2, now=later) == "requeued"
    assert ledger.state(tid) == "queued"
    assert ledger.expire(tid, max_attempts=2, now=later) == "skip"  # lease gone
    assert stream_events(ledger.redis, run_id) == []
    # the old owner cannot publish after its lease expired and the trajectory was re-queued
    assert not ledger.mark_uploaded(tid, "a").ok

    assert ledger.claim(tid, "b", 30) == (True, "2")
    assert ledger.expire(tid, max_attempts=2, now=later) == "failed"
    assert ledger.state(tid) == "failed"
    assert "lease_expired" in ledger.failure_reasons(run_id)[tid]
    events = stream_events(ledger.redis, run_id)
    assert len(events) == 1
    assert events[0].kind == "failed" and events[0].trajectory_id == tid and "lease_expired" in events[0].failure_reason
    assert ledger.expired_leases(now=later) == []
    assert_counts_consistent(ledger, run_id, 3)


def test_expire_skips_a_trajectory_that_moved_on(ledger, run_id):
    reqs = requests_for(run_id)
    ledger.register(reqs)
    tid = reqs[0].trajectory_id
    ledger.claim(tid, "a", 30)
    ledger.mark_uploaded(tid, "a")
    assert ledger.expire(tid, max_attempts=1, now=time.time() + 60) == "skip"
    assert ledger.state(tid) == "uploaded"


def test_status_counts_are_per_run(ledger, run_id):
    other = run_id + "-b"
    ledger.register(requests_for(run_id, size=3))
    ledger.register(requests_for(other, size=5))
    ledger.fail(requests_for(other, size=5)[0].trajectory_id, "x")
    assert ledger.counts(run_id) == {"queued": 3, "running": 0, "uploaded": 0, "scored": 0, "consumed": 0, "failed": 0}
    assert ledger.counts(other) == {"queued": 4, "running": 0, "uploaded": 0, "scored": 0, "consumed": 0, "failed": 1}
    assert ledger.counts("never-registered") == {s: 0 for s in STATES}
    assert ledger.runs() == sorted([run_id, other])
    assert stream_events(ledger.redis, run_id) == []


def test_batched_moves_survive_a_restart_that_emptied_the_script_cache(redis_client):
    """A restart keeps Redis's data but not its scripts; a batch sent after it claims, uploads
    and scores each member once (no NoScriptError reaches the caller)."""
    ledger, requests = Ledger(redis_client), requests_for("flushed")
    ledger.register(requests)
    redis_client.script_flush()
    claims = [(r.trajectory_id, f"token-{r.episode_index}", r.model_dump_json()) for r in requests]
    assert [ok for ok, _ in ledger.claim_many(claims, lease_ttl_s=30)] == [True] * 3
    redis_client.script_flush()
    moves = [(tid, token, "scoring-task") for tid, token, _ in claims]
    assert [r.ok for r in ledger.mark_uploaded_many(moves)] == [True] * 3
    redis_client.script_flush()
    scored = [(r.trajectory_id, scored_event(r.trajectory_id, "flushed"), None) for r in requests]
    assert [r.ok for r in ledger.mark_scored_many(scored)] == [True] * 3
    assert {ledger.attempts(r.trajectory_id) for r in requests} == {1}
    assert len(stream_events(redis_client, "flushed")) == 3
    assert_counts_consistent(ledger, "flushed", 3)
