"""Batches a worker process's scoring messages: one message per batch of uploaded trajectories
(the members of a group, usually) instead of one per trajectory (issue 15: the per-message
cost of Celery and its task events was most of the scorer's CPU).

Invariants:
- A trajectory reaches the outbox only after the ledger moved it to ``uploaded`` together
  with its stored scoring task and a send-by entry (``Ledger.mark_uploaded``). So the outbox
  holds no state of its own: if the process dies before a batch goes out, the scoring reaper
  sends each task once its send-by entry expires (``send_within_s`` after the upload).
- A batch goes out when the rollout task that filled it ends (``flush``), when it holds
  ``max_batch`` tasks, or ``linger_s`` after its first task arrived, whichever comes first;
  ``linger_s`` is well inside ``send_within_s``, so the reaper sends only what a dead process
  left.
- After a batch is published its send-by entries move ``ledger.dispatch_ttl_s`` ahead
  (``Ledger.scoring_sent``): a message lost by the broker after that is sent again then. A
  process dying in between leaves a duplicate message at worst, a no-op at the scoring claim.
- All methods run in the episodes' event loop; publishing (blocking Redis calls) runs in a
  thread.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Callable

from shared.schemas import ScoringTask

log = logging.getLogger(__name__)

SendBatch = Callable[[list[ScoringTask]], None]


class ScoringOutbox:
    def __init__(self, send: SendBatch, linger_s: float = 0.25, max_batch: int = 64):
        self.send, self.linger_s, self.max_batch = send, linger_s, max_batch
        self._pending: list[ScoringTask] = []
        self._timer: asyncio.TimerHandle | None = None
        self._flushing: asyncio.Task | None = None

    async def add(self, task: ScoringTask) -> None:
        self._pending.append(task)
        if len(self._pending) >= self.max_batch:
            await self.flush()
        elif self._timer is None:
            self._timer = asyncio.get_running_loop().call_later(self.linger_s, self._flush_later)

    async def flush(self) -> None:
        """Send what is pending now (a rollout task calls it when its episodes are done)."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        batch, self._pending = self._pending, []
        if not batch:
            return
        try:
            await asyncio.to_thread(self.send, batch)
        except Exception as exc:  # e.g. the broker down past outage.limit_s: the send-by entries stand in
            log.error("a scoring batch of %d trajectories (%s, ...) was not sent; the scoring reaper sends each "
                      "from the ledger once its send-by entry expires: %s: %s",
                      len(batch), batch[0].trajectory_id, type(exc).__name__, exc)

    def _flush_later(self) -> None:
        self._timer = None
        self._flushing = asyncio.get_running_loop().create_task(self.flush())  # a reference keeps it alive
