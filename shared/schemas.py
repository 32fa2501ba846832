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
- A turn with ``segment_start`` begins a new sequence: its prompt ids are a whole context, not
  an extension (an agent behind the recording proxy rewrote its history: compaction, a cut
  context). ``Trajectory.segments`` gives one sequence per segment; ``flatten`` is their
  concatenation (the alignment per-token rewards use), a real sequence only for one segment.
- The loss mask is 1 exactly on sampled tokens (``Trajectory.flatten``).
- Every message between processes is one of these models, built by its producer and read by
  its consumer through ``parse_message``: rollout tasks (``RolloutRequest``), scoring tasks
  (``ScoringTask``), trainer-stream events (``TrainerEvent``: ``ScoredEvent | FailedEvent``),
  train-queue entries (``TrainQueueEntry``: ``TrainBatchEntry | SkippedGroupEntry``),
  checkpoint announcements (``CheckpointAnnouncement``), group registrations, and the objects
  in the bucket. ``parse_message`` raises ``BadMessage`` (a ``ValueError`` naming the message
  and each bad field) and nothing else, whatever the input; the consumer logs it and
  dead-letters (``shared.state.dead_letters``) or fails the work it names, and goes on.
"""

from __future__ import annotations

import enum
from typing import Annotated, Any, Literal, Union

from pydantic import (
    AliasChoices,
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    Tag,
    TypeAdapter,
    ValidationError,
    SerializerFunctionWrapHandler,
    field_validator,
    model_serializer,
    model_validator,
)

SCHEMA_VERSION = "1.3"  # 1.3: RolloutRequest.inference (a run's own inference server)


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
    max_tokens = "max_tokens"  # the episode's sampled-token budget (max_episode_tokens) is used up
    context_exhausted = "context_exhausted"  # the model's context (max_model_len) has no room for another reply
    truncated = "truncated"  # the episode ended on a reply cut at the per-turn token limit (DAPO's overlong)
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
    dataset_version: str = ""  # label@content-hash of the dataset intake read it from


class InferenceTarget(BaseModel):
    """A run's own inference server, which its rollouts call instead of the rollout workers'
    configured one (``inference.own_server``; ``conveyor run submit`` starts one with ``--inference own``, or ``auto`` when the shared one is held)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    base_url: str  # as the rollout workers reach it
    model: str  # the served name
    model_path: str  # the tokenizer's (the run's policy's) directory or Hugging Face name
    max_model_len: int = Field(gt=0)
    lora_adapters: bool = False  # the server serves one LoRA adapter per policy version


class RolloutRequest(Message):
    """One trajectory to roll out. Carried by rollout tasks, stored in the ledger for re-dispatch."""

    run_id: str
    group_id: int
    episode_index: int
    episode_seed: int
    trajectory_id: str
    # members dispatched (rollout.group_size + rollout.redundancy; rollout.group_size is the count
    # kept, the registration's keep); read from "group_size" too, its name before schema 1.2
    members_dispatched: int = Field(validation_alias=AliasChoices("members_dispatched", "group_size"))
    task: TaskProfile
    policy_version: int = 0  # the policy version when intake dispatched the group
    dispatched_at: float  # unix time; queue wait is measured from here
    inference: InferenceTarget | None = None  # the run's own server; None: the rollout workers' inference settings
    # the earliest served policy version the first turn may be sampled by: the worker waits for it
    # (trainer.admit_before_served admits a group before its weights are served); 0: no wait
    generate_from_version: int = Field(0, ge=0)

    @model_serializer(mode="wrap")
    def _defaults_left_out(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        """Without a server of the run's own, ``inference`` is left out, and so is a
        ``generate_from_version`` of 0: the request reads as a 1.2 one, so a worker of the build
        before (whose requests forbid unknown fields) takes it."""
        data = handler(self)
        if data.get("inference") is None:
            data.pop("inference", None)
        if not data.get("generate_from_version"):
            data.pop("generate_from_version", None)
        return data

    @property
    def task_seed(self) -> int:
        """The seed the environment's ``reset`` gets: the group's seed (``shared.ids.group_seed``),
        the same for every member of the group and different for every group of the run."""
        return self.episode_seed - self.episode_index


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
    reward: float = 0.0  # the environment's reward for this turn (StepResult.reward)
    info: dict[str, Any] = Field(default_factory=dict)  # the environment's info for this turn (JSON values)
    timings: TurnTimings = Field(default_factory=TurnTimings)
    segment_start: bool = False  # prompt_token_ids are a whole new context (see module doc)

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


def _flat(turns: list[Turn]) -> FlatSequence:
    token_ids: list[int] = []
    loss_mask: list[int] = []
    logprobs: list[float] = []
    for turn in turns:
        token_ids += turn.prompt_token_ids
        loss_mask += [0] * len(turn.prompt_token_ids)
        logprobs += [0.0] * len(turn.prompt_token_ids)
        token_ids += turn.sampled_token_ids
        loss_mask += [1] * len(turn.sampled_token_ids)
        logprobs += turn.logprobs
    return FlatSequence(token_ids=token_ids, loss_mask=loss_mask, inference_logprobs=logprobs)


class Trajectory(Message):
    request: RolloutRequest
    turns: list[Turn]
    stop_reason: StopReason
    prompt_messages: list[dict[str, str]] = Field(default_factory=list)  # what reset gave, before tokenizing
    observation_role: str = "user"  # the chat role the observations were rendered with
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
        """Every turn's prompt ids then sampled ids, in order: the model's one context when the
        trajectory has one segment, the segments back to back otherwise."""
        return _flat(self.turns)

    def segments(self) -> list[FlatSequence]:
        """One training sequence per segment (a turn with ``segment_start`` opens the next);
        their concatenation is ``flatten()``."""
        cuts = [i for i, turn in enumerate(self.turns) if i == 0 or turn.segment_start]
        return [_flat(self.turns[a:b]) for a, b in zip(cuts, cuts[1:] + [len(self.turns)])]


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


# A float that JSON can carry: NaN and infinity would be written as null and fail the reader,
# so the producer refuses them.
FiniteFloat = Annotated[float, Field(allow_inf_nan=False)]


class _TrainerEventBase(Message):
    trajectory_id: str  # names run_id and group_id (``shared.ids``): an event cannot stray into another group
    run_id: str
    group_id: int
    at: FiniteFloat

    @model_validator(mode="after")
    def _of_its_run_and_group(self) -> "_TrainerEventBase":
        parts = self.trajectory_id.split("_")
        if len(parts) != 4 or parts[0] != self.run_id or parts[1] != str(self.group_id):
            raise ValueError(f"trajectory_id {self.trajectory_id!r} is not a trajectory of run {self.run_id!r}, "
                             f"group {self.group_id} (run_group_episode_seed)")
        return self


class ScoredEvent(_TrainerEventBase):
    """The trajectory was scored. It carries what the trainer reads of the ScoredTrajectory at
    ``scored_key`` (the Trajectory's key and the stop reason), so the trainer reads only the
    Trajectory. Events written before schema 1.1 lack both: readers then read the ScoredTrajectory
    (``shared.trajectory_lookup.trajectory_of_event``)."""

    kind: Literal["scored"] = "scored"
    reward: FiniteFloat
    scored_key: str  # object key of the ScoredTrajectory
    failure_reason: None = None  # always null: kept so the JSON is the same for both kinds (see below)
    trajectory_key: str | None = None  # the Trajectory's object key (as in ScoredTrajectory); None before 1.1
    stop_reason: StopReason | None = None  # the Trajectory's; None before 1.1


class FailedEvent(_TrainerEventBase):
    """The trajectory failed for good, with the reason the ledger records."""

    kind: Literal["failed"] = "failed"
    failure_reason: str = Field(min_length=1)
    reward: None = None  # always null, as above
    scored_key: None = None
    trajectory_key: None = None
    stop_reason: None = None


# What the trainer receives for one trajectory, on the run's trainer stream: a union told apart
# by ``kind``. Each kind requires its own fields; the other kind's fields are present as null,
# so both kinds have the same keys. Schema 1.1 added ``trajectory_key`` and ``stop_reason``:
# 1.1 readers take 1.0 events, but a 1.0 reader refuses the new keys, so upgrade the readers
# (trainer, viewer, export) before the scorer.
TrainerEvent = Annotated[Union[ScoredEvent, FailedEvent], Field(discriminator="kind")]


class ScoringTask(Message):
    """The scoring task's arguments: what a rollout worker publishes on queue ``scoring``, what
    the scorer stores at its claim, and what the scoring reaper publishes again."""

    trajectory_id: str
    trajectory_key: str  # object key of the uploaded Trajectory
    upload_s: FiniteFloat = 0.0  # how long the upload took, for the stage timings


class CheckpointAnnouncement(Message):
    """The trainer's word that checkpoint ``version`` is committed under ``prefix``: one entry of
    the run's checkpoints stream, read by the weight follower. A stream entry is a flat map of
    strings: ``stream_fields()`` writes it, ``parse_message`` reads it back."""

    version: int = Field(ge=0)
    prefix: str = Field(min_length=1)  # ends with "/" (added if missing)

    @field_validator("prefix")
    @classmethod
    def _a_directory(cls, prefix: str) -> str:
        return prefix if prefix.endswith("/") else prefix + "/"

    def stream_fields(self) -> dict[str, str]:
        return {k: str(v) for k, v in self.model_dump(mode="json").items()}


class TrainBatchEntry(Message):
    """A train-queue entry: an accepted group, its batch at ``key``, ready to train on."""

    group_id: int
    key: str  # object key of the TrainingBatch
    oldest_policy_version: int  # of the group's oldest turn: staleness is checked when it is trained on
    env_name: str = ""  # the group's environment, for the per-batch shares (trainer.min_env_share)


class SkippedGroupEntry(Message):
    """A train-queue entry: a dropped group, passed over by a step but counted by it (reward
    metrics, and the cap on the extra groups a step waits for)."""

    group_id: int
    skip: Literal["zero_variance", "filtered"]  # why it was dropped
    rewards: list[FiniteFloat]  # its members' rewards


def _train_entry_kind(entry: Any) -> str:
    skip = entry.get("skip") if isinstance(entry, dict) else getattr(entry, "skip", None)
    return "skip" if skip is not None else "train"


# One entry of the run's train queue (consumer -> training loop), told apart by ``skip``.
TrainQueueEntry = Annotated[
    Union[Annotated[TrainBatchEntry, Tag("train")], Annotated[SkippedGroupEntry, Tag("skip")]],
    Discriminator(_train_entry_kind),
]


class BadMessage(ValueError):
    """A message between processes that does not fit its schema. The text names the message,
    every bad field with what is wrong with it, and the start of the message itself."""

    def __init__(self, what: str, problems: str, raw: object):
        self.what, self.problems, self.raw = what, problems, _shorten(raw)
        super().__init__(f"bad {what}: {problems}; the message: {self.raw}")


def _shorten(raw: object, limit: int = 300) -> str:
    text = raw.decode(errors="replace") if isinstance(raw, (bytes, bytearray)) else raw if isinstance(raw, str) else repr(raw)
    return text if len(text) <= limit else text[:limit] + f"... ({len(text)} characters)"


_ADAPTERS: dict[Any, TypeAdapter] = {}


def parse_message(schema: Any, raw: str | bytes | Any, what: str | None = None) -> Any:
    """Read one message: ``raw`` is JSON text or bytes, or an already decoded object (a dict, a
    stream entry's field map). Returns the model; raises ``BadMessage`` and nothing else."""
    adapter = _ADAPTERS.get(schema)
    if adapter is None:
        adapter = _ADAPTERS[schema] = TypeAdapter(schema)
    what = what or _message_name(schema)
    try:
        if isinstance(raw, (str, bytes, bytearray)):
            return adapter.validate_json(raw)
        return adapter.validate_python(raw)
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(str(part) for part in error['loc']) or '(whole message)'}: {error['msg']}" for error in exc.errors()[:5]
        )
        if exc.error_count() > 5:
            problems += f"; and {exc.error_count() - 5} more"
        raise BadMessage(what, problems, raw) from None


def _message_name(schema: Any) -> str:
    if schema is TrainerEvent:
        return "trainer event"
    if schema is TrainQueueEntry:
        return "train-queue entry"
    return getattr(schema, "__name__", str(schema))


class GroupMember(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    trajectory_id: str
    reward: float | None  # None for a failed member
    advantage: float | None
    failure_reason: str | None = None


GroupStatus = Literal["accepted", "zero_variance", "all_failed", "stale", "filtered"]  # services.trainer.group_decision


class GroupRecord(Message):
    """A completed GRPO group, as the trainer decided it."""

    run_id: str
    group_id: int
    expected_size: int
    members: list[GroupMember]
    reward_mean: float | None
    reward_std: float | None
    status: GroupStatus
    batch_key: str | None = None  # object key of the emitted training batch
    filter_reason: str | None = None  # status "filtered": which filter of trainer.group_filters, and why
    completed_at: float


class EvalEnd(Message):
    """The end signal of one eval pass (``services.trainer.evaluation``): every eval trajectory of
    ``eval_run_id`` is accounted for (or ``timed_out``). One per version, on the run's eval stream."""

    run_id: str  # the training run
    eval_run_id: str
    policy_version: int  # the version evaluated
    served_version: int  # what vLLM served when the pass started
    tasks: int
    trajectories: int
    scored: int
    failed: int
    timed_out: bool
    metrics: dict[str, float]


class RejectedRow(BaseModel):
    """A dataset row intake rejected: where it was (file and line, or split and index) and why."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    source: str
    reason: str


class GroupRegistration(Message):
    """Intake's record of a dispatched group, kept in Redis."""

    run_id: str
    group_id: int
    expected_size: int
    task_id: str
    policy_version: int
    dispatched_at: float
    env_name: str = ""  # the task's environment (per-environment eval metrics); "" in older records
    # group redundancy (rollout.redundancy): the group is decided once ``keep`` members are
    # scored; the others of ``members`` are then failed as superseded. 0: every member counts
    keep: int = Field(0, ge=0)
    members: list[str] = Field(default_factory=list)  # trajectory ids, with redundancy


class TrainingSample(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    trajectory_id: str
    token_ids: list[int]
    loss_mask: list[int]
    inference_logprobs: list[float]
    advantage: float  # the trajectory's: every segment of it gets the same one
    reward: float
    oldest_policy_version: int
    stop_reason: StopReason
    # per-token advantages aligned with token_ids (trainer.token_rewards); None: ``advantage`` on every token
    token_advantages: list[float] | None = None
    segment: int = 0  # which segment of the trajectory (Trajectory.segments) this sample is


class TrainingBatch(Message):
    """What the trainer's optimizer step consumes: one GRPO group, ready to train on."""

    run_id: str
    group_id: int
    samples: list[TrainingSample]
