"""The policy loss against a hand computation: clipping on both sides, masks, aggregation, KL."""

from __future__ import annotations

import math

import pytest
import torch

from services.trainer.loss import loss_denominator, policy_loss
from shared.settings import LossSettings

# Two sequences of 4 tokens; position 0 is a prompt token (mask 0).
#   seq 0, A = +1: ratios 1.5 (clipped at 1.2), 0.9, 0.5 (below 1 - eps but A > 0: not clipped)
#   seq 1, A = -1: ratios 0.5 (clipped at 0.8), 1.5 (above 1 + eps but A < 0: not clipped),
#                  then a masked token with a huge ratio that must not count anywhere
RATIOS = [[1.0, 1.5, 0.9, 0.5], [1.0, 0.5, 1.5, math.e**3]]
MASK = [[0, 1, 1, 1], [0, 1, 1, 0]]
ADV = [1.0, -1.0]
OLD = [[-2.0, -1.0, -3.0, -0.5], [-1.5, -2.5, -0.7, -4.0]]


def _inputs():
    old = torch.tensor(OLD, dtype=torch.float64)
    logprobs = (old + torch.log(torch.tensor(RATIOS, dtype=torch.float64))).requires_grad_(True)
    return logprobs, old, torch.tensor(ADV, dtype=torch.float64), torch.tensor(MASK, dtype=torch.float64)


def test_clip_both_sides_token_mean_by_hand() -> None:
    logprobs, old, adv, mask = _inputs()
    loss, stats = policy_loss(logprobs, old, adv, mask, clip_eps=0.2)
    # per-token losses: seq0 -1.2, -0.9, -0.5; seq1 +0.8, +1.5
    assert loss.item() == pytest.approx((-1.2 - 0.9 - 0.5 + 0.8 + 1.5) / 5, abs=1e-12)
    assert stats["loss_tokens"] == 5
    assert stats["clip_frac"] == pytest.approx(2 / 5)
    assert stats["ratio_mean"] == pytest.approx((1.5 + 0.9 + 0.5 + 0.5 + 1.5) / 5)
    mad = (math.log(1.5) + abs(math.log(0.9)) + math.log(2) + math.log(2) + math.log(1.5)) / 5
    assert stats["logprob_mad_vs_inference"] == pytest.approx(mad)
    assert stats["kl"] == 0.0
    loss.backward()
    # d loss / d logp = -A * ratio / N where unclipped, 0 where clipped or masked
    expected = [[0, 0, -0.9 / 5, -0.5 / 5], [0, 0, 1.5 / 5, 0]]
    torch.testing.assert_close(logprobs.grad, torch.tensor(expected, dtype=torch.float64), atol=1e-12, rtol=0)


def test_seq_mean_by_hand() -> None:
    logprobs, old, adv, mask = _inputs()
    loss, _ = policy_loss(logprobs, old, adv, mask, clip_eps=0.2, aggregation="seq_mean")
    seq0, seq1 = (-1.2 - 0.9 - 0.5) / 3, (0.8 + 1.5) / 2
    assert loss.item() == pytest.approx((seq0 + seq1) / 2, abs=1e-12)
    loss.backward()
    expected = [[0, 0, -0.9 / 3 / 2, -0.5 / 3 / 2], [0, 0, 1.5 / 2 / 2, 0]]
    torch.testing.assert_close(logprobs.grad, torch.tensor(expected, dtype=torch.float64), atol=1e-12, rtol=0)


def test_clip_higher() -> None:
    logprobs, old, adv, mask = _inputs()
    loss, stats = policy_loss(logprobs, old, adv, mask, clip_eps=0.2, clip_eps_high=0.6)
    # 1.5 is now inside [0.8, 1.6]: seq0 pos1 is -1.5 unclipped; the lower side is unchanged
    assert loss.item() == pytest.approx((-1.5 - 0.9 - 0.5 + 0.8 + 1.5) / 5, abs=1e-12)
    assert stats["clip_frac"] == pytest.approx(1 / 5)


def test_k3_kl_penalty_by_hand() -> None:
    logprobs, old, adv, mask = _inputs()
    d = [[0.0, 0.3, -0.4, 0.1], [0.0, 1.0, -1.0, 5.0]]  # ref_logp - logp
    ref = logprobs.detach() + torch.tensor(d, dtype=torch.float64)
    loss, stats = policy_loss(logprobs, old, adv, mask, clip_eps=0.2, kl_coef=0.1, ref_logprobs=ref)
    k3 = [math.exp(x) - x - 1 for x in (0.3, -0.4, 0.1, 1.0, -1.0)]
    pg = (-1.2 - 0.9 - 0.5 + 0.8 + 1.5) / 5
    assert loss.item() == pytest.approx(pg + 0.1 * sum(k3) / 5, abs=1e-12)
    assert stats["kl"] == pytest.approx(sum(k3) / 5)
    loss.backward()
    # d k3 / d logp = 1 - exp(ref - logp); the reference itself gets no gradient
    assert logprobs.grad[0, 1].item() == pytest.approx(0.1 * (1 - math.exp(0.3)) / 5)
    with pytest.raises(ValueError, match="ref_logprobs"):
        policy_loss(logprobs, old, adv, mask, kl_coef=0.1)


@pytest.mark.parametrize("aggregation", ["token_mean", "seq_mean"])
def test_split_rows_with_full_denominator_add_up(aggregation: str) -> None:
    logprobs, old, adv, mask = _inputs()
    full, _ = policy_loss(logprobs, old, adv, mask, aggregation=aggregation)
    denominator = loss_denominator(mask, aggregation)
    parts = sum(
        policy_loss(logprobs[i:i + 1], old[i:i + 1], adv[i:i + 1], mask[i:i + 1],
                    aggregation=aggregation, denominator=denominator)[0]
        for i in range(2)
    )
    assert parts.item() == pytest.approx(full.item(), abs=1e-12)


def test_all_masked_is_zero_not_nan() -> None:
    logprobs, old, adv, mask = _inputs()
    for aggregation in ("token_mean", "seq_mean"):
        loss, stats = policy_loss(logprobs, old, adv, torch.zeros_like(mask), aggregation=aggregation)
        assert loss.item() == 0.0 and stats["loss_tokens"] == 0 and not math.isnan(stats["clip_frac"])


def test_sequence_without_masked_tokens_is_not_a_sequence_of_seq_mean() -> None:
    logprobs, old, adv, mask = _inputs()
    mask[1] = 0
    loss, _ = policy_loss(logprobs, old, adv, mask, aggregation="seq_mean")
    assert loss.item() == pytest.approx((-1.2 - 0.9 - 0.5) / 3, abs=1e-12)


def test_advantages_per_token_are_accepted() -> None:
    logprobs, old, adv, mask = _inputs()
    a, _ = policy_loss(logprobs, old, adv, mask)
    b, _ = policy_loss(logprobs, old, adv.unsqueeze(-1).expand(2, 4), mask)
    assert a.item() == b.item()


def test_settings_forbid_unknown_and_bad_values() -> None:
    assert LossSettings().clip_eps == 0.2 and LossSettings().aggregation == "token_mean"
    with pytest.raises(ValueError):
        LossSettings(clip_epsilon=0.1)
    with pytest.raises(ValueError):
        LossSettings(aggregation="sum")
    with pytest.raises(ValueError):
        LossSettings(clip_eps=1.5)
