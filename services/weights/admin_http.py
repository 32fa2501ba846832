"""One HTTP call to one vLLM replica's admin (or probe) endpoint, with bounded retries.

Invariants:
- Transport errors and 502/503/504 are retried (tenacity, exponential backoff, at most
  ``ADMIN_ATTEMPTS`` tries); other 5xx answers only when the caller says the call is
  idempotent (``retry_5xx``). Anything else fails at once.
- Every failure surfaces as ``AdminCallError`` naming the replica, the call and vLLM's own
  error message.
"""

from __future__ import annotations

from typing import Any

import httpx
from tenacity import Retrying, retry_if_exception, stop_after_attempt, wait_exponential

ADMIN_ATTEMPTS = 3
CALL_TIMEOUT_S = 30.0
_ALWAYS_RETRY_STATUS = frozenset({502, 503, 504})


class AdminCallError(RuntimeError):
    """One admin call to one replica failed after its retries."""

    def __init__(self, base_url: str, call: str, detail: str, status: int | None = None):
        super().__init__(f"{base_url} {call}: {detail}")
        self.base_url, self.call, self.detail, self.status = base_url, call, detail, status


def admin_client(timeout_s: float = CALL_TIMEOUT_S) -> httpx.Client:
    """A client for admin calls (thread-safe; one is shared by all replicas of a sync)."""
    return httpx.Client(timeout=httpx.Timeout(timeout_s, connect=5.0))


class _Status(Exception):
    def __init__(self, response: httpx.Response):
        super().__init__(f"HTTP {response.status_code}")
        self.response = response


def admin_request(client: httpx.Client, method: str, base_url: str, path: str, *, call: str,
             retry_5xx: bool, attempts: int = ADMIN_ATTEMPTS, **kwargs: Any) -> httpx.Response:
    """One admin request with bounded retries; raises ``AdminCallError`` naming the replica."""

    def retryable(exc: BaseException) -> bool:
        if isinstance(exc, httpx.TransportError):
            return True
        if isinstance(exc, _Status):
            code = exc.response.status_code
            return code in _ALWAYS_RETRY_STATUS or (retry_5xx and code >= 500)
        return False

    try:
        for attempt in Retrying(stop=stop_after_attempt(attempts), wait=wait_exponential(multiplier=0.1, max=2.0),
                                retry=retry_if_exception(retryable), reraise=True):
            with attempt:
                response = client.request(method, base_url + path, **kwargs)
                if response.status_code != 200:
                    raise _Status(response)
                return response
    except _Status as exc:
        raise AdminCallError(base_url, call, _error_text(exc.response), exc.response.status_code) from None
    except httpx.HTTPError as exc:
        raise AdminCallError(base_url, call, f"{type(exc).__name__}: {exc}") from None
    raise AssertionError("unreachable")  # pragma: no cover


def _error_text(response: httpx.Response) -> str:
    try:
        body = response.json()
        if isinstance(body, dict) and isinstance(body.get("error"), dict):
            return f"HTTP {response.status_code}: {body['error'].get('message')}"
        if isinstance(body, dict) and "error" in body:
            return f"HTTP {response.status_code}: {body['error']}"
    except ValueError:
        pass
    return f"HTTP {response.status_code}: {response.text[:500]}"
