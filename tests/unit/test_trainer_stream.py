"""Reading a run's trainer stream outside the consumer group (real Redis): paged, in order,
resumable from a cursor, and never stopped by one bad entry."""

from __future__ import annotations

import logging
import time

from shared.names import RedisKeys
from shared.schemas import FailedEvent, ScoredEvent
from shared.state.trainer_stream import has_entries_after, stream_entries, trainer_events

RUN = "streamrun"


def append_events(redis_client, count: int, first: int = 0) -> list[str]:
    tids = []
    for index in range(first, first + count):
        tid = f"{RUN}_{index}_0_{index}"
        event = (ScoredEvent(trajectory_id=tid, run_id=RUN, group_id=index, reward=0.5, scored_key=f"scored/{tid}", at=time.time())
                 if index % 2 == 0 else
                 FailedEvent(trajectory_id=tid, run_id=RUN, group_id=index, failure_reason="env_error", at=time.time()))
        redis_client.xadd(RedisKeys.trainer_stream(RUN), {"event": event.model_dump_json()})
        tids.append(tid)
    return tids


def test_every_entry_comes_once_in_order_across_pages(redis_client):
    tids = append_events(redis_client, 7)
    events = [event for _, event in trainer_events(redis_client, RUN, page_size=3)]
    assert [e.trajectory_id for e in events] == tids
    assert [type(e) for e in events[:2]] == [ScoredEvent, FailedEvent]


def test_the_last_id_seen_is_a_cursor_to_go_on_from(redis_client):
    tids = append_events(redis_client, 5)
    entry_ids = [entry_id for entry_id, _ in stream_entries(redis_client, RUN, page_size=2)]
    rest = [event.trajectory_id for _, event in trainer_events(redis_client, RUN, after=entry_ids[1])]
    assert rest == tids[2:]
    assert has_entries_after(redis_client, RUN, entry_ids[3]) and not has_entries_after(redis_client, RUN, entry_ids[4])


def test_a_bad_entry_is_passed_over_and_named(redis_client, caplog):
    before = append_events(redis_client, 1)
    bad_id = redis_client.xadd(RedisKeys.trainer_stream(RUN), {"event": '{"kind": "scored", "reward": "lots"}'})
    after = append_events(redis_client, 1, first=1)
    with caplog.at_level(logging.ERROR, logger="shared.state.trainer_stream"):
        read = [event.trajectory_id for _, event in trainer_events(redis_client, RUN)]
    assert read == before + after
    assert any(bad_id in record.getMessage() and RUN in record.getMessage() for record in caplog.records)


def test_a_run_with_no_stream_reads_nothing(redis_client):
    assert list(trainer_events(redis_client, "no-such-run")) == []
