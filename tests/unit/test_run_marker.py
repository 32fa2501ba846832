"""Redis losing a run's data is detected (``shared.state.run_marker``), against a real Redis and a
local object store: the marker is written with the run, a run opened by intake cannot be
refilled after a FLUSHALL, intake refuses a run the store knows and Redis does not, workers
refuse its tasks, and the trainer's consumer stops instead of going on with an empty ledger. A
write that was under way as Redis lost the run (intake's, the trainer's) is refused, not applied
to the empty Redis (``RunMarker.guarded``, and the admission's Lua call)."""

from __future__ import annotations

import logging
import os

import pytest

from services.intake.datasets import Row
from services.intake.publisher import run_intake
from services.trainer.consumer import TrainerConsumer
from services.trainer.process import TrainerProcess
from shared.names import RedisKeys, run_marker_key
from shared.state.run_marker import RedisDataLost, RunMarker, refuse_lost_run
from shared.settings import Settings
from shared.state.policy_version import PolicyVersion
from shared.state.staleness import StalenessBudget

from unit.test_groups import deliver_scored, register_groups
from unit.test_ledger import requests_for


@pytest.fixture
def settings(monkeypatch, run_id, tmp_path) -> Settings:
    for name in [n for n in os.environ if n.startswith("CONVEYOR_")]:
        monkeypatch.delenv(name)
    return Settings(run_id=run_id, rollout={"group_size": 2}, intake={"mode": "traversal", "env_name": "guess_number"},
                    trainer={"block_ms": 10, "metrics_path": tmp_path / "metrics.jsonl"})


def rows(n: int) -> list[Row]:
    return [Row(f"mem:{i}", {"id": f"task-{i}", "low": 1, "high": 20, "target": i + 1}) for i in range(n)]


def test_registering_trajectories_records_the_runs_marker(ledger, run_id):
    ledger.register(requests_for(run_id))
    assert ledger.redis.exists(RedisKeys.run_marker(run_id))


def test_a_run_intake_opened_is_not_refilled_after_redis_lost_it(ledger, run_id):
    RunMarker(ledger.redis, run_id).open()
    ledger.register(requests_for(run_id, group_id=0), require_marker=True)
    ledger.redis.flushall()
    with pytest.raises(RedisDataLost, match=f"Redis lost its data: the marker of run {run_id} "):
        ledger.register(requests_for(run_id, group_id=1), require_marker=True)
    assert ledger.redis.keys(f"conveyor:{{{run_id}}}:*") == []  # refused in the same Lua call: nothing written


def test_intake_refuses_a_run_the_store_knows_and_redis_lost(settings, ledger, redis_client, store, run_id):
    published = []
    report = run_intake(settings, rows(3), redis_client, published.append, store=store)
    assert report.groups == 3 and store.get_bytes(run_marker_key(run_id))
    ledger.redis.flushall()  # Redis restarted without its data
    with pytest.raises(RedisDataLost) as lost:
        run_intake(settings, rows(3), redis_client, published.append, store=store)
    assert f"the object store holds it ({run_marker_key(run_id)})" in str(lost.value)
    assert len(published) == 3 and ledger.redis.keys(f"conveyor:{{{run_id}}}:*") == []


def test_a_marker_seen_and_then_gone_is_a_loss_and_one_never_seen_is_not(ledger, store, run_id):
    fresh = RunMarker(ledger.redis, run_id, store)
    fresh.check("stops", look_in_store=True)  # a run that has not started: nothing to say
    RunMarker(ledger.redis, run_id, store).open()
    fresh.check("stops")
    ledger.redis.flushall()
    with pytest.raises(RedisDataLost, match="this service saw it earlier; .* so this service stops"):
        fresh.check("stops")
    with pytest.raises(RedisDataLost, match="the object store holds it"):
        RunMarker(ledger.redis, run_id, store).check("stops", look_in_store=True)


def test_workers_refuse_a_lost_runs_tasks_saying_so_once(ledger, run_id, caplog):
    ledger.register(requests_for(run_id))
    assert not refuse_lost_run(ledger.redis, run_id)
    ledger.redis.flushall()
    caplog.set_level(logging.ERROR)
    assert refuse_lost_run(ledger.redis, run_id) and refuse_lost_run(ledger.redis, run_id)
    [line] = [r.getMessage() for r in caplog.records if r.name == "shared.state.run_marker"]
    assert line.startswith(f"Redis lost its data: the marker of run {run_id} ") and "refuses the run's tasks" in line


def test_the_trainer_stops_rather_than_go_on_with_an_empty_ledger(settings, ledger, redis_client, store, run_id):
    run_intake(settings, rows(2), redis_client, lambda _requests: None, store=store)
    consumer = TrainerConsumer(settings, redis_client, store)
    assert consumer.poll(block_ms=10) == 0
    ledger.redis.flushall()
    with pytest.raises(RedisDataLost, match=f"marker of run {run_id} .* this service stops"):
        TrainerProcess(consumer).run()
    with pytest.raises(RedisDataLost, match="the object store holds it"):  # a trainer started afterwards
        TrainerConsumer(settings, redis_client, store)
    assert not ledger.redis.exists(RedisKeys.trainer_stream(run_id))  # it recreated nothing


def test_a_group_completed_as_redis_loses_the_run_is_not_written_into_the_empty_redis(settings, ledger, redis_client, store, run_id, monkeypatch):
    [requests] = register_groups(settings, redis_client, 1).values()
    consumer = TrainerConsumer(settings, redis_client, store)
    for reward, request in enumerate(requests):
        deliver_scored(ledger, store, request, float(reward))
    log_metrics = consumer._log_metrics

    def lose_the_data_first(*args, **kwargs):  # between the group's reads and its final transaction
        ledger.redis.flushall()
        return log_metrics(*args, **kwargs)

    monkeypatch.setattr(consumer, "_log_metrics", lose_the_data_first)
    with pytest.raises(RedisDataLost):
        consumer.poll(block_ms=10)
    assert ledger.redis.keys(f"conveyor:{{{run_id}}}:*") == []  # no done mark, queue entry or counter


def test_an_event_read_as_redis_loses_the_run_is_not_counted_into_the_empty_redis(settings, ledger, redis_client, store, run_id, monkeypatch):
    [requests] = register_groups(settings, redis_client, 1).values()
    consumer = TrainerConsumer(settings, redis_client, store)
    deliver_scored(ledger, store, requests[0], 1.0)
    read = consumer._read

    def lose_the_data_after_the_read(*args, **kwargs):  # the read's reply in hand, its group's registration gone
        entries = read(*args, **kwargs)
        ledger.redis.flushall()
        return entries

    monkeypatch.setattr(consumer, "_read", lose_the_data_after_the_read)
    with pytest.raises(RedisDataLost, match=f"marker of run {run_id} .* this service stops"):
        consumer.poll(block_ms=10)  # the event's group is unknown now: a loss, not a bad event to count
    assert ledger.redis.keys(f"conveyor:{{{run_id}}}:*") == []


def test_a_guarded_write_is_refused_when_the_marker_goes_before_it_commits(ledger, redis_client, store, run_id):
    marker = RunMarker(redis_client, run_id, store)
    counts = f"conveyor:{{{run_id}}}:trainer"
    assert marker.guarded(lambda tx: tx.hincrby(counts, "n", 1), "stops") == [1]  # a run not yet opened: written
    marker.open()
    assert marker.guarded(lambda tx: tx.hincrby(counts, "n", 1), "stops") == [2]

    def lose_the_data_while_queued(tx):  # the marker goes between the watch and the commit
        ledger.redis.flushall()
        tx.hincrby(counts, "n", 1)

    with pytest.raises(RedisDataLost, match="this service saw it earlier; .* so this service stops"):
        marker.guarded(lose_the_data_while_queued, "stops")
    with pytest.raises(RedisDataLost, match="the object store holds it"):  # a writer that never saw the marker
        RunMarker(redis_client, run_id, store).guarded(lambda tx: tx.hincrby(counts, "n", 1), "stops")
    assert ledger.redis.keys(f"conveyor:{{{run_id}}}:*") == []


def test_intake_going_on_as_redis_loses_the_run_writes_nothing_more_of_it(settings, ledger, redis_client, store, run_id):
    published = []

    def publish_then_lose_the_data(requests):  # Redis restarts empty right after a group went out
        published.append(requests)
        redis_client.flushall()

    with pytest.raises(RedisDataLost, match=f"marker of run {run_id} .* this service registers nothing more of it"):
        run_intake(settings, rows(3), redis_client, publish_then_lose_the_data, store=store)
    assert len(published) == 1  # the group's publication is not marked, and no later group is admitted or registered
    assert ledger.redis.keys(f"conveyor:{{{run_id}}}:*") == []


def test_the_runs_scripts_write_nothing_into_a_redis_that_lost_the_run(redis_client, store, run_id):
    budget, served = StalenessBudget(redis_client, run_id, 0, 1), PolicyVersion(redis_client, run_id)
    marker = RunMarker(redis_client, run_id, store)
    assert budget.advance_step(1, marker) == 1  # a run not opened yet (a trainer before intake): written
    marker.open()
    assert budget.admit_for(marker) == 0 and served.advance(1, marker)
    redis_client.flushall()
    for write in (lambda: budget.admit_for(marker), lambda: budget.advance_step(2, marker),
                  lambda: served.advance(2, marker, "stops"),
                  lambda: budget.admit_for(RunMarker(redis_client, run_id, store))):  # one that never saw it: the store did
        with pytest.raises(RedisDataLost, match=f"the marker of run {run_id} "):
            write()
    assert redis_client.keys(f"conveyor:{{{run_id}}}:*") == []
