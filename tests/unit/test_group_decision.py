"""``decide_group``, the trainer's decision on a completed group, without object storage:
trajectories come from a dict, the staleness bound from a plain function (or, for the bound at
use, the run's budget in a real Redis)."""

from __future__ import annotations

import pytest

from services.trainer.group_decision import decide_group
from services.trainer.group_filters import build_filter
from shared.settings.group_filters import ScoreRangeFilter
from services.trainer.groups import PendingGroup
from shared.schemas import (
    FailedEvent,
    RolloutRequest,
    ScoredEvent,
    SkippedGroupEntry,
    StopReason,
    TaskProfile,
    TrainBatchEntry,
    Trajectory,
    Turn,
)
from shared.settings import Settings, TrainerSettings
from shared.state.staleness import budget_of

RUN, GROUP = "decide", 3


def tid(index: int) -> str:
    return f"{RUN}_{GROUP}_{index}_{index}"


def trajectory_of(index: int, policy_versions: tuple[int, ...] = (5,)) -> Trajectory:
    """One turn per policy version: prompt 2 tokens, 3 sampled, turn reward 0.25."""
    task = TaskProfile(task_id="t", env_name="guess", task_data={})
    request = RolloutRequest(run_id=RUN, group_id=GROUP, episode_index=index, episode_seed=index, trajectory_id=tid(index),
                             group_size=4, task=task, dispatched_at=0.0)
    turns = [Turn(index=i, prompt_token_ids=[7, 7], sampled_token_ids=[9, 9, 9], logprobs=[-0.5] * 3, policy_version=v,
                  finish_reason="stop", completion_text="", reward=0.25) for i, v in enumerate(policy_versions)]
    return Trajectory(request=request, turns=turns, stop_reason=StopReason.done)


def scored(index: int, reward: float) -> ScoredEvent:
    return ScoredEvent(trajectory_id=tid(index), run_id=RUN, group_id=GROUP, at=0.0, reward=reward,
                       scored_key=f"scored/{index}")


def failed(index: int) -> FailedEvent:
    return FailedEvent(trajectory_id=tid(index), run_id=RUN, group_id=GROUP, at=0.0, failure_reason="env_error: boom")


def group_of(*events: ScoredEvent | FailedEvent) -> PendingGroup:
    group = PendingGroup(GROUP, expected_size=len(events))
    for number, event in enumerate(reversed(events)):  # stream order is not trajectory order
        group.events[event.trajectory_id] = event
        group.entry_ids.append(f"{number}-0")
    return group


class Trajectories:
    """Scored members' trajectories by id, and which were read."""

    def __init__(self, **versions: tuple[int, ...]):
        self.versions = versions
        self.read: list[str] = []

    def __call__(self, event: ScoredEvent) -> Trajectory:
        self.read.append(event.trajectory_id)
        index = int(event.trajectory_id.split("_")[2])
        return trajectory_of(index, self.versions.get(f"t{index}", (5,)))


def never_asked(oldest: int) -> bool:
    raise AssertionError("the staleness bound was asked of a group that needs no batch")


def decide(group: PendingGroup, trainer: TrainerSettings | None = None, filters=(), read=None, is_stale=None):
    return decide_group(group, RUN, trainer or TrainerSettings(), list(filters), read or Trajectories(), is_stale)


def test_a_group_with_no_scored_member_is_all_failed_and_reads_nothing():
    read = Trajectories()
    decision = decide(group_of(failed(1), failed(0)), read=read, is_stale=never_asked)
    assert decision.status == "all_failed" and not decision.accepted and decision.batch is None
    assert [m.trajectory_id for m in decision.members] == [tid(0), tid(1)]
    assert {m.failure_reason for m in decision.members} == {"env_error: boom"}
    assert (decision.reward_mean, decision.reward_std, read.read) == (None, None, [])
    assert decision.queue_entry(None, "guess") is None


def test_equal_rewards_drop_the_group_as_zero_variance_with_a_skip_entry_and_no_batch():
    read = Trajectories()
    decision = decide(group_of(scored(0, 1.0), scored(1, 1.0), failed(2)), read=read, is_stale=never_asked)
    assert decision.status == "zero_variance" and decision.batch is None and read.read == []
    assert (decision.reward_mean, decision.reward_std) == (1.0, 0.0)
    assert [m.advantage for m in decision.members] == [0.0, 0.0, None]
    entry = decision.queue_entry(None, "guess")
    assert isinstance(entry, SkippedGroupEntry) and (entry.skip, entry.rewards) == ("zero_variance", [1.0, 1.0])


def test_zero_variance_keep_trains_the_group_with_every_advantage_zero():
    decision = decide(group_of(scored(0, 0.5), scored(1, 0.5)), TrainerSettings(zero_variance_groups="keep"))
    assert decision.status == "accepted" and decision.zero_variance_kept
    assert [s.advantage for s in decision.batch.samples] == [0.0, 0.0]
    assert all(s.token_advantages is None for s in decision.batch.samples)


def test_disagreeing_rewards_are_accepted_with_grpo_advantages_and_a_batch_entry():
    read = Trajectories(t1=(2, 4))
    decision = decide(group_of(scored(0, 1.0), scored(1, 0.0), failed(2)), read=read, is_stale=lambda oldest: False)
    assert decision.status == "accepted" and not decision.zero_variance_kept
    assert sorted(read.read) == [tid(0), tid(1)]
    assert (decision.reward_mean, decision.reward_std) == (0.5, 0.5)
    assert [m.trajectory_id for m in decision.members] == [tid(0), tid(1), tid(2)]
    assert [m.advantage for m in decision.members[:2]] == pytest.approx([1.0, -1.0], abs=1e-5)
    samples = decision.batch.samples
    assert [(s.trajectory_id, s.reward, s.oldest_policy_version) for s in samples] == [(tid(0), 1.0, 5), (tid(1), 0.0, 2)]
    assert (decision.batch.run_id, decision.batch.group_id, decision.oldest_policy_version) == (RUN, GROUP, 2)
    entry = decision.queue_entry("batches/3", "guess")
    assert entry == TrainBatchEntry(group_id=GROUP, key="batches/3", oldest_policy_version=2, env_name="guess")
    record = decision.record(RUN, expected_size=3, batch_object="batches/3", completed_at=7.0)
    assert (record.status, record.batch_key, record.completed_at) == ("accepted", "batches/3", 7.0)
    assert record.members == list(decision.members)
    with pytest.raises(ValueError, match="needs the key of its batch"):
        decision.queue_entry(None, "guess")


def test_a_filter_objection_drops_the_group_before_the_staleness_bound_is_asked():
    score_range = build_filter(ScoreRangeFilter(score_range=(0.9, 1.0)))
    decision = decide(group_of(scored(0, 1.0), scored(1, 0.0)), filters=[score_range], is_stale=never_asked)
    assert decision.status == "filtered" and decision.batch is None
    assert decision.filter_reason == "score_range: mean reward 0.5 outside [0.9, 1]"
    entry = decision.queue_entry(None, "guess")
    assert isinstance(entry, SkippedGroupEntry) and (entry.skip, entry.rewards) == ("filtered", [1.0, 0.0])


def test_a_group_whose_oldest_turn_is_stale_is_dropped_with_no_entry():
    asked: list[int] = []

    def is_stale(oldest: int) -> bool:
        asked.append(oldest)
        return oldest < 3

    decision = decide(group_of(scored(0, 1.0), scored(1, 0.0)), read=Trajectories(t0=(1, 6)), is_stale=is_stale)
    assert (decision.status, asked, decision.batch) == ("stale", [1], None)
    assert decision.queue_entry(None, "guess") is None
    fresh = decide(group_of(scored(0, 1.0), scored(1, 0.0)), read=Trajectories(t0=(4, 6)), is_stale=is_stale)
    assert fresh.status == "accepted"


def test_without_a_staleness_bound_nothing_is_stale():
    decision = decide(group_of(scored(0, 1.0), scored(1, 0.0)), read=Trajectories(t0=(0,), t1=(0,)), is_stale=None)
    assert decision.status == "accepted" and decision.oldest_policy_version == 0


@pytest.mark.parametrize("at_use, statuses", [(None, ["accepted", "stale", "stale"]), (4, ["accepted", "accepted", "stale"])])
def test_the_bound_at_use_trains_a_group_admitted_inside_the_bound_that_finished_behind_it(
        redis_client, run_id, at_use, statuses):
    """The run's budget in Redis (``budget_of``, as the consumer asks it), k = 1, trainer at step 10:
    a group 1 behind is inside both bounds, one 2 behind (k + 1) is trained only with
    ``max_staleness_at_use`` 4, one 5 behind is stale either way."""
    trainer = Settings(trainer={"max_off_policy_steps": 1, "max_staleness_at_use": at_use}).trainer
    budget = budget_of(redis_client, run_id, trainer)
    budget.advance_step(10)

    def status(oldest: int) -> str:
        read = Trajectories(t0=(oldest, 10), t1=(10,))
        return decide(group_of(scored(0, 1.0), scored(1, 0.0)), read=read,
                      is_stale=lambda version: budget.is_stale(version, budget.state().trainer_step)).status

    assert [status(oldest) for oldest in (9, 8, 5)] == statuses


def test_per_token_rewards_place_advantages_on_the_sampled_tokens():
    trainer = TrainerSettings(token_rewards="last_token")
    decision = decide(group_of(scored(0, 1.0), scored(1, 0.0)), trainer)
    for sample in decision.batch.samples:
        assert len(sample.token_advantages) == len(sample.token_ids)
        assert [a for a, m in zip(sample.token_advantages, sample.loss_mask) if not m] == [0.0, 0.0]
    assert decide(group_of(scored(0, 1.0), scored(1, 0.0))).batch.samples[0].token_advantages is None


def test_the_same_group_is_decided_the_same_way_twice():
    def one() -> object:
        return decide(group_of(scored(0, 1.0), scored(1, 0.25), failed(2)), read=Trajectories(t1=(3, 4)),
                      is_stale=lambda oldest: False)

    assert one() == one()
