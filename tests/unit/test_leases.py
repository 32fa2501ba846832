"""Leases of both stages that hold work (rollout, scoring), their keeper and their reaper,
against a real Redis: one owner at a time, renewal only by the owner, re-dispatch once per
expiry, and a bounded number of attempts."""

from __future__ import annotations

import json
import time

import pytest
from test_ledger import assert_counts_consistent, requests_for, scored_event, stream_events

from shared.celery_app import check_lease_timing
from shared.state.leases import LeaseKeeper, LeaseReaper, one_by_one
from shared.state.ledger import ROLLOUT, SCORING, Ledger
from shared.names import RedisKeys
from shared.settings import LedgerSettings, SettingsError

ON_BOTH_TOPOLOGIES = True  # each test using redis_client runs on the standalone Redis and a Redis Cluster


LATER = time.time() + 1e6  # every lease taken in these tests has run out by then


def uploaded(ledger: Ledger, run_id: str, size: int = 3) -> list[str]:
    """Trajectories a rollout worker has uploaded: what the scorer claims."""
    reqs = requests_for(run_id, size=size)
    ledger.register(reqs)
    for req in reqs:
        assert ledger.claim(req.trajectory_id, "rollout-tok", 30)[0]
        assert ledger.mark_uploaded(req.trajectory_id, "rollout-tok").ok
    return [r.trajectory_id for r in reqs]


def test_scoring_claim_holds_an_uploaded_trajectory_once(ledger, run_id):
    reqs = requests_for(run_id)
    ledger.register(reqs)
    tid = reqs[0].trajectory_id
    assert ledger.claim(tid, "s1", 30, SCORING, '["args"]') == (False, "queued")  # not uploaded yet
    ledger.claim(tid, "r", 30)
    assert ledger.claim(tid, "s1", 30, SCORING) == (False, "running")
    ledger.mark_uploaded(tid, "r")
    assert ledger.claim(tid, "s1", 30, SCORING, '["args"]') == (True, "1")
    assert ledger.claim(tid, "s2", 30, SCORING, '["other"]') == (False, "leased")
    assert ledger.state(tid) == "uploaded"  # the lease holds the state as it is
    assert ledger.lease_owner(tid, SCORING) == "s1"
    assert ledger.payload(tid, SCORING) == '["args"]'
    assert (ledger.attempts(tid, SCORING), ledger.attempts(tid)) == (1, 1)  # stages count apart
    assert ledger.lease_deadline(tid, SCORING) is not None
    assert ledger.lease_deadline(tid) is None
    assert_counts_consistent(ledger, run_id, 3)


def test_only_the_scoring_owner_scores_or_fails_and_that_ends_the_lease(ledger, run_id):
    tid, other, *_ = uploaded(ledger, run_id)
    ledger.claim(tid, "owner", 30, SCORING)
    event = scored_event(tid, run_id)
    assert ledger.mark_scored(tid, event, token="intruder").state == "not_owner"
    assert ledger.fail(tid, "x", token="intruder").state == "not_owner"
    assert ledger.mark_scored(tid, event, token="rollout-tok").state == "not_owner"
    assert ledger.mark_scored(tid, event, token="owner").ok
    assert ledger.mark_scored(tid, event, token="owner").state == "scored"
    assert stream_events(ledger.redis, run_id) == [event]
    assert ledger.lease_owner(tid, SCORING) is None
    assert ledger.lease_deadline(tid, SCORING) is None
    assert ledger.mark_scored(other, scored_event(other, run_id), token="owner").state == "not_owner"  # never claimed
    ledger.claim(other, "owner-2", 30, SCORING)
    assert ledger.fail(other, "scoring_error: bad", token="owner-2").ok
    assert ledger.lease_deadline(other, SCORING) is None
    assert_counts_consistent(ledger, run_id, 3)


def test_scoring_heartbeat_renews_only_the_owners_held_leases(ledger, run_id):
    tid, *_ = uploaded(ledger, run_id)
    ledger.claim(tid, "owner", 10, SCORING)
    before = ledger.lease_deadline(tid, SCORING)
    assert ledger.heartbeat({tid: "intruder"}, 1000, SCORING) == 0
    assert ledger.heartbeat({tid: "owner"}, 1000) == 0  # the rollout stage holds nothing here
    assert ledger.lease_deadline(tid, SCORING) == before
    assert ledger.heartbeat({tid: "owner"}, 1000, SCORING) == 1
    assert ledger.lease_deadline(tid, SCORING) > before + 900
    ledger.mark_scored(tid, scored_event(tid, run_id), token="owner")
    assert ledger.heartbeat({tid: "owner"}, 1000, SCORING) == 0
    assert ledger.lease_deadline(tid, SCORING) is None


def test_expired_scoring_lease_frees_the_trajectory_then_fails_it_after_max_attempts(ledger, run_id):
    tid, *_ = uploaded(ledger, run_id)
    ledger.claim(tid, "dead", 30, SCORING, '["a1"]')
    assert ledger.expire(tid, 2, stage=SCORING) == "skip"  # still valid
    assert ledger.expired_leases(now=LATER, stage=SCORING) == [tid]
    assert ledger.expired_leases(now=LATER) == []  # the rollout stage's leases are apart
    assert ledger.expire(tid, 2, now=LATER) == "skip"  # ... and so is its expiry
    assert ledger.expire(tid, 2, now=LATER, stage=SCORING) == "requeued"
    assert ledger.state(tid) == "uploaded" and ledger.lease_owner(tid, SCORING) is None
    assert ledger.expire(tid, 2, now=LATER, stage=SCORING) == "skip"  # once per expiry
    # the scorer presumed dead wakes up: it cannot hand its copy on
    assert ledger.mark_scored(tid, scored_event(tid, run_id), token="dead").state == "not_owner"
    assert stream_events(ledger.redis, run_id) == []

    assert ledger.claim(tid, "second", 30, SCORING, '["a2"]') == (True, "2")
    assert ledger.payload(tid, SCORING) == '["a2"]'
    assert ledger.expire(tid, 2, now=LATER, stage=SCORING) == "failed"
    assert ledger.state(tid) == "failed"
    assert ledger.failure_reasons(run_id)[tid] == "scoring_lease_expired after 2 attempts"
    [event] = stream_events(ledger.redis, run_id)
    assert (event.kind, event.trajectory_id, event.failure_reason) == ("failed", tid, "scoring_lease_expired after 2 attempts")
    assert ledger.expired_leases(now=LATER, stage=SCORING) == []
    assert_counts_consistent(ledger, run_id, 3)


def test_expiry_after_the_hand_off_is_a_no_op(ledger, run_id):
    tid, *_ = uploaded(ledger, run_id)
    ledger.claim(tid, "s", 30, SCORING)
    # the lease's deadline passed, but the owner scored before any reaper looked
    ledger.redis.zadd(RedisKeys.scoring_leases(run_id), {tid: 1.0})
    assert ledger.mark_scored(tid, scored_event(tid, run_id), token="s").ok
    assert ledger.expire(tid, 1, stage=SCORING) == "skip"
    assert ledger.claim(tid, "late-copy", 30, SCORING) == (False, "scored")
    assert ledger.state(tid) == "scored" and len(stream_events(ledger.redis, run_id)) == 1


def test_reaper_redispatches_each_expired_lease_of_its_stage_once(ledger, run_id):
    scoring_tids = uploaded(ledger, run_id, size=3)
    for i, tid in enumerate(scoring_tids):
        ledger.claim(tid, f"dead-{i}", 0.01, SCORING, json.dumps([tid, f"key-{i}", 0.5]))
    rollout = requests_for(run_id, group_id=1, size=1)
    ledger.register(rollout)
    ledger.claim(rollout[0].trajectory_id, "dead-rollout", 0.01)
    time.sleep(0.05)
    sent: list[tuple[str, list]] = []
    scoring_reaper = LeaseReaper(ledger, SCORING, 3, 1.0, one_by_one(lambda tid, payload: sent.append((tid, json.loads(payload)))))
    assert scoring_reaper.sweep() == {"requeued": 3, "resent": 0, "failed": 0}
    assert sorted(sent) == sorted((tid, [tid, f"key-{i}", 0.5]) for i, tid in enumerate(scoring_tids))
    assert scoring_reaper.sweep() == {"requeued": 0, "resent": 0, "failed": 0}
    assert ledger.state(rollout[0].trajectory_id) == "running"  # another stage's lease: untouched

    requests = []
    rollout_reaper = LeaseReaper(ledger, ROLLOUT, 3, 1.0, one_by_one(lambda tid, payload: requests.append(payload)))
    assert rollout_reaper.sweep() == {"requeued": 1, "resent": 0, "failed": 0}
    assert requests == [rollout[0].model_dump_json()]
    assert {ledger.state(t) for t in scoring_tids} == {"uploaded"}
    assert_counts_consistent(ledger, run_id, 4)


def test_keeper_claims_renews_and_lets_go(ledger, run_id):
    tid, other, _ = uploaded(ledger, run_id)
    keeper = LeaseKeeper(ledger, lease_ttl_s=1000, heartbeat_s=0.05, stage=SCORING)
    token, attempt = keeper.claim(tid, '["p"]')
    assert token and attempt == "1" and ledger.lease_owner(tid, SCORING) == token
    assert keeper.claim(tid) == (None, "leased")
    ledger.redis.zadd(RedisKeys.scoring_leases(run_id), {tid: time.time() + 5})
    keeper.start()
    try:
        deadline = time.time() + 10
        while ledger.lease_deadline(tid, SCORING) < time.time() + 900:
            assert time.time() < deadline, "the heartbeat thread never renewed the lease"
            time.sleep(0.05)
        keeper.release(tid)
        ledger.redis.zadd(RedisKeys.scoring_leases(run_id), {tid: 1.0})
        time.sleep(0.3)  # several heartbeats: a released lease is no longer renewed
        assert ledger.lease_deadline(tid, SCORING) == 1.0
    finally:
        keeper.stop()
    assert keeper.beat() == 0


@pytest.mark.parametrize(
    "values, message",
    [
        ({"lease_ttl_s": 5, "heartbeat_s": 5}, "heartbeat_s"),
        ({"lease_ttl_s": 30, "reaper_interval_s": 5, "visibility_timeout_s": 35}, "visibility_timeout_s"),
    ],
)
def test_lease_timing_that_would_let_the_broker_recover_work_is_refused(values, message):
    with pytest.raises(SettingsError, match=message):
        check_lease_timing(LedgerSettings(**values))
    check_lease_timing(LedgerSettings())


def test_members_a_dead_worker_never_claimed_are_sent_again_with_its_expired_ones(ledger, run_id):
    """A rollout task carries a whole group; its worker died after claiming two of four members.
    The two it never claimed wait in ``queued``: the reaper sends them with the expired ones,
    instead of leaving them to the broker's visibility timeout."""
    group = requests_for(run_id, group_id=3, size=4)
    other = requests_for(run_id, group_id=4, size=2)
    ledger.register(group + other)
    for req in group[:2]:
        assert ledger.claim(req.trajectory_id, "dead-worker", 0.01)[0]
    time.sleep(0.05)
    sent: list[str] = []
    reaper = LeaseReaper(ledger, ROLLOUT, 3, 1.0, one_by_one(lambda tid, payload: sent.append(tid)))
    assert reaper.sweep() == {"requeued": 2, "resent": 0, "failed": 0}
    unclaimed = [r.trajectory_id for r in group[2:]]
    expired = [r.trajectory_id for r in group[:2]]
    assert sorted(sent) == sorted(expired + unclaimed)  # once each; group 4, not the dead worker's, is not sent
    # each copy beyond the first is a no-op at the claim: one claim wins per member
    winners = [tid for i, tid in enumerate(sent) if ledger.claim(tid, f"survivor-{i}", 30)[0]]
    assert sorted(winners) == sorted(expired + unclaimed)
    assert_counts_consistent(ledger, run_id, 6)
