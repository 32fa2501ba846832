"""A run's train queue and its selection commits: the one owner of ``RedisKeys.train_queue`` (a
list of ``TrainQueueEntry`` JSON, append-only) and ``RedisKeys.train_cursor`` (a hash: policy
version -> the queue position after that version's step).

Invariants:
- The consumer appends an entry in the transaction that acknowledges the group's events, so a
  group reaches the queue once (``services.trainer.consumer``).
- A selection is committed once per version: the cursor of version ``v + 1``, the stale groups
  counted (staleness ``filtered`` and the trainer's counters) and the entries mixing deferred
  appended again, all in one Lua call, applied only if the cursor of ``v + 1`` is not yet set
  (HSETNX). A selection replayed after a restart counts and appends nothing twice. With the
  run's marker, the call writes nothing into a Redis that lost the run (``shared.state.run_marker``).
"""

from __future__ import annotations

from typing import Any

from shared.names import RedisKeys
from shared.schemas import SkippedGroupEntry, TrainBatchEntry
from shared.state.run_marker import TRAINER_STOPS, RunMarker, run_script
from shared.state.staleness import StalenessBudget, budget_key
from shared.state.trainer_counters import TrainerCounter, TrainerCounters

# KEYS: cursors, staleness, counters, queue[, run marker: required] -> 1 / -1 the marker is required and gone
_COMMIT_SELECTION = """
local cursors, staleness, counters, queue, marker = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5]
local version, cursor, stale, trained, bad, filtered_field, stale_field, trained_field, bad_field = ARGV[1], ARGV[2], ARGV[3], ARGV[4], ARGV[5], ARGV[6], ARGV[7], ARGV[8], ARGV[9]
local first_deferred = 10  -- ARGV[10..]: entries deferred by mixing, appended to the queue again
if marker and redis.call('EXISTS', marker) == 0 then return -1 end  -- the run's marker, given: required, and gone
if redis.call('HSETNX', cursors, version, cursor) == 1 then
  redis.call('HINCRBY', staleness, filtered_field, stale)
  redis.call('HINCRBY', counters, stale_field, stale)
  redis.call('HINCRBY', counters, trained_field, trained)
  if tonumber(bad) > 0 then redis.call('HINCRBY', counters, bad_field, bad) end
  for i = first_deferred, #ARGV do redis.call('RPUSH', queue, ARGV[i]) end
end
return 1
"""


class TrainQueue:
    def __init__(self, client: Any, run_id: str):
        self.redis, self.run_id = client, run_id
        self.queue_key, self.cursor_key = RedisKeys.train_queue(run_id), RedisKeys.train_cursor(run_id)
        self._commit_selection = client.register_script(_COMMIT_SELECTION)

    def append(self, entry: TrainBatchEntry | SkippedGroupEntry, transaction: Any) -> None:
        """Queue the append on the caller's transaction (a Redis pipeline)."""
        transaction.rpush(self.queue_key, entry.model_dump_json())

    def after_version(self, version: int) -> tuple[int, list[str]]:
        """Version ``version``'s cursor (0 before any step) and the raw entries from it on."""
        cursor = int(self.redis.hget(self.cursor_key, str(version)) or 0)
        return cursor, self.redis.lrange(self.queue_key, cursor, -1)

    def commit_selection(self, version: int, cursor: int, stale: int, trained: int, bad: int,
                         deferred: list[str | bytes], marker: RunMarker | None = None) -> None:
        """Record the selection of step ``version`` (its cursor after): see the module invariants.
        With the run's ``marker`` (the trainer's), never into a Redis that lost the run."""
        run_script(marker, self._commit_selection,
                   [self.cursor_key, budget_key(self.run_id), TrainerCounters(self.redis, self.run_id).key, self.queue_key],
                   [version, cursor, stale, trained, bad, StalenessBudget.FILTERED, TrainerCounter.groups_stale.value,
                    TrainerCounter.groups_trained.value, TrainerCounter.bad_train_entries.value, *deferred],
                   TRAINER_STOPS)
