"""GRPO group assembly, and the trainer consumer end to end against real Redis + LocalStore."""

from __future__ import annotations

import gzip
import json
import os
import time

import pytest
import redis
from pydantic import TypeAdapter

from services.intake.datasets import Row
from services.intake.publisher import run_intake
from services.trainer.advantages import group_advantages
from services.trainer.batch_handoff import BatchHandoff
from services.trainer.consumer import STREAM_READERS, TrainerConsumer
from services.trainer.groups import GroupAssembler
from services.trainer.process import TrainerProcess
from shared.state.dead_letters import DeadLetters
from shared.state.ledger import Ledger, redis_for
from shared.names import RedisKeys, batch_key, group_record_key, scored_key, trajectory_key
from shared.schemas import (
    GroupRecord,
    RolloutRequest,
    ScoredTrajectory,
    StopReason,
    FailedEvent,
    ScoredEvent,
    SkippedGroupEntry,
    TrainBatchEntry,
    TrainerEvent,
    TrainQueueEntry,
    parse_message,
    TrainingBatch,
    Trajectory,
    Turn,
)
from shared.settings import Settings
from shared.settings.group_filters import GroupFilterSpec
from shared.storage import LocalStore, get_model, put_model

# --- GroupAssembler -----------------------------------------------------------------------


ON_BOTH_TOPOLOGIES = True  # each test using redis_client runs on the standalone Redis and a Redis Cluster


def ev(group_id: int, episode: int, kind: str = "scored", reward: float = 1.0) -> TrainerEvent:
    tid = f"r_{group_id}_{episode}_{group_id + episode}"
    if kind == "scored":
        return ScoredEvent(trajectory_id=tid, run_id="r", group_id=group_id, reward=reward, scored_key="k", at=0.0)
    return FailedEvent(trajectory_id=tid, run_id="r", group_id=group_id, failure_reason="env_error", at=0.0)


class Done:
    """A stand-in for the consumer's groups_done set."""

    def __init__(self):
        self.ids: set[int] = set()

    def __call__(self, group_id: int) -> bool:
        return group_id in self.ids


def test_group_completes_when_all_members_are_terminal():
    done = Done()
    asm = GroupAssembler(lambda g: 3, done)
    assert asm.add(ev(0, 0, reward=0.0), "1-0") == ("added", None)
    assert asm.add(ev(1, 0), "1-1") == ("added", None)  # other groups are independent
    assert asm.add(ev(0, 1, reward=1.0), "1-2") == ("added", None)
    outcome, group = asm.add(ev(0, 2, reward=0.5), "1-3")
    assert outcome == "added" and group is not None
    assert group.group_id == 0 and group.expected_size == 3
    assert [e.reward for e in group.scored] == [0.0, 1.0, 0.5]
    assert group.failed == []
    assert group.entry_ids == ["1-0", "1-2", "1-3"]
    assert 0 not in asm.pending and 1 in asm.pending


def test_failed_member_counts_as_terminal():
    asm = GroupAssembler(lambda g: 2, Done())
    asm.add(ev(0, 0, reward=1.0), "1-0")
    outcome, group = asm.add(ev(0, 1, kind="failed"), "1-1")
    assert outcome == "added" and group is not None
    assert [e.trajectory_id for e in group.scored] == ["r_0_0_0"]
    assert [e.trajectory_id for e in group.failed] == ["r_0_1_1"]


def test_all_failed_group_completes():
    asm = GroupAssembler(lambda g: 2, Done())
    asm.add(ev(0, 0, kind="failed"), "1-0")
    _, group = asm.add(ev(0, 1, kind="failed"), "1-1")
    assert group is not None and group.scored == [] and len(group.failed) == 2


def test_duplicate_delivery_is_ignored_but_its_entry_is_kept_for_ack():
    asm = GroupAssembler(lambda g: 2, Done())
    asm.add(ev(0, 0, reward=1.0), "1-0")
    # a redelivery, even with a different payload, does not replace the decided member
    assert asm.add(ev(0, 0, reward=0.0), "1-1") == ("duplicate", None)
    assert asm.add(ev(0, 0, kind="failed"), "1-2") == ("duplicate", None)
    outcome, group = asm.add(ev(0, 1, reward=0.0), "1-3")
    assert outcome == "added" and group is not None
    assert [e.reward for e in group.scored] == [1.0, 0.0]
    assert group.entry_ids == ["1-0", "1-1", "1-2", "1-3"]


def test_late_member_after_completion_is_reported_late():
    done = Done()
    asm = GroupAssembler(lambda g: 1, done)
    _, group = asm.add(ev(0, 0), "1-0")
    assert group is not None
    done.ids.add(0)  # the consumer marks the group done
    assert asm.add(ev(0, 1), "1-1") == ("late", None)
    assert asm.add(ev(0, 0), "1-2") == ("late", None)
    assert 0 not in asm.pending


def test_zero_variance_group_is_detected_from_its_rewards():
    asm = GroupAssembler(lambda g: 3, Done())
    for i in range(2):
        asm.add(ev(0, i, reward=0.5), f"1-{i}")
    _, group = asm.add(ev(0, 2, reward=0.5), "1-2")
    assert group_advantages([e.reward for e in group.scored]).zero_variance


# --- TrainerConsumer integration ----------------------------------------------------------

GROUP_SIZE = 4


@pytest.fixture
def clean_env(monkeypatch):
    for name in list(os.environ):
        if name.startswith("CONVEYOR_"):
            monkeypatch.delenv(name)


@pytest.fixture
def settings(clean_env, run_id, tmp_path) -> Settings:
    return Settings(
        run_id=run_id,
        rollout={"group_size": GROUP_SIZE},
        intake={"mode": "traversal", "env_name": "guess_number", "base_seed": 100},
        trainer={"consumer_name": "trainer-x", "block_ms": 10, "metrics_path": tmp_path / "metrics.jsonl"},
    )


def register_groups(settings: Settings, client: redis.Redis, num_groups: int) -> dict[int, list[RolloutRequest]]:
    rows = [Row(f"mem:{i}", {"id": f"task-{i}", "low": 1, "high": 20, "target": i + 1}) for i in range(num_groups)]
    published: list[list[RolloutRequest]] = []
    report = run_intake(settings, rows, client, published.append)
    assert report.groups == num_groups and not report.rejected
    return {reqs[0].group_id: reqs for reqs in published}


def trajectory_for(req: RolloutRequest) -> Trajectory:
    i = req.episode_index
    turns = [
        Turn(index=0, prompt_token_ids=[1, 2, 3], sampled_token_ids=[100 + i, 101], logprobs=[-0.5, -0.25],
             policy_version=3, finish_reason="stop", completion_text="a", observation="higher"),
        Turn(index=1, prompt_token_ids=[7] * (i + 1), sampled_token_ids=[200 + i], logprobs=[-1.0 - i],
             policy_version=2 + i, finish_reason="stop", completion_text="b"),
    ]
    return Trajectory(request=req, turns=turns, stop_reason=StopReason.done, env_reward=None)


def deliver_scored(ledger: Ledger, store: LocalStore, req: RolloutRequest, reward: float, schema_1_0: bool = True) -> None:
    """What a rollout worker and the scorer do for one trajectory. A 1.0 event names only the
    ScoredTrajectory; a 1.1 event also names the Trajectory, and here no ScoredTrajectory is
    written, so a reader that still read it would fail."""
    tid = req.trajectory_id
    assert ledger.claim(tid, f"tok-{tid}", 30)[0]
    t_key = trajectory_key(req.run_id, req.group_id, tid)
    put_model(store, t_key, trajectory_for(req))
    assert ledger.mark_uploaded(tid, f"tok-{tid}").ok
    s_key = scored_key(req.run_id, req.group_id, tid)
    if schema_1_0:
        put_model(store, s_key, ScoredTrajectory(
            trajectory_id=tid, run_id=req.run_id, group_id=req.group_id, trajectory_key=t_key, reward=reward,
            components=[], stop_reason=StopReason.done, scored_at=time.time(),
        ))
        event = ScoredEvent(trajectory_id=tid, run_id=req.run_id, group_id=req.group_id,
                            reward=reward, scored_key=s_key, at=time.time())
    else:
        event = ScoredEvent(trajectory_id=tid, run_id=req.run_id, group_id=req.group_id, reward=reward, scored_key=s_key,
                            at=time.time(), trajectory_key=t_key, stop_reason=StopReason.done)
    assert ledger.mark_scored(tid, event).ok


def metrics_lines(settings: Settings) -> list[dict]:
    """The metrics file's whole lines (a line cut short by a crash is not one)."""
    lines = []
    for raw in settings.trainer.metrics_path.read_text().splitlines():
        try:
            lines.append(json.loads(raw))
        except ValueError:
            continue
    return lines


def drain(consumer: TrainerConsumer) -> int:
    total = 0
    while (n := consumer.poll(block_ms=10)):
        total += n
    return total


def pending_count(redis_client, run_id: str) -> int:
    return redis_client.xpending(RedisKeys.trainer_stream(run_id), STREAM_READERS)["pending"]


@pytest.mark.parametrize("schema_1_0", [True, False], ids=["events of schema 1.0", "events naming the trajectory"])
def test_consumer_trains_a_group_with_correct_advantages_and_masks(settings, ledger, store, redis_client, run_id, schema_1_0):
    groups = register_groups(settings, redis_client, 1)
    reqs = groups[0]
    consumer = TrainerConsumer(settings, redis_client, store)
    rewards = [0.0, 1.0, 1.0, 0.5]
    for req, reward in zip(reqs[:3], rewards[:3]):
        deliver_scored(ledger, store, req, reward, schema_1_0)
    assert drain(consumer) == 3
    assert store.list_keys("batches/") == []
    assert redis_client.smembers(RedisKeys.groups_done(run_id)) == set()
    assert pending_count(redis_client, run_id) == 3  # not acknowledged before the group is handled

    deliver_scored(ledger, store, reqs[3], rewards[3], schema_1_0)
    assert (store.list_keys("scored/") != []) is schema_1_0  # a 1.1 event's group is trained with no ScoredTrajectory read
    assert drain(consumer) == 1

    batch = get_model(store, batch_key(run_id, 0), TrainingBatch)
    assert batch.run_id == run_id and batch.group_id == 0
    assert [s.trajectory_id for s in batch.samples] == [r.trajectory_id for r in reqs]
    expected = group_advantages(rewards, settings.trainer.advantage_eps).advantages
    assert [s.advantage for s in batch.samples] == pytest.approx(expected)
    # hand check: mean .625, population std sqrt(.171875)
    std = (sum((r - 0.625) ** 2 for r in rewards) / 4) ** 0.5
    assert batch.samples[1].advantage == pytest.approx(0.375 / (std + 1e-6))
    for sample, req, reward in zip(batch.samples, reqs, rewards):
        flat = trajectory_for(req).flatten()
        assert sample.token_ids == flat.token_ids
        assert sample.loss_mask == flat.loss_mask
        assert sample.inference_logprobs == flat.inference_logprobs
        assert [t for t, m in zip(sample.token_ids, sample.loss_mask) if m] == [100 + req.episode_index, 101, 200 + req.episode_index]
        assert sample.reward == reward
        assert sample.oldest_policy_version == min(3, 2 + req.episode_index)
        assert sample.stop_reason is StopReason.done

    record = get_model(store, group_record_key(run_id, 0), GroupRecord)
    assert record.status == "accepted" and record.batch_key == batch_key(run_id, 0)
    assert record.expected_size == GROUP_SIZE and len(record.members) == GROUP_SIZE
    assert record.reward_mean == pytest.approx(0.625) and record.reward_std == pytest.approx(std)

    assert {ledger.state(r.trajectory_id) for r in reqs} == {"consumed"}
    assert ledger.counts(run_id)["consumed"] == GROUP_SIZE
    assert redis_client.smembers(RedisKeys.groups_done(run_id)) == {"0"}
    assert consumer.counters() == {"groups_accepted": 1}
    assert pending_count(redis_client, run_id) == 0
    lines = [json.loads(line) for line in (settings.trainer.metrics_path).read_text().splitlines()]
    assert [(m["group_id"], m["status"], m["scored"], m["failed"]) for m in lines] == [(0, "accepted", 4, 0)]

    redis_client.set(RedisKeys.intake_done(run_id), "1")
    assert consumer.finished()


def test_batch_object_is_gzip_json(settings, ledger, redis_client, store, run_id):
    groups = register_groups(settings, redis_client, 1)
    consumer = TrainerConsumer(settings, redis_client, store)
    for req, reward in zip(groups[0], [0, 1, 0, 1]):
        deliver_scored(ledger, store, req, reward)
    drain(consumer)
    raw = json.loads(gzip.decompress(store.get_bytes(batch_key(run_id, 0))))
    assert raw["group_id"] == 0 and len(raw["samples"]) == GROUP_SIZE


def test_zero_variance_group_is_dropped_and_counted(settings, ledger, store, redis_client, run_id):
    groups = register_groups(settings, redis_client, 2)
    consumer = TrainerConsumer(settings, redis_client, store)
    for req in groups[0]:
        deliver_scored(ledger, store, req, 0.5)
    for req, reward in zip(groups[1], [1, 0, 0, 0]):
        deliver_scored(ledger, store, req, reward)
    assert drain(consumer) == 2 * GROUP_SIZE
    assert store.list_keys("batches/") == [batch_key(run_id, 1)]
    record = get_model(store, group_record_key(run_id, 0), GroupRecord)
    assert record.status == "zero_variance" and record.batch_key is None
    assert all(m.advantage == pytest.approx(0.0) for m in record.members)
    # dropped, but its members still reached the trainer exactly once
    assert {ledger.state(r.trajectory_id) for r in groups[0]} == {"consumed"}
    assert consumer.counters() == {"groups_zero_variance": 1, "groups_accepted": 1}
    assert redis_client.smembers(RedisKeys.groups_done(run_id)) == {"0", "1"}
    assert pending_count(redis_client, run_id) == 0
    # the dropped group is on the train queue as a skip entry, so a step can count it
    queue = [parse_message(TrainQueueEntry, e) for e in redis_client.lrange(RedisKeys.train_queue(run_id), 0, -1)]
    assert SkippedGroupEntry(skip="zero_variance", group_id=0, rewards=[0.5] * GROUP_SIZE) in queue
    assert TrainBatchEntry(key=batch_key(run_id, 1), oldest_policy_version=2, group_id=1, env_name="guess_number") in queue


def test_zero_variance_group_is_kept_with_zero_advantages_when_configured(settings, ledger, store, redis_client, run_id):
    settings = settings.model_copy(update={"trainer": settings.trainer.model_copy(update={"zero_variance_groups": "keep"})})
    groups = register_groups(settings, redis_client, 1)
    consumer = TrainerConsumer(settings, redis_client, store)
    for req in groups[0]:
        deliver_scored(ledger, store, req, 0.1)  # 0.1 * 4 / 4 != 0.1 in floats: advantages must still be 0
    drain(consumer)
    record = get_model(store, group_record_key(run_id, 0), GroupRecord)
    assert record.status == "accepted" and record.batch_key == batch_key(run_id, 0)
    batch = get_model(store, record.batch_key, TrainingBatch)
    assert [s.advantage for s in batch.samples] == [0.0] * GROUP_SIZE  # exactly: their tokens count, no push
    assert consumer.counters() == {"groups_accepted": 1, "groups_zero_variance_kept": 1}


def test_bessel_std_changes_the_advantages_as_trl_computes_them(settings, ledger, redis_client, store, run_id):
    settings = settings.model_copy(update={"trainer": settings.trainer.model_copy(update={"advantage_std": "bessel"})})
    groups = register_groups(settings, redis_client, 1)
    consumer = TrainerConsumer(settings, redis_client, store)
    for req, reward in zip(groups[0], [0.0, 0.0, 1.0, 1.0]):
        deliver_scored(ledger, store, req, reward)
    drain(consumer)
    record = get_model(store, group_record_key(run_id, 0), GroupRecord)
    # mean 0.5, Bessel std sqrt(1/3) = 0.57735: advantages -+0.866
    assert record.reward_std == pytest.approx(0.5773503)
    assert sorted(m.advantage for m in record.members) == pytest.approx([-0.8660254] * 2 + [0.8660254] * 2, abs=1e-5)


def test_failed_member_completes_the_group(settings, ledger, store, redis_client, run_id):
    groups = register_groups(settings, redis_client, 1)
    reqs = groups[0]
    consumer = TrainerConsumer(settings, redis_client, store)
    for req, reward in zip(reqs[:3], [1.0, 0.0, 0.0]):
        deliver_scored(ledger, store, req, reward)
    drain(consumer)
    assert store.list_keys("batches/") == []
    assert ledger.fail(reqs[3].trajectory_id, "env_error: sandbox died").ok  # still queued
    assert drain(consumer) == 1

    batch = get_model(store, batch_key(run_id, 0), TrainingBatch)
    assert [s.trajectory_id for s in batch.samples] == [r.trajectory_id for r in reqs[:3]]
    assert [s.advantage for s in batch.samples] == pytest.approx(group_advantages([1.0, 0.0, 0.0]).advantages)
    record = get_model(store, group_record_key(run_id, 0), GroupRecord)
    failed = [m for m in record.members if m.reward is None]
    assert [(m.trajectory_id, m.failure_reason, m.advantage) for m in failed] == [(reqs[3].trajectory_id, "env_error: sandbox died", None)]
    assert record.status == "accepted" and record.expected_size == GROUP_SIZE
    assert ledger.counts(run_id) == {"queued": 0, "running": 0, "uploaded": 0, "scored": 0, "consumed": 3, "failed": 1}
    assert consumer.counters() == {"groups_accepted": 1}
    assert pending_count(redis_client, run_id) == 0


def test_all_failed_group_is_dropped_and_counted(settings, ledger, redis_client, store, run_id):
    groups = register_groups(settings, redis_client, 1)
    consumer = TrainerConsumer(settings, redis_client, store)
    for req in groups[0]:
        ledger.fail(req.trajectory_id, "infra_error")
    drain(consumer)
    record = get_model(store, group_record_key(run_id, 0), GroupRecord)
    assert record.status == "all_failed" and record.reward_mean is None and record.batch_key is None
    assert consumer.counters() == {"groups_all_failed": 1}
    assert store.list_keys("batches/") == []


def test_duplicate_late_and_bad_events_are_counted_and_acknowledged(settings, ledger, store, redis_client, run_id):
    groups = register_groups(settings, redis_client, 1)
    reqs = groups[0]
    consumer = TrainerConsumer(settings, redis_client, store)
    stream = RedisKeys.trainer_stream(run_id)
    deliver_scored(ledger, store, reqs[0], 1.0)
    first = redis_client.xrange(stream)[0][1]
    redis_client.xadd(stream, first)  # a redelivered copy
    for req in reqs[1:]:
        deliver_scored(ledger, store, req, 0.0)
    redis_client.xadd(stream, first)  # arrives after the group completed
    redis_client.xadd(stream, {"event": "not json"})
    unknown = FailedEvent(trajectory_id=f"{run_id}_99_0_0", run_id=run_id, group_id=99, failure_reason="x", at=0.0)
    redis_client.xadd(stream, {"event": unknown.model_dump_json()})
    assert drain(consumer) == GROUP_SIZE + 4

    assert consumer.counters() == {"groups_accepted": 1, "duplicate_events": 1, "late_events": 1, "bad_events": 2}
    [letter] = DeadLetters(redis_client).newest()  # the unparseable one; the unknown group's is only counted
    not_json = [entry_id for entry_id, fields in redis_client.xrange(stream) if fields["event"] == "not json"][0]
    assert letter["source"] == f"{stream} entry {not_json}" and letter["message"] == "not json"
    assert letter["problems"].startswith("(whole message): Invalid JSON")
    batch = get_model(store, batch_key(run_id, 0), TrainingBatch)
    assert len(batch.samples) == GROUP_SIZE
    assert pending_count(redis_client, run_id) == 0


def test_restart_recovers_pending_entries_and_completes_the_group_once(settings, ledger, store, redis_client, run_id):
    groups = register_groups(settings, redis_client, 1)
    reqs = groups[0]
    rewards = [1.0, 0.0, 0.0, 1.0]
    consumer_a = TrainerConsumer(settings, redis_client, store)
    for req, reward in zip(reqs[:2], rewards[:2]):
        deliver_scored(ledger, store, req, reward)
    assert consumer_a.poll(block_ms=10) == 2  # read, group incomplete ...
    del consumer_a  # ... and the trainer dies
    assert pending_count(redis_client, run_id) == 2

    consumer_b = TrainerConsumer(settings, redis_client, store)
    assert consumer_b.recover() == 2
    assert store.list_keys("batches/") == []
    for req, reward in zip(reqs[2:], rewards[2:]):
        deliver_scored(ledger, store, req, reward)
    assert drain(consumer_b) == 2

    batch = get_model(store, batch_key(run_id, 0), TrainingBatch)
    assert [s.trajectory_id for s in batch.samples] == [r.trajectory_id for r in reqs]
    assert [s.advantage for s in batch.samples] == pytest.approx(group_advantages(rewards).advantages)
    assert store.list_keys("batches/") == [batch_key(run_id, 0)]
    assert consumer_b.counters() == {"groups_accepted": 1}
    assert pending_count(redis_client, run_id) == 0
    assert {ledger.state(r.trajectory_id) for r in reqs} == {"consumed"}

    # yet another restart finds nothing to replay and trains nothing again
    consumer_c = TrainerConsumer(settings, redis_client, store)
    assert consumer_c.recover() == 0
    assert drain(consumer_c) == 0
    assert consumer_c.counters() == {"groups_accepted": 1}
    assert len(settings.trainer.metrics_path.read_text().splitlines()) == 1


def test_restart_after_crash_mid_completion_finishes_the_group(settings, ledger, store, redis_client, run_id, monkeypatch):
    """The trainer dies after writing the batch but before consuming members / marking the group."""
    groups = register_groups(settings, redis_client, 1)
    reqs = groups[0]
    consumer_a = TrainerConsumer(settings, redis_client, store)

    def crash(tids):
        raise RuntimeError("killed")

    monkeypatch.setattr(consumer_a.ledger, "mark_consumed_many", crash)
    for req, reward in zip(reqs, [0, 1, 1, 1]):
        deliver_scored(ledger, store, req, reward)
    with pytest.raises(RuntimeError, match="killed"):
        consumer_a.poll(block_ms=10)
    assert store.list_keys("batches/") == [batch_key(run_id, 0)]
    assert pending_count(redis_client, run_id) == GROUP_SIZE

    consumer_b = TrainerConsumer(settings, redis_client, store)
    assert consumer_b.recover() == GROUP_SIZE
    assert {ledger.state(r.trajectory_id) for r in reqs} == {"consumed"}
    assert store.list_keys("batches/") == [batch_key(run_id, 0)]
    assert consumer_b.counters() == {"groups_accepted": 1}
    assert pending_count(redis_client, run_id) == 0
    assert [m["group_id"] for m in metrics_lines(settings)] == [0]  # died before its line: written once, now


def test_crash_before_the_group_is_marked_done_is_finished_once_on_restart(settings, ledger, store, redis_client, redis_topology_url, run_id,
                                                                          monkeypatch):
    """Done, counted and acked move together: a trainer dying before that transaction leaves
    the group pending, and the restarted trainer completes and counts it exactly once."""
    groups = register_groups(settings, redis_client, 1)
    reqs = groups[0]
    client_a = redis_for(redis_topology_url)  # its own client: only trainer A's transaction fails
    consumer_a = TrainerConsumer(settings, client_a, store)

    pipeline = consumer_a.client.pipeline

    def crash(transaction=True, **kwargs):  # the group's transaction; the members' pipelined moves go
        if transaction:
            raise RuntimeError("killed")
        return pipeline(transaction=transaction, **kwargs)

    monkeypatch.setattr(consumer_a.client, "pipeline", crash)
    for req, reward in zip(reqs, [0, 1, 1, 1]):
        deliver_scored(ledger, store, req, reward)
    with pytest.raises(RuntimeError, match="killed"):
        consumer_a.poll(block_ms=10)
    assert redis_client.smembers(RedisKeys.groups_done(run_id)) == set()
    assert consumer_a.counters() == {}

    lines_before_restart = metrics_lines(settings)
    assert [m["group_id"] for m in lines_before_restart] == [0]  # the line went out before the transaction

    consumer_b = TrainerConsumer(settings, redis_client, store)
    consumer_b.recover()
    assert pending_count(redis_client, run_id) == 0
    assert redis_client.smembers(RedisKeys.groups_done(run_id)) == {"0"}
    assert consumer_b.counters() == {"groups_accepted": 1}
    assert metrics_lines(settings) == lines_before_restart  # the replay found it written: once, not twice


def test_metrics_lines_of_other_runs_and_a_line_cut_short_do_not_confuse_the_restarted_trainer(
        settings, ledger, store, redis_client, run_id):
    """The file holds another run's line for the same group and ends in half a line (a machine
    that crashed mid-write): the group still gets exactly one line of its own, on a line of its own."""
    path = settings.trainer.metrics_path
    path.write_text(json.dumps({"run_id": "other", "group_id": 0, "completed_by": "1-0", "status": "accepted"})
                    + '\n{"run_id": "' + run_id + '", "group_')
    groups = register_groups(settings, redis_client, 1)
    consumer = TrainerConsumer(settings, redis_client, store)
    for req, reward in zip(groups[0], [0, 1, 1, 1]):
        deliver_scored(ledger, store, req, reward)
    drain(consumer)
    ours = [m for m in metrics_lines(settings) if m["run_id"] == run_id]
    assert [(m["group_id"], m["status"]) for m in ours] == [(0, "accepted")]
    assert ours[0]["completed_by"] == redis_client.xrange(RedisKeys.trainer_stream(run_id))[-1][0]
    assert TrainerConsumer(settings, redis_client, store).metrics.written == {(0, ours[0]["completed_by"])}


def too_short(batch: TrainingBatch):
    """A user's filter (``module:function``): drops groups whose replies are all short."""
    return "every reply is short" if max(sum(s.loss_mask) for s in batch.samples) < 2 else None


@pytest.mark.parametrize("filters, status, reason", [
    ([{"score_range": [0.3, 0.9]}], "filtered", "score_range: mean reward 0.25 outside [0.3, 0.9]"),
    ([{"score_range": [0.0, 1.0]}, {"stop_reasons": ["done"]}], "filtered", "stop_reasons: a member ended done"),
    ([{"max_sampled_tokens": 1}], "filtered", "max_sampled_tokens: a member sampled"),
    ([f"{__name__}:too_short"], "accepted", None),
    ([{"score_range": [0.2, 0.3]}, {"max_sampled_tokens": 1000}], "accepted", None),
])
def test_group_filters_drop_count_and_record_why(settings, ledger, store, redis_client, run_id, filters, status, reason):
    specs = TypeAdapter(list[GroupFilterSpec]).validate_python(filters)
    settings = settings.model_copy(update={"trainer": settings.trainer.model_copy(update={"group_filters": specs})})
    groups = register_groups(settings, redis_client, 1)
    consumer = TrainerConsumer(settings, redis_client, store)
    for req, reward in zip(groups[0], [1, 0, 0, 0]):
        deliver_scored(ledger, store, req, reward)
    drain(consumer)
    record = get_model(store, group_record_key(run_id, 0), GroupRecord)
    assert record.status == status and (reason is None) == (record.filter_reason is None)
    if reason:
        assert record.filter_reason.startswith(reason) and record.batch_key is None
        assert consumer.counters() == {"groups_filtered": 1}
        assert {ledger.state(r.trajectory_id) for r in groups[0]} == {"consumed"}  # still reached the trainer once
        queue = [parse_message(TrainQueueEntry, e) for e in redis_client.lrange(RedisKeys.train_queue(run_id), 0, -1)]
        assert queue == [SkippedGroupEntry(skip="filtered", group_id=0, rewards=[1, 0, 0, 0])]


def test_a_filter_that_names_nothing_is_refused_when_settings_load():
    from shared.settings import SettingsError, load_settings

    with pytest.raises(SettingsError, match="unknown group filter 'score'"):
        load_settings(trainer={"group_filters": [{"score": [0, 1]}]})
    with pytest.raises(SettingsError, match="group filter 'no_such_mod_xyz:f' cannot be imported"):
        load_settings(trainer={"group_filters": ["no_such_mod_xyz:f"]})
    with pytest.raises(SettingsError, match=r"score_range takes \[low, high\]"):
        load_settings(trainer={"group_filters": [{"score_range": [1, 0]}]})
    with pytest.raises(SettingsError, match=r"trainer.group_filters.1.stop_reasons.stop_reasons.0: Input should be 'done'"):
        load_settings(trainer={"group_filters": [{"max_sampled_tokens": 8}, {"stop_reasons": ["timout"]}]})


def test_a_multi_segment_trajectory_trains_as_one_sample_per_segment_with_its_advantage(settings, ledger, redis_client, store, run_id):
    """An agent behind the recording proxy rewrote its history: turn 1 starts a new segment."""
    reqs = register_groups(settings, redis_client, 1)[0]
    rewards = [0.0, 1.0, 1.0, 0.5]
    for req, reward in zip(reqs, rewards):
        deliver_scored(ledger, store, req, reward)
    segmented = trajectory_for(reqs[1])
    segmented = segmented.model_copy(update={"turns": [segmented.turns[0], segmented.turns[1].model_copy(update={"segment_start": True})]})
    put_model(store, trajectory_key(run_id, 0, reqs[1].trajectory_id), segmented)
    consumer = TrainerConsumer(settings, redis_client, store)
    assert drain(consumer) == GROUP_SIZE

    batch = get_model(store, batch_key(run_id, 0), TrainingBatch)
    expected = group_advantages(rewards, settings.trainer.advantage_eps).advantages  # one reward per trajectory
    assert [(s.trajectory_id, s.segment) for s in batch.samples] == [
        (reqs[0].trajectory_id, 0), (reqs[1].trajectory_id, 0), (reqs[1].trajectory_id, 1),
        (reqs[2].trajectory_id, 0), (reqs[3].trajectory_id, 0)]
    assert [s.advantage for s in batch.samples] == pytest.approx([expected[0], expected[1], expected[1], expected[2], expected[3]])
    first, second = batch.samples[1], batch.samples[2]
    assert first.token_ids == [1, 2, 3, 101, 101] and first.loss_mask == [0, 0, 0, 1, 1]
    assert second.token_ids == [7, 7, 201] and second.loss_mask == [0, 0, 1]
    assert ledger.counts(run_id)["consumed"] == GROUP_SIZE


# --- group redundancy (issue 13, item 4) -----------------------------------------------------


def test_a_redundant_group_completes_with_its_first_keep_scored_members():
    done = Done()
    asm = GroupAssembler(lambda g: 5, done, keep=lambda g: 2)
    assert asm.add(ev(0, 3, reward=0.0), "1-0") == ("added", None)
    assert asm.add(ev(0, 1, "failed"), "2-0") == ("added", None)  # a failure does not count toward keep
    outcome, group = asm.add(ev(0, 0, reward=1.0), "3-0")
    assert outcome == "added" and group is not None
    assert [e.trajectory_id for e in group.scored] == ["r_0_0_0", "r_0_3_3"] and len(group.failed) == 1
    done.ids.add(0)
    assert asm.add(ev(0, 2), "4-0") == ("late", None)


def test_redundancy_keeps_the_first_n_scored_and_supersedes_the_rest_keeping_the_ledger_exact(
        settings, ledger, store, redis_client, run_id):
    """group_size 4 + redundancy 2: six members go out; once four are scored the group is decided
    on those four, the two others are failed(superseded) (one still running, one scored whose
    event comes after the decision), and dispatched = consumed + failed."""
    settings = settings.model_copy(update={"rollout": settings.rollout.model_copy(update={"redundancy": 2})})
    reqs = register_groups(settings, redis_client, 1)[0]
    assert len(reqs) == GROUP_SIZE + 2
    consumer = TrainerConsumer(settings, redis_client, store)
    for req, reward in zip(reqs[:3], [1.0, 0.0, 0.5]):
        deliver_scored(ledger, store, req, reward)
    drain(consumer)
    assert ledger.claim(reqs[4].trajectory_id, "slow-worker", 30)[0]  # a slow member, still running
    deliver_scored(ledger, store, reqs[3], 0.25)  # the fourth scored: the group is decided
    deliver_scored(ledger, store, reqs[5], 1.0)  # scored too, but after the fourth
    drain(consumer)

    batch = get_model(store, batch_key(run_id, 0), TrainingBatch)
    assert [s.trajectory_id for s in batch.samples] == [r.trajectory_id for r in reqs[:4]]
    assert [s.advantage for s in batch.samples] == pytest.approx(group_advantages([1.0, 0.0, 0.5, 0.25]).advantages)
    failures = redis_client.hgetall(RedisKeys.failures(run_id))
    assert sorted(failures) == sorted([reqs[4].trajectory_id, reqs[5].trajectory_id])
    assert all(reason.startswith("superseded: group 0 kept its first 4 scored members") for reason in failures.values())
    counts = ledger.counts(run_id)
    assert counts["consumed"] == 4 and counts["failed"] == 2 and sum(counts.values()) == len(reqs)
    counters = consumer.counters()
    assert counters["groups_accepted"] == 1 and counters["superseded"] == 2
    # after the decision: the sixth member's scored event, then both superseded members' failures
    assert counters["late_events"] == 3
    assert pending_count(redis_client, run_id) == 0
    # the slow worker's lease is lost: its heartbeat names it, so the worker cancels the episode
    assert ledger.renew({reqs[4].trajectory_id: "slow-worker"}, 30) == [reqs[4].trajectory_id]


def test_groups_one_read_completes_are_assembled_together_each_once_and_their_batches_handed_over_as_written(
        settings, ledger, store, redis_client, run_id):
    """Four groups completed by one read are assembled side by side (trainer.assembly_threads 8):
    each written, queued, consumed and acknowledged once, an entry of a group the read already
    completed is late; each accepted batch is handed to the loop as S3 holds it, once."""
    settings = settings.model_copy(update={"trainer": settings.trainer.model_copy(update={"assembly_threads": 8})})
    groups = register_groups(settings, redis_client, 4)
    handoff = BatchHandoff(8)
    consumer = TrainerConsumer(settings, redis_client, store, handoff=handoff)
    assert consumer._assembler_pool is not None
    for reqs in groups.values():
        for req, reward in zip(reqs, [0.0, 1.0, 0.5, 1.0]):
            deliver_scored(ledger, store, req, reward)
    stream = RedisKeys.trainer_stream(run_id)
    redelivered = next(fields for _, fields in redis_client.xrange(stream) if parse_message(TrainerEvent, fields["event"]).group_id == 1)
    redis_client.xadd(stream, redelivered)  # group 1's first event again, after the entry that completed it
    assert consumer.poll(block_ms=10) == 4 * GROUP_SIZE + 1  # one read: all four groups complete in it
    assert redis_client.smembers(RedisKeys.groups_done(run_id)) == {"0", "1", "2", "3"}
    queue = [parse_message(TrainQueueEntry, e) for e in redis_client.lrange(RedisKeys.train_queue(run_id), 0, -1)]
    assert sorted(e.key for e in queue if isinstance(e, TrainBatchEntry)) == [batch_key(run_id, g) for g in range(4)]
    assert ledger.counts(run_id)["consumed"] == 4 * GROUP_SIZE and pending_count(redis_client, run_id) == 0
    assert consumer.counters() == {"groups_accepted": 4, "late_events": 1}
    assert sorted(m["group_id"] for m in metrics_lines(settings)) == [0, 1, 2, 3]
    assert len(handoff) == 4
    for g in range(4):
        kept = handoff.take(store, batch_key(run_id, g))
        assert kept == get_model(store, batch_key(run_id, g), TrainingBatch)  # the S3 copy, field for field
    assert len(handoff) == 0 and handoff.taken == 4 and handoff.read_back == 0
    handoff.take(store, batch_key(run_id, 0))  # taken once: a second take reads S3
    assert handoff.read_back == 1


def test_the_handoff_keeps_at_most_its_bound_and_zero_keeps_none(store, run_id):
    batch = TrainingBatch(run_id=run_id, group_id=0, samples=[])
    bounded, off = BatchHandoff(2), BatchHandoff(0)
    for key in ["a", "b", "c"]:
        bounded.keep(key, batch)
        off.keep(key, batch)
    assert len(bounded) == 2 and len(off) == 0
    put_model(store, "a", batch)
    assert bounded.take(store, "a") == batch and bounded.read_back == 1  # the oldest was dropped: read from S3


def test_a_stopped_run_ends_the_consumer_between_reads_with_every_trajectory_terminal(settings, ledger, redis_client, store, run_id):
    """``conveyor run stop``: the consumer fails what is unfinished (a group read and not yet
    decided, a group not yet rolled out) and returns; one group decided before stays consumed."""
    from shared.state.run_stop import request_stop

    groups = register_groups(settings, redis_client, 3)
    consumer = TrainerConsumer(settings, redis_client, store)
    for req, reward in zip(groups[0], [0, 1, 0, 1]):
        deliver_scored(ledger, store, req, reward)
    for req in groups[1][:2]:
        deliver_scored(ledger, store, req, 1.0)
    drain(consumer)  # group 0 decided and consumed, group 1 read and undecided, group 2 queued
    request_stop(ledger.redis, run_id, "enough")
    TrainerProcess(consumer).run()  # returns: no SIGTERM, no training loop, no stop_when_idle
    counts = ledger.counts(run_id)
    assert (counts["consumed"], counts["failed"], sum(counts.values())) == (GROUP_SIZE, 2 * GROUP_SIZE, 3 * GROUP_SIZE)
    assert consumer.stopped.reason == "enough"
    assert {r.split(" (by ")[0] for r in ledger.failure_reasons(run_id).values()} == {"run_stopped: enough"}


@pytest.mark.parametrize("correction, warned", [("none", True), ("tis", False)])
def test_a_bound_at_use_above_admission_without_a_correction_is_warned_of(settings, redis_client, store, caplog,
                                                                         correction, warned):
    trainer = {**settings.trainer.model_dump(include={"consumer_name", "block_ms", "metrics_path"}),
               "max_off_policy_steps": 1, "max_staleness_at_use": 3, "loss": {"correction": correction}}
    with caplog.at_level("WARNING", logger="services.trainer.consumer"):
        TrainerConsumer(settings.model_copy(update={"trainer": Settings(trainer=trainer).trainer}), redis_client, store)
    assert ("max_staleness_at_use 3" in caplog.text) is warned


def test_a_trainer_with_nothing_to_do_says_what_it_waits_for_and_where_the_runs_trajectories_are(
        settings, redis_client, store, run_id, caplog):
    """No silent wait: with groups queued and no rollout running, the trainer logs what it waits
    for, the run's counts, and where to look, every ``wait_report_every_s``."""
    import threading

    register_groups(settings, redis_client, 2)
    process = TrainerProcess(TrainerConsumer(settings, redis_client, store), wait_report_every_s=0.2)
    with caplog.at_level("INFO", logger="services.trainer.process"):
        runner = threading.Thread(target=process.run)
        runner.start()
        time.sleep(1.0)
        process.stop.set()
        runner.join(timeout=10)
    assert not runner.is_alive()
    reports = [r.getMessage() for r in caplog.records if r.name == "services.trainer.process"]
    assert reports, "an idle trainer logged nothing in 1 s with a 0.2 s report interval"
    assert reports[0].startswith(f"run {run_id}: waiting for scored trajectories; trajectories {2 * GROUP_SIZE} queued")
    assert "none running: the rollout workers may wait for inference" in reports[0]
