"""Durable checkpoints on the broadcast path (``services.trainer.broadcast_publish``): which versions
are written, what happens when the writer is still busy, what is written at shutdown, and how a
restart replays the versions served beyond the newest checkpoint. Real Redis, a real local store
and the tiny model; the replicas are a stand-in that records what it was sent (the broadcast
into a real vLLM is ``tests/test_weight_broadcast.py``)."""

from __future__ import annotations

import threading

import pytest
import torch

from services.weights.sync import SyncReport
from services.trainer.checkpoints import download_checkpoint, latest_checkpoint
from services.trainer.loop import TrainingLoop
from services.trainer.metrics import MetricsSink
from services.policy.model import load_policy
from services.trainer.broadcast_publish import BroadcastPublisher
from shared.names import RedisKeys, checkpoints_of_run
from shared.state.policy_version import PolicyVersion
from shared.schemas import CheckpointAnnouncement, parse_message
from shared.settings import Settings
from shared.state.staleness import StalenessBudget
from shared.storage import LocalStore
from test_training_loop import queue_group
from synthetic_logprobs import SYNTHETIC_LOGPROBS


class ReplicasStandIn:
    """Takes a broadcast as a replica would: records a copy of the weights and serves them."""

    def __init__(self) -> None:
        self.served: dict[int, dict[str, torch.Tensor]] = {}

    def sync(self, named_tensors, version, *, probe=None, on_served=None) -> SyncReport:
        self.served[version] = {name: t.detach().clone() for name, t in named_tensors}
        if on_served is not None:
            on_served()
        return SyncReport(version, ("stand-in",), 0.0, 0.0, 0.0, 0.0, 0.0)

    def close(self) -> None:
        pass


class GatedStore(LocalStore):
    """A local store whose writes wait at a gate while it is closed (``started`` tells one is waiting)."""

    def __init__(self, root):
        super().__init__(root)
        self.gate, self.started = threading.Event(), threading.Event()
        self.gate.set()

    def put_bytes(self, key, data, content_type="application/gzip"):
        self.started.set()
        assert self.gate.wait(timeout=60), "the test never opened the gate"
        super().put_bytes(key, data, content_type)


def _committed(store, run_id) -> list[int]:
    base = checkpoints_of_run(run_id)
    return sorted(int(k[len(base):].split("/")[0]) for k in store.list_keys(base) if k.endswith("/COMMITTED"))


def _nccl_settings(run_id, redis_url, tiny_dir, tmp_path, every) -> Settings:
    return Settings(run_id=run_id, redis={"url": redis_url},
                    inference={"model_path": tiny_dir, "weight_sync": "nccl", "weight_sync_checkpoint_every": every},
                    trainer={"max_off_policy_steps": 1, "groups_per_step": 2, "optim": {"lr": 1e-3},
                             "logprob_alarm": SYNTHETIC_LOGPROBS.model_dump(),  # make_batch's logprobs are synthetic
                             "reward_curve_path": tmp_path / "curve.png"})


def test_every_nth_version_is_written_a_busy_writer_defers_to_the_newest_and_close_writes_the_last(
        tiny_dir, tmp_path, redis_client, redis_url, run_id):
    settings = _nccl_settings(run_id, redis_url, tiny_dir, tmp_path, every=2)
    store = GatedStore(tmp_path / "objects")
    model, tokenizer = load_policy(tiny_dir)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    replicas, announced, published = ReplicasStandIn(), [], {}
    publisher = BroadcastPublisher(settings, redis_client, store, broadcaster=replicas)

    def publish(version):
        with torch.no_grad():  # a training step: every version's weights differ
            for p in model.parameters():
                p.add_(0.01 * version)
        published[version] = {k: v.clone() for k, v in model.state_dict().items()}
        return publisher.publish(version, model, tokenizer, optimizer, version, ["d1"], announce=announced.append)

    assert publish(1)["checkpoint_queued"] == 0  # 1 version past the last durable (0): not due
    store.gate.clear()
    assert publish(2)["checkpoint_queued"] == 1
    assert store.started.wait(timeout=60)  # version 2 is being written and stays so until the gate opens
    three = publish(3)  # not due: 1 version past the one being written
    assert (three["checkpoint_queued"], three["checkpoint_deferred"]) == (0, 0)
    four = publish(4)  # due, but version 2 is still being written: not copied, not queued
    assert (four["checkpoint_queued"], four["checkpoint_deferred"]) == (0, 1)
    assert _committed(store, run_id) == [] and announced == []
    store.gate.set()
    publisher.wait()
    assert _committed(store, run_id) == [2] and announced == [2]
    five = publish(5)  # still due (3 past 2) and the writer is free: the newest version is written
    assert (five["checkpoint_queued"], five["checkpoint_deferred"]) == (1, 0)
    publish(6)  # not due; close writes it, as the last version published
    publisher.close()

    assert _committed(store, run_id) == [2, 5, 6] and announced == [2, 5, 6]
    assert sorted(replicas.served) == [1, 2, 3, 4, 5, 6] and PolicyVersion(redis_client, run_id).get() == 6
    for version in (2, 5, 6):  # each checkpoint holds what was broadcast as its version
        saved = load_policy(download_checkpoint(store, f"checkpoints/{run_id}/{version:06d}/", tmp_path / f"v{version}"))[0]
        for name, value in saved.state_dict().items():
            assert torch.equal(value, published[version][name]), (version, name)
            if name in replicas.served[version]:
                assert torch.equal(value, replicas.served[version][name]), (version, name)


def test_close_in_the_middle_of_a_step_writes_nothing_from_weights_that_may_have_moved(
        tiny_dir, tmp_path, redis_client, redis_url, run_id):
    settings = _nccl_settings(run_id, redis_url, tiny_dir, tmp_path, every=2)
    store = LocalStore(tmp_path / "objects")
    model, tokenizer = load_policy(tiny_dir)
    publisher = BroadcastPublisher(settings, redis_client, store, broadcaster=ReplicasStandIn())
    announced = []
    publisher.publish(1, model, tokenizer, torch.optim.SGD(model.parameters(), lr=0.1), 1, [], announce=announced.append)
    publisher.close(write_last=False)
    assert _committed(store, run_id) == [] and announced == []


def test_a_restart_replays_the_versions_served_past_the_newest_checkpoint_without_serving_them(
        tiny_dir, tmp_path, redis_client, redis_url, run_id, make_batch):
    """The trainer dies after serving versions 1 and 2 (every 3: neither written). The restarted
    one resumes at 0, trains 1 and 2 again on the same groups without broadcasting them (the
    replicas keep serving the first 2), and serves and writes 3: no label is served twice."""
    settings = _nccl_settings(run_id, redis_url, tiny_dir, tmp_path, every=3)
    store = LocalStore(tmp_path / "objects")
    budget = StalenessBudget(redis_client, run_id, 1, 2)
    for group_id in range(6):  # groups 4 and 5 generated under version 2, for step 3
        queue_group(redis_client, store, make_batch, run_id, group_id, 0 if group_id < 4 else 2)

    def make_loop(replicas) -> TrainingLoop:
        return TrainingLoop(settings, store, budget, MetricsSink(tmp_path / "steps.jsonl"), broadcaster=replicas)

    first_replicas = ReplicasStandIn()
    first = make_loop(first_replicas)
    assert [first.train_once()["replayed"] for _ in range(2)] == [0, 0]
    assert sorted(first_replicas.served) == [1, 2] and _committed(store, run_id) == []
    del first  # dies: never closed, nothing durable

    replicas = ReplicasStandIn()
    second = make_loop(replicas)
    assert second.version == 0 and second.publisher.served_at_start == 2
    replayed = []
    for _ in range(2):
        second.train_once()
        replayed.append({k: v.detach().clone() for k, v in second.trainer.model.named_parameters()})
    assert replicas.served == {} and PolicyVersion(redis_client, run_id).get() == 2
    for version, weights in zip((1, 2), replayed):  # the same groups trained again: the served weights
        for name, value in first_replicas.served[version].items():
            torch.testing.assert_close(weights[name], value, atol=1e-6, rtol=0)
    metrics = second.train_once()
    assert (metrics["replayed"], metrics["checkpoint_queued"]) == (0, 1)
    second.close()
    assert sorted(replicas.served) == [3] and PolicyVersion(redis_client, run_id).get() == 3
    assert latest_checkpoint(store, run_id) == (3, f"checkpoints/{run_id}/000003/")
    announced = [parse_message(CheckpointAnnouncement, f).version
                 for _, f in redis_client.xrange(RedisKeys.checkpoints(run_id))]
    assert announced == [3]
    assert int(redis_client.hget(RedisKeys.trainer_counters(run_id), "groups_trained")) == 6  # replays count once


@pytest.mark.parametrize("every", [0, -1])
def test_a_checkpoint_cadence_below_one_is_refused(every, tiny_dir, tmp_path, redis_url, run_id):
    with pytest.raises(ValueError, match="inference.weight_sync.nccl.checkpoint_every"):
        _nccl_settings(run_id, redis_url, tiny_dir, tmp_path, every)
