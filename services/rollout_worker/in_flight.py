"""The episodes a rollout worker process is running, so that a shutdown can hand them back.

Invariants:
- Until ``stop()`` every episode runs to its end. ``stop()`` (the worker's shutdown grace
  period ran out) cancels every episode still running (its environment is closed on the way
  out) and makes ``run`` raise ``HandBack``; the runner then hands the trajectory back through
  the ledger (running -> queued, the attempt not counted) and publishes it again. A trajectory
  claimed after ``stop()`` is handed back without starting.
- Only what runs through ``run`` is cancelled: a hand-on in progress (upload, ledger move,
  scoring task) finishes, so a trajectory is handed back or handed on, never both.
- ``stop()`` runs in the event loop's thread (``loop.call_soon_threadsafe``).
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


class HandBack(Exception):
    """The worker is shutting down: give this trajectory back to the queue."""


class InFlight:
    def __init__(self) -> None:
        self.stopping = False
        self._running: set[asyncio.Future[Any]] = set()

    def __len__(self) -> int:
        return len(self._running)

    async def run(self, work: Coroutine[Any, Any, T]) -> T:
        if self.stopping:
            work.close()
            raise HandBack
        future = asyncio.ensure_future(work)
        self._running.add(future)
        try:
            return await future
        except asyncio.CancelledError:
            if self.stopping and future.cancelled():
                raise HandBack from None
            raise
        finally:
            self._running.discard(future)

    def stop(self) -> int:
        """Cancel what is running; returns how many."""
        self.stopping = True
        running = list(self._running)
        for future in running:
            future.cancel()
        return len(running)
