"""Chat templates that are not append-only (issue 27): the tiny model with the ``reasoning``
template (``services.inference.tiny_model.TEMPLATES``), which drops the reasoning of assistant
turns before the last user message, as Qwen3's does. Rendering a grown conversation then
changes text rendered before, yet the trainer trains on exactly the ids vLLM sampled:

- the token loop never renders history again: an observation appends the template's frame only;
- the recording proxy keeps a reply echoed back as it was sampled in its context, and a history
  that does not extend the recorded one opens a segment, rendered afresh, whose loss mask covers
  exactly that turn's sampled ids; the trainer's mismatch metric on it stays at the fp32 floor.

The slow tests run the real proxy in front of the session's vLLM (``served_model``): vLLM takes
token ids, the template is Conveyor's, and the reasoning variant has the served model's weights
and vocabulary, byte for byte (asserted). The fast tests make a reply with reasoning from the
tokenizer (a ``Completion`` stands in for vLLM there): the random tiny model never samples one.
"""

from __future__ import annotations

import filecmp

import openai
import pytest
import torch
from agent_support import assert_recorded_as_vllm_sampled, running_proxy

from services.inference.tiny_model import generate_tiny_model
from services.rollout_worker.agents.proxy import RecordingLimits
from services.rollout_worker.agents.proxy.messages import template_messages
from services.rollout_worker.agents.proxy.recording import AgentRecording
from services.rollout_worker.chat_tokens import load_chat_tokens
from services.rollout_worker.inference_client import Completion, InferenceClient
from services.trainer.batching import micro_batches, prepare_samples
from services.trainer.group_decision import training_batch
from services.policy.model import load_policy, sequence_logprobs
from services.trainer.step import PolicyTrainer
from services.policy.probe import FP32_TOLERANCE
from shared.schemas import ScoredEvent, StopReason, Trajectory
from shared.settings import ALARM_MAD_BY_DTYPE, BatchingSettings, TrainerSettings
from unit.test_schemas import make_request

SERVED = "tiny"
LIMITS = RecordingLimits(max_tokens_per_turn=24, max_episode_tokens=400, max_model_len=1024, max_turns=20)
REASONING = "<think>\nthe secret is above {n}\n</think>\n\n"


@pytest.fixture(scope="module")
def reasoning_dir(tmp_path_factory):
    """The session vLLM's tiny model (seed 0, end-of-turn bias 4) with the reasoning template."""
    return generate_tiny_model(tmp_path_factory.mktemp("reasoning") / "tiny", end_of_turn_bias=4.0, template="reasoning")


@pytest.fixture(scope="module")
def chat(reasoning_dir):
    return load_chat_tokens(reasoning_dir)


def _ids(chat, text: str) -> list[int]:
    return list(chat.tokenizer(text, add_special_tokens=False)["input_ids"])


def test_the_template_rewrites_earlier_turns(chat):
    history = [{"role": "user", "content": "guess"}, {"role": "assistant", "content": REASONING.format(n=10) + "50"}]
    before = chat.tokenizer.apply_chat_template(history, tokenize=False)
    after = chat.tokenizer.apply_chat_template(history + [{"role": "user", "content": "higher"}], tokenize=False)
    assert "<think>" in before and "<think>" not in after
    assert not after.startswith(before)  # not append-only: what was rendered changed


def test_the_token_loop_appends_the_observation_frame_only(chat):
    """``episode/loop.py``'s context: prompt, sampled ids, ``observation_ids``; never re-rendered."""
    prompt = chat.initial_prompt([{"role": "user", "content": "guess"}])
    sampled = _ids(chat, REASONING.format(n=10) + "50") + [chat.eos_token_id]
    observation = chat.observation_ids("higher", sampled_ended_with_eos=True)
    assert chat.tokenizer.decode(observation) == "\n<|im_start|>user\nhigher<|im_end|>\n<|im_start|>assistant\n"
    context = prompt + sampled + observation
    assert "<think>" in chat.tokenizer.decode(context)  # the sampled reasoning stays as sampled
    rendered_afresh = chat.initial_prompt([{"role": "user", "content": "guess"},
                                           {"role": "assistant", "content": REASONING.format(n=10) + "50"},
                                           {"role": "user", "content": "higher"}])
    assert rendered_afresh != context  # what the template would render now: not what the model sampled


def test_a_reply_echoed_with_its_reasoning_extends_the_sequence_as_sampled(chat):
    """A reply whose text holds reasoning, echoed back as it was (as Cline does): the call extends
    the recorded context, so its ids stay the sampled ones though the template would drop them."""
    recording = AgentRecording(chat, LIMITS)
    first = [{"role": "user", "content": "guess"}]
    sampled = _ids(chat, REASONING.format(n=10) + "50") + [chat.eos_token_id]
    call1 = recording.prepare(template_messages(first), [], None, 0)
    reply = recording.record(call1, Completion(sampled, [-0.5] * len(sampled), "stop", None), [])
    second = first + [{"role": "assistant", "content": reply.text}, {"role": "user", "content": "higher"}]
    call2 = recording.prepare(template_messages(second), [], None, 0)
    assert not call2.segment_start and call2.context == call1.context + sampled + call2.new_ids
    assert chat.tokenizer.decode(call2.new_ids) == "\n<|im_start|>user\nhigher<|im_end|>\n<|im_start|>assistant\n"


# ---------------------------------------------------------------- slow: the session's vLLM

@pytest.fixture(scope="module")
def proxy(tmp_path_factory, served_model, reasoning_dir):
    for name in ("model.safetensors", "config.json", "tokenizer.json"):  # only the template differs
        assert filecmp.cmp(reasoning_dir / name, served_model.model_dir / name, shallow=False), name
    with running_proxy(reasoning_dir, InferenceClient(served_model.base_url, SERVED), SERVED,
                       tmp_path_factory.mktemp("rewriting") / "sockets") as server:
        server.vllm = served_model
        yield server


@pytest.fixture(scope="module")
def trajectory(proxy):
    """Three calls from an agent that sends its whole history, its assistant turns with their
    reasoning (the reply's text after a ``<think>`` block): the template drops that reasoning."""
    session = proxy.loop.run(proxy.open_session("run_2_1_3", LIMITS, lambda: 0))
    client = openai.OpenAI(base_url=proxy.url, api_key=session.key)
    messages = [{"role": "system", "content": "Guess the number."}, {"role": "user", "content": "Your first guess?"}]
    for n in range(3):
        reply = client.chat.completions.create(model=SERVED, messages=messages)
        messages += [{"role": "assistant", "content": REASONING.format(n=n) + (reply.choices[0].message.content or "")},
                     {"role": "user", "content": "higher"}]
    turns = list(session.turns)
    proxy.loop.run(proxy.close_session(session))
    return Trajectory(request=make_request(), turns=turns, stop_reason=StopReason.done)


def _training_batch(trajectory):
    """The trainer's batch of a group of one: ``trajectory``, scored 1.0, advantage 1.0."""
    scored = ScoredEvent(trajectory_id="run_2_1_3", run_id="run", group_id=2, reward=1.0, scored_key="k", at=1.0)
    return training_batch("run", 2, [scored], [1.0], lambda _: trajectory, TrainerSettings())


@pytest.mark.slow
def test_each_rewritten_history_is_a_segment_that_trains_exactly_the_sampled_ids(proxy, trajectory):
    turns = trajectory.turns
    assert [t.segment_start for t in turns] == [False, True, True]
    segments = trajectory.segments()
    assert len(segments) == 3
    for turn, segment in zip(turns, segments):
        assert segment.token_ids == turn.prompt_token_ids + turn.sampled_token_ids
        # rendered afresh by the template: the reasoning the agent sent back is not in the prompt
        assert "<think>" not in proxy.chat.tokenizer.decode(turn.prompt_token_ids)
        assert [i for i, m in zip(segment.token_ids, segment.loss_mask) if m] == turn.sampled_token_ids
        assert [lp for lp, m in zip(segment.inference_logprobs, segment.loss_mask) if m] == turn.logprobs
    # each segment's prompt, sent again to vLLM with the turn's seed, gives the recorded ids and logprobs
    assert_recorded_as_vllm_sampled(proxy.vllm.base_url, "run_2_1_3", turns)
    # no sampled id lost or counted twice across segments
    trained = [i for s in segments for i, m in zip(s.token_ids, s.loss_mask) if m]
    assert trained == [i for t in turns for i in t.sampled_token_ids]

    # the trainer's samples: one per segment, loss mask 1 on exactly the sampled ids
    batch = _training_batch(trajectory)
    assert [s.segment for s in batch.samples] == [0, 1, 2]
    prepared = prepare_samples(batch.samples, BatchingSettings(max_seq_len=1024, micro_batch_tokens=4096))
    assert prepared.dropped == []
    rows = [row for mb in micro_batches(prepared.samples, 4096, 0)
            for row in zip(mb.input_ids, mb.loss_mask, mb.old_logprobs)]
    assert len(rows) == 3
    by_ids = {tuple(t.sampled_token_ids): t for t in turns}
    for ids, mask, old in rows:
        turn = by_ids[tuple(ids[mask == 1].tolist())]
        assert old[mask == 1].tolist() == pytest.approx(turn.logprobs, abs=0)


@pytest.mark.slow
def test_the_mismatch_metric_stays_at_its_fp32_floor(proxy, trajectory):
    model, tokenizer = load_policy(proxy.vllm.model_dir)
    with torch.no_grad():
        for segment in trajectory.segments():  # the trainer's logprobs against vLLM's, on each segment
            ids = torch.tensor([segment.token_ids])
            trainer_logprobs = sequence_logprobs(model, ids, torch.ones_like(ids))[0]
            mask = torch.tensor(segment.loss_mask, dtype=torch.bool)
            vllm_logprobs = torch.tensor(segment.inference_logprobs)
            assert float((trainer_logprobs[mask] - vllm_logprobs[mask]).abs().mean()) < FP32_TOLERANCE
    # and the metric the logprob alarm reads, from a real training step on the trajectory's samples
    batch = _training_batch(trajectory)
    metrics = PolicyTrainer(model, tokenizer.pad_token_id).train_step([batch])
    assert metrics["sequences"] == 3 and metrics["alarm"] == 0
    assert metrics["logprob_mad_on_policy"] < ALARM_MAD_BY_DTYPE["fp32"]
