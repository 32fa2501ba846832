"""The recording proxy's bookkeeping, on the tiny model's real tokenizer and chat template:
which calls join one sequence, which start a segment, what the trainer gets from each.

vLLM's answers are stood in for by ``Completion`` values here (the tokens it would return);
``test_agent_proxy.py`` runs the same path against a real vLLM.
"""

from __future__ import annotations

import json

import pytest

from services.inference.tiny_model import generate_tiny_model
from services.rollout_worker.agents.proxy.messages import BadChatRequest, template_messages
from services.rollout_worker.agents.proxy.recording import AgentRecording, BudgetExhausted, RecordingLimits
from services.rollout_worker.chat_tokens import load_chat_tokens
from services.rollout_worker.inference_client import Completion
from shared.schemas import StopReason, Trajectory
from unit.test_schemas import make_request

LIMITS = RecordingLimits(max_tokens_per_turn=32, max_episode_tokens=200, max_model_len=1024, max_turns=10)
TOOLS = [{"type": "function", "function": {"name": "run", "parameters": {"type": "object"}}}]


@pytest.fixture(scope="module")
def chat(tmp_path_factory):
    return load_chat_tokens(generate_tiny_model(tmp_path_factory.mktemp("recording") / "tiny", end_of_turn_bias=4.0))


def _sampled(chat, text: str, eos: bool = True) -> Completion:
    ids = list(chat.tokenizer(text, add_special_tokens=False)["input_ids"]) + ([chat.eos_token_id] if eos else [])
    return Completion(ids, [-0.5] * len(ids), "stop" if eos else "length", None)


def _call(recording, messages, completion, tools=(), version=0):
    call = recording.prepare(template_messages(messages), list(tools), None, version)
    return call, recording.record(call, completion, list(tools))


def test_a_call_that_extends_the_last_one_joins_its_sequence(chat):
    recording = AgentRecording(chat, LIMITS)
    first = [{"role": "system", "content": "fix the bug"}, {"role": "user", "content": "go"}]
    call1, reply1 = _call(recording, first, _sampled(chat, "look at the tests"), version=3)
    # the agent echoes the reply back, as OpenAI clients do, and adds the next user message
    second = first + [{"role": "assistant", "content": reply1.text}, {"role": "user", "content": "tests fail"}]
    call2, reply2 = _call(recording, second, _sampled(chat, "ok"), version=4)

    assert not call2.segment_start
    assert call2.context[: len(call1.context) + len(reply1.turn.sampled_token_ids)] == call1.context + reply1.turn.sampled_token_ids
    # the new ids are the template's rendering after an assistant turn, the sampled end marker not repeated
    rendered = chat.tokenizer.decode(call2.new_ids)
    assert rendered.startswith("\n<|im_start|>user\ntests fail<|im_end|>") and rendered.endswith("<|im_start|>assistant\n")
    trajectory_turns = recording.turns
    assert [t.policy_version for t in trajectory_turns] == [3, 4]
    assert trajectory_turns[0].observation == "tests fail"
    flat = _trajectory(trajectory_turns).flatten()
    assert flat.token_ids == call2.context + reply2.turn.sampled_token_ids  # exactly what the model saw and sampled
    assert sum(flat.loss_mask) == len(reply1.turn.sampled_token_ids) + len(reply2.turn.sampled_token_ids)
    assert [lp for lp, m in zip(flat.inference_logprobs, flat.loss_mask) if m] == [-0.5] * sum(flat.loss_mask)


def test_tool_calls_echoed_back_in_openai_form_still_extend(chat):
    recording = AgentRecording(chat, LIMITS)
    first = [{"role": "user", "content": "run the tests"}]
    _, reply = _call(recording, first, _sampled(chat, 'sure <tool_call>{"name": "run", "arguments": {"cmd": "pytest"}}</tool_call>'), TOOLS)
    assert reply.finish_reason == "tool_calls" and reply.text == "sure"
    assert [(c.name, c.arguments) for c in reply.tool_calls] == [("run", {"cmd": "pytest"})]
    echoed = {"role": "assistant", "content": "sure", "tool_calls": [
        {"id": "call_0_0", "type": "function", "function": {"name": "run", "arguments": json.dumps({"cmd": "pytest"}, indent=2)}}]}
    call2, _ = _call(recording, first + [echoed, {"role": "tool", "tool_call_id": "call_0_0", "content": "1 failed"}],
                     _sampled(chat, "fixing"), TOOLS)
    assert not call2.segment_start and recording.turns[0].observation == "1 failed"


def test_a_rewritten_history_starts_a_segment_and_each_segment_trains(chat):
    recording = AgentRecording(chat, LIMITS)
    history = [{"role": "user", "content": "step one"}]
    _, reply = _call(recording, history, _sampled(chat, "done one"))
    history += [{"role": "assistant", "content": reply.text}, {"role": "user", "content": "step two"}]
    _call(recording, history, _sampled(chat, "done two"))
    compacted = [{"role": "system", "content": "summary: one and two done"}, {"role": "user", "content": "step three"}]
    call3, _ = _call(recording, compacted, _sampled(chat, "done three"))

    assert call3.segment_start and call3.new_ids == call3.context  # rendered whole, from scratch
    trajectory = _trajectory(recording.turns)
    segments = trajectory.segments()
    assert len(segments) == 2
    assert sum(len(s.token_ids) for s in segments) == len(trajectory.flatten().token_ids)
    assert segments[1].token_ids[: len(call3.context)] == call3.context
    for segment in segments:  # the loss mask covers sampled ids only, in each segment
        assert segment.loss_mask[0] == 0 and segment.loss_mask[-1] == 1


def test_asking_the_same_thing_again_is_a_new_segment(chat):
    recording = AgentRecording(chat, LIMITS)
    messages = [{"role": "user", "content": "hello"}]
    _call(recording, messages, _sampled(chat, "hi"))
    call, _ = _call(recording, messages, _sampled(chat, "hey"))
    assert call.segment_start


def test_budgets_stop_calls_and_say_why(chat):
    recording = AgentRecording(chat, RecordingLimits(max_tokens_per_turn=8, max_episode_tokens=10, max_model_len=1024, max_turns=10))
    call = recording.prepare(template_messages([{"role": "user", "content": "go"}]), [], 100, 0)
    assert call.max_tokens == 8  # the agent's max_tokens can only lower the rollout's limit
    recording.record(call, _sampled(chat, "one two three four five six", eos=False), [])
    left = 10 - len(recording.turns[0].sampled_token_ids)
    if left > 0:
        messages = [{"role": "user", "content": "go"}, {"role": "assistant", "content": recording.turns[0].completion_text},
                    {"role": "user", "content": "more"}]
        assert recording.prepare(template_messages(messages), [], None, 0).max_tokens == left
        recording.record(recording.prepare(template_messages(messages), [], None, 0), _sampled(chat, "x " * left, eos=False), [])
    with pytest.raises(BudgetExhausted, match="max_tokens"):
        recording.prepare(template_messages([{"role": "user", "content": "again"}]), [], None, 0)
    assert recording.exhausted is StopReason.max_tokens

    tight = AgentRecording(chat, RecordingLimits(max_tokens_per_turn=8, max_episode_tokens=100, max_model_len=12, max_turns=10))
    with pytest.raises(BudgetExhausted, match="context_exhausted"):
        tight.prepare(template_messages([{"role": "user", "content": "a long opening message for a tiny context"}]), [], None, 0)


@pytest.mark.parametrize("messages, error", [
    ([], "non-empty list"),
    ([{"role": "wizard", "content": "x"}], r"messages\[0\]: role 'wizard'"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}], r"messages\[0\]: content part 0 of type 'image_url'"),
    ([{"role": "user", "content": "a"}, {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "f", "arguments": "{oops"}}]}],
     r"messages\[1\]\.tool_calls\[0\]: arguments are not JSON"),
])
def test_bad_messages_are_refused_with_where_and_what(messages, error):
    with pytest.raises(BadChatRequest, match=error):
        template_messages(messages)


def _trajectory(turns):
    return Trajectory(request=make_request(), turns=turns, stop_reason=StopReason.done)
