"""Rate limit on container creation, so a burst of provisions cannot topple the daemon.

Invariant: at most ``max_concurrent`` create+start calls are in flight per limiter, and two
starts are at least ``min_interval_s`` apart. Each sandbox host has its own limiter in a process
(``providers``: ``max_concurrent_creates`` of its settings); the local daemon at the default
settings has ``DEFAULT_LIMITER``, as before there were hosts. The limiter is process-wide and loop-agnostic
(thread-safe counters, async waiting), because a worker may run one event loop per thread;
waiting never blocks a thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from typing import AsyncIterator


class ProvisionLimiter:
    def __init__(self, max_concurrent: int = 8, min_interval_s: float = 0.01, poll_s: float = 0.002):
        if max_concurrent < 1:
            raise ValueError("max_concurrent must be at least 1")
        self.max_concurrent = max_concurrent
        self.min_interval_s = min_interval_s
        self._poll_s = poll_s
        self._lock = threading.Lock()
        self._in_flight = 0
        self._next_start = 0.0
        self.peak_in_flight = 0  # for tests and benchmarks

    @contextlib.asynccontextmanager
    async def slot(self) -> AsyncIterator[None]:
        await self._acquire()
        try:
            yield
        finally:
            with self._lock:
                self._in_flight -= 1

    async def _acquire(self) -> None:
        while True:
            with self._lock:
                if self._in_flight < self.max_concurrent:
                    self._in_flight += 1
                    self.peak_in_flight = max(self.peak_in_flight, self._in_flight)
                    now = time.monotonic()
                    start_at = max(now, self._next_start)
                    self._next_start = start_at + self.min_interval_s
                    break
            await asyncio.sleep(self._poll_s)
        delay = start_at - time.monotonic()
        if delay > 0:
            try:
                await asyncio.sleep(delay)
            except BaseException:
                with self._lock:
                    self._in_flight -= 1
                raise


DEFAULT_LIMITER = ProvisionLimiter()
