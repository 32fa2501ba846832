"""What the trainer does with a completed GRPO group: a pure decision, like
``services.trainer.selection.select``; the consumer (``services.trainer.consumer``) only applies it.

Invariants:
- ``decide_group`` writes nothing and keeps nothing. Its only reads are through the callables it
  is given: ``read_trajectory`` (a scored member's trajectory, read only when the group needs a
  batch) and ``is_stale`` (the staleness bound, asked only of a batch that passed every filter).
  The same group, trajectories and bound give the same decision, so a replay after a restart
  decides a group as it was decided before.
- Statuses, in the order they are tried: ``all_failed`` (no member scored), ``zero_variance``
  (every scored reward equal, unless ``zero_variance_groups: keep``: then trained with every
  advantage exactly 0), ``filtered`` (the first objection of ``trainer.group_filters``),
  ``stale`` (oldest turn more than ``max_staleness_at_use``, by default ``max_off_policy_steps``,
  behind the trainer; never without a bound), else ``accepted``. Only an accepted decision carries a batch.
- Members are every scored member, with its reward and advantage, and every failed member,
  with its failure; sorted by trajectory id.
- A train-queue entry follows the status: a ``TrainBatchEntry`` for an accepted group, a
  ``SkippedGroupEntry`` with its rewards for a zero-variance or filtered one, none otherwise.
  Every group not accepted frees its admission slot.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Callable

from services.trainer.advantages import group_advantages
from services.trainer.group_filters import GroupFilter, first_objection
from services.trainer.groups import PendingGroup
from services.trainer.token_rewards import place_rewards
from services.trainer.token_rewards import token_advantages as token_advantages_of
from shared.schemas import (
    GroupMember,
    GroupRecord,
    GroupStatus,
    ScoredEvent,
    SkippedGroupEntry,
    TrainBatchEntry,
    Trajectory,
    TrainingBatch,
    TrainingSample,
)
from shared.settings import TrainerSettings

ReadTrajectory = Callable[[ScoredEvent], Trajectory]


@dataclass(frozen=True)
class GroupDecision:
    group_id: int
    status: GroupStatus
    members: tuple[GroupMember, ...]  # sorted by trajectory id
    rewards: tuple[float, ...]  # the scored members' rewards, in stream order
    reward_mean: float | None = None
    reward_std: float | None = None
    batch: TrainingBatch | None = None  # accepted only: what the group trains on
    zero_variance_kept: bool = False  # accepted with every advantage 0 (zero_variance_groups: keep)
    filter_reason: str | None = None  # filtered: which filter, and why

    @property
    def accepted(self) -> bool:
        return self.status == "accepted"

    @property
    def oldest_policy_version(self) -> int | None:
        """The policy version of the accepted batch's oldest turn."""
        return None if self.batch is None else min(sample.oldest_policy_version for sample in self.batch.samples)

    def record(self, run_id: str, expected_size: int, batch_object: str | None, completed_at: float) -> GroupRecord:
        return GroupRecord(
            run_id=run_id, group_id=self.group_id, expected_size=expected_size, members=list(self.members),
            reward_mean=self.reward_mean, reward_std=self.reward_std, status=self.status, batch_key=batch_object,
            completed_at=completed_at, filter_reason=self.filter_reason,
        )

    def queue_entry(self, batch_object: str | None, env_name: str) -> TrainBatchEntry | SkippedGroupEntry | None:
        """The group's train-queue entry; ``batch_object``: where an accepted group's batch was put."""
        if self.accepted:
            if batch_object is None:
                raise ValueError(f"group {self.group_id} is accepted: its entry needs the key of its batch")
            return TrainBatchEntry(group_id=self.group_id, key=batch_object, oldest_policy_version=self.oldest_policy_version,
                                   env_name=env_name)
        if self.status in ("zero_variance", "filtered"):
            return SkippedGroupEntry(group_id=self.group_id, skip=self.status, rewards=list(self.rewards))
        return None


def decide_group(group: PendingGroup, run_id: str, trainer: TrainerSettings, filters: list[GroupFilter],
                 read_trajectory: ReadTrajectory, is_stale: Callable[[int], bool] | None) -> GroupDecision:
    """The decision on a completed ``group``; ``is_stale(oldest_policy_version)``: None without a
    staleness bound (nothing trains, so nothing is stale)."""
    scored = group.scored
    rewards = tuple(event.reward for event in scored)
    failed = [GroupMember(trajectory_id=e.trajectory_id, reward=None, advantage=None, failure_reason=e.failure_reason)
              for e in group.failed]
    if not scored:
        return GroupDecision(group.group_id, "all_failed", _sorted(failed), rewards)
    adv = group_advantages(list(rewards), trainer.advantage_eps, trainer.scale_advantage_by_std, trainer.advantage_std)
    keep = adv.zero_variance and trainer.zero_variance_groups == "keep"
    advantages = [0.0] * len(rewards) if keep else adv.advantages
    members = _sorted(failed + [GroupMember(trajectory_id=e.trajectory_id, reward=e.reward, advantage=a)
                                for e, a in zip(scored, advantages)])
    decided = partial(GroupDecision, group_id=group.group_id, members=members, rewards=rewards, reward_mean=adv.mean,
                      reward_std=adv.std)
    if adv.zero_variance and not keep:
        return decided(status="zero_variance")
    # per-token advantages share GRPO's statistics: (G_t - mean) / scale (token_rewards)
    scale = (adv.std + trainer.advantage_eps) if trainer.scale_advantage_by_std else 1.0
    per_token = None if keep or trainer.token_rewards == "terminal" else (adv.mean, scale)
    batch = training_batch(run_id, group.group_id, scored, advantages, read_trajectory, trainer, per_token)
    filter_reason = first_objection(filters, batch)
    if filter_reason is not None:
        return decided(status="filtered", filter_reason=filter_reason)
    if is_stale is not None and is_stale(min(sample.oldest_policy_version for sample in batch.samples)):
        return decided(status="stale")
    return decided(status="accepted", batch=batch, zero_variance_kept=keep)


def training_batch(run_id: str, group_id: int, scored: list[ScoredEvent], advantages: list[float],
                   read_trajectory: ReadTrajectory, trainer: TrainerSettings,
                   per_token: tuple[float, float] | None = None) -> TrainingBatch:
    """One sample per segment of each scored member; ``per_token``: the group's (mean, scale)
    when rewards are placed per token."""
    samples = []
    for event, advantage in zip(scored, advantages):
        trajectory = read_trajectory(event)
        token_advantages = None
        if per_token is not None:
            placed = place_rewards(trajectory, event.reward, trainer.token_rewards)
            token_advantages = token_advantages_of(placed, trajectory.flatten().loss_mask, *per_token)
        start = 0
        for number, segment in enumerate(trajectory.segments()):  # one, unless an agent rewrote its history
            end = start + len(segment.token_ids)
            samples.append(
                TrainingSample(
                    trajectory_id=event.trajectory_id, token_ids=segment.token_ids, loss_mask=segment.loss_mask,
                    inference_logprobs=segment.inference_logprobs, advantage=advantage, reward=event.reward,
                    oldest_policy_version=min((t.policy_version for t in trajectory.turns), default=0),
                    stop_reason=trajectory.stop_reason, segment=number,
                    token_advantages=None if token_advantages is None else token_advantages[start:end],
                )
            )
            start = end
    return TrainingBatch(run_id=run_id, group_id=group_id, samples=samples)


def _sorted(members: list[GroupMember]) -> tuple[GroupMember, ...]:
    return tuple(sorted(members, key=lambda m: m.trajectory_id))
