"""Samples to tensors: truncation keeps the prompt, overlong masking, token-budget micro-batches."""

from __future__ import annotations

import pytest
import torch

from services.trainer.batching import (
    BatchingSettings,
    collate,
    micro_batches,
    plan_micro_batches,
    prepare_sample,
    prepare_samples,
)
from shared.schemas import StopReason, TrainingSample


def _sample(prompt: int, completion: int, stop: StopReason = StopReason.done, tid: str = "t", adv: float = 1.0) -> TrainingSample:
    ids = list(range(100, 100 + prompt + completion))
    mask = [0] * prompt + [1] * completion
    lps = [0.0] * prompt + [-(i + 1) / 10 for i in range(completion)]
    return TrainingSample(trajectory_id=tid, token_ids=ids, loss_mask=mask, inference_logprobs=lps,
                          advantage=adv, reward=1.0, oldest_policy_version=0, stop_reason=stop)


def test_truncation_keeps_the_prompt_and_cuts_the_tail() -> None:
    s = _sample(prompt=5, completion=10)
    p = prepare_sample(s, max_seq_len=8)
    assert p.truncated
    assert p.token_ids == s.token_ids[:8]  # the whole prompt, then the first 3 sampled tokens
    assert p.loss_mask == [0] * 5 + [1] * 3
    assert p.inference_logprobs == s.inference_logprobs[:8]
    untouched = prepare_sample(s, max_seq_len=15)
    assert not untouched.truncated and untouched.token_ids == s.token_ids


def test_multi_turn_truncation_keeps_the_first_prompt() -> None:
    # prompt 3, sampled 2, observation 2 (mask 0), sampled 3
    s = TrainingSample(trajectory_id="mt", token_ids=list(range(10)), loss_mask=[0, 0, 0, 1, 1, 0, 0, 1, 1, 1],
                       inference_logprobs=[0, 0, 0, -1, -1, 0, 0, -1, -1, -1], advantage=1.0, reward=1.0,
                       oldest_policy_version=0, stop_reason=StopReason.done)
    p = prepare_sample(s, max_seq_len=6)
    assert p.token_ids == list(range(6)) and p.loss_mask == [0, 0, 0, 1, 1, 0]


@pytest.mark.parametrize("prompt", [8, 9])
def test_prompt_that_fills_max_seq_len_is_dropped_with_a_reason(prompt: int) -> None:
    settings = BatchingSettings(max_seq_len=8, micro_batch_tokens=64)
    prepared = prepare_samples([_sample(prompt, 4, tid="long"), _sample(3, 4, tid="ok")], settings)
    assert [s.trajectory_id for s in prepared.samples] == ["ok"]
    assert prepared.dropped[0][0] == "long"
    assert f"prompt of {prompt} tokens" in prepared.dropped[0][1] and "max_seq_len=8" in prepared.dropped[0][1]


def test_malformed_samples_are_dropped_with_a_reason() -> None:
    bad_len = TrainingSample(trajectory_id="x", token_ids=[1, 2, 3], loss_mask=[0, 1], inference_logprobs=[0, -1, -1],
                             advantage=1.0, reward=1.0, oldest_policy_version=0, stop_reason=StopReason.done)
    assert "length mismatch" in prepare_sample(bad_len, 16)
    no_prompt = _sample(0, 4)
    assert "no prompt" in prepare_sample(no_prompt, 16)


def test_overlong_samples_are_masked_and_counted() -> None:
    samples = [_sample(3, 5, StopReason.truncated, "over"), _sample(3, 5, StopReason.done, "done"),
               _sample(3, 5, StopReason.max_turns, "turns")]
    prepared = prepare_samples(samples, BatchingSettings(max_seq_len=16, micro_batch_tokens=64))
    by_id = {s.trajectory_id: s for s in prepared.samples}
    assert by_id["over"].loss_mask == [0] * 8 and by_id["over"].overlong_masked
    assert by_id["done"].loss_tokens == 5 and by_id["turns"].loss_tokens == 5
    assert prepared.overlong_masked == 1
    assert {s.trajectory_id for s in prepared.trainable} == {"done", "turns"}
    # masked samples are never forwarded
    mbs = micro_batches(prepared.samples, 64, pad_token_id=0)
    assert sum(mb.input_ids.shape[0] for mb in mbs) == 2

    kept = prepare_samples(samples, BatchingSettings(max_seq_len=16, micro_batch_tokens=64, mask_overlong=False))
    assert kept.overlong_masked == 0 and len(kept.trainable) == 3


def test_micro_batches_respect_the_token_budget() -> None:
    samples = [prepare_sample(_sample(3, c, tid=f"s{c}"), 64) for c in [1, 20, 5, 9, 13, 2, 30, 7, 4, 11]]
    budget = 40
    plan = plan_micro_batches(samples, budget)
    assert sorted(s.trajectory_id for mb in plan for s in mb) == sorted(s.trajectory_id for s in samples)
    for mb in plan:
        assert len(mb) * max(len(s.token_ids) for s in mb) <= budget
    assert len(plan) < len(samples)  # packing happened
    assert plan == plan_micro_batches(samples, budget)  # deterministic


def test_collate_pads_right() -> None:
    a, b = prepare_sample(_sample(2, 3, tid="a", adv=0.5), 64), prepare_sample(_sample(2, 1, tid="b", adv=-2.0), 64)
    mb = collate([a, b], pad_token_id=7)
    assert mb.input_ids.tolist() == [a.token_ids, b.token_ids + [7, 7]]
    assert mb.attention_mask.tolist() == [[1] * 5, [1, 1, 1, 0, 0]]
    assert mb.loss_mask.tolist() == [[0, 0, 1, 1, 1], [0, 0, 1, 0, 0]]
    torch.testing.assert_close(mb.old_logprobs, torch.tensor([[0, 0, -0.1, -0.2, -0.3], [0, 0, -0.1, 0, 0]]))
    assert mb.advantages.tolist() == [0.5, -2.0] and mb.tokens == 8


def test_settings_need_one_sample_to_fit_a_micro_batch() -> None:
    with pytest.raises(ValueError, match="micro_batch_tokens"):
        BatchingSettings(max_seq_len=512, micro_batch_tokens=256)
    with pytest.raises(ValueError):
        BatchingSettings(max_len=5)
