"""Fuzz the messages between processes (``shared.schemas``): whatever arrives on a queue, a
stream or a list, ``parse_message`` returns the message or raises ``BadMessage`` naming it,
and nothing else, so a consumer can log it, dead-letter it and go on; every message a producer
can build comes back equal from its wire form. Examples per target: ``FUZZ_EXAMPLES``
(tests/fuzz_support.py).

Inputs: arbitrary text and bytes, deeply nested JSON, JSON-like objects, and valid messages
with a field replaced, dropped or added (so the checks past the first field are reached).
"""

from __future__ import annotations

import json

from fuzz_support import FUZZ, json_like, nested, text
from hypothesis import event, given, strategies as st

from shared.names import checkpoint_prefix
from shared.schemas import (
    BadMessage,
    CheckpointAnnouncement,
    FailedEvent,
    GroupRegistration,
    RolloutRequest,
    ScoredEvent,
    ScoringTask,
    SkippedGroupEntry,
    StopReason,
    TaskProfile,
    TrainBatchEntry,
    TrainerEvent,
    TrainQueueEntry,
    Trajectory,
    Turn,
    parse_message,
)

TASK = TaskProfile(task_id="t", env_name="guess_number", task_data={"low": 1, "high": 9, "target": 3})
REQUEST = RolloutRequest(run_id="r", group_id=1, episode_index=0, episode_seed=5, trajectory_id="r_1_0_5", members_dispatched=4,
                         task=TASK, dispatched_at=1.0)
TEMPLATES = {  # schema -> a valid message of it, as its producer writes it (before JSON)
    TrainerEvent: [ScoredEvent(trajectory_id="r_1_0_5", run_id="r", group_id=1, reward=0.5, scored_key="k", at=1.0)
                   .model_dump(mode="json"),
                   FailedEvent(trajectory_id="r_1_0_5", run_id="r", group_id=1, failure_reason="env_error", at=1.0)
                   .model_dump(mode="json")],
    ScoringTask: [ScoringTask(trajectory_id="r_1_0_5", trajectory_key="trajectories/r/x.json.gz", upload_s=0.1).model_dump(mode="json")],
    TrainQueueEntry: [TrainBatchEntry(group_id=1, key="batches/r/000001.json.gz", oldest_policy_version=0).model_dump(mode="json"),
                      SkippedGroupEntry(group_id=1, skip="zero_variance", rewards=[0.5, 0.5]).model_dump(mode="json")],
    CheckpointAnnouncement: [CheckpointAnnouncement(version=2, prefix=checkpoint_prefix("r", 2)).stream_fields()],
    GroupRegistration: [GroupRegistration(run_id="r", group_id=1, expected_size=4, task_id="t", policy_version=0,
                                          dispatched_at=1.0).model_dump(mode="json")],
    RolloutRequest: [REQUEST.model_dump(mode="json")],
    Trajectory: [Trajectory(request=REQUEST, stop_reason=StopReason.done, turns=[Turn(
        index=0, prompt_token_ids=[1, 2], sampled_token_ids=[3], logprobs=[-0.5], policy_version=0, finish_reason="stop",
        completion_text="x")]).model_dump(mode="json")],
}
SCHEMAS = list(TEMPLATES)
anything = json_like()


def near_valid(schema) -> st.SearchStrategy[dict]:
    def mutate(template: dict) -> st.SearchStrategy[dict]:
        fields = sorted(template)
        return st.tuples(st.dictionaries(st.sampled_from(fields) | text, anything, max_size=2),
                         st.sets(st.sampled_from(fields), max_size=1)).map(
            lambda t: {k: v for k, v in {**template, **t[0]}.items() if k not in t[1]})
    return st.sampled_from(TEMPLATES[schema]).flatmap(mutate)


def wire(value, form: str):
    """The value as it would arrive: JSON text, JSON bytes, or an already decoded object."""
    if form == "object":
        return value
    doc = json.dumps(value)  # NaN and infinities go out as Python's json writes them
    return doc if form == "text" else doc.encode()


def members(schema) -> tuple[type, ...]:
    if schema is TrainerEvent:
        return (ScoredEvent, FailedEvent)
    if schema is TrainQueueEntry:
        return (TrainBatchEntry, SkippedGroupEntry)
    return (schema,)


@FUZZ
@given(schema=st.sampled_from(SCHEMAS), data=st.data(), form=st.sampled_from(["object", "text", "bytes"]))
def test_any_input_is_a_message_or_a_bad_message(schema, data, form):
    raw = data.draw(st.one_of(near_valid(schema).map(lambda v: wire(v, form)), near_valid(schema).map(lambda v: wire(v, form)),
                              anything.map(lambda v: wire(v, form)), text, st.binary(max_size=60), nested()))
    try:
        message = parse_message(schema, raw)
    except BadMessage as exc:
        assert str(exc).startswith("bad ") and exc.problems
        event(f"{getattr(schema, '__name__', 'union')}: bad")
        return
    assert isinstance(message, members(schema))
    event(f"{getattr(schema, '__name__', 'union')}: read")


finite = st.floats(allow_nan=False, allow_infinity=False)
ints = st.integers(-(2**63), 2**63)

@st.composite
def of_a_trajectory(draw, event: type):
    """The event's ids, as ``shared.ids`` makes them: the trajectory id names run and group."""
    run_id, group_id = draw(text.filter(lambda r: "_" not in r)), draw(ints)
    trajectory_id = f"{run_id}_{group_id}_{draw(st.integers(0, 64))}_{draw(ints)}"
    if event is ScoredEvent:
        return ScoredEvent(trajectory_id=trajectory_id, run_id=run_id, group_id=group_id, reward=draw(finite),
                           scored_key=draw(text), at=draw(finite))
    return FailedEvent(trajectory_id=trajectory_id, run_id=run_id, group_id=group_id, failure_reason=draw(text.filter(bool)),
                       at=draw(finite))


messages = st.one_of(
    of_a_trajectory(ScoredEvent),
    of_a_trajectory(FailedEvent),
    st.builds(ScoringTask, trajectory_id=text, trajectory_key=text, upload_s=finite),
    st.builds(TrainBatchEntry, group_id=ints, key=text, oldest_policy_version=ints),
    st.builds(SkippedGroupEntry, group_id=ints, skip=st.just("zero_variance"), rewards=st.lists(finite, max_size=8)),
    st.builds(CheckpointAnnouncement, version=st.integers(0, 2**63), prefix=text.filter(bool)),
)
SCHEMA_OF = {ScoredEvent: TrainerEvent, FailedEvent: TrainerEvent, SkippedGroupEntry: TrainQueueEntry,
             TrainBatchEntry: TrainQueueEntry}


@FUZZ
@given(message=messages)
def test_every_message_a_producer_builds_comes_back_equal(message):
    schema = SCHEMA_OF.get(type(message), type(message))
    if isinstance(message, CheckpointAnnouncement):
        back = parse_message(schema, message.stream_fields())  # a stream entry: a flat map of strings
    else:
        back = parse_message(schema, message.model_dump_json())
    assert type(back) is type(message) and back == message


@given(bad=st.sampled_from([float("nan"), float("inf"), -float("inf")]))
def test_a_producer_cannot_build_a_message_json_would_change(bad):
    """NaN would be written as null and refused by the reader: the producer refuses it first."""
    for build in (lambda: ScoredEvent(trajectory_id="t", run_id="r", group_id=0, reward=bad, scored_key="k", at=1.0),
                  lambda: ScoringTask(trajectory_id="t", trajectory_key="k", upload_s=bad),
                  lambda: SkippedGroupEntry(group_id=0, skip="zero_variance", rewards=[bad])):
        try:
            build()
        except ValueError:
            continue
        raise AssertionError(f"{build} accepted {bad}")

