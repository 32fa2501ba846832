"""One run of many episodes in flight on a local stack (bench/in_flight.py and the slow scale test):
the workers, a feeder that keeps a number of trajectories queued or running, a kill -9 of one
worker, and the exactly-once check at the end.
"""

from __future__ import annotations

import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from bench.capacity import ReplayPolicy
from bench.local_runs import BenchRun, episode_settings
from services.cli.local_stack import LocalStack, ManagedProcess, free_port
from services.inference.tiny_model import generate_tiny_model
from shared.names import RedisKeys
from shared.schemas import GroupRecord
from shared.state.ledger import ROLLOUT
from shared.storage import get_model


@contextmanager
def replay_stack(root: Path) -> Iterator[LocalStack]:
    """redis-server, the moto S3 server and the replay policy in place of vLLM (its tokenizer is
    the tiny generated model's, which the workers load)."""
    model_dir = generate_tiny_model(root / "tiny")
    policy = ReplayPolicy(model_dir)
    base = LocalStack(root / "base")
    try:
        base.start_redis()
        base.start_s3()
        base.use_inference(policy.base_url, model_dir, "tiny")
        yield base
    finally:
        base.stop()


def episodes_in_flight(port: int) -> int:
    """A worker's own count of its running episodes (its Prometheus gauge), -1 if it does not answer."""
    try:
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    except OSError:
        return -1
    line = next((x for x in text.splitlines() if x.startswith("conveyor_rollout_episodes_in_flight ")), None)
    return int(float(line.split()[1])) if line else -1


@dataclass
class InFlightRun:
    bench: BenchRun
    slots: int
    group_size: int
    step_latency: float
    workers: list[ManagedProcess] = field(default_factory=list)
    ports: dict[str, int] = field(default_factory=dict)  # worker name -> its metrics port
    groups: int = 0
    killed: list[ManagedProcess] = field(default_factory=list)

    @classmethod
    def start(cls, base: LocalStack, root: Path, workers: int, slots: int, group_size: int, max_turns: int,
              step_latency: float, run_id: str = "inflight", env: dict[str, str] | None = None) -> "InFlightRun":
        overrides = episode_settings(group_size, max_turns, 4) | {
            "CONVEYOR_TRAINER__ZERO_VARIANCE_GROUPS": "keep",  # every reply is the same: keep, assemble, write
        } | (env or {})
        run = cls(BenchRun.open(base, root, run_id, overrides), slots, group_size, step_latency)
        for i in range(workers):
            run.start_worker(f"rollout{i}")
        run.bench.stack.start_scoring_worker()
        run.bench.stack.start_trainer()
        run.wait_ready(len(run.workers) + 1)
        return run

    def start_worker(self, name: str) -> None:
        port = free_port()
        self.ports[name] = port
        self.workers.append(self.bench.stack.conveyor(
            f"worker-{name}", "worker", "rollout", "--name", name, "--concurrency", str(self.slots),
            extra_env={"CONVEYOR_METRICS_PORT": str(port)}))

    def wait_ready(self, nodes: int, timeout_s: float = 300) -> None:
        deadline = time.time() + timeout_s
        while len(self.bench.celery.control.ping(timeout=1.0)) < nodes:
            if time.time() > deadline:
                raise TimeoutError(f"fewer than {nodes} Celery nodes answer after {timeout_s:.0f}s")

    def metrics_ports(self) -> list[int]:
        return [self.ports[p.name.removeprefix("worker-")] for p in self.workers]

    def registered(self) -> int:
        return self.groups * self.group_size

    def finished(self) -> int:
        counts = self.bench.ledger.counts(self.bench.run_id)
        return counts["consumed"] + counts["failed"]

    def feed(self, level: int) -> int:
        """Publish whole groups until ``queued + running`` reaches ``level``; how many groups."""
        counts = self.bench.ledger.counts(self.bench.run_id)
        missing = level - counts["queued"] - counts["running"]
        published = 0
        while missing >= self.group_size:
            self.bench.publish_guess_group(self.groups, self.step_latency)
            self.groups += 1
            published += 1
            missing -= self.group_size
        return published

    def feed_until_running(self, level: int, timeout_s: float, share: float = 0.95) -> None:
        deadline = time.time() + timeout_s
        while self.bench.ledger.counts(self.bench.run_id)["running"] < share * level:
            if time.time() > deadline:
                raise TimeoutError(f"{level} in flight not reached in {timeout_s:.0f}s: "
                                   f"{self.bench.ledger.counts(self.bench.run_id)}")
            self.feed(level)
            time.sleep(0.5)

    def kill_one_worker(self) -> dict:
        """SIGKILL the first worker, start a new one in its place; what it held."""
        victim = self.workers.pop(0)
        held = episodes_in_flight(self.ports[victim.name.removeprefix("worker-")])
        victim.kill()
        victim.proc.wait(10)
        self.killed.append(victim)
        self.start_worker(f"replacement{len(self.killed)}")
        return {"worker": victim.name, "episodes_it_held": held, "at": time.time()}

    def __enter__(self) -> "InFlightRun":
        return self

    def __exit__(self, *exc: object) -> None:
        self.bench.stack.stop()


def check_exactly_once(run: InFlightRun, timeout_s: float) -> dict:
    """Stop feeding; wait for every registered trajectory; each consumed once, in one group record."""
    bench, run_id = run.bench, run.bench.run_id
    started = time.time()
    while run.finished() < run.registered():
        if time.time() - started > timeout_s:
            raise TimeoutError(f"not all finished in {timeout_s:.0f}s: {bench.ledger.counts(run_id)}")
        time.sleep(1.0)
    counts = bench.ledger.counts(run_id)
    tids = sorted(bench.ledger.states(run_id))
    members = sorted(m.trajectory_id for key in bench.store.list_keys(f"groups/{run_id}/")
                     for m in get_model(bench.store, key, GroupRecord).members)
    trainer = bench.client.hgetall(RedisKeys.trainer_counters(run_id))
    attempts = bench.client.hvals(ROLLOUT.attempts(run_id))
    return {
        "registered": run.registered(), "consumed": counts["consumed"], "failed": counts["failed"],
        "in_group_records": len(members), "distinct_in_records": len(set(members)),
        "exactly_once": members == tids and len(tids) == run.registered(),
        "duplicate_events": int(trainer.get("duplicate_events", 0)), "late_events": int(trainer.get("late_events", 0)),
        "rerun_after_kill": sum(int(a) > 1 for a in attempts), "drain_s": round(time.time() - started, 1),
    }
