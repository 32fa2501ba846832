"""Reading a run's trainer stream (``RedisKeys.trainer_stream``) outside the trainer's consumer
group: the exporter, the evaluation pass, the viewer and the trajectory lookup.

Invariants:
- Reads page through the stream (``page_size`` entries per XRANGE), so no reply holds a whole
  run, and a reader that stops early reads no further.
- Entries come in stream order, each once; ``after`` is exclusive ("-": from the start), so the
  last id a reader saw is a cursor to go on from.
- Nothing here writes, acknowledges or claims: the consumer group's bookkeeping is the
  trainer's alone.
- ``trainer_events`` passes over an entry that is not a TrainerEvent (hand-written, or from a
  newer schema) with one log line naming the stream and entry id: a reader never stops on one
  bad entry.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

from shared.names import RedisKeys
from shared.schemas import BadMessage, TrainerEvent, parse_message

log = logging.getLogger(__name__)


def _text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else value


def stream_key(run_id: str) -> str:
    """The run's trainer stream: for the ledger's Lua transitions, which append to it atomically
    with a state change, and the trainer's consumer group, which reads it."""
    return RedisKeys.trainer_stream(run_id)


def stream_length(redis: Any, run_id: str) -> int:
    return int(redis.xlen(RedisKeys.trainer_stream(run_id)))


def stream_entries(redis: Any, run_id: str, after: str = "-", page_size: int = 1000) -> Iterator[tuple[str, str]]:
    """(entry id, the entry's raw event JSON) of ``run_id``'s trainer stream, after ``after``."""
    stream, start = RedisKeys.trainer_stream(run_id), after if after == "-" else f"({after}"
    while entries := redis.xrange(stream, min=start, count=page_size):
        for entry_id, fields in entries:
            yield _text(entry_id), _text(fields.get("event") or fields.get(b"event") or "")
        start = f"({_text(entries[-1][0])}"


def trainer_events(redis: Any, run_id: str, after: str = "-", page_size: int = 1000) -> Iterator[tuple[str, TrainerEvent]]:
    """(entry id, event) of the run's trainer stream; entries that do not parse are passed over."""
    for entry_id, raw in stream_entries(redis, run_id, after, page_size):
        try:
            yield entry_id, parse_message(TrainerEvent, raw)
        except BadMessage as exc:
            log.error("trainer stream of run %s, entry %s, passed over: %s", run_id, entry_id, exc)


def has_entries_after(redis: Any, run_id: str, entry_id: str) -> bool:
    return bool(redis.xrange(RedisKeys.trainer_stream(run_id), min=f"({entry_id}", count=1))
