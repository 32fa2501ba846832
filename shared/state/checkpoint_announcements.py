"""A run's checkpoint announcements: the one owner of ``RedisKeys.checkpoints``, a stream of one
``CheckpointAnnouncement`` (``shared.schemas``) per committed checkpoint.

Invariants:
- The trainer announces a version only after its checkpoint is committed
  (``services.trainer.loop``), and again on start for the latest one: a reader ignores a version
  it already serves.
- The weight follower reads the stream from its own cursor (``services.weights.follower``);
  an entry that does not parse stays in the stream.
"""

from __future__ import annotations

from typing import Any

from shared.names import RedisKeys
from shared.schemas import CheckpointAnnouncement


class CheckpointAnnouncements:
    def __init__(self, client: Any, run_id: str):
        self.redis, self.key = client, RedisKeys.checkpoints(run_id)

    def announce(self, announcement: CheckpointAnnouncement, transaction: Any = None) -> None:
        """With a transaction (a Redis pipeline), as part of it."""
        # redis-py types the fields as an invariant Dict of its own unions, so it refuses a dict[str, str]
        (transaction if transaction is not None else self.redis).xadd(self.key, announcement.stream_fields())  # type: ignore[arg-type]

    def read_after(self, cursor: str, block_ms: int | None) -> list[tuple[Any, dict[Any, Any]]]:
        """(entry id, fields) of the entries after ``cursor``, waiting up to ``block_ms`` for one
        (None: not at all)."""
        reply = self.redis.xread({self.key: cursor}, block=block_ms)
        if isinstance(reply, dict):  # RESP3
            reply = list(reply.items())
        return [entry for _stream, entries in reply or [] for entry in entries]
