"""The training loop under torchrun (issue 16, item 2): 2 processes with the environment torchrun
gives them (gloo on CPU), real Redis, a local object store and the tiny model. The 2-rank run's
weights after each step equal a one-process run's on the same batches; only rank 0 talks to
Redis and commits checkpoints (rank 1 gets an unreachable Redis and writes only its shards);
a restarted 2-rank job resumes the sharded state and still matches; one process resumes it too.
A LoRA policy trains sharded as well, and its 2-rank adapter equals the one-process run's."""

from __future__ import annotations

import faulthandler
import json
import os
import sys
from pathlib import Path

import pytest
import redis
import torch
import torch.multiprocessing as mp
from torch.multiprocessing.spawn import ProcessException
from safetensors.torch import load_file

from services.cli.local_stack import free_port
from services.trainer.checkpoints import download_checkpoint, latest_checkpoint, read_manifest
from services.trainer.distributed import exit_rank_process, follow, join_from_env, unsupported
from services.trainer.loop import TrainingLoop
from services.trainer.metrics import MetricsSink
from shared.names import RedisKeys
from shared.schemas import CheckpointAnnouncement, parse_message
from shared.settings import Settings
from shared.state.staleness import StalenessBudget
from shared.storage import LocalStore
from test_training_loop import queue_group
from synthetic_logprobs import SYNTHETIC_LOGPROBS

WORLD = 2
UNREACHABLE_REDIS = "redis://127.0.0.1:9/0"  # a follower that touched Redis would fail


def _settings(run_id: str, redis_url: str, tiny_dir: Path, tmp_path: Path, device: str = "cpu") -> dict:
    return dict(
        run_id=run_id, redis={"url": redis_url}, inference={"model_path": str(tiny_dir)},
        trainer={"max_off_policy_steps": 1, "groups_per_step": 2, "device": device,
                 "optim": {"lr": 1e-3, "max_grad_norm": 1.0},
                 "batching": {"max_seq_len": 32, "micro_batch_tokens": 40},  # several micro-batches a step, split over the ranks
                 "logprob_alarm": SYNTHETIC_LOGPROBS.model_dump(),  # make_batch's logprobs are synthetic
                 "reward_curve_path": str(tmp_path / f"curve-{run_id}.png")},
    )


class _RecordingStore(LocalStore):
    """A local store that appends every key it writes to a file."""

    def __init__(self, root: Path, log: Path):
        super().__init__(root)
        self.log = log

    def put_bytes(self, key: str, data: bytes, content_type: str = "application/gzip") -> None:
        with self.log.open("a") as f:
            f.write(key + "\n")
        super().put_bytes(key, data, content_type)


def _rank(rank: int, settings_kwargs: dict, store_root: str, out_dir: str, port: int) -> None:
    # the rank's own log (stdout and stderr, native aborts included) and its Python stacks on a
    # fatal signal, so a crashed rank says where in _torchrun's failure message
    log = open(Path(out_dir) / f"rank{rank}.log", "a", buffering=1)  # noqa: SIM115 - open for the process's life
    os.dup2(log.fileno(), 1)
    os.dup2(log.fileno(), 2)
    sys.stdout = sys.stderr = log
    faulthandler.enable(log)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(WORLD))
    torch.set_num_threads(1)
    out = Path(out_dir)
    if rank != 0:
        settings_kwargs = {**settings_kwargs, "redis": {"url": UNREACHABLE_REDIS}}
    settings = Settings(**settings_kwargs)
    ranks = join_from_env(settings)
    try:
        if ranks.leader:
            client = redis.Redis.from_url(settings.redis.url, decode_responses=True)
            budget = StalenessBudget(client, settings.run_id, 1, 2)
            loop = TrainingLoop(settings, _RecordingStore(Path(store_root), out / "rank0-puts.txt"), budget,
                                MetricsSink(out / "steps.jsonl"), ranks=ranks)
            started = loop.version
            try:
                while loop.ready():
                    loop.train_once()
            finally:
                loop.close()
            result = {"started": started, "version": loop.version}
        else:
            version = follow(settings, _RecordingStore(Path(store_root), out / f"rank{rank}-puts.txt"), ranks)
            result = {"version": version}
    finally:
        ranks.leave()
    (out / f"rank{rank}.json").write_text(json.dumps(result))
    exit_rank_process()  # as the trainer command's ranks end


def _torchrun(settings_kwargs: dict, store_root: Path, out_dir: Path) -> list[dict]:
    out_dir.mkdir()
    try:
        mp.start_processes(_rank, args=(settings_kwargs, str(store_root), str(out_dir), free_port()), nprocs=WORLD,
                           start_method="spawn", join=True)
    except ProcessException as e:
        raise AssertionError(_ranks_failure(e, out_dir)) from e
    return [json.loads((out_dir / f"rank{r}.json").read_text()) for r in range(WORLD)]


def _ranks_failure(error: Exception, out_dir: Path) -> str:
    """One line that names the failure and each rank's last words (what a truncated CI log still
    shows), then each rank's log tail."""
    tails = {r: (out_dir / f"rank{r}.log").read_text(errors="replace").splitlines()[-40:]
             if (out_dir / f"rank{r}.log").exists() else ["(no log)"] for r in range(WORLD)}

    def last_words(lines: list[str]) -> str:
        native = [line for line in lines if "what()" in line or "terminate called" in line]
        errors = [line for line in lines if "Error" in line or "error" in line]
        frames = [line for line in lines if line.lstrip().startswith('File "')]  # faulthandler: most recent first
        words = (native or errors or lines or [""])[-1].strip()
        return words + (f" at {frames[0].strip()}" if native and frames else "")

    summary = "; ".join(f"rank {r}: {last_words(lines)}" for r, lines in tails.items())
    return "\n".join([f"{error} ({summary})"] + [f"--- rank {r} log tail ---\n" + "\n".join(lines)
                                                  for r, lines in tails.items()])


def _weights(store: LocalStore, run_id: str, version: int, tmp_path: Path) -> dict[str, torch.Tensor]:
    local = download_checkpoint(store, f"checkpoints/{run_id}/{version:06d}/", tmp_path / f"dl-{run_id}-{version}")
    return {k: v for path in sorted(local.glob("*.safetensors")) for k, v in load_file(path).items()}


def _assert_same_weights(store, sharded_run, single_run, version, tmp_path) -> None:
    sharded, single = _weights(store, sharded_run, version, tmp_path), _weights(store, single_run, version, tmp_path)
    assert sharded.keys() == single.keys()
    for name, value in single.items():
        # summation order differs across ranks (fp32 noise); Adam divides by sqrt(v), so where a
        # gradient is near 0 that noise grows to a small fraction of one step (lr 1e-3)
        torch.testing.assert_close(sharded[name], value, atol=1e-5, rtol=1e-5, msg=lambda m, version=version, name=name: f"version {version}: {name}: {m}")


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("device", [
    "cpu",  # gloo
    pytest.param("cuda", marks=[pytest.mark.gpu,  # NCCL, one GPU per rank
                                pytest.mark.skipif(torch.cuda.device_count() < WORLD, reason=f"needs {WORLD} GPUs")]),
])
def test_the_loop_under_torchrun_equals_one_process_and_resumes_its_sharded_state(
        device, tiny_dir, tmp_path, redis_url, redis_client, make_batch, run_id):
    store = LocalStore(tmp_path / "objects")
    single_id, sharded_id = run_id + "-one", run_id + "-two"
    single_kwargs = _settings(single_id, redis_url, tiny_dir, tmp_path, device)
    sharded_kwargs = _settings(sharded_id, redis_url, tiny_dir, tmp_path, device)

    def queue(group_ids, oldest):
        _queue_for_both(redis_client, store, make_batch, (single_id, sharded_id), group_ids, oldest)

    def single_loop() -> TrainingLoop:
        budget = StalenessBudget(redis_client, single_id, 1, 2)
        return TrainingLoop(Settings(**single_kwargs), store, budget, MetricsSink(tmp_path / "single.jsonl"))

    queue(range(4), 0)
    one = single_loop()
    one.train_once()
    one.train_once()
    first = _torchrun(sharded_kwargs, store.root, tmp_path / "first")
    assert first == [{"started": 0, "version": 2}, {"version": 2}]
    for version in (1, 2):
        _assert_same_weights(store, sharded_id, single_id, version, tmp_path)

    # rank 0 alone decided: one selection per step, each version announced once, two step records
    counters = redis_client.hgetall(RedisKeys.trainer_counters(sharded_id))
    assert counters["groups_trained"] == "4"
    announced = [parse_message(CheckpointAnnouncement, f) for _, f in redis_client.xrange(RedisKeys.checkpoints(sharded_id))]
    assert [a.version for a in announced] == [1, 2]
    assert redis_client.xlen(RedisKeys.step_metrics(sharded_id)) == 2
    # rank 1 wrote its shard of each checkpoint and nothing else; the manifest holds both ranks' shards
    rank1_puts = (tmp_path / "first" / "rank1-puts.txt").read_text().split()
    assert rank1_puts == [f"checkpoints/{sharded_id}/{v:06d}/trainer_state_sharded/__1_0.distcp" for v in (1, 2)]
    rank0_puts = (tmp_path / "first" / "rank0-puts.txt").read_text().split()
    assert rank0_puts[-1] == f"checkpoints/{sharded_id}/000002/COMMITTED"
    manifest = read_manifest(store, f"checkpoints/{sharded_id}/000002/")
    assert {n for n in manifest["files"] if n.startswith("trainer_state_sharded/")} == {
        "trainer_state_sharded/.metadata", "trainer_state_sharded/__0_0.distcp", "trainer_state_sharded/__1_0.distcp"}
    served = download_checkpoint(store, f"checkpoints/{sharded_id}/000002/", tmp_path / "replica")
    assert not (served / "trainer_state_sharded").exists()  # a replica never fetches the trainer's state

    # a restarted job resumes the sharded model and optimizer state: step 3 still matches
    queue(range(4, 6), 2)
    one = single_loop()
    assert one.version == 2
    one.train_once()
    second = _torchrun(sharded_kwargs, store.root, tmp_path / "second")
    assert second == [{"started": 2, "version": 3}, {"version": 3}]
    _assert_same_weights(store, sharded_id, single_id, 3, tmp_path)
    assert latest_checkpoint(store, sharded_id)[0] == 3

    # and one process can take the sharded run over (its optimizer state from the shards)
    budget = StalenessBudget(redis_client, sharded_id, 1, 2)
    alone = TrainingLoop(Settings(**sharded_kwargs), store, budget, MetricsSink(tmp_path / "alone.jsonl"))
    assert (alone.version, alone.trainer.step) == (3, 3)
    expected = one.trainer.optimizer.state_dict()["state"]
    resumed = alone.trainer.optimizer.state_dict()["state"]
    assert resumed.keys() == expected.keys()
    for index, state in expected.items():
        torch.testing.assert_close(resumed[index]["exp_avg_sq"].cpu(), state["exp_avg_sq"].cpu(), atol=1e-9, rtol=1e-4)


def _queue_for_both(redis_client, store, make_batch, runs, group_ids, oldest) -> None:
    for run in runs:
        for group_id in group_ids:
            queue_group(redis_client, store, make_batch, run, group_id, oldest)


def _with_lora(settings_kwargs: dict) -> dict:
    lora = {"enabled": True, "rank": 4, "alpha": 8, "sync": "adapter"}
    return {**settings_kwargs, "trainer": {**settings_kwargs["trainer"], "lora": lora,
                                           "optim": {"lr": 1e-2, "max_grad_norm": 1.0}}}


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_lora_policy_trains_sharded_and_writes_the_adapter_one_process_writes(
        tiny_dir, tmp_path, redis_url, redis_client, make_batch, run_id):
    """Adapters wrapped, then FSDP2: after 2 steps the adapter the leader gathers and writes
    equals the one-process run's, loads into the base with peft, and one process resumes it."""
    from peft import PeftModel
    from services.policy.model import load_policy, logprob_probe
    from services.policy.probe import LogprobProbe

    store = LocalStore(tmp_path / "objects")
    single_id, sharded_id = run_id + "-one", run_id + "-two"
    single_kwargs = _with_lora(_settings(single_id, redis_url, tiny_dir, tmp_path))
    sharded_kwargs = _with_lora(_settings(sharded_id, redis_url, tiny_dir, tmp_path))
    _queue_for_both(redis_client, store, make_batch, (single_id, sharded_id), range(4), 0)
    one = TrainingLoop(Settings(**single_kwargs), store, StalenessBudget(redis_client, single_id, 1, 2),
                       MetricsSink(tmp_path / "single.jsonl"))
    one.train_once()
    one.train_once()
    assert _torchrun(sharded_kwargs, store.root, tmp_path / "lora") == [{"started": 0, "version": 2}, {"version": 2}]

    for version in (1, 2):
        sharded, single = (_weights(store, run, version, tmp_path) for run in (sharded_id, single_id))
        assert sharded.keys() == single.keys() and all("lora_" in name for name in single)
        for name, value in single.items():
            torch.testing.assert_close(sharded[name], value, atol=1e-5, rtol=1e-5, msg=lambda m, version=version, name=name: f"v{version} {name}: {m}")
    manifests = [read_manifest(store, f"checkpoints/{run}/000002/") for run in (sharded_id, single_id)]
    assert manifests[0]["lora"] == manifests[1]["lora"] == {
        "rank": 4, "alpha": 8.0, "target_modules": ["k_proj", "o_proj", "q_proj", "v_proj"], "sync": "adapter"}
    assert {n for n in manifests[0]["files"] if not n.startswith("trainer_state_sharded/")} == set(manifests[1]["files"])

    # the adapter loads into the served base with peft and gives the probe the leader wrote
    served = download_checkpoint(store, f"checkpoints/{sharded_id}/000002/", tmp_path / "adapter")
    adapted = PeftModel.from_pretrained(load_policy(tiny_dir)[0], str(served))
    written = LogprobProbe.from_json((served / "logprob_probe.json").read_bytes())
    def off_by(model) -> float:
        return max(abs(a - b) for a, b in zip(logprob_probe(model, 2).logprobs, written.logprobs, strict=True))

    assert off_by(adapted) < 1e-5
    assert off_by(load_policy(tiny_dir)[0]) > 1e-3  # the adapter changed the policy

    # one process takes the sharded LoRA run over: adapter from the trainer state, AdamW moments from the shards
    alone = TrainingLoop(Settings(**sharded_kwargs), store, StalenessBudget(redis_client, sharded_id, 1, 2),
                         MetricsSink(tmp_path / "alone.jsonl"))
    assert (alone.version, alone.trainer.step) == (2, 2)
    expected = one.trainer.optimizer.state_dict()["state"]
    resumed = alone.trainer.optimizer.state_dict()["state"]
    assert resumed.keys() == expected.keys() and len(expected) > 0
    for index, state in expected.items():
        torch.testing.assert_close(resumed[index]["exp_avg"], state["exp_avg"], atol=1e-6, rtol=1e-4)


def test_settings_a_sharded_trainer_does_not_support_yet_are_named(tiny_dir, tmp_path, redis_url):
    base = _settings("r", redis_url, tiny_dir, tmp_path)
    assert unsupported(Settings(**base)) == []
    trainer = {**base["trainer"], "lora": {"enabled": True}, "loss": {"kl_coef": 0.1}}
    assert unsupported(Settings(**{**base, "trainer": trainer})) == ["trainer.loss.kl_coef > 0"]
