"""What intake recorded about a run: the one owner of ``RedisKeys.intake_done``,
``RedisKeys.dataset_versions`` and ``RedisKeys.rejected_rows``.

Invariants:
- ``intake_done`` is set once intake has dispatched everything it will; the trainer's consumer
  calls a run finished only after it (and once every trajectory is terminal).
- ``dataset_versions`` is the set of dataset versions intake published from; the trainer stamps
  them, sorted, on each checkpoint.
- ``rejected_rows`` is append-only: each row intake rejected, as a ``RejectedRow``
  (``shared.schemas``), in the order rejected. A re-run of intake appends its rejections again.
"""

from __future__ import annotations

from typing import Any

from shared.names import RedisKeys
from shared.schemas import RejectedRow, parse_message


class RunRecords:
    def __init__(self, client: Any, run_id: str):
        self.redis, self.run_id = client, run_id

    # each write below: with a transaction (a Redis pipeline), as part of it
    def mark_intake_done(self, transaction: Any = None) -> None:
        (transaction if transaction is not None else self.redis).set(RedisKeys.intake_done(self.run_id), "1")

    def intake_done(self) -> bool:
        return bool(self.redis.get(RedisKeys.intake_done(self.run_id)))

    def add_dataset_version(self, version: str, transaction: Any = None) -> None:
        (transaction if transaction is not None else self.redis).sadd(RedisKeys.dataset_versions(self.run_id), version)

    def dataset_versions(self) -> list[str]:
        return sorted(_text(v) for v in self.redis.smembers(RedisKeys.dataset_versions(self.run_id)))

    def reject_row(self, row: RejectedRow, transaction: Any = None) -> None:
        (transaction if transaction is not None else self.redis).rpush(RedisKeys.rejected_rows(self.run_id), row.model_dump_json())

    def rejected_rows(self, first: int = 0, last: int = -1) -> list[RejectedRow]:
        """Rows ``first`` to ``last`` (inclusive, as LRANGE counts) of the rejections, oldest first."""
        raw = self.redis.lrange(RedisKeys.rejected_rows(self.run_id), first, last)
        return [parse_message(RejectedRow, r, f"rejected row of run {self.run_id}") for r in raw]


def _text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else value
