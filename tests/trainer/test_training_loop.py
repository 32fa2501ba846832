"""The training loop's queue discipline, against real Redis, a local object store and the tiny
model: which groups a step trains on, staleness at training time, and restart safety."""

from __future__ import annotations

import re

import pytest

import services.trainer.loop as loop_module
from services.trainer.checkpoints import latest_checkpoint
from services.trainer.loop import TrainingLoop
from services.trainer.metrics import MetricsSink, read_steps
from shared.names import RedisKeys
from shared.settings import DeltaWeightSync, Settings
from shared.state.run_marker import RedisDataLost, RunMarker
from shared.state.staleness import StalenessBudget
from shared.schemas import CheckpointAnnouncement, SkippedGroupEntry, TrainBatchEntry, TrainingBatch, TrainQueueEntry, parse_message
from shared.storage import LocalStore, get_model, put_model
from synthetic_logprobs import SYNTHETIC_LOGPROBS


@pytest.fixture
def setup(tiny_dir, tmp_path, redis_client, redis_url, run_id):
    settings = Settings(
        run_id=run_id, redis={"url": redis_url}, inference={"model_path": tiny_dir},
        trainer={"max_off_policy_steps": 1, "groups_per_step": 2, "optim": {"lr": 1e-3},
                 "logprob_alarm": SYNTHETIC_LOGPROBS.model_dump(),  # make_batch's logprobs are synthetic
                 "reward_curve_path": tmp_path / "curve.png"},
    )
    store = LocalStore(tmp_path / "objects")
    budget = StalenessBudget(redis_client, run_id, 1, 2)

    def make_loop() -> TrainingLoop:
        return TrainingLoop(settings, store, budget, MetricsSink(tmp_path / "steps.jsonl"))

    return settings, store, budget, make_loop


def queue_group(redis_client, store, make_batch, run_id, group_id, oldest_version, env=""):
    batch = make_batch(seed=group_id, group_id=group_id)
    batch = batch.model_copy(update={"samples": [s.model_copy(update={"oldest_policy_version": oldest_version}) for s in batch.samples]})
    key = f"batches/{run_id}/{group_id:06d}.json.gz"
    put_model(store, key, batch)
    entry = TrainBatchEntry(key=key, oldest_policy_version=oldest_version, group_id=group_id, env_name=env)
    redis_client.rpush(RedisKeys.train_queue(run_id), entry.model_dump_json())


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
    announced = [parse_message(CheckpointAnnouncement, f) for _, f in redis_client.xrange(RedisKeys.checkpoints(run_id))]
    assert [(a.version, a.prefix) for a in announced] == [(v, f"checkpoints/{run_id}/{v:06d}/") for v in (1, 2, 3)]


def test_a_restarted_trainer_resumes_at_its_checkpoint_and_counts_nothing_twice(setup, redis_client, make_batch, run_id):
    _, store, budget, make_loop = setup
    for group_id in range(4):
        queue_group(redis_client, store, make_batch, run_id, group_id, 0)
    first = make_loop()
    first.train_once()
    # the second step's selection is recorded, then the trainer dies before its checkpoint
    selection = first._select()
    first._record_selection(selection)
    del first
    second = make_loop()
    assert second.version == 1 and second.trainer.step == 1
    assert second._select() == selection  # the same groups, not the next ones
    second.train_once()
    counters = redis_client.hgetall(RedisKeys.trainer_counters(run_id))
    assert counters["groups_trained"] == "4"  # 2 + 2, not 2 + 2 + 2
    assert latest_checkpoint(store, run_id)[0] == 2


def test_a_trainer_dying_after_its_checkpoint_and_before_its_line_gets_the_line_back_on_restart(
        setup, redis_client, make_batch, run_id, monkeypatch):
    """Killed between the commit of step 2's checkpoint and step 2's metrics line, the restarted
    trainer resumes at version 2 (it does not train it again) and logs the line its checkpoint
    kept, once: one line per step."""
    _, store, _, make_loop = setup
    for group_id in range(4):
        queue_group(redis_client, store, make_batch, run_id, group_id, 0)
    first = make_loop()
    first.train_once()

    class Killed(BaseException):
        pass

    def die(*_args, **_kwargs):
        raise Killed

    monkeypatch.setattr(first.metrics, "log", die)  # SIGKILL right after the announcement
    with pytest.raises(Killed):
        first.train_once()
    assert latest_checkpoint(store, run_id)[0] == 2
    assert [int(s["step"]) for s in read_steps(first.metrics.jsonl_path)] == [1]
    second = make_loop()
    assert second.version == 2
    steps = read_steps(second.metrics.jsonl_path)
    assert [int(s["step"]) for s in steps] == [1, 2] and steps[1]["recovered"] == 1.0
    assert steps[1]["groups_trained"] == 2.0 and steps[1]["loss"] is not None and "checkpoint_s" not in steps[1]
    assert [int(s["step"]) for s in read_steps(make_loop().metrics.jsonl_path)] == [1, 2]  # again: nothing twice


def test_a_bad_queue_entry_is_passed_over_and_counted_once_across_restarts(setup, redis_client, make_batch, run_id, caplog):
    _, store, _, make_loop = setup
    queue_group(redis_client, store, make_batch, run_id, 0, 0)
    redis_client.rpush(RedisKeys.train_queue(run_id), '{"key": "batches/x", "group_id": 1}')  # no oldest_policy_version
    queue_group(redis_client, store, make_batch, run_id, 2, 0)
    first = make_loop()
    assert first.ready() and first.ready()
    assert caplog.text.count("train queue entry 1 passed over: bad train-queue entry: train.oldest_policy_version") == 1
    first._record_selection(first._select())
    del first  # dies before its checkpoint; the restarted trainer records the same selection again
    second = make_loop()
    second.train_once()
    counters = redis_client.hgetall(RedisKeys.trainer_counters(run_id))
    assert counters["bad_train_entries"] == "1" and counters["groups_trained"] == "2"


def queue_dropped(redis_client, run_id, group_id, rewards):
    """What the consumer queues for a zero-variance group it drops."""
    entry = SkippedGroupEntry(skip="zero_variance", group_id=group_id, rewards=rewards)
    redis_client.rpush(RedisKeys.train_queue(run_id), entry.model_dump_json())


@pytest.mark.parametrize("cap, trained, passed", [(None, [0, 3], 4), (0, [0], 2), (1, [0], 3), (2, [0, 3], 4)])
def test_dropped_groups_and_the_cap_on_extra_groups_a_step_waits_for(setup, redis_client, make_batch, run_id, cap, trained, passed):
    """Queue: fresh 0, dropped 1, dropped 2, fresh 3 (G = 2). A step waits for at most G + cap
    fresh entries (dropped ones included); with no cap it waits for G trainable groups."""
    settings, store, budget, _ = setup
    settings = settings.model_copy(update={"trainer": settings.trainer.model_copy(update={"max_extra_groups_per_step": cap})})
    loop = TrainingLoop(settings, store, budget, MetricsSink(store.root.parent / f"steps-{cap}.jsonl"))
    queue_group(redis_client, store, make_batch, run_id, 0, 0)
    queue_dropped(redis_client, run_id, 1, [1.0, 1.0, 1.0, 1.0])
    queue_dropped(redis_client, run_id, 2, [0.0, 0.0, 0.0, 0.0])
    queue_group(redis_client, store, make_batch, run_id, 3, 0)
    selection = loop._select()
    assert [int(k.rsplit("/", 1)[1].split(".")[0]) for k in selection.keys] == trained
    assert selection.cursor == passed and selection.dropped == passed - len(trained)
    metrics = loop.train_once()
    assert metrics["groups_trained"] == len(trained) and metrics["groups_dropped_zero_variance"] == passed - len(trained)
    # reward_mean covers every scored sample of the step's groups, the dropped ones included
    trained_rewards = [s.reward for k in selection.keys for s in get_model(store, k, TrainingBatch).samples]
    dropped_rewards = [1.0] * 4 + [0.0] * 4 if passed - len(trained) == 2 else [1.0] * 4 * (passed - len(trained))
    assert metrics["reward_mean"] == pytest.approx(sum(trained_rewards + dropped_rewards) / len(trained_rewards + dropped_rewards))


def test_mixing_defers_surplus_groups_to_the_queue_tail_once_and_a_restart_selects_the_same(setup, redis_client, make_batch, run_id):
    """G = 2 with at least half of each step from env b: of a, a, b the step trains on a and b;
    the second a goes back on the queue's tail in the selection's commit, once, and trains later."""
    settings, store, budget, _ = setup
    settings = settings.model_copy(update={"trainer": settings.trainer.model_copy(update={"min_env_share": {"b": 0.5}})})

    def make_loop() -> TrainingLoop:
        return TrainingLoop(settings, store, budget, MetricsSink(store.root.parent / "mix.jsonl"))

    for group_id, env in enumerate(["a", "a", "b"]):
        queue_group(redis_client, store, make_batch, run_id, group_id, 0, env=env)
    first = make_loop()
    selection = first._select()
    assert selection.envs == ["a", "b"] and len(selection.deferred) == 1
    first._record_selection(selection)
    del first  # dies before its checkpoint
    second = make_loop()
    assert second._select() == selection
    metrics = second.train_once()
    assert metrics["groups_env_a"] == 1 and metrics["groups_env_b"] == 1 and metrics["groups_deferred"] == 1
    queue = [parse_message(TrainQueueEntry, raw) for raw in redis_client.lrange(RedisKeys.train_queue(run_id), 0, -1)]
    assert [(e.group_id, e.env_name) for e in queue] == [(0, "a"), (1, "a"), (2, "b"), (1, "a")]  # appended once
    queue_group(redis_client, store, make_batch, run_id, 3, 1, env="b")
    trained = second._select()
    assert trained.keys == [queue[1].key, f"batches/{run_id}/000003.json.gz"]  # the deferred group, then the new b


def test_a_steps_log_line_says_a_rate_with_no_interval_is_unknown_never_nan(setup, redis_client, make_batch, run_id, caplog):
    """Step 1 has no step before it: its time since the last step and its trajectories/s are
    unknown ("-"); step 2 has both."""
    _, store, _, make_loop = setup
    for group_id in range(4):
        queue_group(redis_client, store, make_batch, run_id, group_id, 0)
    loop = make_loop()
    caplog.set_level("INFO", logger="services.trainer.loop")
    loop.train_once()
    loop.train_once()
    lines = {int(r.getMessage().split(":")[0].removeprefix("step ")): r.getMessage()
             for r in caplog.records if r.getMessage().startswith("step ")}
    assert "nan" not in lines[1].lower() and "- since the last step, - trajectories/s" in lines[1], lines[1]
    assert re.search(r"\d+\.\ds since the last step, \d+\.\d trajectories/s", lines[2]), lines[2]


@pytest.mark.parametrize("encode_on", ["host", "device"])
def test_on_delta_each_version_goes_to_the_chain_after_its_checkpoint_and_a_restart_writes_a_full_one(
        setup, redis_client, make_batch, run_id, tmp_path, encode_on):
    """``inference.weight_sync: delta``: the chain holds exactly each checkpoint's served tensors,
    the announcements name the chain, and a restarted trainer (no previous tensors) starts full;
    with the encode on the model's device too (the CPU here: the same chain)."""
    import shutil

    from safetensors.torch import load as load_safetensors

    from services.weights.delta import tensor_checksum
    from services.weights.delta_chain import ChainReader
    from shared.names import checkpoint_prefix, weight_chain_prefix

    settings, store, budget, _ = setup
    settings = settings.model_copy(update={"inference": settings.inference.model_copy(update={
        "weight_sync": DeltaWeightSync(encoding="xor", delta_max_fraction=1.0, encode_on=encode_on)})})

    def make_loop() -> TrainingLoop:
        return TrainingLoop(settings, store, budget, MetricsSink(tmp_path / "delta-steps.jsonl"))

    for group_id in range(6):
        queue_group(redis_client, store, make_batch, run_id, group_id, 0 if group_id < 4 else 1)
    first = make_loop()
    first.train_once()
    metrics = first.train_once()
    assert metrics["delta_full"] == 0.0 and 0 < metrics["delta_bytes"] < metrics["delta_full_size"]
    del first
    second = make_loop()  # restarted at version 2: it announces 2 again, and version 3 is full
    second.train_once()
    reader = ChainReader(store, run_id)
    assert [(m.kind, m.base) for m in (reader.manifest(v) for v in (1, 2, 3))] == [("full", None), ("delta", 1), ("full", None)]
    announced = [parse_message(CheckpointAnnouncement, f) for _, f in redis_client.xrange(RedisKeys.checkpoints(run_id))]
    assert [(a.version, a.prefix) for a in announced] == [(v, weight_chain_prefix(run_id, v)) for v in (1, 2, 2, 3)]
    # a trainer that died after checkpoint 3 and before chain version 3 announces the checkpoint
    shutil.rmtree(store.root / weight_chain_prefix(run_id, 3))
    make_loop()
    assert parse_message(CheckpointAnnouncement, redis_client.xrevrange(RedisKeys.checkpoints(run_id), count=1)[0][1]).prefix \
        == checkpoint_prefix(run_id, 3)
    checkpoint = load_safetensors(store.get_bytes(checkpoint_prefix(run_id, 2) + "model.safetensors"))
    chain = {e.name: e.checksum for e in reader.manifest(2).tensors}
    assert checkpoint and set(checkpoint) <= set(chain)
    assert {name: tensor_checksum(t) for name, t in checkpoint.items()} == {n: c for n, c in chain.items() if n in checkpoint}


def test_a_step_under_way_when_redis_loses_the_run_writes_nothing_into_the_empty_redis(setup, redis_client, make_batch, run_id,
                                                                                      monkeypatch):
    settings, store, budget, make_loop = setup
    RunMarker(redis_client, run_id, store).open()  # as intake does
    loop = make_loop()
    for group_id in (0, 1):
        queue_group(redis_client, store, make_batch, run_id, group_id, 0)
    assert loop.ready()
    train = loop_module.train_version

    def lose_the_data_while_training(*args, **kwargs):  # Redis restarts empty while the step trains
        redis_client.flushall()
        return train(*args, **kwargs)

    monkeypatch.setattr(loop_module, "train_version", lose_the_data_while_training)
    with pytest.raises(RedisDataLost, match=f"marker of run {run_id} .* this service stops rather than train on it"):
        loop.train_once()  # its announcement, step and metrics are refused
    assert redis_client.keys(f"conveyor:{{{run_id}}}:*") == []
