"""The weight follower's record of a run's weight syncs: the one owner of
``RedisKeys.weight_sync`` (a Redis hash). The follower writes it; the trainer reads the last
sync's timings for its step metrics and the last failure for its served-weights alarm.

Invariants:
- A successful sync overwrites the timing fields (``SYNC_FIELDS``) of the previous one; a
  failed sync writes the failure fields (``FAILURE_FIELDS``) and leaves the timings alone.
  A failure is therefore still there after a later success: it is over once the served
  policy version (``shared.state.policy_version``) reached ``failed_version``.
- Writing the record never fails a sync: the follower logs an error writing it and goes on.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any

from shared.names import RedisKeys

SYNC_FIELDS = ("version", "replicas", "at", "seconds", "total_s", "download_s", "sync_s", "pause_s", "reload_s",
               "version_s", "resume_s", "probe_s", "probe_max_abs_diff")
FAILURE_FIELDS = ("failed_version", "failed_phase", "error", "failed_at")


@dataclass(frozen=True)
class SyncFailure:
    version: int
    phase: str  # the sync's phase that failed: pause, reload, probe, label, ...
    error: str


class WeightSyncRecord:
    def __init__(self, client: Any, run_id: str):
        self.redis, self.run_id = client, run_id
        self.key = RedisKeys.weight_sync(run_id)

    def record_sync(self, version: int, replicas: int, total_s: float, download_s: float, sync_s: float,
                    pause_s: float, reload_s: float, version_s: float, resume_s: float,
                    probe_max_abs_diff: float | str = "nan", probe_s: float | str = "nan", transaction: Any = None) -> None:
        """With a transaction (a Redis pipeline), as part of it (so ``record_failure`` too)."""
        (transaction if transaction is not None else self.redis).hset(self.key, mapping={
            "version": version, "replicas": replicas, "at": time.time(), "seconds": total_s, "total_s": total_s,
            "download_s": download_s, "sync_s": sync_s, "pause_s": pause_s, "reload_s": reload_s,
            "version_s": version_s, "resume_s": resume_s, "probe_s": probe_s, "probe_max_abs_diff": probe_max_abs_diff,
        })

    def record_failure(self, version: int, phase: str, error: str, transaction: Any = None) -> None:
        (transaction if transaction is not None else self.redis).hset(self.key, mapping={
            "failed_version": version, "failed_phase": phase, "error": error[:2000], "failed_at": time.time(),
        })

    def last_failure(self) -> SyncFailure | None:
        version, phase, error = (_text(v) for v in self.redis.hmget(self.key, "failed_version", "failed_phase", "error"))
        if version is None:
            return None
        return SyncFailure(int(version), phase or "", error or "")

    def last_sync(self) -> dict[str, float]:
        """The last successful sync's timing fields as numbers (NaN for a field never written)."""
        raw = dict(zip(SYNC_FIELDS, self.redis.hmget(self.key, *SYNC_FIELDS)))
        return {name: _number(raw[name]) for name in SYNC_FIELDS}


def _text(value: Any) -> str | None:
    return value.decode() if isinstance(value, bytes) else value


def _number(value: Any) -> float:
    try:
        return float(str(_text(value))) if value is not None else math.nan
    except ValueError:
        return math.nan
