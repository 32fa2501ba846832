"""What the viewer shows, read from Redis and S3 through the services' own key and storage modules.

Invariants:
- Every read is bounded by a page: group pages GET at most ``page_size`` group records by
  their ids; trajectory and failure lists walk the run's stream or hash from a cursor, at most
  ``scan_budget`` entries per request, and hand back the cursor to go on from. No request
  lists or reads a whole run, so a run of 100,000 trajectories pages as fast as one of 100.
- Nothing here writes.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from shared.state.group_registry import GroupRegistry
from shared.ids import parse_trajectory_id
from shared.state.ledger import LedgerReads
from shared.names import group_record_key
from shared.outcomes import kind_of
from shared.schemas import (BadMessage, EvalEnd, GroupRecord, GroupRegistration, ScoredEvent,
                            TrainerEvent, parse_message)
from shared.storage import ObjectStore, StorageError, get_model
from shared.state.eval_ends import EvalEnds
from shared.state.run_records import RunRecords
from shared.state.step_metrics import StepMetrics
from shared.state.trainer_counters import TrainerCounters
from shared.state.trainer_stream import has_entries_after, stream_entries
from shared.trajectory_lookup import FoundTrajectory, find_trajectory, stop_reason_of_event


@dataclass
class TrajectoryFilter:
    min_reward: float | None = None
    max_reward: float | None = None
    stop_reason: str = ""  # needs each candidate's scored object: one GET per candidate
    env_name: str = ""
    kind: str = ""  # "scored", "failed" or "" for both
    failure_class: str = ""  # a failure reason's first word (shared.outcomes.FailureKind)


@dataclass
class TrajectoryRow:
    trajectory_id: str
    group_id: int
    env_name: str
    kind: str
    reward: float | None
    failure: str | None
    stop_reason: str | None = None


@dataclass
class Page:
    rows: list[Any]
    next_cursor: str | None  # None: nothing after this page
    scanned: int = 0


@dataclass
class ViewerData:
    redis: Any  # a client with decode_responses=True
    store: ObjectStore
    page_size: int = 50
    scan_budget: int = 2000
    _registrations: dict[tuple[str, int], GroupRegistration | None] = field(default_factory=dict)

    # --- runs -----------------------------------------------------------------------------
    def runs(self) -> list[dict[str, Any]]:
        ledger = LedgerReads(self.redis)
        return [{"run_id": run, "counts": ledger.counts(run)} for run in ledger.runs()]

    def has_run(self, run_id: str) -> bool:
        return LedgerReads(self.redis).has_run(run_id)

    def counts(self, run_id: str) -> dict[str, int]:
        return LedgerReads(self.redis).counts(run_id)

    def steps(self, run_id: str, limit: int = 2000) -> list[dict[str, Any]]:
        """The newest ``limit`` step-metric lines, oldest first."""
        return [line for _, line in StepMetrics(self.redis, run_id).newest(limit)]

    def evals(self, run_id: str) -> list[EvalEnd]:
        return EvalEnds(self.redis, run_id).all()

    def trainer_counters(self, run_id: str) -> dict[str, int]:
        return TrainerCounters(self.redis, run_id).all()

    # --- groups ---------------------------------------------------------------------------
    def registration(self, run_id: str, group_id: int) -> GroupRegistration | None:
        key = (run_id, group_id)
        if key not in self._registrations:
            try:
                self._registrations[key] = GroupRegistry(self.redis, run_id).get(group_id)
            except (KeyError, BadMessage):
                self._registrations[key] = None
        return self._registrations[key]

    def group(self, run_id: str, group_id: int) -> GroupRecord | None:
        """The group's record once the trainer decided it; None before."""
        try:
            return get_model(self.store, group_record_key(run_id, group_id), GroupRecord)
        except StorageError as exc:
            if "NoSuchKey" in str(exc) or "not found" in str(exc):
                return None
            raise

    def groups_page(self, run_id: str, page: int) -> list[tuple[int, GroupRegistration | None, GroupRecord | None]]:
        """Groups ``page * page_size`` onwards, by id: their registration and, once decided, record."""
        first = page * self.page_size
        registered = GroupRegistry(self.redis, run_id).registrations_in(range(first, first + self.page_size))
        return [(group_id, registration, self.group(run_id, group_id)) for group_id, registration in registered.items()]

    # --- trajectories ---------------------------------------------------------------------
    def trajectory(self, trajectory_id: str) -> FoundTrajectory:
        return find_trajectory(self.store, trajectory_id, self.redis)

    def trajectories_page(self, run_id: str, flt: TrajectoryFilter, cursor: str = "-") -> Page:
        """Trajectories in the order the trainer received them (its stream), filtered, from
        ``cursor`` (a stream id, exclusive; "-" for the start)."""
        rows: list[TrajectoryRow] = []
        scanned, last = 0, cursor
        for entry_id, raw in stream_entries(self.redis, run_id, cursor, page_size=min(200, self.scan_budget)):
            scanned, last = scanned + 1, entry_id
            if (row := self._row(run_id, raw, flt)) is not None:
                rows.append(row)
            if len(rows) == self.page_size or scanned >= self.scan_budget:
                break
        else:
            return Page(rows, None, scanned)
        return Page(rows, last if has_entries_after(self.redis, run_id, last) else None, scanned)

    def _row(self, run_id: str, raw_event: str, flt: TrajectoryFilter) -> TrajectoryRow | None:
        try:
            event = parse_message(TrainerEvent, raw_event)
        except BadMessage:
            return None
        registration = self.registration(run_id, event.group_id)
        env_name = registration.env_name if registration else ""
        scored = isinstance(event, ScoredEvent)
        checks: list[Callable[[], bool]] = [
            lambda: not flt.kind or flt.kind == event.kind,
            lambda: not flt.env_name or flt.env_name == env_name,
            lambda: flt.min_reward is None or (scored and event.reward >= flt.min_reward),
            lambda: flt.max_reward is None or (scored and event.reward <= flt.max_reward),
            lambda: not flt.failure_class or (not scored and kind_of(event.failure_reason) == flt.failure_class),
        ]
        if not all(check() for check in checks):
            return None
        row = TrajectoryRow(event.trajectory_id, event.group_id, env_name, event.kind,
                            event.reward if scored else None, None if scored else event.failure_reason)
        if flt.stop_reason:
            if not scored:
                return None
            row.stop_reason = stop_reason_of_event(self.store, event).value
            if row.stop_reason != flt.stop_reason:
                return None
        return row

    def failures_page(self, run_id: str, failure_class: str = "", cursor: int = 0) -> Page:
        """Failed trajectories with their reasons and attempts (HSCAN from ``cursor``)."""
        rows: list[dict[str, Any]] = []
        scanned = 0
        while True:
            cursor, batch = LedgerReads(self.redis).failures_scan(run_id, cursor, self.page_size)
            for trajectory_id, reason, tries in batch:
                scanned += 1
                if failure_class and kind_of(reason) != failure_class:
                    continue
                rows.append({"trajectory_id": trajectory_id, "group_id": parse_trajectory_id(trajectory_id).group_id,
                             "class": kind_of(reason), "reason": reason, "attempts": tries})
            if cursor == 0 or len(rows) >= self.page_size or scanned >= self.scan_budget:
                return Page(rows, None if cursor == 0 else str(cursor), scanned)

    def rejected_rows(self, run_id: str, page: int) -> list[dict[str, str]]:
        first = page * self.page_size
        return [row.model_dump() for row in RunRecords(self.redis, run_id).rejected_rows(first, first + self.page_size - 1)]
