"""Token-in/token-out client for vLLM's OpenAI-compatible ``/v1/completions``.

Invariants:
- The prompt goes out as token ids and the sampled ids and their logprobs come back as vLLM
  produced them (``return_token_ids``); nothing is re-tokenized.
- Connection errors, timeouts and 5xx answers are retried a bounded number of times, then
  raised as ``InferenceUnavailable`` naming the server; the episode ends with infra_error.
- A 4xx answer (e.g. prompt longer than the context) is the request's fault, not retried.
"""

from __future__ import annotations

from dataclasses import dataclass

import httpx
from tenacity import AsyncRetrying, retry_if_exception_type, stop_after_attempt, wait_exponential


class InferenceUnavailable(RuntimeError):
    pass


class InferenceRejected(RuntimeError):
    pass


@dataclass(frozen=True)
class Completion:
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str
    prompt_token_ids: list[int] | None


class _Retryable(Exception):
    pass


class InferenceClient:
    def __init__(self, base_url: str, model: str, timeout_s: float = 120.0, max_retries: int = 3):
        self.base_url = base_url.rstrip("/")
        self.model = model
        self.max_retries = max_retries
        limits = httpx.Limits(max_connections=512, max_keepalive_connections=128)
        self._http = httpx.AsyncClient(base_url=self.base_url, timeout=timeout_s, limits=limits)

    async def complete(
        self, prompt_ids: list[int], max_tokens: int, seed: int, temperature: float = 1.0, top_p: float = 1.0
    ) -> Completion:
        body = {
            "model": self.model,
            "prompt": prompt_ids,
            "max_tokens": max_tokens,
            "temperature": temperature,
            "top_p": top_p,
            "seed": seed,
            "logprobs": 0,
            "return_token_ids": True,
            "skip_special_tokens": False,
        }
        try:
            async for attempt in AsyncRetrying(
                retry=retry_if_exception_type(_Retryable),
                stop=stop_after_attempt(self.max_retries + 1),
                wait=wait_exponential(multiplier=0.2, max=3),
                reraise=True,
            ):
                with attempt:
                    return self._parse(await self._post(body))
        except _Retryable as exc:
            raise InferenceUnavailable(f"inference at {self.base_url} unavailable after {self.max_retries + 1} tries: {exc}") from None
        raise AssertionError("unreachable")

    async def _post(self, body: dict) -> dict:
        try:
            response = await self._http.post("/v1/completions", json=body)
        except (httpx.TransportError, httpx.TimeoutException) as exc:
            raise _Retryable(f"{type(exc).__name__}: {exc}") from exc
        if response.status_code >= 500:
            raise _Retryable(f"HTTP {response.status_code}: {response.text[:200]}")
        if response.status_code >= 400:
            raise InferenceRejected(f"inference rejected the request: HTTP {response.status_code}: {response.text[:300]}")
        return response.json()

    @staticmethod
    def _parse(payload: dict) -> Completion:
        choice = payload["choices"][0]
        token_ids = list(choice["token_ids"])
        logprobs = [float(x) for x in choice["logprobs"]["token_logprobs"]]
        return Completion(token_ids, logprobs, choice.get("finish_reason") or "stop", choice.get("prompt_token_ids") or payload.get("prompt_token_ids"))

    async def aclose(self) -> None:
        await self._http.aclose()
