"""The rollout worker process's view of its inference server: up, or down since the first
failure any episode saw. It follows ``shared.outage``'s rules for Redis and S3, in the event
loop where the episodes run.

Invariants:
- An outage belongs to the process, not to a request: it starts at the first failure any
  request reported since the server was last seen up, so ``outage.limit_s`` bounds the outage,
  however many requests wait. While it lasts, one probe checks ``/health``, the wait doubling
  from 0.1 s up to ``outage.backoff_max_s``; every request waits, and none is sent.
- A wait shorter than the limit never fails anything. Past it, every waiting request, and
  every later one until the server is back, raises ``InferenceOutage``: one line naming the
  server, how long it has been down and the setting.
- ``on_change(False)`` is called once when an outage starts and ``on_change(True)`` once when
  it ends (the worker stops taking tasks in between). The process logs one warning when the
  outage starts, one every ``outage.log_every_s`` while it lasts and one when the server is back.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Awaitable, Callable

from tenacity import AsyncRetrying, retry_if_exception_type, wait_exponential

from shared.settings import OutageSettings

log = logging.getLogger(__name__)


class InferenceUnavailable(RuntimeError):
    """The inference server failed this request (a 5xx while it is healthy): an infra error."""


class InferenceOutage(InferenceUnavailable):
    """The inference server has been unreachable for longer than ``outage.limit_s``."""


class _StillDown(Exception):
    pass


class InferenceGate:
    def __init__(self, base_url: str, health_problem: Callable[[float], Awaitable[str | None]], outage: OutageSettings,
                 on_change: Callable[[bool], None] | None = None):
        """``health_problem(timeout_s)``: None while the server's ``/health`` answers 200, else what is wrong."""
        self.base_url, self.outage = base_url, outage
        self._health_problem = health_problem
        self.on_change = on_change or (lambda _up: None)
        self.down_since: float | None = None  # monotonic
        self.last_error = ""
        self._up = asyncio.Event()
        self._up.set()
        self._probe: asyncio.Task | None = None
        self._last_logged = 0.0

    @property
    def is_up(self) -> bool:
        return self.down_since is None

    def down_for_s(self) -> float:
        return 0.0 if self.down_since is None else time.monotonic() - self.down_since

    def report(self, error: str) -> None:
        """A request found the server unreachable. Call from the event loop."""
        self.last_error = error
        if self.down_since is not None:
            return
        self.down_since = self._last_logged = time.monotonic()
        self._up.clear()
        log.warning("inference at %s is unreachable (%s): episodes wait for it, no new task is taken; checking it with "
                    "backoff up to %gs, for at most %gs (outage.limit_s)", self.base_url, error,
                    self.outage.backoff_max_s, self.outage.limit_s)
        self._probe = asyncio.get_running_loop().create_task(self._probe_until_up())
        self.on_change(False)

    async def wait_up(self) -> float:
        """Return once the server is up (the seconds waited); ``InferenceOutage`` past the limit."""
        if self._up.is_set():
            return 0.0
        started = time.monotonic()
        remaining = self.outage.limit_s - self.down_for_s()
        try:
            if remaining <= 0:
                raise asyncio.TimeoutError
            await asyncio.wait_for(self._up.wait(), remaining)
        except asyncio.TimeoutError:
            raise InferenceOutage(self.outage_line()) from None
        return time.monotonic() - started

    def outage_line(self) -> str:
        return (f"inference at {self.base_url} has been unreachable for {self.down_for_s():.0f}s, longer than "
                f"outage.limit_s ({self.outage.limit_s:g}s): {self.last_error}")

    async def _probe_until_up(self) -> None:
        async for attempt in AsyncRetrying(
            retry=retry_if_exception_type(_StillDown),
            wait=wait_exponential(multiplier=0.1, max=self.outage.backoff_max_s),
            before_sleep=lambda _state: self._log_still_down(),
        ):
            with attempt:
                await self._check()
        log.warning("inference at %s is back after %.1fs", self.base_url, self.down_for_s())
        self.down_since = None
        self._up.set()
        self.on_change(True)

    async def _check(self) -> None:
        problem = await self._health_problem(min(5.0, max(1.0, self.outage.backoff_max_s)))
        if problem is not None:
            self.last_error = problem
            raise _StillDown

    def _log_still_down(self) -> None:
        now = time.monotonic()
        if now - self._last_logged >= self.outage.log_every_s:
            self._last_logged = now
            log.warning("still waiting for inference at %s: down for %.0fs (%s)", self.base_url, self.down_for_s(), self.last_error)
