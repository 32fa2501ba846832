"""The trainer's counters of a run: the one owner of ``RedisKeys.trainer_counters`` (a Redis
hash, counter name -> integer), read by ``conveyor demo``, the step metrics, Prometheus and
the tests.

Invariants:
- Every counter only grows, and each event is counted once: a group's decision is counted in
  the transaction that marks it done (``services.trainer.consumer``), a step's selection in
  the Lua call that records it once per version (``services.trainer.loop``), so a trainer
  restarted at any point counts nothing twice.
- The names are the members of ``TrainerCounter``; nothing else is written to the hash.
"""

from __future__ import annotations

import enum
from typing import Any

from shared.names import RedisKeys


class TrainerCounter(str, enum.Enum):
    # groups, as the consumer decided them (one of the four per group) ...
    groups_accepted = "groups_accepted"
    groups_zero_variance = "groups_zero_variance"
    groups_all_failed = "groups_all_failed"
    groups_stale = "groups_stale"  # ... or, later, by the step that found an accepted group stale
    groups_filtered = "groups_filtered"  # dropped by a filter of trainer.group_filters
    groups_reopened = "groups_reopened"  # all_failed groups `conveyor retry` re-opened: decided (and counted) again later
    groups_zero_variance_kept = "groups_zero_variance_kept"  # accepted with all advantages 0 (zero_variance_groups: keep)
    groups_trained = "groups_trained"  # by the training loop, per step
    bad_events = "bad_events"  # trainer-stream entries that did not parse or named an unknown group
    duplicate_events = "duplicate_events"  # a second event for a trajectory of a pending group
    late_events = "late_events"  # an event for a group already done
    superseded = "superseded"  # redundant members failed(superseded) once their group kept its first N
    bad_train_entries = "bad_train_entries"  # train-queue entries that did not parse (passed over)
    alarm_skipped_steps = "alarm_skipped_steps"  # steps the logprob alarm applied no update in
    alarm_failed_syncs = "alarm_failed_syncs"  # weight syncs that did not take, with action skip_step

    @classmethod
    def for_group_status(cls, status: str) -> "TrainerCounter":
        return cls(f"groups_{status}")


class TrainerCounters:
    def __init__(self, client: Any, run_id: str):
        self.redis, self.run_id = client, run_id
        self.key = RedisKeys.trainer_counters(run_id)

    def add(self, counter: TrainerCounter, n: int = 1, transaction: Any = None) -> None:
        """Add ``n``; with a transaction (a Redis pipeline), as part of it."""
        (transaction if transaction is not None else self.redis).hincrby(self.key, TrainerCounter(counter).value, n)

    def get(self, counter: TrainerCounter) -> int:
        return int(self.redis.hget(self.key, TrainerCounter(counter).value) or 0)

    def all(self) -> dict[str, int]:
        """Every counter that was ever added to, by name."""
        return {_text(k): int(v) for k, v in self.redis.hgetall(self.key).items()}


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
