"""The owners of a run's Redis records (``shared.state.group_registry``, ``shared.state.policy_version``,
``shared.state.trainer_counters``, ``shared.state.weight_sync_record``, ``shared.state.dead_letters``), on a real
Redis: each keeps the invariant its docstring states."""

from __future__ import annotations

import math
import threading

import pytest

from shared.state.dead_letters import MAX_LETTERS, DeadLetters
from shared.state.group_registry import GroupRegistry
from shared.state.policy_version import PolicyVersion
from shared.schemas import BadMessage, GroupRegistration, ScoringTask, parse_message
from shared.state.trainer_counters import TrainerCounter, TrainerCounters
from shared.state.weight_sync_record import SyncFailure, WeightSyncRecord


def registration(run_id: str, group_id: int, task_id: str = "t") -> GroupRegistration:
    return GroupRegistration(run_id=run_id, group_id=group_id, expected_size=4, task_id=task_id, policy_version=0, dispatched_at=1.0)


def test_a_registration_is_written_once_and_read_back(redis_client, run_id):
    groups = GroupRegistry(redis_client, run_id)
    assert groups.register(registration(run_id, 3))
    assert not groups.register(registration(run_id, 3, task_id="other"))  # a re-run of intake keeps the first
    assert groups.get(3).task_id == "t" and groups.is_registered(3) and not groups.is_registered(4)
    assert set(groups.registrations()) == {3}
    with pytest.raises(KeyError, match="never registered"):
        groups.get(4)
    with pytest.raises(ValueError, match="of run 'elsewhere'"):
        groups.register(registration("elsewhere", 1))
    redis_client.hset(groups.registrations_key, "5", '{"run_id": 1}')  # corrupted by hand
    with pytest.raises(BadMessage, match="registration of group 5: .*group_id: Field required"):
        groups.get(5)


def test_published_and_done_are_marked_per_group(redis_client, run_id):
    groups = GroupRegistry(redis_client, run_id)
    groups.mark_published(1)
    assert groups.is_published(1) and not groups.is_published(2)
    with redis_client.pipeline(transaction=True) as tx:
        groups.mark_done(1, tx)
        assert not groups.is_done(1)  # only with the transaction
        tx.execute()
    assert groups.is_done(1) and groups.done() == {1}


def test_the_policy_version_never_goes_backwards_even_when_raced(redis_client, run_id):
    served = PolicyVersion(redis_client, run_id)
    assert served.get() == 0
    assert served.advance(2) and not served.advance(2) and not served.advance(1)
    assert served.get() == 2
    threads = [threading.Thread(target=served.advance, args=(v,)) for v in range(10, 0, -1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert served.get() == 10


def test_trainer_counters_are_the_named_ones_and_move_with_a_transaction(redis_client, run_id):
    counters = TrainerCounters(redis_client, run_id)
    counters.add(TrainerCounter.bad_events)
    with redis_client.pipeline(transaction=True) as tx:
        counters.add(TrainerCounter.for_group_status("zero_variance"), transaction=tx)
        counters.add(TrainerCounter.groups_trained, 4, transaction=tx)
        tx.execute()
    assert counters.all() == {"bad_events": 1, "groups_zero_variance": 1, "groups_trained": 4}
    assert counters.get(TrainerCounter.groups_trained) == 4 and counters.get(TrainerCounter.late_events) == 0
    with pytest.raises(ValueError):
        counters.add("groups_typo")  # not a counter: refused before it reaches Redis
    with pytest.raises(ValueError):
        TrainerCounter.for_group_status("maybe")


def test_weight_sync_record_keeps_the_last_failure_next_to_later_successes(redis_client, run_id):
    record = WeightSyncRecord(redis_client, run_id)
    assert record.last_failure() is None and math.isnan(record.last_sync()["seconds"])
    record.record_failure(3, "probe", "x" * 5000)
    record.record_sync(4, 1, 1.5, 0.5, 1.0, 0.1, 0.7, 0.1, 0.1, 2e-6, probe_s=0.3)
    failure = record.last_failure()
    assert failure == SyncFailure(3, "probe", "x" * 2000)  # the error is kept short
    sync = record.last_sync()
    assert (sync["version"], sync["seconds"], sync["probe_max_abs_diff"], sync["probe_s"]) == (4.0, 1.5, 2e-6, 0.3)


def test_dead_letters_keep_what_did_not_parse_newest_first_and_bounded(redis_client, monkeypatch):
    letters = DeadLetters(redis_client)
    for i in range(3):
        with pytest.raises(BadMessage) as info:
            parse_message(ScoringTask, {"trajectory_id": f"r_0_0_{i}"}, "scoring task")
        letters.add("queue scoring", info.value)
    newest = letters.newest()
    assert [letter["message"] for letter in newest] == [f"{{'trajectory_id': 'r_0_0_{i}'}}" for i in (2, 1, 0)]
    assert newest[0]["what"] == "scoring task" and newest[0]["problems"] == "trajectory_key: Field required"
    monkeypatch.setattr("shared.state.dead_letters.MAX_LETTERS", 2)
    letters.add("queue scoring", info.value)
    assert redis_client.llen(letters.key) == 2 < MAX_LETTERS
