"""Message schemas: JSON round trips, version and extra-field checks, Trajectory.flatten, the
messages between processes (trainer events as a union, scoring tasks, train-queue entries,
checkpoint announcements) and ``parse_message``'s one error type, naming the bad fields."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from shared.schemas import (
    SCHEMA_VERSION,
    BadMessage,
    CheckpointAnnouncement,
    EpisodeTimings,
    FailedEvent,
    GroupMember,
    GroupRecord,
    GroupRegistration,
    RewardBreakdown,
    RolloutRequest,
    ScoredEvent,
    ScoredTrajectory,
    ScoringTask,
    SkippedGroupEntry,
    StopReason,
    TaskProfile,
    ToolCall,
    TrainBatchEntry,
    TrainerEvent,
    TrainQueueEntry,
    TrainingBatch,
    TrainingSample,
    Trajectory,
    TrajectoryState,
    Turn,
    TurnTimings,
    parse_message,
)


def make_task() -> TaskProfile:
    return TaskProfile(
        task_id="t-1", env_name="guess_number", task_data={"low": 1, "high": 10, "target": 4},
        env_config={"max_turns": 3}, source="data/train.jsonl:1",
    )


def make_request(**kw) -> RolloutRequest:
    base = dict(
        run_id="run", group_id=2, episode_index=1, episode_seed=3, trajectory_id="run_2_1_3",
        group_size=4, task=make_task(), policy_version=5, dispatched_at=1700000000.5,
    )
    base.update(kw)
    return RolloutRequest(**base)


def make_trajectory() -> Trajectory:
    turns = [
        Turn(
            index=0, prompt_token_ids=[1, 2, 3], sampled_token_ids=[10, 11], logprobs=[-0.1, -0.2],
            policy_version=5, finish_reason="stop", completion_text='<tool_call>{"name": "guess"}</tool_call>',
            tool_calls=[ToolCall(name="guess", arguments={"number": 5})], observation="lower",
            timings=TurnTimings(inference_s=0.3, env_step_s=0.01),
        ),
        Turn(
            index=1, prompt_token_ids=[4, 5], sampled_token_ids=[12, 13, 14], logprobs=[-0.3, -0.4, -0.5],
            policy_version=6, finish_reason="length", completion_text="oops", tool_call_error="bad json",
        ),
    ]
    return Trajectory(
        request=make_request(), turns=turns, stop_reason=StopReason.max_turns, env_reward=0.25,
        env_info={"solved": False, "guesses": 1}, attempt=2, worker="w-1",
        timings=EpisodeTimings(queue_wait_s=0.5, episode_s=2.0, inference_s=1.0, env_s=0.1, upload_s=0.05),
    )


def round_trip(model):
    raw = model.model_dump_json()
    json.loads(raw)  # it is real JSON
    back = type(model).model_validate_json(raw)
    assert back == model
    assert back.model_dump() == model.model_dump()
    return back


def test_task_profile_round_trip():
    back = round_trip(make_task())
    assert back.task_data == {"low": 1, "high": 10, "target": 4}
    assert back.schema_version == SCHEMA_VERSION


def test_rollout_request_round_trip():
    back = round_trip(make_request())
    assert back.task.env_name == "guess_number"
    assert back.dispatched_at == 1700000000.5


def test_trajectory_round_trip_with_turns():
    traj = make_trajectory()
    back = round_trip(traj)
    assert back.trajectory_id == "run_2_1_3"
    assert back.stop_reason is StopReason.max_turns
    assert back.turns[0].tool_calls == [ToolCall(name="guess", arguments={"number": 5})]
    assert back.turns[1].tool_call_error == "bad json"
    assert back.turns[0].timings.inference_s == 0.3


def test_scored_trajectory_round_trip():
    round_trip(
        ScoredTrajectory(
            trajectory_id="run_2_1_3", run_id="run", group_id=2, trajectory_key="trajectories/run/000002/run_2_1_3.json.gz",
            reward=0.7, components=[RewardBreakdown(name="verifier", value=0.5, weight=1.0), RewardBreakdown(name="format", value=2.0, weight=0.1)],
            stop_reason=StopReason.done, scored_at=1.5, timings={"scoring": 0.01},
        )
    )


def test_trainer_event_round_trip_both_kinds_through_the_union():
    scored = ScoredEvent(trajectory_id="run_2_1_3", run_id="run", group_id=2, reward=1.0, scored_key="k", at=1.0)
    failed = FailedEvent(trajectory_id="run_2_1_3", run_id="run", group_id=2, failure_reason="boom", at=1.0)
    for event in (scored, failed):
        round_trip(event)
        back = parse_message(TrainerEvent, event.model_dump_json())
        assert type(back) is type(event) and back == event


def test_trainer_event_kind_needs_its_fields():
    base = {"trajectory_id": "r_0_0_0", "run_id": "r", "group_id": 0, "at": 1.0}
    with pytest.raises(BadMessage, match=r"bad trainer event: scored\.scored_key: Field required"):
        parse_message(TrainerEvent, {**base, "kind": "scored", "reward": 1.0})
    with pytest.raises(BadMessage, match=r"failed\.failure_reason: Field required"):
        parse_message(TrainerEvent, {**base, "kind": "failed"})
    with pytest.raises(BadMessage, match=r"failed\.reward: Input should be None"):  # a failed event carries no reward
        parse_message(TrainerEvent, {**base, "kind": "failed", "failure_reason": "x", "reward": 1.0})
    with pytest.raises(BadMessage, match="does not match any of the expected tags"):
        parse_message(TrainerEvent, {**base, "kind": "other"})
    with pytest.raises(ValidationError):
        FailedEvent(**base, failure_reason="")
    with pytest.raises(BadMessage, match=r"trajectory_id 'r_1_0_0' is not a trajectory of run 'r', group 0"):
        parse_message(TrainerEvent, {**base, "trajectory_id": "r_1_0_0", "kind": "failed", "failure_reason": "x"})
    with pytest.raises(BadMessage, match=r"trajectory_id 'other_0_0_0' is not a trajectory of run 'r'"):
        parse_message(TrainerEvent, {**base, "trajectory_id": "other_0_0_0", "kind": "failed", "failure_reason": "x"})


def test_trainer_events_keep_the_json_of_schema_1_0():
    """Schema 1.0 had one event class with every field, null where unused: a 1.1 reader takes
    the events a 1.0 scorer wrote."""
    old_scored = ('{"schema_version": "1.0", "kind": "scored", "trajectory_id": "r_0_0_0", "run_id": "r", "group_id": 0,'
                  ' "reward": 0.5, "scored_key": "k", "failure_reason": null, "at": 1.0}')
    old_failed = ('{"schema_version": "1.0", "kind": "failed", "trajectory_id": "r_0_1_1", "run_id": "r", "group_id": 0,'
                  ' "reward": null, "scored_key": null, "failure_reason": "env_error", "at": 1.0}')
    assert isinstance(parse_message(TrainerEvent, old_scored), ScoredEvent)
    assert isinstance(parse_message(TrainerEvent, old_failed), FailedEvent)
    assert parse_message(TrainerEvent, old_scored).trajectory_key is None  # readers then read the ScoredTrajectory
    for event in (parse_message(TrainerEvent, old_scored), parse_message(TrainerEvent, old_failed)):
        # both kinds keep the same keys: 1.0's, and 1.1's trajectory_key and stop_reason
        assert json.loads(event.model_dump_json()).keys() == json.loads(old_scored).keys() | {"trajectory_key", "stop_reason"}


def test_scoring_task_round_trip_and_bad_fields_named():
    task = round_trip(ScoringTask(trajectory_id="run_2_1_3", trajectory_key="trajectories/run/x.json.gz", upload_s=0.2))
    assert parse_message(ScoringTask, task.model_dump(mode="json")) == task
    with pytest.raises(BadMessage, match=r"bad ScoringTask: trajectory_key: Field required; upload_s: Input should be a valid number"):
        parse_message(ScoringTask, {"trajectory_id": "run_2_1_3", "upload_s": "x"})


def test_train_queue_entries_are_told_apart_by_skip():
    batch = TrainBatchEntry(group_id=1, key="batches/run/000001.json.gz", oldest_policy_version=3)
    skipped = SkippedGroupEntry(group_id=2, skip="zero_variance", rewards=[0.5, 0.5])
    for entry in (batch, skipped):
        assert parse_message(TrainQueueEntry, entry.model_dump_json()) == entry
    # the entries the trainer wrote before they had a schema still read
    assert parse_message(TrainQueueEntry, '{"key": "k", "oldest_policy_version": 0, "group_id": 5}') == TrainBatchEntry(
        group_id=5, key="k", oldest_policy_version=0)
    assert isinstance(parse_message(TrainQueueEntry, '{"skip": "zero_variance", "group_id": 5, "rewards": []}'), SkippedGroupEntry)
    with pytest.raises(BadMessage, match=r"bad train-queue entry: skip\.skip: Input should be 'zero_variance'"):
        parse_message(TrainQueueEntry, '{"skip": "stale", "group_id": 5, "rewards": []}')
    with pytest.raises(BadMessage, match=r"train\.oldest_policy_version: Field required"):
        parse_message(TrainQueueEntry, '{"key": "k", "group_id": 5}')


def test_checkpoint_announcement_is_a_flat_stream_entry():
    ann = CheckpointAnnouncement(version=3, prefix="checkpoints/run/000003")
    assert ann.prefix == "checkpoints/run/000003/"
    fields = ann.stream_fields()
    assert all(isinstance(v, str) for v in fields.values())
    assert parse_message(CheckpointAnnouncement, fields) == ann
    assert parse_message(CheckpointAnnouncement, {"version": "3", "prefix": "checkpoints/run/000003/"}) == ann  # no schema_version: 1.0
    for bad, problem in [({"version": "-1", "prefix": "p/"}, "version: Input should be greater than or equal to 0"),
                         ({"version": "3"}, "prefix: Field required"), ({"version": "x", "prefix": "p"}, "version: Input should be a valid integer"),
                         ({"version": "3", "prefix": ""}, "prefix: String should have at least 1 character")]:
        with pytest.raises(BadMessage, match=problem):
            parse_message(CheckpointAnnouncement, bad)


@pytest.mark.parametrize("raw", ["", "{", "null", "[]", b"\xff\xfe", "[" * 10_000, '{"a": ' * 5000, 12, None])
def test_parse_message_raises_only_bad_message_and_shows_the_start_of_the_message(raw):
    with pytest.raises(BadMessage) as info:
        parse_message(TrainerEvent, raw)
    assert str(info.value).startswith("bad trainer event: ")
    assert len(str(info.value)) < 1000  # a huge message is shortened


def test_group_record_round_trip():
    round_trip(
        GroupRecord(
            run_id="run", group_id=3, expected_size=2,
            members=[
                GroupMember(trajectory_id="run_3_0_3", reward=1.0, advantage=1.0),
                GroupMember(trajectory_id="run_3_1_4", reward=None, advantage=None, failure_reason="env_error"),
            ],
            reward_mean=1.0, reward_std=0.0, status="zero_variance", completed_at=2.0,
        )
    )
    round_trip(GroupRegistration(run_id="run", group_id=3, expected_size=2, task_id="t", policy_version=0, dispatched_at=1.0))


def test_training_batch_round_trip():
    sample = TrainingSample(
        trajectory_id="run_3_0_3", token_ids=[1, 2, 3], loss_mask=[0, 1, 1], inference_logprobs=[0.0, -0.1, -0.2],
        advantage=-0.5, reward=0.0, oldest_policy_version=4, stop_reason=StopReason.done,
    )
    back = round_trip(TrainingBatch(run_id="run", group_id=3, samples=[sample, sample]))
    assert back.samples[0].stop_reason is StopReason.done


@pytest.mark.parametrize("version", ["2.0", "0.9", "10.0"])
def test_unknown_major_schema_version_is_rejected(version):
    raw = json.loads(make_request().model_dump_json())
    raw["schema_version"] = version
    with pytest.raises(ValidationError, match="schema_version"):
        RolloutRequest.model_validate(raw)
    with pytest.raises(ValidationError, match="schema_version"):
        TaskProfile(task_id="t", env_name="qa", task_data={}, schema_version=version)


def test_newer_minor_schema_version_is_accepted():
    raw = json.loads(make_task().model_dump_json())
    raw["schema_version"] = "1.7"
    assert TaskProfile.model_validate(raw).schema_version == "1.7"


def test_nested_message_with_wrong_major_version_is_rejected():
    raw = json.loads(make_trajectory().model_dump_json())
    raw["request"]["task"]["schema_version"] = "2.0"
    with pytest.raises(ValidationError):
        Trajectory.model_validate(raw)


def test_extra_fields_are_rejected_top_level_and_nested():
    raw = json.loads(make_trajectory().model_dump_json())
    raw["typo_field"] = 1
    with pytest.raises(ValidationError, match="typo_field"):
        Trajectory.model_validate(raw)
    raw = json.loads(make_trajectory().model_dump_json())
    raw["turns"][0]["extra"] = 1
    with pytest.raises(ValidationError, match="extra"):
        Trajectory.model_validate(raw)
    with pytest.raises(ValidationError):
        FailedEvent(trajectory_id="r_0_0_0", run_id="r", group_id=0, failure_reason="x", at=1.0, bogus=2)


def test_turn_with_wrong_logprob_count_is_rejected():
    with pytest.raises(ValidationError, match="2 logprobs for 3 sampled tokens"):
        Turn(index=0, prompt_token_ids=[1], sampled_token_ids=[1, 2, 3], logprobs=[-0.1, -0.2],
             policy_version=0, finish_reason="stop", completion_text="")
    with pytest.raises(ValidationError):
        Turn(index=0, prompt_token_ids=[1], sampled_token_ids=[], logprobs=[-0.1],
             policy_version=0, finish_reason="stop", completion_text="")


def test_flatten_concatenates_tokens_and_masks_exactly_the_sampled_ones():
    flat = make_trajectory().flatten()
    assert flat.token_ids == [1, 2, 3, 10, 11, 4, 5, 12, 13, 14]
    assert flat.loss_mask == [0, 0, 0, 1, 1, 0, 0, 1, 1, 1]
    assert flat.inference_logprobs == [0.0, 0.0, 0.0, -0.1, -0.2, 0.0, 0.0, -0.3, -0.4, -0.5]
    assert len(flat.token_ids) == len(flat.loss_mask) == len(flat.inference_logprobs)
    sampled = [t for t, m in zip(flat.token_ids, flat.loss_mask) if m == 1]
    assert sampled == [10, 11, 12, 13, 14]


def test_flatten_of_trajectory_without_turns_is_empty():
    traj = Trajectory(request=make_request(), turns=[], stop_reason=StopReason.infra_error, error="down")
    flat = traj.flatten()
    assert flat.token_ids == [] and flat.loss_mask == [] and flat.inference_logprobs == []


def test_messages_are_frozen():
    task = make_task()
    with pytest.raises(ValidationError):
        task.task_id = "other"


def test_terminal_states():
    assert {s for s in TrajectoryState if s.terminal} == {TrajectoryState.consumed, TrajectoryState.failed}


def test_a_rollout_request_of_schema_1_1_still_reads_its_dispatched_count_from_group_size():
    from shared.schemas import RolloutRequest

    old = {"schema_version": "1.1", "run_id": "r", "group_id": 2, "episode_index": 0, "episode_seed": 7,
           "trajectory_id": "r_2_0_7", "group_size": 5, "dispatched_at": 0.0,
           "task": {"task_id": "t", "env_name": "single_turn", "task_data": {}}}
    request = RolloutRequest.model_validate(old)
    assert request.members_dispatched == 5
    assert "group_size" not in request.model_dump() and request.model_dump()["members_dispatched"] == 5
