"""Bundles a rollout task's finished trajectories into one upload: one object and one pipelined
ledger round trip for many trajectories instead of one each (issue 15: the S3 server's request
rate bounded the trajectories per second).

Invariants:
- Until its bundle is written and its ledger move is done, a finished trajectory is still
  ``running`` under this worker's lease, renewed by the heartbeat: should the process die, the
  lease runs out and the rollout reaper queues it again. A crash re-runs it, never loses it.
- The outbox holds no state that outlives the task: what it waits on is the runner's own
  ``hand_on`` calls. Writing a bundle and moving its members (the runner's ``upload_bundle``)
  happen in that order, so no member is ``uploaded`` without its object.
- A bundle goes out when every episode of the task has ended (handed on, or ``finished``
  without), when it holds ``max_bundle`` trajectories, or ``linger_s`` after its first one
  arrived, whichever comes first. ``max_bundle`` 1 uploads each trajectory alone, as before.
- Each member's ``hand_on`` returns its own outcome, or raises what writing the bundle raised
  (an infra error: each member is retried as a single upload's would be).
- All methods run in the episodes' event loop; the upload (blocking calls) runs in a thread.
"""

from __future__ import annotations

import asyncio
from typing import Callable, Generic, TypeVar

Finished = TypeVar("Finished")
Outcome = TypeVar("Outcome")


class UploadOutbox(Generic[Finished, Outcome]):
    def __init__(self, upload: Callable[[list[Finished]], list[Outcome]], episodes: list[str],
                 linger_s: float = 0.25, max_bundle: int = 64):
        """``upload`` writes a bundle and moves its members, returning each one's outcome in
        order; ``episodes``: the trajectory ids of the task's claimed episodes."""
        self.upload, self.linger_s, self.max_bundle = upload, linger_s, max_bundle
        self._open = set(episodes)
        self._pending: list[tuple[Finished, asyncio.Future[Outcome]]] = []
        self._timer: asyncio.TimerHandle | None = None
        self._uploads: set[asyncio.Task[None]] = set()  # references keep them alive

    async def hand_on(self, trajectory_id: str, finished: Finished) -> Outcome:
        """Wait for the bundle holding ``finished`` to be uploaded; its outcome."""
        outcome: asyncio.Future[Outcome] = asyncio.get_running_loop().create_future()
        self._pending.append((finished, outcome))
        self._open.discard(trajectory_id)
        if len(self._pending) >= self.max_bundle or not self._open:
            self._send()
        elif self._timer is None:
            self._timer = asyncio.get_running_loop().call_later(self.linger_s, self._send)
        return await outcome

    def finished(self, trajectory_id: str) -> None:
        """The episode ended (handed on, failed, handed back or dropped): with it, the task's last
        one, what waits goes at once. Idempotent."""
        self._open.discard(trajectory_id)
        if not self._open and self._pending:
            self._send()

    def _send(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        bundle, self._pending = self._pending, []
        if bundle:
            task = asyncio.get_running_loop().create_task(self._upload(bundle))
            self._uploads.add(task)
            task.add_done_callback(self._uploads.discard)

    async def _upload(self, bundle: list[tuple[Finished, asyncio.Future[Outcome]]]) -> None:
        try:
            outcomes = await asyncio.to_thread(self.upload, [finished for finished, _ in bundle])
        except BaseException as exc:  # each member's hand_on raises it: retried, or handed back, as its own
            for _, outcome in bundle:
                if not outcome.done():
                    outcome.cancel() if isinstance(exc, asyncio.CancelledError) else outcome.set_exception(exc)
            if not isinstance(exc, Exception):
                raise
            return
        for (_, outcome), result in zip(bundle, outcomes, strict=True):
            if not outcome.done():
                outcome.set_result(result)
