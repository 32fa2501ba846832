"""Token-in/token-out client for vLLM's OpenAI-compatible ``/v1/completions``.

Invariants:
- The prompt goes out as token ids and the sampled ids and their logprobs come back as vLLM
  produced them (``return_token_ids``); nothing is re-tokenized.
- An unreachable server (connection refused or reset, no answer within
  ``inference.request_timeout_s``, a 5xx while ``/health`` fails too) is an outage of the
  process's inference (``InferenceGate``), not an error of the request: the request waits for
  the server and is sent again with the same seed. Waiting costs no attempt, and it does not
  count against the request's time budget (the episode's time limit).
- Only an outage longer than ``outage.limit_s`` fails the request: ``InferenceOutage``.
- A 5xx while ``/health`` answers is retried ``inference.max_retries`` times with backoff,
  then raised as ``InferenceUnavailable`` (an infra error of this request).
- A 4xx answer (e.g. prompt longer than the context) is the request's fault, not retried:
  ``InferenceRejected``.
- A request that used up its time budget raises ``asyncio.TimeoutError``.
- With ``lora_adapters`` (``trainer.lora.sync: adapter``) a request given the policy version it
  was read under names that version's adapter (``shared.names.lora_adapter_name``), so every
  token it samples comes from that version; otherwise it names the served model.
- The transport is one aiohttp session per process (created on first use, in the episodes'
  event loop): at 256 concurrent requests it costs about 0.2 ms of CPU per request, httpx's
  connection pool 14x as much (``bench/inference_client.py``), and a worker process runs
  hundreds of episodes on one core.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass
from typing import Callable

import aiohttp

from services.rollout_worker.inference_gate import InferenceGate, InferenceOutage, InferenceUnavailable
from shared.names import lora_adapter_name
from shared.prometheus import INFERENCE_REQUEST_SECONDS
from shared.settings import OutageSettings

__all__ = ["Completion", "InferenceClient", "InferenceOutage", "InferenceRejected", "InferenceUnavailable"]


HEALTH_TIMEOUT_S = 5.0
MAX_CONNECTIONS = 512  # requests in flight at once per process; more wait for a free connection


class InferenceRejected(RuntimeError):
    pass


@dataclass(frozen=True)
class Completion:
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str
    prompt_token_ids: list[int] | None
    outage_wait_s: float = 0.0  # time this request waited for an unreachable server


class InferenceClient:
    """Create it inside the event loop that runs the episodes (its gate probes from there)."""

    def __init__(self, base_url: str, model: str, timeout_s: float = 120.0, max_retries: int = 3,
                 outage: OutageSettings | None = None, on_outage_change: Callable[[bool], None] | None = None,
                 lora_adapters: bool = False):
        self.base_url = base_url.rstrip("/")
        self.model = model
        self.lora_adapters = lora_adapters
        self.timeout_s = timeout_s
        self.max_retries = max_retries
        self._session: aiohttp.ClientSession | None = None
        self.gate = InferenceGate(self.base_url, self.health_problem, outage or OutageSettings(), on_outage_change)

    @property
    def _http(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=MAX_CONNECTIONS))
        return self._session

    async def complete(
        self, prompt_ids: list[int], max_tokens: int, seed: int, temperature: float = 1.0, top_p: float = 1.0,
        budget_s: float | None = None, policy_version: int | None = None,
    ) -> Completion:
        """``budget_s``: seconds this call may spend waiting for answers; waiting out an outage
        is not counted. ``policy_version``: the served version read just before the call."""
        adapter_version = policy_version if self.lora_adapters else None
        body = {
            "model": lora_adapter_name(self.model, adapter_version) if adapter_version is not None else self.model,
            "prompt": prompt_ids,
            "max_tokens": max_tokens,
            "temperature": temperature,
            "top_p": top_p,
            "seed": seed,
            "logprobs": 0,
            "return_token_ids": True,
            "skip_special_tokens": False,
        }
        spent = waited = 0.0
        server_errors = 0
        while True:
            waited += await self.gate.wait_up()
            timeout = self.timeout_s if budget_s is None else min(self.timeout_s, budget_s - spent)
            if timeout <= 0:
                raise asyncio.TimeoutError
            started = time.monotonic()
            try:
                with INFERENCE_REQUEST_SECONDS.time():
                    status, payload = await self._post("/v1/completions", body, timeout)
            except asyncio.TimeoutError as exc:
                spent += time.monotonic() - started
                if budget_s is not None and spent >= budget_s:
                    raise asyncio.TimeoutError from None
                self.gate.report(f"no answer within {timeout:g}s ({type(exc).__name__})")
                continue
            except (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError) as exc:
                spent += time.monotonic() - started
                self.gate.report(f"{type(exc).__name__}: {exc}")
                continue
            spent += time.monotonic() - started
            if status >= 500:
                problem = f"HTTP {status}: {payload[:200]}"
                if await self.health_problem() is not None:
                    self.gate.report(problem)
                    continue
                server_errors += 1
                if server_errors > self.max_retries:
                    raise InferenceUnavailable(f"inference at {self.base_url} failed the request {server_errors} times: {problem}")
                await asyncio.sleep(min(0.2 * 2 ** (server_errors - 1), 3.0))
                continue
            if status >= 400:
                raise InferenceRejected(f"inference rejected the request: HTTP {status}: {payload[:300]}")
            try:
                return self._parse(json.loads(payload), waited)
            except (ValueError, KeyError, IndexError, TypeError) as exc:
                raise InferenceRejected(f"inference answered HTTP {status} with a body that is not a completion "
                                        f"({type(exc).__name__}: {exc}): {payload[:300]}") from None

    async def _post(self, path: str, body: dict, timeout_s: float) -> tuple[int, str]:
        async with self._http.post(self.base_url + path, json=body,
                                   timeout=aiohttp.ClientTimeout(total=timeout_s)) as response:
            return response.status, await response.text()

    async def health_problem(self, timeout_s: float = HEALTH_TIMEOUT_S) -> str | None:
        """None while ``/health`` answers 200; otherwise what is wrong, for the outage lines."""
        try:
            async with self._http.get(self.base_url + "/health", timeout=aiohttp.ClientTimeout(total=timeout_s)) as response:
                return None if response.status == 200 else f"/health returned {response.status}"
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            return f"{type(exc).__name__}: {exc}"

    @staticmethod
    def _parse(payload: dict, waited: float) -> Completion:
        choice = payload["choices"][0]
        token_ids = list(choice["token_ids"])
        logprobs = [float(x) for x in choice["logprobs"]["token_logprobs"]]
        prompt_ids = choice.get("prompt_token_ids") or payload.get("prompt_token_ids")
        return Completion(token_ids, logprobs, choice.get("finish_reason") or "stop", prompt_ids, waited)

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()

    async def __aenter__(self) -> "InferenceClient":
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()
