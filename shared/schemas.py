"""Message schemas: the one vocabulary every hop of Conveyor speaks.

Invariants:
- Every message carries ``schema_version``; a reader rejects a major version it does not know,
  so a mixed-version deployment fails loudly instead of misreading fields.
- Models forbid unknown fields: a typo in a producer is an error at the producer.
- Token ids are never re-derived. A ``Turn`` holds the ids that were *appended* to the context
  before the model sampled (``prompt_token_ids``: the whole rendered prompt for turn 0, the
  observation and next-turn header for later turns) and the ids vLLM sampled
  (``sampled_token_ids``), with one inference logprob per sampled id. Concatenating, turn by
  turn, prompt ids then sampled ids gives the exact context the model saw.
- The loss mask is 1 exactly on sampled tokens (``Trajectory.flatten``).
"""

from __future__ import annotations

import enum
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

SCHEMA_VERSION = "1.0"


class Message(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    schema_version: str = SCHEMA_VERSION

    @model_validator(mode="after")
    def _known_major_version(self) -> "Message":
        if self.schema_version.split(".")[0] != SCHEMA_VERSION.split(".")[0]:
            raise ValueError(
                f"{type(self).__name__}: schema_version {self.schema_version!r} is not "
                f"compatible with this build ({SCHEMA_VERSION})"
            )
        return self


class StopReason(str, enum.Enum):
    done = "done"  # the environment said the episode is over
    max_turns = "max_turns"
    max_tokens = "max_tokens"  # episode token budget or model context exhausted
    timeout = "timeout"  # episode wall-time limit
    env_error = "env_error"  # the environment raised: ends this trajectory, not retried
    infra_error = "infra_error"  # inference/storage unreachable after bounded retries


class TrajectoryState(str, enum.Enum):
    queued = "queued"
    running = "running"
    uploaded = "uploaded"
    scored = "scored"
    consumed = "consumed"
    failed = "failed"

    @property
    def terminal(self) -> bool:
        return self in (TrajectoryState.consumed, TrajectoryState.failed)


class TaskProfile(Message):
    """One dataset row, mapped by its environment's row adapter."""

    task_id: str
    env_name: str
    task_data: dict[str, Any]
    env_config: dict[str, Any] = Field(default_factory=dict)
    source: str = ""  # where the row came from, e.g. "data/train.jsonl:17"


class RolloutRequest(Message):
    """One trajectory to roll out. Carried by rollout tasks, stored in the ledger for re-dispatch."""

    run_id: str
    group_id: int
    episode_index: int
    episode_seed: int
    trajectory_id: str
    group_size: int
    task: TaskProfile
    policy_version: int = 0  # the policy version when intake dispatched the group
    dispatched_at: float  # unix time; queue wait is measured from here


class ToolCall(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str
    arguments: dict[str, Any] = Field(default_factory=dict)


class TurnTimings(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    inference_s: float = 0.0
    env_step_s: float = 0.0


class Turn(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    index: int
    prompt_token_ids: list[int]  # ids appended to the context before this turn (see module doc)
    sampled_token_ids: list[int]
    logprobs: list[float]  # inference logprob of each sampled id
    policy_version: int
    finish_reason: str  # vLLM's: "stop" or "length"
    completion_text: str
    tool_calls: list[ToolCall] = Field(default_factory=list)
    tool_call_error: str | None = None  # set when the output held a malformed tool call
    observation: str | None = None  # the environment's reply, rendered into the next prompt
    timings: TurnTimings = Field(default_factory=TurnTimings)

    @model_validator(mode="after")
    def _one_logprob_per_sampled_token(self) -> "Turn":
        if len(self.logprobs) != len(self.sampled_token_ids):
            raise ValueError(
                f"turn {self.index}: {len(self.logprobs)} logprobs for "
                f"{len(self.sampled_token_ids)} sampled tokens"
            )
        return self


class EpisodeTimings(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    queue_wait_s: float = 0.0  # dispatched -> episode start
    episode_s: float = 0.0  # episode start -> last turn done
    inference_s: float = 0.0
    env_s: float = 0.0
    upload_s: float = 0.0


class FlatSequence(BaseModel):
    """A trajectory as one training sequence."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    token_ids: list[int]
    loss_mask: list[int]
    inference_logprobs: list[float]  # 0.0 where loss_mask is 0


class Trajectory(Message):
    request: RolloutRequest
    turns: list[Turn]
    stop_reason: StopReason
    error: str | None = None  # what went wrong, for env_error / infra_error
    env_reward: float | None = None  # the environment's verifier result, if it produced one
    env_info: dict[str, Any] = Field(default_factory=dict)
    attempt: int = 1
    worker: str = ""
    timings: EpisodeTimings = Field(default_factory=EpisodeTimings)

    @property
    def trajectory_id(self) -> str:
        return self.request.trajectory_id

    def flatten(self) -> FlatSequence:
        token_ids: list[int] = []
        loss_mask: list[int] = []
        logprobs: list[float] = []
        for turn in self.turns:
            token_ids += turn.prompt_token_ids
            loss_mask += [0] * len(turn.prompt_token_ids)
            logprobs += [0.0] * len(turn.prompt_token_ids)
            token_ids += turn.sampled_token_ids
            loss_mask += [1] * len(turn.sampled_token_ids)
            logprobs += turn.logprobs
        return FlatSequence(token_ids=token_ids, loss_mask=loss_mask, inference_logprobs=logprobs)


class RewardBreakdown(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str
    value: float
    weight: float


class ScoredTrajectory(Message):
    trajectory_id: str
    run_id: str
    group_id: int
    trajectory_key: str  # object key of the Trajectory
    reward: float
    components: list[RewardBreakdown]
    stop_reason: StopReason
    scored_at: float
    # stage latencies in seconds: queue_wait, episode, inference, env, upload, scoring
    timings: dict[str, float] = Field(default_factory=dict)


class TrainerEvent(Message):
    """What the trainer receives for one trajectory: it was scored, or it failed."""

    kind: Literal["scored", "failed"]
    trajectory_id: str
    run_id: str
    group_id: int
    reward: float | None = None
    scored_key: str | None = None  # object key of the ScoredTrajectory
    failure_reason: str | None = None
    at: float

    @model_validator(mode="after")
    def _kind_has_its_fields(self) -> "TrainerEvent":
        if self.kind == "scored" and (self.reward is None or self.scored_key is None):
            raise ValueError("a 'scored' trainer event needs reward and scored_key")
        if self.kind == "failed" and not self.failure_reason:
            raise ValueError("a 'failed' trainer event needs failure_reason")
        return self


class GroupMember(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    trajectory_id: str
    reward: float | None  # None for a failed member
    advantage: float | None
    failure_reason: str | None = None


class GroupRecord(Message):
    """A completed GRPO group, as the trainer decided it."""

    run_id: str
    group_id: int
    expected_size: int
    members: list[GroupMember]
    reward_mean: float | None
    reward_std: float | None
    status: Literal["accepted", "zero_variance", "all_failed", "stale"]
    batch_key: str | None = None  # object key of the emitted training batch
    completed_at: float


class GroupRegistration(Message):
    """Intake's record of a dispatched group, kept in Redis."""

    run_id: str
    group_id: int
    expected_size: int
    task_id: str
    policy_version: int
    dispatched_at: float


class TrainingSample(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    trajectory_id: str
    token_ids: list[int]
    loss_mask: list[int]
    inference_logprobs: list[float]
    advantage: float
    reward: float
    oldest_policy_version: int
    stop_reason: StopReason


class TrainingBatch(Message):
    """What the trainer's optimizer step consumes: one GRPO group, ready to train on."""

    run_id: str
    group_id: int
    samples: list[TrainingSample]
