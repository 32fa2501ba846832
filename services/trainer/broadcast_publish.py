"""The trainer's side of ``inference.weight_sync: nccl``: broadcast each new version to the
replicas, and write an S3 checkpoint (the durable record a restart resumes from) of every
``inference.weight_sync.checkpoint_every``-th version in the background.

Per version, in the trainer's thread: compute the logprob probe, broadcast the weights
(``services.weights.broadcast``: pause, receive, probe, label, advance
``policy_version``, resume). A version due for a durable checkpoint is first copied to CPU
(``services.trainer.checkpoints.take_snapshot``), and one background thread writes that copy
and announces it once committed. A version is due when it is at least ``every`` versions past
the newest durable one (committed, or being written); the last version a trainer published is
written at shutdown (``close``) unless a step was in hand.

Back-pressure: skip to the newest, never wait. When a version is due while the previous
checkpoint is still being written, it is not copied and not queued; the checkpoint goes to the
first later version at which the writer is free. The trainer never stalls on storage (that is
what the broadcast path is for), at most one snapshot is in host memory, and a late
checkpoint costs only a longer replay after a crash (below), never data.

Invariants:
- ``policy_version`` moves to ``v`` only once every replica serves ``v`` and passed the probe
  (``on_served``), as on the S3 path, and never into a Redis that lost the run
  (``RunMarker.guarded``). The announcement of ``v`` comes after its checkpoint is
  committed (later); the weight follower ignores it, since ``v`` is already served.
- A label is served with one set of weights only, and a checkpoint ``v`` holds exactly what was
  broadcast as ``v``: the snapshot is taken before the next optimizer step can change the
  weights, and a checkpoint is only written for a version this publisher broadcast.
- Resume: the trainer restarts from the newest committed checkpoint ``d``
  (``checkpoints.resume``), while the replicas may serve a later ``p`` (``policy_version``,
  read when the publisher starts). Versions ``d + 1 .. p`` are replayed: trained again on the
  same recorded selections (``services.trainer.loop``), neither broadcast nor checkpointed, so
  the replicas keep serving ``p`` and the next label they see is ``p + 1``. Version numbers stay
  monotonic, and the version stays the number of optimizer steps and the train queue position.
- At most one checkpoint is being written at a time, and a failed write raises at the next
  ``publish`` (or in ``close``), never silently.
- A step's metrics carry its own sync: ``broadcast_sync_s`` and the probe's
  ``served_probe_max_abs_diff`` for the version just broadcast (on the S3 path that field is the
  weight follower's last sync, of the version before).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

from services.weights.broadcast import WeightBroadcaster
from services.weights.sync import SyncProbe, SyncReport
from services.trainer.checkpoints import save_checkpoint, take_snapshot
from services.policy.model import logprob_probe
from services.policy.probe import default_tolerance
from shared.state.policy_version import PolicyVersion
from shared.state.run_marker import TRAINER_STOPS, RunMarker
from shared.settings import NcclWeightSync, Settings
from shared.storage import ObjectStore

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class _Unwritten:
    """The newest broadcast version with no durable checkpoint yet: what ``close`` writes."""

    version: int
    model: object
    tokenizer: object
    optimizer: object
    step: int
    dataset_versions: list[str]
    announce: Callable[[int], None]


class BroadcastPublisher:
    """Publishes each version by broadcast, and every ``every``-th by S3 checkpoint too."""

    def __init__(self, settings: Settings, redis_client, store: ObjectStore, resumed_version: int = 0,
                 broadcaster: WeightBroadcaster | None = None):
        """``resumed_version``: the committed checkpoint the trainer resumed from (0: none)."""
        self.settings, self.store = settings, store
        sync = settings.inference.weight_sync
        if not isinstance(sync, NcclWeightSync):
            raise ValueError(f"inference.weight_sync is {sync.mode!r}: the broadcast path is not chosen")
        self.every = sync.checkpoint_every
        self.broadcaster = broadcaster or WeightBroadcaster.from_settings(settings)  # refuses nccl without CUDA
        self.policy_version = PolicyVersion(redis_client, settings.run_id)
        self.marker = RunMarker(redis_client, settings.run_id, store)  # never advanced into a Redis that lost the run
        self.served_at_start = self.policy_version.get()  # versions up to it are replays
        self.durable_version = resumed_version  # the newest version committed or being written
        self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="checkpoint-writer")
        self._pending: Future | None = None
        self._unwritten: _Unwritten | None = None
        if self.served_at_start > resumed_version:
            log.warning("replicas serve version %d, the newest checkpoint is %d: versions %d to %d are replayed "
                        "(trained again, not served)", self.served_at_start, resumed_version, resumed_version + 1,
                        self.served_at_start)

    def _probe(self, model, version: int, snapshot_probe=None) -> SyncProbe | None:
        inference = self.settings.inference
        if not inference.sync_probe:
            return None
        probe = snapshot_probe if snapshot_probe is not None else logprob_probe(model, version)
        return SyncProbe(probe, inference.model, inference.sync_probe_tolerance or default_tolerance(inference.dtype))

    def writing(self) -> bool:
        """A checkpoint is being written now; a finished write's failure is raised here."""
        if self._pending is not None and self._pending.done():
            self.wait()
        return self._pending is not None

    def publish(self, version: int, model, tokenizer, optimizer, step: int, dataset_versions: list[str],
                announce: Callable[[int], None]) -> dict[str, float]:
        """Broadcast ``version`` to every replica and, when it is due and the writer is free, queue
        its checkpoint; returns timings and what was done (``replayed``, ``checkpoint_queued``,
        ``checkpoint_deferred``)."""
        busy = self.writing()
        if version <= self.served_at_start:
            return {"replayed": 1.0, "checkpoint_queued": 0.0, "checkpoint_deferred": 0.0}
        due = version - self.durable_version >= self.every
        if due and busy:
            log.warning("checkpoint of version %d deferred: version %d is still being written (%d versions "
                        "without a durable checkpoint)", version, self.durable_version, version - self.durable_version)
        write = due and not busy
        t0 = time.perf_counter()
        snapshot = take_snapshot(model, optimizer, version) if write else None
        t1 = time.perf_counter()
        report: SyncReport = self.broadcaster.sync(
            model.named_parameters(), version, probe=self._probe(model, version, snapshot and snapshot.probe),
            on_served=lambda: self.policy_version.advance(version, self.marker, TRAINER_STOPS))
        t2 = time.perf_counter()
        if write:
            def write_checkpoint() -> None:
                save_checkpoint(self.store, self.settings.run_id, version, model, tokenizer, optimizer, step,
                                dataset_versions=dataset_versions, snapshot=snapshot)
                announce(version)

            self._pending = self._writer.submit(write_checkpoint)
            self.durable_version = version
            self._unwritten = None
        else:
            self._unwritten = _Unwritten(version, model, tokenizer, optimizer, step, dataset_versions, announce)
        probed = {"served_probe_max_abs_diff": report.extra["probe_max_abs_diff"]} if "probe_max_abs_diff" in report.extra else {}
        return {"snapshot_s": t1 - t0, "broadcast_sync_s": t2 - t1, "broadcast_s": report.reload_s, "replayed": 0.0,
                "checkpoint_queued": float(write), "checkpoint_deferred": float(due and busy), **probed}

    def wait(self) -> None:
        """Wait for the checkpoint being written (if any); its failure is raised here."""
        pending, self._pending = self._pending, None
        if pending is not None:
            finished = pending.done()
            started = time.perf_counter()
            pending.result()
            if not finished:  # a write that had already ended (``writing``) cost no wait
                log.info("waited %.2fs for the checkpoint of version %d", time.perf_counter() - started,
                         self.durable_version)

    def close(self, write_last: bool = True) -> None:
        """Wait for the checkpoint being written, then (``write_last``) write the last broadcast
        version's if it has none, from the live model: the caller passes ``write_last=False``
        when a step may have changed the weights since that version was published."""
        try:
            self.wait()
            last = self._unwritten
            if last is not None and write_last:
                save_checkpoint(self.store, self.settings.run_id, last.version, last.model, last.tokenizer,
                                last.optimizer, last.step, dataset_versions=last.dataset_versions)
                self.durable_version, self._unwritten = last.version, None
                last.announce(last.version)
            elif last is not None:
                log.error("closed in the middle of a step: version %d (served) has no checkpoint; a restart resumes "
                          "at version %d and replays up to it", last.version, self.durable_version)
        finally:
            self._writer.shutdown(wait=True)
            self.broadcaster.close()
