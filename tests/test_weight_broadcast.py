"""Weight sync by broadcast into a real vLLM: the trainer (this process, rank 0) sends its
tensors through a process group that the replica's worker extension joined.

On CPU the group is gloo (``slow``): the same worker-extension methods, the same
``WeightBroadcaster``, the same pause/probe/label/resume discipline as nccl, only the
process-group class differs. The ``gpu`` test is the nccl path itself; it needs two GPUs
(NCCL refuses two ranks on one device: vLLM takes GPU 1, the trainer GPU 0) and the GPU
build of vLLM, and it was never run on the CPU-only machines this project is built on.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from services.cli.local_stack import free_port
from services.weights import sync as ws
from services.inference.server import VllmServer
from services.inference.tiny_model import generate_tiny_model
from services.weights.broadcast import WeightBroadcaster
from services.policy.model import load_policy, logprob_probe
from services.policy.probe import FP32_TOLERANCE
from pipeline_support import ServedModel, same_model

SERVED = "tiny"


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Qwen2 layout (q/k/v biases, tied head): the tied head must be re-processed after a broadcast.
    A is what ``qwen2_vllm`` (tests/conftest.py) serves."""
    root = tmp_path_factory.mktemp("broadcast-weights")
    return {"A": generate_tiny_model(root / "A", seed=0, layout="qwen2"),
            "B": generate_tiny_model(root / "B", seed=1, layout="qwen2")}


@pytest.fixture(scope="module")
def hf(models: dict[str, Path]) -> dict[str, Any]:
    return {name: load_policy(path)[0].eval() for name, path in models.items()}


def _greedy(model: Any, prompt: list[int], n: int = 8) -> list[int]:
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(model(torch.tensor([ids], device=model.device)).logits[0, -1].argmax()))
    return ids[len(prompt):]


def _served_greedy(server: ServedModel, prompt: list[int], n: int = 8) -> list[int]:
    body = {"model": SERVED, "prompt": prompt, "max_tokens": n, "temperature": 0.0, "return_token_ids": True,
            "ignore_eos": True}
    r = httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=300)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["token_ids"]


PROMPT = list(range(10, 60))


@pytest.fixture(scope="module")
def server(models: dict[str, Path], qwen2_vllm: ServedModel) -> ServedModel:
    """The pool's Qwen2 server (shared with tests/test_weight_sync_layouts.py), given back as it was."""
    assert same_model(models["A"], qwen2_vllm.model_dir)  # the server was started on A
    return qwen2_vllm


@pytest.mark.slow
def test_gloo_broadcast_serves_the_trainers_weights(server: ServedModel, hf: dict[str, Any]) -> None:
    assert _served_greedy(server, PROMPT) == _greedy(hf["A"], PROMPT)
    assert _greedy(hf["A"], PROMPT) != _greedy(hf["B"], PROMPT)  # the two models are told apart
    served: list[int] = []
    with WeightBroadcaster([server.base_url], backend="gloo", port=free_port(), timeout_s=120) as sender, \
            ws.admin_client() as admin:
        report = sender.sync(hf["B"].named_parameters(), 1, probe=ws.SyncProbe(logprob_probe(hf["B"], 1), SERVED,
                                                                                   FP32_TOLERANCE),
                             on_served=lambda: served.append(1))
        assert served == [1] and ws.weight_version(admin, server.base_url) == "1"
        assert ws.is_paused(admin, server.base_url) is False
        assert report.extra["probe_max_abs_diff"] < FP32_TOLERANCE
        assert _served_greedy(server, PROMPT) == _greedy(hf["B"], PROMPT)  # tied head and biases included

        # the probe refuses weights that are not the probe's: the version does not move
        with pytest.raises(ws.WeightSyncError, match="did not take") as info:
            sender.sync(hf["A"].named_parameters(), 2, probe=ws.SyncProbe(logprob_probe(hf["B"], 2), SERVED,
                                                                           FP32_TOLERANCE),
                        on_served=lambda: served.append(2))
        assert info.value.phase == "probe" and served == [1]
        assert ws.weight_version(admin, server.base_url) == "1" and ws.is_paused(admin, server.base_url) is False

        # a tensor the replica cannot load fails the sync fast (the worker drains the rest of
        # the broadcast instead of leaving the trainer to its timeout), and the next sync heals it
        bogus = [("model.layers.0.no_such.weight", torch.zeros(3)), *hf["B"].named_parameters()]
        t0 = time.monotonic()
        with pytest.raises(ws.WeightSyncError, match="reload of gloo broadcast") as info:
            sender.sync(bogus, 3)
        assert info.value.phase == "reload" and time.monotonic() - t0 < 60
        print(f"failed broadcast: {info.value}")
        assert "no_such" in str(info.value)  # the replica's own error, not a timeout
        assert sender.group is None  # rebuilt at the next sync
        assert ws.is_paused(admin, server.base_url) is False and ws.weight_version(admin, server.base_url) == "1"
        sender.sync(hf["A"].named_parameters(), 4, probe=ws.SyncProbe(logprob_probe(hf["A"], 4), SERVED,
                                                                        FP32_TOLERANCE))
        assert ws.weight_version(admin, server.base_url) == "4"
        assert _served_greedy(server, PROMPT) == _greedy(hf["A"], PROMPT)


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs (vLLM on GPU 1, the trainer on GPU 0)")
def test_nccl_broadcast_into_vllm_on_gpu(models: dict[str, Path], tmp_path: Path,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")  # the server's environment only: this process keeps its GPUs
    srv = VllmServer(models["A"], SERVED, port=free_port(), log_path=tmp_path / "vllm.log", dtype="bfloat16",
                     max_model_len=512, gpu=True, gpu_memory_utilization=0.3)
    srv.start()
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    try:
        srv.wait_ready(timeout=900)
        trainer = load_policy(models["B"], "cuda:0")[0].eval()
        with WeightBroadcaster([srv.base_url], backend="nccl", port=free_port(), device="cuda:0",
                               wire_dtype=torch.bfloat16, timeout_s=300) as sender, ws.admin_client() as admin:
            report = sender.sync(trainer.named_parameters(), 1,
                                 probe=ws.SyncProbe(logprob_probe(trainer, 1), SERVED, 5e-2))
            assert ws.weight_version(admin, srv.base_url) == "1" and ws.is_paused(admin, srv.base_url) is False
            assert report.extra["probe_max_abs_diff"] < 5e-2
            print(f"nccl sync of the tiny model: {report.as_dict()}")
    finally:
        srv.stop()


@pytest.mark.slow
def test_trainer_publishes_by_broadcast_then_commits_the_checkpoint(server: ServedModel, models: dict[str, Path],
                                                                   hf: dict[str, Any], redis_client: Any,
                                                                   s3_endpoint: str, run_id: str,
                                                                   tmp_path: Path) -> None:
    """The trainer's nccl-path publisher, over gloo: the version is served (and policy_version
    moved) by the broadcast; the checkpoint is committed and announced afterwards, holding
    the weights that were broadcast even though training changed them meanwhile."""
    from services.trainer.checkpoints import download_checkpoint, latest_checkpoint
    from services.trainer.broadcast_publish import BroadcastPublisher
    from shared.state.policy_version import PolicyVersion
    from shared.settings import S3StorageSettings, load_settings
    from shared.storage import S3Store

    store = S3Store(S3StorageSettings(endpoint=s3_endpoint, access_key="testing", secret_key="testing"))
    store.ensure_bucket()
    settings = load_settings(run_id=run_id, inference={"weight_sync": "nccl", "base_url": server.base_url,
                                                       "model": SERVED})
    model, tokenizer = load_policy(models["B"])
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    announced: list[tuple[int, int]] = []
    sender = WeightBroadcaster([server.base_url], backend="gloo", port=free_port(), timeout_s=120)
    publisher = BroadcastPublisher(settings, redis_client, store, broadcaster=sender)
    try:
        timings = publisher.publish(7, model, tokenizer, optimizer, 7, ["d1"],
                                    announce=lambda v: announced.append((v, PolicyVersion(redis_client, run_id).get())))
        assert PolicyVersion(redis_client, run_id).get() == 7  # served before the checkpoint exists
        with ws.admin_client() as admin:
            assert ws.weight_version(admin, server.base_url) == "7"
        assert _served_greedy(server, PROMPT) == _greedy(hf["B"], PROMPT)
        assert timings["broadcast_s"] > 0
        weights_v7 = {k: v.clone() for k, v in model.state_dict().items()}
        with torch.no_grad():  # the next step trains while version 7 is being written
            for p in model.parameters():
                p.add_(1.0)
        publisher.wait()
    finally:
        publisher.close()
    assert announced == [(7, 7)]  # announced once committed, after the version was served
    assert latest_checkpoint(store, run_id) == (7, f"checkpoints/{run_id}/000007/")
    saved = load_policy(download_checkpoint(store, f"checkpoints/{run_id}/000007/", tmp_path / "v7"))[0]
    for name, value in saved.state_dict().items():
        assert torch.equal(value, weights_v7[name]), name
