"""The inference servers a rollout worker process calls: the one its own settings name
(``inference``), and for a run with a server of its own (``inference.own_server``, which
``conveyor run submit --inference own`` starts) that run's, as its requests name it
(``RolloutRequest.inference``).

Invariants:
- A request that names no server is served by the worker's own client and tokenizer (the
  rollout context's, made when the process starts) and the worker's ``inference.max_model_len``.
- A run's server gets one client and one tokenizer (of the request's ``model_path``) for the
  process, made on the first request that names it, in the episodes' event loop; every later
  episode naming the same server shares them. A tokenizer that cannot be loaded raises
  ``InferenceTargetError`` naming the run, the server and the model path, for that request
  only (the runner fails it as a configuration error), and is tried again by the next one.
- Only the worker's own server switches its taking of rollout tasks off while it is down
  (``on_outage_change``). A run's own server that is down fails that run's episodes after the
  outage limit (``InferenceOutage``) and never stops the worker from serving the other runs.
- An agent-driven episode calls the same ``Served`` as a token-loop episode of its request: the
  recording proxy opens its session on that server (``AgentProxy.open_session(server=...)``), so
  its turns are sampled by its run's server and tokenized by its run's tokenizer, never another
  run's policy; the outage rule above holds for it too (``agents.episode``).
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from typing import Callable

from services.rollout_worker.chat_tokens import ChatTokens, load_chat_tokens
from services.rollout_worker.inference_client import InferenceClient
from shared.model_source import resolve_model_source
from shared.schemas import InferenceTarget, RolloutRequest
from shared.settings import Settings

log = logging.getLogger(__name__)


class InferenceTargetError(RuntimeError):
    """A run's own inference server cannot serve this request (its tokenizer cannot be loaded here)."""


@dataclass(frozen=True)
class Served:
    """What an episode calls: the server's client, its tokenizer, and its context length."""

    client: InferenceClient
    chat: ChatTokens
    max_model_len: int


@dataclass
class RunServers:
    """The clients and tokenizers of the runs' own servers, one each, made on first use."""

    make_client: Callable[[InferenceTarget], InferenceClient]  # called in the episodes' loop
    load_chat: Callable[[str], ChatTokens]  # blocking: run in a thread
    _served: dict[InferenceTarget, Served] = field(default_factory=dict)
    _lock: asyncio.Lock = field(default_factory=asyncio.Lock)

    @classmethod
    def from_settings(cls, settings: Settings) -> "RunServers":
        """The worker's request timeout, retries, outage limits and prompt cache, for every run's server."""
        inference = settings.inference

        def make_client(target: InferenceTarget) -> InferenceClient:
            # no on_outage_change: a run's server down must not stop this worker taking the other runs' tasks
            return InferenceClient(target.base_url, target.model, inference.request_timeout_s, inference.max_retries,
                                   outage=settings.outage, lora_adapters=target.lora_adapters)

        return cls(make_client, lambda path: load_chat_tokens(resolve_model_source(path).value,
                                                              settings.rollout.agent_proxy.prompt_cache_bytes))

    async def for_request(self, request: RolloutRequest, own: Served) -> Served:
        """``own`` for a request that names no server; else its run's server."""
        target = request.inference
        if target is None:
            return own
        served = self._served.get(target)
        if served is not None:
            return served
        async with self._lock:  # one tokenizer load and one client per server, however many episodes ask
            served = self._served.get(target)
            if served is None:
                try:
                    chat = await asyncio.to_thread(self.load_chat, target.model_path)
                except (OSError, ValueError) as exc:
                    raise InferenceTargetError(
                        f"run {request.run_id}'s inference server {target.base_url}: its tokenizer at "
                        f"{target.model_path!r} cannot be loaded on this worker ({type(exc).__name__}: {exc}); "
                        f"the rollout workers need the run's model path too (in compose: the models volume)") from exc
                served = self._served[target] = Served(self.make_client(target), chat, target.max_model_len)
                log.info("run %s's episodes call its own inference server %s (serving %s, tokenizer %s)",
                         request.run_id, target.base_url, target.model, target.model_path)
        return served

