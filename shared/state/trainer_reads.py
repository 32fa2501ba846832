"""Whether the trainer of a run reads its events: what a process that waits on the trainer
(intake, held by the staleness bound) can tell about it from Redis' own stream records.

The trainer reads the run's trainer stream (``RedisKeys.trainer_stream``) as the consumer group
``TRAINER_CONSUMER_GROUP``, which its consumer creates at start (``services.trainer.consumer``).
Redis keeps the group's last delivered entry, and an entry's id is the time Redis added it.

Invariants:
- Nothing here writes to Redis and no key is added: the stream's events are written by the
  ledger's Lua, its consumer group belongs to the trainer's consumer.
- No consumer group: no trainer has started for the run, or one is still starting. An event
  left undelivered for longer than a training step takes: no trainer is reading the run (a
  running one reads every ``trainer.block_ms`` between its steps).
- Ages are measured on Redis' clock, the clock the entry ids come from.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import redis

from shared.state.trainer_stream import stream_key

TRAINER_CONSUMER_GROUP = "trainer"


@dataclass(frozen=True)
class TrainerReading:
    started: bool  # a trainer created the run's consumer group
    oldest_unread_s: float | None  # how long the oldest event no trainer took has waited; None: none waits


def trainer_reading(client: Any, run_id: str) -> TrainerReading:
    stream = stream_key(run_id)
    try:
        groups = client.xinfo_groups(stream)
    except redis.ResponseError:  # no stream yet: no trainer started and no event was sent
        return TrainerReading(False, None)
    group = next((g for g in groups if g["name"] == TRAINER_CONSUMER_GROUP), None)
    after = "-" if group is None else f"({group['last-delivered-id']}"
    oldest_unread = client.xrange(stream, min=after, count=1)
    if not oldest_unread:
        return TrainerReading(group is not None, None)
    seconds, microseconds = client.time()
    added_ms = int(oldest_unread[0][0].split("-")[0])
    return TrainerReading(group is not None, max(0.0, seconds + microseconds / 1e6 - added_ms / 1000))
