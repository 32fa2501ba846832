"""Dead letters: messages between processes that did not fit their schema
(``shared.schemas.BadMessage``), kept with the reason, so that a bad message is never only a
log line. The one owner of ``RedisKeys.dead_letters`` (a Redis list of JSON, all runs: a
message that does not parse may not name its run).

Invariants:
- A consumer that cannot read a message logs it, adds it here, and goes on; when the message
  names a trajectory, the consumer also fails that trajectory with the reason
  (``bad_message: ...``), so the ledger still accounts for it. Nothing is dropped silently.
- The list keeps the newest ``MAX_LETTERS``; each letter holds at most the first few hundred
  characters of the message (``BadMessage.raw``).
"""

from __future__ import annotations

import json
import time
from typing import Any

from shared.names import RedisKeys
from shared.schemas import BadMessage

MAX_LETTERS = 10_000


class DeadLetters:
    def __init__(self, client: Any):
        self.redis = client
        self.key = RedisKeys.dead_letters

    def add(self, source: str, error: BadMessage) -> None:
        """``source``: where the message was read (a queue, a stream and its entry id)."""
        letter = {"source": source, "what": error.what, "problems": error.problems, "message": error.raw, "at": time.time()}
        with self.redis.pipeline(transaction=True) as tx:
            tx.lpush(self.key, json.dumps(letter))
            tx.ltrim(self.key, 0, MAX_LETTERS - 1)
            tx.execute()

    def newest(self, n: int = 100) -> list[dict[str, Any]]:
        return [json.loads(raw) for raw in self.redis.lrange(self.key, 0, n - 1)]
