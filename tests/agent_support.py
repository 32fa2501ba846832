"""A recording proxy (``services.rollout_worker.agent_proxy``) on a real vLLM, in a background
event loop of its own, for tests that call it from the test's thread."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from vllm_support import running_vllm

from services.inference.tiny_model import generate_tiny_model
from services.rollout_worker.agent_proxy import AgentProxy
from services.rollout_worker.chat_tokens import load_chat_tokens
from services.rollout_worker.event_loop import BackgroundLoop
from services.rollout_worker.inference_client import InferenceClient


@contextmanager
def running_proxy(model_dir: Path, vllm_url: str, served: str, socket_dir: Path) -> Iterator[AgentProxy]:
    """The proxy, with ``.loop`` (a ``BackgroundLoop``) to run its coroutines from the test."""
    loop = BackgroundLoop()

    async def start() -> AgentProxy:
        proxy = AgentProxy(InferenceClient(vllm_url, served), load_chat_tokens(model_dir), served, socket_dir=socket_dir)
        await proxy.start()
        return proxy

    proxy = loop.run(start())
    proxy.loop = loop
    try:
        yield proxy
    finally:
        loop.run(proxy.stop())


@contextmanager
def proxy_on_tiny_vllm(root: Path, served: str = "tiny") -> Iterator[AgentProxy]:
    """The tiny model generated under ``root``, served by vLLM, behind a proxy (``.vllm``: the server)."""
    model_dir = generate_tiny_model(root / "tiny", end_of_turn_bias=4.0)
    with running_vllm(model_dir, served, root / "vllm.log", max_model_len=1024) as vllm, \
            running_proxy(model_dir, vllm.base_url, served, root / "sockets") as proxy:
        proxy.vllm = vllm
        yield proxy
