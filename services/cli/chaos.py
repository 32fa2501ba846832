"""Fault injection on a local stack (``conveyor chaos``, ``bench/chaos.py``, the chaos tests): run
a workload of guess-the-number groups through every real process, inject faults from a list,
and check the ledger's promise after each.

The promise checked, after every fault and at the end of the run:
- ``dispatched = consumed + failed + in flight``: the per-state counts add up to the
  trajectories registered, and nothing is lost from the ledger;
- nothing failed of the fault: no failure reason names a lease, an infrastructure error, an
  outage, storage or a scoring error;
- nothing doubled: each trajectory reached the trainer exactly once (one event in the run's
  trainer stream, one membership in the groups the trainer decided, no duplicate events
  counted by the trainer);
- nothing stuck: the run drains within ``drain_timeout_s`` of the last fault, whatever the
  fault interrupted, with no person stepping in.

Faults (``FAULTS``): ``kill_all`` (SIGKILL to Redis and every service at once, intake included
while it runs, then everything started again, Redis from its append-only file),
``redis_kill`` (Redis alone, SIGKILL, then restarted), ``redis_restart`` (Redis stopped cleanly
for ``fault_s``), ``freeze_worker`` (the rollout worker
stopped past its leases, then woken), ``disk_full`` (the object store's filesystem filled, then
freed) and ``store_unavailable`` (the object store's volume unmounted, then mounted again). The
last two need the store on its own mount (``ChaosRun.mount_store``, as root);
``inference_outage`` (inference unreachable: the workers reach it through a TCP gate, closed for
``fault_s``) and ``s3_outage`` (the same for the S3 server, with ``storage: s3``). ``kill_all``
spares moto, which keeps its objects in memory (a real S3 server keeps them on disk), and vLLM,
which holds nothing of the ledger (an inference outage is its own fault).
"""

from __future__ import annotations

import json
import random
import signal
import subprocess
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from services.cli.demo import DEMO_REWARD_WEIGHTS, write_demo_dataset
from services.cli.local_stack import LocalStack, ManagedProcess
from services.cli.tcp_gate import TcpGate
from shared.state.ledger import ROLLOUT, SCORING, LedgerReads
from shared.outcomes import FailureKind, kind_of
from shared.schemas import GroupRecord, TrainerEvent, parse_message
from shared.outage import redis_client
from shared.settings import OutageSettings, S3StorageSettings
from shared.storage import LocalStore, ObjectStore, S3Store, get_models_under
from shared.state.trainer_counters import TrainerCounters
from shared.state.trainer_stream import stream_entries

FAULT_KINDS = {FailureKind.infra_error.value, "lease_expired", "scoring_lease_expired", "inference_outage", "scoring_error"}
SERVICES = ("worker-rollout", "worker-scoring", "trainer")


@dataclass
class ChaosConfig:
    groups: int = 16
    group_size: int = 4
    seed: int = 0
    faults: list[str] = field(default_factory=lambda: ["kill_all"] * 5)
    # each fault comes at a share of the run drawn with the seed (so many trajectories terminal),
    # then after a pause drawn within gap_s
    gap_s: tuple[float, float] = (0.0, 3.0)
    span: tuple[float, float] = (0.05, 0.9)  # the shares of the run the faults are drawn within
    step_latency_s: float = 0.3  # each environment step takes this long, as tool use does
    concurrency: int = 8  # rollout slots (each runs a whole group): fewer make a longer run with smaller jumps
    storage: str = "local"  # "local": the filesystem store; "s3": moto, reached through a gate (s3_outage)
    fault_s: float = 10.0  # how long a fault that lasts (disk full, store unavailable, freeze) lasts
    appendfsync: str = "everysec"
    lease_ttl_s: float = 4.0
    dispatch_ttl_s: float = 6.0
    drain_timeout_s: float = 300.0


@dataclass
class FaultRecord:
    fault: str
    at_s: float  # since the run started
    counts_before: dict[str, int]
    recovered_s: float = 0.0  # the fault's end -> the next trajectory consumed (0: the run had ended)


@dataclass
class ChaosReport:
    config: ChaosConfig
    records: list[FaultRecord]
    counts: dict[str, int]
    drained_s: float  # the last fault's end -> every trajectory terminal
    problems: list[str]
    rerun: dict[str, int] = field(default_factory=dict)  # stage -> trajectories it ran more than once (work redone)

    @property
    def ok(self) -> bool:
        return not self.problems

    def table(self) -> str:
        rows = ["| # | fault | at (s) | consumed before | back to consuming (s) |", "|---|---|---|---|---|"]
        for i, r in enumerate(self.records, 1):
            rows.append(f"| {i} | {r.fault} | {r.at_s:.1f} | {r.counts_before.get('consumed', 0)} | {r.recovered_s:.1f} |")
        c = self.counts
        total = self.config.groups * self.config.group_size
        rows.append(f"\n{total} trajectories, AOF appendfsync {self.config.appendfsync}: consumed {c.get('consumed')}, "
                    f"failed {c.get('failed')}, drained {self.drained_s:.1f}s after the last fault; with a second attempt "
                    f"counted: rollout {self.rerun.get('rollout', 0)}, scoring {self.rerun.get('scoring', 0)} (a crash of "
                    f"Redis counts none); "
                    + ("no problem found" if self.ok else "PROBLEMS: " + "; ".join(self.problems)))
        return "\n".join(rows)


class ChaosRun:
    """One workload on one stack, with faults injected in order."""

    def __init__(self, stack: LocalStack, config: ChaosConfig, inference: Callable[[LocalStack], None]):
        self.stack, self.config = stack, config
        self.rng = random.Random(config.seed)
        self.run_id = stack.run_id
        self.total = config.groups * config.group_size
        self.dataset = write_demo_dataset(stack.root / "chaos.jsonl", config.groups, seed=config.seed)
        self.intake: ManagedProcess | None = None
        self._ledger: LedgerReads | None = None
        self._redis: Any = None
        stack.env.update({
            "CONVEYOR_ROLLOUT__GROUP_SIZE": str(config.group_size), "CONVEYOR_ROLLOUT__MAX_TURNS": "3",
            "CONVEYOR_ROLLOUT__MAX_TOKENS_PER_TURN": "16",
            "CONVEYOR_REWARDS__WEIGHTS": json.dumps(DEMO_REWARD_WEIGHTS),
            "CONVEYOR_LEDGER__LEASE_TTL_S": str(config.lease_ttl_s), "CONVEYOR_LEDGER__HEARTBEAT_S": "1",
            "CONVEYOR_LEDGER__REAPER_INTERVAL_S": "1", "CONVEYOR_LEDGER__DISPATCH_TTL_S": str(config.dispatch_ttl_s),
            "CONVEYOR_LEDGER__VISIBILITY_TIMEOUT_S": "30", "CONVEYOR_OUTAGE__BACKOFF_MAX_S": "1",
            # each step takes a while, as tool use does: faults land while episodes run
            "CONVEYOR_INTAKE__ENV_CONFIG": json.dumps({"step_latency_s": config.step_latency_s}),
        })
        inference(stack)
        self.inference_gate = self._gate("CONVEYOR_INFERENCE__BASE_URL")  # the workers reach inference through it
        self.s3_gate: TcpGate | None = None
        self.started = time.time()

    def _gate(self, variable: str) -> TcpGate:
        """A gate in front of the server the variable names (``http://host:port``); the variable
        then names the gate."""
        url = self.stack.env[variable]
        scheme, _, rest = url.partition("://")
        gate = TcpGate(int(rest.split("/")[0].rpartition(":")[2]))
        gate.open()
        self.stack.env[variable] = f"{scheme}://127.0.0.1:{gate.port}"
        return gate

    # --- the stack ----------------------------------------------------------------------
    def start(self) -> None:
        self.stack.start_redis(self.stack.redis_port, appendfsync=self.config.appendfsync)
        if self.config.storage == "s3":
            endpoint = self.stack.start_s3()
            self.s3_gate = TcpGate(int(endpoint.rpartition(":")[2]))
            self.s3_gate.open()
            self.stack.env["CONVEYOR_STORAGE__ENDPOINT"] = f"127.0.0.1:{self.s3_gate.port}"
        elif "CONVEYOR_STORAGE__LOCAL_ROOT" not in self.stack.env:
            self.stack.start_object_store()
        self._start_services()
        self.intake = self.stack.conveyor("intake", "intake", "--dataset", str(self.dataset))

    def _start_services(self) -> None:
        self.stack.start_rollout_worker(concurrency=self.config.concurrency)
        self.stack.start_scoring_worker()
        self.stack.start_trainer()

    @property
    def redis(self) -> Any:
        """A client that waits out Redis restarting and loading."""
        if self._redis is None:
            self._redis = redis_client(self.stack.env["CONVEYOR_REDIS__URL"],
                                       OutageSettings(limit_s=300, backoff_max_s=0.5, log_every_s=60))
        return self._redis

    @property
    def ledger(self) -> LedgerReads:
        """The run's ledger, read through ``redis``."""
        if self._ledger is None:
            self._ledger = LedgerReads(self.redis)
        return self._ledger

    def counts(self) -> dict[str, int]:
        return self.ledger.counts(self.run_id)

    # --- faults -------------------------------------------------------------------------
    def kill_all(self) -> None:
        """SIGKILL to every process at once, then all started again (intake again if it had not
        finished: registering is idempotent, and what it registered and never published goes
        out at its dispatch deadline)."""
        intake_running = self.intake is not None and self.intake.alive()
        victims = [p for p in self.stack.processes if p.alive() and p.name != "s3"]  # moto holds objects in memory only
        for proc in victims:
            proc.kill(signal.SIGKILL)
        for proc in victims:
            proc.proc.wait(10)
            self.stack.processes.remove(proc)
        self.start_redis_again()
        self._start_services()
        if intake_running:  # the same run, resumed: what it published is skipped
            self.intake = self.stack.conveyor("intake", "intake", "--dataset", str(self.dataset), "--resume")

    def redis_kill(self) -> None:
        redis_proc = self.stack.process("redis")
        redis_proc.kill(signal.SIGKILL)
        redis_proc.proc.wait(10)
        self.stack.processes.remove(redis_proc)
        time.sleep(2.0)
        self.start_redis_again()

    def redis_restart(self) -> None:
        """Redis stopped cleanly (SIGTERM: it writes its append-only file), down for ``fault_s``."""
        self.stack.stop_redis()
        time.sleep(self.config.fault_s)
        self.start_redis_again()

    def start_redis_again(self) -> None:
        self.stack.start_redis(self.stack.redis_port, appendfsync=self.config.appendfsync)

    def inference_outage(self) -> None:
        """Inference unreachable for ``fault_s``: connections refused, open ones cut."""
        self._gate_closed(self.inference_gate)

    def s3_outage(self) -> None:
        """The S3 server unreachable for ``fault_s`` (``storage: s3``)."""
        if self.s3_gate is None:
            raise ValueError("s3_outage needs the S3 store: ChaosConfig(storage='s3')")
        self._gate_closed(self.s3_gate)

    def _gate_closed(self, gate: TcpGate) -> None:
        gate.close()
        time.sleep(self.config.fault_s)
        gate.open()

    def freeze_worker(self) -> None:
        worker = self.stack.process("worker-rollout")
        worker.kill(signal.SIGSTOP)
        time.sleep(max(self.config.fault_s, 2 * self.config.lease_ttl_s + 2))
        worker.kill(signal.SIGCONT)

    def disk_full(self) -> None:
        filler = self._store_root() / "chaos-filler.bin"
        with open(filler, "ab", buffering=0) as fh:
            for block in (1 << 20, 4096):  # to the last page: even a small object does not fit
                try:
                    while True:
                        fh.write(b"\0" * block)
                except OSError:
                    pass
        time.sleep(self.config.fault_s)
        filler.unlink()

    def store_unavailable(self) -> None:
        root = self._store_root()
        subprocess.run(["umount", "-l", str(root)], check=True)
        time.sleep(self.config.fault_s)
        subprocess.run(["mount", "--bind", str(self._store_volume()), str(root)], check=True)

    def _store(self) -> ObjectStore:
        """The run's object store, read directly (not through a gate)."""
        env = self.stack.env
        if self.config.storage == "s3":
            endpoint = f"127.0.0.1:{self.s3_gate.target_port}" if self.s3_gate else env["CONVEYOR_STORAGE__ENDPOINT"]
            return S3Store(S3StorageSettings(endpoint=endpoint, access_key="testing", secret_key="testing"))
        return LocalStore(Path(env["CONVEYOR_STORAGE__LOCAL_ROOT"]))

    def _store_root(self) -> Path:
        return Path(self.stack.env["CONVEYOR_STORAGE__LOCAL_ROOT"])

    def _store_volume(self) -> Path:
        return self.stack.root / "store-volume"

    def mount_store(self, size_kib: int = 65536) -> None:
        """The object store on a tmpfs of its own, seen through a bind mount (so that
        ``store_unavailable`` can take the mount away and give it back with its data)."""
        volume, root = self._store_volume(), self.stack.root / "objects"
        volume.mkdir(parents=True, exist_ok=True)
        root.mkdir(parents=True, exist_ok=True)
        subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_kib}k", "tmpfs", str(volume)], check=True)
        subprocess.run(["mount", "--bind", str(volume), str(root)], check=True)
        self.stack.env.update({"CONVEYOR_STORAGE__BACKEND": "local", "CONVEYOR_STORAGE__LOCAL_ROOT": str(root)})

    def unmount_store(self) -> None:
        for path in (self.stack.root / "objects", self._store_volume()):
            subprocess.run(["umount", "-l", str(path)], check=False, capture_output=True)

    # --- the run ------------------------------------------------------------------------
    def run(self) -> ChaosReport:
        faults = {name: getattr(self, name) for name in FAULTS}
        records: list[FaultRecord] = []
        problems: list[str] = []
        self.start()
        points = sorted(self.rng.uniform(*self.config.span) for _ in self.config.faults)  # shares of the run, seeded
        for name, point in zip(self.config.faults, points):
            self._wait_for_a_point(point)
            before = self.counts()
            if before["consumed"] + before["failed"] >= self.total:
                problems.append(f"the run ended before fault {len(records) + 1} of {len(self.config.faults)}: only "
                                f"{len(records)} landed mid-run (give it more groups, or slower steps)")
                break
            record = FaultRecord(name, time.time() - self.started, before)
            faults[name]()
            ended = time.time()
            problems += self.check_accounting(f"after fault {len(records) + 1} ({name})")
            record.recovered_s = self._time_to_next_consumed(before["consumed"], ended)
            records.append(record)
        last = time.time()
        counts = self.wait_drained()
        drained_s = time.time() - last
        if counts["consumed"] + counts["failed"] != self.total:
            problems.append(f"not drained {self.config.drain_timeout_s:.0f}s after the last fault: {counts}; "
                            f"stuck: {self.stuck()}")
        else:
            problems += self.check_exactly_once()
        problems += self.check_accounting("at the end")
        return ChaosReport(self.config, records, counts, drained_s, problems, self.rerun())

    def rerun(self) -> dict[str, int]:
        """Per stage, the trajectories with more than one attempt: work a fault made redo."""
        return {stage.name: self.ledger.retried(self.run_id, stage) for stage in (ROLLOUT, SCORING)}

    def _wait_for_a_point(self, share: float, timeout_s: float = 180.0) -> None:
        """Until that share of the run's trajectories is terminal, then a seeded pause within
        ``gap_s``: faults land spread over the run, in every stage, start-up included."""
        deadline = time.time() + timeout_s
        while time.time() < deadline:
            counts = self.counts()
            if counts["consumed"] + counts["failed"] >= share * self.total:
                break
            time.sleep(0.1)
        time.sleep(self.rng.uniform(*self.config.gap_s))

    def _time_to_next_consumed(self, consumed_before: int, since: float, timeout_s: float = 120.0) -> float:
        while time.time() - since < timeout_s:
            counts = self.counts()
            if counts["consumed"] > consumed_before or counts["consumed"] + counts["failed"] == self.total:
                return time.time() - since
            time.sleep(0.2)
        return float("inf")

    def wait_drained(self) -> dict[str, int]:
        deadline = time.time() + self.config.drain_timeout_s
        counts = self.counts()
        while time.time() < deadline:
            counts = self.counts()
            if sum(counts.values()) == self.total and counts["consumed"] + counts["failed"] == self.total:
                return counts
            if any(not self.stack.process(name).alive() for name in SERVICES):
                return counts  # a service exited: nothing will drain it (check_accounting says which)
            time.sleep(0.5)
        return counts

    def check_accounting(self, when: str) -> list[str]:
        """The counts add up to what the ledger registered (intake may still be registering)."""
        ledger, problems = self.ledger, []
        counts, registered = self.counts(), len(ledger.states(self.run_id))
        if sum(counts.values()) != registered:
            problems.append(f"{when}: counts {counts} add up to {sum(counts.values())}, {registered} registered")
        for name in SERVICES:
            if not self.stack.process(name).alive():
                problems.append(f"{when}: {name} exited: {self.stack.logs(name, 5)}")
        return problems

    def stuck(self) -> dict[str, list[str]]:
        """Non-terminal trajectories, by state, with their deadline (or 'none')."""
        ledger = self.ledger
        out: dict[str, list[str]] = {}
        for tid, state in ledger.states(self.run_id).items():
            if state in ("consumed", "failed"):
                continue
            deadline = ledger.lease_deadline(tid, SCORING if state == "uploaded" else ROLLOUT)
            out.setdefault(state, []).append(f"{tid} (deadline {'none' if deadline is None else f'{deadline - time.time():+.0f}s'})")
        return out

    def check_exactly_once(self) -> list[str]:
        ledger, problems = self.ledger, []
        reasons = ledger.failure_reasons(self.run_id)
        of_fault = {t: r for t, r in reasons.items() if kind_of(r) in FAULT_KINDS or r.startswith(tuple(FAULT_KINDS))}
        if of_fault:
            problems.append(f"{len(of_fault)} failed of the faults: {dict(list(of_fault.items())[:3])}")
        events = [parse_message(TrainerEvent, raw).trajectory_id for _, raw in stream_entries(self.redis, self.run_id)]
        tids = sorted(ledger.states(self.run_id))
        if sorted(events) != tids:
            doubled = sorted(t for t, n in Counter(events).items() if n > 1)
            problems.append(f"trainer events: {len(events)} for {len(tids)} trajectories; doubled {doubled[:5]}, "
                            f"missing {sorted(set(tids) - set(events))[:5]}")
        store = self._store()
        members = [m.trajectory_id for record in get_models_under(store, f"groups/{self.run_id}/", GroupRecord)
                   for m in record.members]
        if sorted(members) != tids:
            problems.append(f"group records: {len(members)} memberships for {len(tids)} trajectories")
        counters = TrainerCounters(self.redis, self.run_id).all()
        if int(counters.get("duplicate_events", 0)):
            problems.append(f"the trainer counted {counters['duplicate_events']} duplicate events")
        return problems


FAULTS = ("kill_all", "redis_kill", "redis_restart", "freeze_worker", "inference_outage", "s3_outage", "disk_full",
          "store_unavailable")
