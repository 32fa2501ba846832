"""A run's step metrics in Redis: the one owner of ``RedisKeys.step_metrics``, a stream of one
``{"metrics": JSON}`` entry per optimizer step that the trainer appends and the viewer's curves
and ``conveyor run list`` read.

Invariants:
- Each line is strict JSON (the trainer writes no NaN or infinity) with at least ``step`` and
  ``time``.
- The stream is capped at about ``STEPS_KEPT`` entries, the newest kept.
- An entry's id starts with Redis' clock (ms) at the append: a reader can tell a line's age on
  the same clock.
"""

from __future__ import annotations

import json
from typing import Any

from shared.names import RedisKeys

STEPS_KEPT = 100_000  # step-metric entries a run's steps stream keeps (about the newest)


class StepMetrics:
    def __init__(self, client: Any, run_id: str):
        self.redis, self.key = client, RedisKeys.step_metrics(run_id)

    def append(self, line: dict[str, Any], transaction: Any = None) -> None:
        """With a transaction (a Redis pipeline), as part of it."""
        (transaction if transaction is not None else self.redis).xadd(self.key, {"metrics": json.dumps(line)}, maxlen=STEPS_KEPT, approximate=True)

    def newest(self, limit: int) -> list[tuple[str, dict[str, Any]]]:
        """The newest ``limit`` lines with their entry ids, oldest first."""
        entries = self.redis.xrevrange(self.key, count=limit)
        return [(_text(entry_id), json.loads(_field(fields))) for entry_id, fields in reversed(entries)]


def _field(fields: dict[Any, Any]) -> str:
    return _text(fields["metrics"] if "metrics" in fields else fields[b"metrics"])


def _text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else value
