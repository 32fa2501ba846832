"""The training loop's queue discipline, against real Redis, a local object store and the tiny
model: which groups a step trains on, staleness at training time, and restart safety."""

from __future__ import annotations

import json

import pytest

from services.trainer.checkpoints import latest_checkpoint
from services.trainer.loop import TrainingLoop
from services.trainer.metrics import MetricsSink, read_steps
from shared.names import RedisKeys
from shared.settings import Settings
from shared.staleness import StalenessBudget
from shared.storage import LocalStore, put_model


@pytest.fixture
def setup(tiny_dir, tmp_path, redis_client, redis_url, run_id):
    settings = Settings(
        run_id=run_id, redis={"url": redis_url}, inference={"model_path": tiny_dir},
        trainer={"max_off_policy_steps": 1, "groups_per_step": 2, "optim": {"lr": 1e-3},
                 "reward_curve_path": tmp_path / "curve.png"},
    )
    store = LocalStore(tmp_path / "objects")
    budget = StalenessBudget(redis_client, run_id, 1, 2)

    def make_loop() -> TrainingLoop:
        return TrainingLoop(settings, store, budget, MetricsSink(tmp_path / "steps.jsonl"))

    return settings, store, budget, make_loop


def queue_group(redis_client, store, make_batch, run_id, group_id, oldest_version):
    batch = make_batch(seed=group_id, group_id=group_id)
    batch = batch.model_copy(update={"samples": [s.model_copy(update={"oldest_policy_version": oldest_version}) for s in batch.samples]})
    key = f"batches/{run_id}/{group_id:06d}.json.gz"
    put_model(store, key, batch)
    redis_client.rpush(RedisKeys.train_queue(run_id), json.dumps({"key": key, "oldest_policy_version": oldest_version, "group_id": group_id}))


def test_steps_take_groups_in_order_and_skip_groups_that_became_stale(setup, redis_client, make_batch, run_id):
    settings, store, budget, make_loop = setup
    loop = make_loop()
    assert not loop.ready()
    queue_group(redis_client, store, make_batch, run_id, 0, 0)
    assert not loop.ready()  # one group of the two a step needs
    queue_group(redis_client, store, make_batch, run_id, 1, 0)
    assert loop.ready()
    loop.train_once()  # step 1 on groups 0 and 1
    queue_group(redis_client, store, make_batch, run_id, 2, 1)
    queue_group(redis_client, store, make_batch, run_id, 3, 1)
    loop.train_once()  # step 2 on groups 2 and 3 (1 behind: allowed)
    queue_group(redis_client, store, make_batch, run_id, 4, 0)  # 2 behind version 2: stale
    queue_group(redis_client, store, make_batch, run_id, 5, 2)
    assert not loop.ready()  # only one fresh group
    queue_group(redis_client, store, make_batch, run_id, 6, 1)
    metrics = loop.train_once()  # step 3 on groups 5 and 6; group 4 skipped as stale
    assert metrics["staleness_0"] + metrics["staleness_1"] == 8 and "staleness_2" not in metrics
    counters = redis_client.hgetall(RedisKeys.trainer_counters(run_id))
    assert counters["groups_stale"] == "1" and counters["groups_trained"] == "6"
    assert budget.state().filtered == 1 and budget.state().trainer_step == 3
    assert latest_checkpoint(store, run_id)[0] == 3
    assert [int(s["step"]) for s in read_steps(loop.metrics.jsonl_path)] == [1, 2, 3]
    announced = [int(f["version"]) for _, f in redis_client.xrange(RedisKeys.checkpoints(run_id))]
    assert announced == [1, 2, 3]


def test_a_restarted_trainer_resumes_at_its_checkpoint_and_counts_nothing_twice(setup, redis_client, make_batch, run_id):
    _, store, budget, make_loop = setup
    for group_id in range(4):
        queue_group(redis_client, store, make_batch, run_id, group_id, 0)
    first = make_loop()
    first.train_once()
    # the second step's selection is recorded, then the trainer dies before its checkpoint
    selection = first._select()
    first._record_selection(selection[1], selection[2])
    del first
    second = make_loop()
    assert second.version == 1 and second.trainer.step == 1
    assert second._select() == selection  # the same groups, not the next ones
    second.train_once()
    counters = redis_client.hgetall(RedisKeys.trainer_counters(run_id))
    assert counters["groups_trained"] == "4"  # 2 + 2, not 2 + 2 + 2
    assert latest_checkpoint(store, run_id)[0] == 2
