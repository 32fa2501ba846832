"""One long-lived asyncio event loop per worker process, shared by every rollout task.

Celery's thread-pool slots only wait on futures; the episodes themselves all run in this
loop. So every episode in the process shares one HTTP connection pool to the inference
service, and a task pays no event-loop or client set-up before its first turn.

Invariant: the loop thread is started once, on first use, and runs until the process exits.
Coroutines submitted from any thread run in it, and their results or exceptions come back
to the submitting thread.

The loop measures its own lag: a timer every ``LAG_PROBE_S`` records how late it ran
(``conveyor_event_loop_lag_seconds``). Every episode of the process shares this loop, so a
lag of a second delays every one of them by a second.
"""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any, Coroutine, TypeVar

from shared.prometheus import EVENT_LOOP_LAG_SECONDS

T = TypeVar("T")
LAG_PROBE_S = 0.5


class BackgroundLoop:
    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="rollout-event-loop", daemon=True)
        self._thread.start()
        asyncio.run_coroutine_threadsafe(_probe_lag(), self.loop)

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result()


async def _probe_lag() -> None:
    while True:
        due = time.monotonic() + LAG_PROBE_S
        await asyncio.sleep(LAG_PROBE_S)
        EVENT_LOOP_LAG_SECONDS.observe(max(0.0, time.monotonic() - due))


_loop: BackgroundLoop | None = None
_lock = threading.Lock()


def background_loop() -> BackgroundLoop:
    global _loop
    with _lock:
        if _loop is None:
            _loop = BackgroundLoop()
        return _loop
