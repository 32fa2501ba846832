"""Every state that holds work has a deadline (``shared.state.ledger``): a lease, or a dispatch
deadline for a trajectory still waiting to be claimed, written in the same Lua call as the
state. So a message lost anywhere (never sent; taken off the broker's queue by a worker that
died before recording the delivery; lost with Redis' last second of writes) is sent again by
the reaper, as one task per GRPO group, with no attempt spent and fewer copies each time.
Real Redis; the broker is that Redis, through a real Celery app."""

from __future__ import annotations

import json
import random
import time

import pytest
from test_ledger import requests_for, scored_event

from shared.celery_app import make_celery, publish_rollouts_by_group
from shared.state.leases import LeaseReaper, one_by_one
from shared.state.ledger import ROLLOUT, SCORING, Ledger
from shared.names import ROLLOUT_QUEUE
from shared.schemas import RolloutRequest
from shared.settings import load_settings

WAITING = {"queued": ROLLOUT, "uploaded": SCORING}  # state -> the stage that claims it
TERMINAL = {"scored", "consumed", "failed"}


def assert_deadlines(ledger: Ledger, tids: list[str], why: str) -> None:
    """The invariant: work-holding states have their deadline, nothing else has one."""
    for tid in tids:
        state = ledger.state(tid)
        in_zset = {stage.name: ledger.lease_deadline(tid, stage) is not None for stage in (ROLLOUT, SCORING)}
        owners = {stage.name: ledger.lease_owner(tid, stage) for stage in (ROLLOUT, SCORING)}
        if state in TERMINAL:
            assert in_zset == {"rollout": False, "scoring": False} and set(owners.values()) == {None}, (tid, state, why)
        elif state == "running":
            assert in_zset == {"rollout": True, "scoring": False} and owners["rollout"], (tid, state, why)
        else:
            stage = WAITING[state]
            other = SCORING if stage is ROLLOUT else ROLLOUT
            assert in_zset[stage.name] and not in_zset[other.name], (tid, state, why)
            assert owners[other.name] is None and (stage is SCORING or owners["rollout"] is None), (tid, state, why)


def random_move(ledger: Ledger, rng: random.Random, tid: str, tokens: dict[str, str]) -> str:
    """One move a live system could make on ``tid`` from its state; returns what it did."""
    state, far = ledger.state(tid), time.time() + 1e6
    payload = json.dumps({"trajectory_id": tid, "trajectory_key": f"k/{tid}"})
    moves = {
        "queued": ["claim", "expire_rollout", "fail"],
        "running": ["requeue", "hand_back", "expire_rollout", "upload", "fail_by_owner"],
        "uploaded": ["scoring_sent", "claim_scoring", "hand_back_scoring", "expire_scoring", "score", "fail"],
        "scored": ["consume", "fail"],
    }.get(state, [])
    if not moves:
        return "none"
    move = rng.choice(moves)
    rollout_token, scoring_token = ledger.lease_owner(tid), ledger.lease_owner(tid, SCORING)
    if move == "claim":
        tokens[tid] = f"w{rng.random()}"
        ledger.claim(tid, tokens[tid], 30)
    elif move == "expire_rollout":
        ledger.expire(tid, 3, now=far)
    elif move == "expire_scoring":
        ledger.expire(tid, 3, now=far, stage=SCORING)
    elif move == "fail":
        ledger.fail(tid, "env_error: test")
    elif move == "fail_by_owner":
        ledger.fail(tid, "env_error: test", token=rollout_token)
    elif move == "requeue":
        ledger.requeue(tid, rollout_token)
    elif move == "hand_back":
        ledger.hand_back(tid, rollout_token)
    elif move == "upload":
        ledger.mark_uploaded(tid, rollout_token, payload, send_within_s=rng.choice([0.0, 5.0]))
    elif move == "scoring_sent":
        ledger.scoring_sent([tid])
    elif move == "claim_scoring":
        ledger.claim(tid, f"s{rng.random()}", 30, SCORING, payload)
    elif move == "hand_back_scoring" and scoring_token:
        ledger.hand_back(tid, scoring_token, SCORING)
    elif move == "score":
        ledger.mark_scored(tid, scored_event(tid, parse_run(tid)), token=scoring_token)
    elif move == "consume":
        ledger.mark_consumed(tid)
    return move


def parse_run(tid: str) -> str:
    return tid.split("_")[0]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_every_state_that_holds_work_has_its_deadline_after_any_sequence_of_moves(ledger, run_id, seed):
    rng = random.Random(seed)
    requests = requests_for(run_id, size=6)
    ledger.register(requests)
    tids = [r.trajectory_id for r in requests]
    tokens: dict[str, str] = {}
    assert_deadlines(ledger, tids, "registered")
    for step in range(300):
        tid = rng.choice(tids)
        move = random_move(ledger, rng, tid, tokens)
        assert_deadlines(ledger, tids, f"step {step}: {move} on {tid}")


def test_a_group_the_broker_lost_goes_out_again_as_one_task_at_its_deadline_each_wait_longer(redis_url, run_id):
    ledger = Ledger(Ledger.from_url(redis_url).redis, dispatch_ttl_s=0.5)
    app = make_celery(load_settings(redis={"url": redis_url}))
    queue = ledger.redis
    queue.delete(ROLLOUT_QUEUE)
    group = requests_for(run_id, size=4)
    ledger.register(group)  # intake published the group; a worker took it off the queue and died before recording it
    reaper = LeaseReaper(ledger, ROLLOUT, 3, 1.0,
                    lambda items: publish_rollouts_by_group(app, [RolloutRequest.model_validate_json(p) for _, p in items]))
    assert reaper.sweep() == {"requeued": 0, "resent": 0, "failed": 0}  # within the deadline: the message may still come
    time.sleep(0.6)
    assert reaper.sweep() == {"requeued": 0, "resent": 4, "failed": 0}
    assert queue.llen(ROLLOUT_QUEUE) == 1  # the whole group in one task, not one per trajectory
    body = json.loads(queue.lindex(ROLLOUT_QUEUE, 0))
    assert body["headers"]["task"].endswith("run_trajectories")
    time.sleep(1.3)  # past the next deadline (twice as far), but the copy still waits in the queue: no other
    assert reaper.sweep() == {"requeued": 0, "resent": 0, "failed": 0} and queue.llen(ROLLOUT_QUEUE) == 1
    queue.delete(ROLLOUT_QUEUE)  # a worker took the copy off the queue and died too
    time.sleep(0.6)  # the deadline moved one wait ahead while the queue held it
    assert reaper.sweep() == {"requeued": 0, "resent": 4, "failed": 0} and queue.llen(ROLLOUT_QUEUE) == 1
    assert {ledger.attempts(r.trajectory_id) for r in group} == {0}  # no attempt was made, none is spent
    first = group[0].trajectory_id
    assert ledger.claim(first, "worker", 30) == (True, "1")  # a copy's claim replaces the deadline with a lease
    assert ledger.claim(first, "late-copy", 30) == (False, "running")  # every other copy is a no-op
    queue.delete(ROLLOUT_QUEUE)


def test_a_scoring_message_lost_after_it_was_sent_is_sent_again_at_its_deadline(ledger, run_id):
    ledger.dispatch_ttl_s = 0.5
    [request] = requests_for(run_id, size=1)
    tid = request.trajectory_id
    ledger.register([request])
    assert ledger.claim(tid, "rollout", 30)[0]
    task = json.dumps({"trajectory_id": tid, "trajectory_key": f"k/{tid}"})
    assert ledger.mark_uploaded(tid, "rollout", task, send_within_s=0.2).ok
    assert ledger.scoring_sent([tid]) == 1  # sent: the scorer that took it off the queue died before its claim
    sent: list[str] = []
    reaper = LeaseReaper(ledger, SCORING, 3, 1.0, one_by_one(lambda t, payload: sent.append(payload)))
    time.sleep(0.3)
    assert reaper.sweep() == {"requeued": 0, "resent": 0, "failed": 0}  # the send-by moved ahead when it was sent
    time.sleep(0.4)
    assert reaper.sweep() == {"requeued": 0, "resent": 1, "failed": 0} and sent == [task]
    assert ledger.state(tid) == "uploaded" and ledger.attempts(tid, SCORING) == 0
