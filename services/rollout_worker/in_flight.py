"""The episodes a rollout worker process is running, so that a shutdown can hand them back.

Invariants:
- Until ``stop()`` every episode runs to its end. ``stop()`` (the worker's shutdown grace
  period ran out) cancels every episode still running (its environment is closed on the way
  out) and makes ``run`` raise ``HandBack``; the runner then hands the trajectory back through
  the ledger (running -> queued, the attempt not counted) and publishes it again. A trajectory
  claimed after ``stop()`` is handed back without starting.
- Only what runs through ``run`` is cancelled: a hand-on in progress (upload, ledger move,
  scoring task) finishes, so a trajectory is handed back or handed on, never both.
- ``cancel(ids)`` cancels the episodes of those trajectories alone (their lease is no longer
  this worker's: superseded by group redundancy, or expired): ``run`` raises ``LeaseLost``, and
  the runner writes nothing to the ledger for them.
- ``stop()`` and ``cancel()`` run in the event loop's thread (``loop.call_soon_threadsafe``).
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


class HandBack(Exception):
    """The worker is shutting down: give this trajectory back to the queue."""


class LeaseLost(Exception):
    """The trajectory's lease is no longer this worker's: drop the work, write nothing."""


class InFlight:
    def __init__(self) -> None:
        self.stopping = False
        self._running: set[asyncio.Future[Any]] = set()
        self._by_trajectory: dict[str, asyncio.Future[Any]] = {}
        self._lost: set[asyncio.Future[Any]] = set()

    def __len__(self) -> int:
        return len(self._running)

    async def run(self, work: Coroutine[Any, Any, T], trajectory_id: str = "") -> T:
        if self.stopping:
            work.close()
            raise HandBack
        future = asyncio.ensure_future(work)
        self._running.add(future)
        if trajectory_id:
            self._by_trajectory[trajectory_id] = future
        try:
            return await future
        except asyncio.CancelledError:
            if future in self._lost and future.cancelled():
                raise LeaseLost from None
            if self.stopping and future.cancelled():
                raise HandBack from None
            raise
        finally:
            self._running.discard(future)
            self._lost.discard(future)
            if self._by_trajectory.get(trajectory_id) is future:
                del self._by_trajectory[trajectory_id]

    def cancel(self, trajectory_ids: list[str]) -> int:
        """Cancel the running episodes of these trajectories; returns how many."""
        cancelled = 0
        for trajectory_id in trajectory_ids:
            future = self._by_trajectory.get(trajectory_id)
            if future is not None and not future.done():
                self._lost.add(future)
                future.cancel()
                cancelled += 1
        return cancelled

    def stop(self) -> int:
        """Cancel what is running; returns how many."""
        self.stopping = True
        running = list(self._running)
        for future in running:
            future.cancel()
        return len(running)
