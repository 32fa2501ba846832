"""A step's batches handed from the trainer's consumer to its training loop in memory.

Invariants:
- The object store holds every batch (``services.trainer.consumer`` writes it before the
  transaction that queues its key); this hand-off only spares the training loop of the same
  process the read back of what its consumer just wrote. A batch is kept only once its write
  returned, and it is the very object that was written, so the loop trains on what S3 holds;
  a restarted trainer, or a batch not kept here, is read from S3 as before.
- A batch is dropped once taken (trained), and the oldest are dropped past ``max_batches``
  (a group skipped as stale at use, or a hand-off nobody takes): memory stays bounded. 0: off.
- Thread-safe: the consumer keeps batches from its assembling threads.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

from shared.schemas import TrainingBatch
from shared.storage import ObjectStore, get_model


class BatchHandoff:
    def __init__(self, max_batches: int):
        self.max_batches = max_batches
        self._batches: OrderedDict[str, TrainingBatch] = OrderedDict()
        self._lock = threading.Lock()
        self.taken = self.read_back = 0  # how many batches each way: kept here, or read from the store

    def keep(self, key: str, batch: TrainingBatch) -> None:
        """``batch``, just written at ``key``, for the step that trains it."""
        if self.max_batches <= 0:
            return
        with self._lock:
            self._batches[key] = batch
            while len(self._batches) > self.max_batches:
                self._batches.popitem(last=False)

    def take(self, store: ObjectStore, key: str) -> TrainingBatch:
        """The batch at ``key``: the kept one (dropped from here), else read from ``store``."""
        with self._lock:
            batch = self._batches.pop(key, None)
            if batch is not None:
                self.taken += 1
                return batch
            self.read_back += 1
        return get_model(store, key, TrainingBatch)

    def __len__(self) -> int:
        return len(self._batches)
