"""The trainer's side of ``inference.weight_sync: nccl``: broadcast each new version to the
replicas, then write its S3 checkpoint in the background.

Per version, in the trainer's thread: take a CPU snapshot of the weights and optimizer state
(``services.trainer.checkpoints.take_snapshot``, with the logprob probe), broadcast the
weights (``services.inference.weight_broadcast``: pause, receive, probe, label, advance
``policy_version``, resume), then hand the snapshot to one background thread that writes the
checkpoint and announces it once committed.

Invariants:
- ``policy_version`` moves to ``v`` only once every replica serves ``v`` and passed the probe
  (``on_served``), as on the S3 path. The announcement of ``v`` comes after its checkpoint is
  committed (later); the weight follower ignores it, since ``v`` is already served.
- At most one checkpoint is being written at a time: ``publish`` waits for the previous one
  first, and a failed write raises there (or in ``close``), never silently.
- The snapshot is taken before the next optimizer step can change the weights, so checkpoint
  ``v`` holds exactly what was broadcast as ``v``.
- Known gap: a trainer that dies after broadcasting ``v`` and before committing it resumes at
  ``v - 1`` and trains ``v`` again; the replicas then serve two different sets of weights
  under the label ``v`` one after the other (the staleness accounting is unaffected).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

from services.inference.weight_broadcast import WeightBroadcaster
from services.inference.weight_sync import SyncProbe, SyncReport
from services.trainer.checkpoints import save_checkpoint, take_snapshot
from shared.logprob_probe import default_tolerance
from shared.policy_version import PolicyVersion
from shared.settings import Settings
from shared.storage import ObjectStore

log = logging.getLogger(__name__)


class BroadcastPublisher:
    """Publishes each version by broadcast first and by S3 checkpoint second."""

    def __init__(self, settings: Settings, redis_client, store: ObjectStore,
                 broadcaster: WeightBroadcaster | None = None):
        self.settings, self.store = settings, store
        self.broadcaster = broadcaster or WeightBroadcaster.from_settings(settings)  # refuses nccl without CUDA
        self.policy_version = PolicyVersion(redis_client, settings.run_id)
        self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="checkpoint-writer")
        self._pending: Future | None = None

    def _probe(self, probe) -> SyncProbe | None:
        inference = self.settings.inference
        if not inference.sync_probe:
            return None
        return SyncProbe(probe, inference.model, inference.sync_probe_tolerance or default_tolerance(inference.dtype))

    def publish(self, version: int, model, tokenizer, optimizer, step: int, dataset_versions: list[str],
                announce: Callable[[int], None]) -> dict[str, float]:
        """Broadcast ``version`` to every replica, then queue its checkpoint; returns timings."""
        t0 = time.perf_counter()
        snapshot = take_snapshot(model, optimizer, version)
        t1 = time.perf_counter()
        report: SyncReport = self.broadcaster.sync(model.named_parameters(), version, probe=self._probe(snapshot.probe),
                                                   on_served=lambda: self.policy_version.advance(version))
        t2 = time.perf_counter()
        self.wait()

        def write() -> None:
            save_checkpoint(self.store, self.settings.run_id, version, model, tokenizer, optimizer, step,
                            dataset_versions=dataset_versions, snapshot=snapshot)
            announce(version)

        self._pending = self._writer.submit(write)
        return {"snapshot_s": t1 - t0, "broadcast_sync_s": t2 - t1, "broadcast_s": report.reload_s,
                "checkpoint_wait_s": time.perf_counter() - t2}

    def wait(self) -> None:
        """Wait for the checkpoint being written (if any); its failure is raised here."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.result()

    def close(self) -> None:
        try:
            self.wait()
        finally:
            self._writer.shutdown(wait=True)
            self.broadcaster.close()
