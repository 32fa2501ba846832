"""Applying one announced checkpoint to replicas, for the weight follower
(``services.weights.follower``, whose invariants it serves): download, sync, record, prune.

Invariants:
- A checkpoint reaches a replica only downloaded complete and verified
  (``checkpoint_files.download_checkpoint``), under ``work_dir/{version:06d}``.
- ``policy_version`` advances only from the sync's ``on_served`` hook: once every replica
  serves the version, labelled and probed, while they are all still paused. It and the sync's
  record are never written into a Redis that lost the run (``shared.state.run_marker``: the
  version's script requires the marker, the record is ``RunMarker.guarded``).
- A checkpoint with a LoRA adapter is served as an adapter (``lora_sync.sync_adapter``), any
  other by a reload of the full weights (``sync.sync_weights``), restoring the served version's
  directory (or the base checkpoint at version 0) if the reload or probe fails.
- A checkpoint that carries the trainer's probe is probed on every replica when ``probe_model``
  is set. A failed sync is recorded in the run's ``WeightSyncRecord`` and raised; a successful one
  is recorded with its seconds per phase.
- An announcement under the run's delta chain (``delta_prefix``) is served by
  ``delta_sync.sync_delta`` from the chain, under the same rules for ``policy_version``, the probe
  and the record.
- After a successful sync only the new version's directory is kept (and the previous one for
  an adapter, whose turns may still run); the others and partial downloads are removed.
"""

from __future__ import annotations

import logging
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import httpx

from services.policy.probe import LogprobProbe
from services.weights.checkpoint_files import Download, download_checkpoint
from services.weights.delta_sync import DeltaCatchUp, sync_delta
from services.weights.lora_sync import sync_adapter
from services.weights.sync import SyncProbe, SyncReport, WeightSyncError, sync_weights
from shared.names import CHECKPOINT_ADAPTER_CONFIG, CHECKPOINT_PROBE
from shared.prometheus import SERVED_POLICY_VERSION, WEIGHT_SYNC_SECONDS
from shared.state.policy_version import PolicyVersion
from shared.state.run_marker import FOLLOWER_STOPS, RunMarker
from shared.state.weight_sync_record import WeightSyncRecord
from shared.storage import ObjectStore

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Applied:
    """One applied sync: download, then ``sync_weights``, from the follower's point of view."""

    version: int
    prefix: str
    replicas: tuple[str, ...]
    download: Download
    sync: SyncReport
    total_s: float


@dataclass
class CheckpointApplier:
    """Serves one checkpoint of a run on a list of replicas (``apply``); see the module invariants."""

    store: ObjectStore
    work_dir: Path  # the run's local checkpoint directories
    initial_weights_dir: Path | None  # the base checkpoint: what version 0 restores
    http: httpx.Client  # the follower's admin client
    policy_version: PolicyVersion
    weight_syncs: WeightSyncRecord
    sync_options: dict[str, Any]
    probe_model: str | None  # the served model name to probe; None: no probe
    probe_tolerance: float
    served_model: str  # the base model's served name: LoRA adapters are named from it
    marker: RunMarker  # the run's marker: its records are never written into a Redis that lost the run
    delta: DeltaCatchUp | None = None  # inference.weight_sync delta: the run's chain, read and decoded
    delta_prefix: str | None = None  # announcements under it are delta-chain versions
    delta_prebuild: bool = True  # inference.weight_sync.prebuild: sync_delta's prebuild

    def _write(self, fill: Callable[[Any], object]) -> None:
        """The run's records, written only while Redis holds the run (``RunMarker.guarded``)."""
        self.marker.guarded(fill, FOLLOWER_STOPS)

    def _advance(self, version: int) -> None:
        self.policy_version.advance(version, self.marker, FOLLOWER_STOPS)

    def local_dir(self, version: int) -> Path:
        return self.work_dir / f"{version:06d}"

    def _restore_dir(self, served: int) -> Path | None:
        if served == 0:
            return self.initial_weights_dir
        current = self.local_dir(served)
        return current if current.is_dir() else None

    def apply(self, version: int, prefix: str, urls: list[str], served: int) -> Applied:
        if self.delta is not None and self.delta_prefix is not None and prefix.startswith(self.delta_prefix):
            return self._apply_delta(self.delta, version, prefix, urls)
        t0 = time.perf_counter()
        download = download_checkpoint(self.store, prefix, self.local_dir(version))

        adapter = (download.local_dir / CHECKPOINT_ADAPTER_CONFIG).is_file()
        try:
            if adapter:
                report = sync_adapter(urls, download.local_dir, version, self.served_model, keep_from=served,
                                      on_served=lambda: self._advance(version), client=self.http,
                                      probe=self._probe(download.local_dir))
            else:
                restore = self._restore_dir(served) if version != served else None
                report = sync_weights(urls, download.local_dir, version, restore_dir=restore,
                                      on_served=lambda: self._advance(version), client=self.http,
                                      probe=self._probe(download.local_dir), **self.sync_options)
        except WeightSyncError as exc:
            self._record_failure(version, exc)
            raise
        total = time.perf_counter() - t0
        applied = Applied(version, prefix, tuple(urls), download, report, total)
        self._record(applied)
        self._prune(keep={download.local_dir, self.local_dir(served)} if adapter else {download.local_dir})
        log.info("serving version %d on %s: %.3fs (download %.3fs, sync %.3fs)",
                 version, ", ".join(urls), total, download.seconds, report.total_s)
        return applied

    def _apply_delta(self, catch_up: DeltaCatchUp, version: int, prefix: str, urls: list[str]) -> Applied:
        """A version of the delta chain (``inference.weight_sync: delta``): ``delta_sync.sync_delta``."""
        t0 = time.perf_counter()

        try:
            report = sync_delta(urls, catch_up, version, http=self.http, probe_model=self.probe_model,
                                probe_tolerance=self.probe_tolerance, on_served=lambda: self._advance(version),
                                prebuild=self.delta_prebuild)
        except WeightSyncError as exc:
            self._record_failure(version, exc)
            raise
        extra = report.extra
        download = Download(catch_up.work_dir, sum(len(p) for p in extra["plans"].values()),
                            extra["download_bytes"], extra["prepare_s"], False)
        applied = Applied(version, prefix, tuple(urls), download, report, time.perf_counter() - t0)
        self._record(applied)
        log.info("serving delta-chain version %d on %s: %.3fs (plans %s, %d bytes fetched, %.3fs to fetch and decode, "
                 "paused %.3fs)", version, ", ".join(urls), applied.total_s, extra["plans"], extra["download_bytes"],
                 extra["prepare_s"], report.reload_s)
        return applied

    def _probe(self, local_dir: Path) -> SyncProbe | None:
        path = local_dir / CHECKPOINT_PROBE
        if self.probe_model is None or not path.is_file():
            return None
        return SyncProbe(LogprobProbe.from_json(path.read_bytes()), self.probe_model, self.probe_tolerance)

    def _record_failure(self, version: int, exc: WeightSyncError) -> None:
        log.error("weight sync to version %d failed (%s): %s", version, exc.phase, exc)
        try:
            self._write(lambda tx: self.weight_syncs.record_failure(version, exc.phase, str(exc), transaction=tx))
        except Exception:
            log.exception("could not record the weight-sync failure")

    def _record(self, applied: Applied) -> None:
        WEIGHT_SYNC_SECONDS.observe(applied.total_s)
        SERVED_POLICY_VERSION.set(applied.version)
        s = applied.sync
        try:
            self._write(lambda tx: self.weight_syncs.record_sync(
                applied.version, len(applied.replicas), applied.total_s, applied.download.seconds, s.total_s,
                s.pause_s, s.reload_s, s.version_s, s.resume_s, s.extra.get("probe_max_abs_diff", "nan"),
                s.extra.get("probe_s", "nan"), transaction=tx,
            ))
        except Exception:
            log.exception("could not record weight-sync stats")

    def _prune(self, keep: set[Path]) -> None:
        for path in self.work_dir.iterdir() if self.work_dir.is_dir() else []:
            if path not in keep and path.is_dir() and (path.name.isdigit() or ".partial-" in path.name):
                shutil.rmtree(path, ignore_errors=True)
