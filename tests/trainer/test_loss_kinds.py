"""Every loss kind and off-policy correction against a hand computation, the micro-batch
invariant for each, the gradient path, the old loss bit for bit, settings validation, and a
step's mismatch metrics."""

from __future__ import annotations

import math

import pytest
import torch

from services.trainer.loss import decoupled_loss, loss_denominator, policy_loss
from services.trainer.losses import KINDS, aggregation_of, clip_range
from services.trainer.step import PolicyTrainer
from synthetic_logprobs import SYNTHETIC_LOGPROBS
from shared.settings import BatchingSettings, LossSettings, TrainerSettings

# Two sequences of 4 tokens; position 0 is a prompt token (mask 0), and so is seq 1's last one.
# k = exp(current - behaviour) per token (current = proximal in value: one update per step):
#   seq 0, A = +1: k = 1.5, 3, 0.25          current logprobs -1.0, -3.0, -0.5
#   seq 1, A = -1: k = 0.9, 1.1, (e^3 masked) current logprobs -2.5, -0.7, (-4.0)
K = [[1.0, 1.5, 3.0, 0.25], [1.0, 0.9, 1.1, math.e**3]]
MASK = [[0, 1, 1, 1], [0, 1, 1, 0]]
ADV = [1.0, -1.0]
CURRENT = [[-2.0, -1.0, -3.0, -0.5], [-1.5, -2.5, -0.7, -4.0]]
MAX_SEQ_LEN = 4
KS = [1.5, 3.0, 0.25, 0.9, 1.1]  # the masked tokens' k, row-major


def _inputs():
    logprobs = torch.tensor(CURRENT, dtype=torch.float64, requires_grad=True)
    behaviour = torch.tensor(CURRENT, dtype=torch.float64) - torch.log(torch.tensor(K, dtype=torch.float64))
    return logprobs, behaviour, torch.tensor(ADV, dtype=torch.float64), torch.tensor(MASK, dtype=torch.float64)


def _loss(**settings):
    logprobs, behaviour, adv, mask = _inputs()
    result = decoupled_loss(logprobs, behaviour, adv, mask, LossSettings(**settings), max_seq_len=MAX_SEQ_LEN)
    result.loss.backward()
    return result, logprobs.grad


def _grad(rows: list[list[float]]) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.float64)


# --- kinds, correction none: the ratio is k (against the behaviour logprobs) -------------------

def test_grpo_by_hand() -> None:
    result, grad = _loss(kind="grpo")
    # seq0 (A=+1): max(-1.5, -1.2) = -1.2, max(-3, -1.2) = -1.2, max(-0.25, -0.8) = -0.25
    # seq1 (A=-1): 0.9 and 1.1 inside [0.8, 1.2]: +0.9, +1.1.  (-2.65 + 2.0) / 5 = -0.13
    assert result.loss.item() == pytest.approx(-0.13, abs=1e-12)
    assert result.stats["clip_frac"] == pytest.approx(2 / 5)
    # d/dlogp = -A k / 5 where unclipped
    torch.testing.assert_close(grad, _grad([[0, 0, 0, -0.25 / 5], [0, 0.9 / 5, 1.1 / 5, 0]]), atol=1e-12, rtol=0)


def test_grpo_seq_mean_by_hand() -> None:
    result, _ = _loss(kind="grpo", aggregation="seq_mean")
    # ((-2.65 / 3) + (2.0 / 2)) / 2
    assert result.loss.item() == pytest.approx((-2.65 / 3 + 1.0) / 2, abs=1e-12)


def test_dr_grpo_by_hand() -> None:
    result, grad = _loss(kind="dr_grpo")
    # GRPO's token terms, summed (-0.65) over max_seq_len * sequences = 4 * 2 = 8
    assert result.loss.item() == pytest.approx(-0.65 / 8, abs=1e-12)
    torch.testing.assert_close(grad, _grad([[0, 0, 0, -0.25 / 8], [0, 0.9 / 8, 1.1 / 8, 0]]), atol=1e-12, rtol=0)


def test_dapo_by_hand() -> None:
    result, _ = _loss(kind="dapo")
    # clip-higher 0.28: seq0 -1.28, -1.28, -0.25; seq1 +0.9, +1.1 -> (-2.81 + 2.0) / 5 = -0.162
    assert clip_range(LossSettings(kind="dapo")) == (0.2, 0.28)
    assert result.loss.item() == pytest.approx(-0.162, abs=1e-12)


def test_gspo_by_hand() -> None:
    result, grad = _loss(kind="gspo")
    # s0 = (1.5 * 3 * 0.25)^(1/3) = 1.125^(1/3) = 1.0400 > 1 + 4e-4: A=+1 -> max(-s0, -1.0004) = -1.0004
    # s1 = (0.9 * 1.1)^(1/2) = 0.99499 < 1 - 3e-4: A=-1 -> max(0.99499, 0.9997) = 0.9997
    # sequence mean: (-1.0004 + 0.9997) / 2 = -0.00035; both clipped, so no gradient
    assert clip_range(LossSettings(kind="gspo")) == (3e-4, 4e-4)
    assert result.loss.item() == pytest.approx(-0.00035, abs=1e-12)
    assert result.stats["clip_frac"] == 1.0
    assert torch.count_nonzero(grad) == 0


def test_gspo_unclipped_gradient_is_the_sequence_ratio_spread_over_its_tokens() -> None:
    result, grad = _loss(kind="gspo", clip_eps=0.5, clip_eps_high=0.5)
    s0, s1 = 1.125 ** (1 / 3), 0.99 ** 0.5
    # loss = (-s0 + s1) / 2; d s_i / d logp_t = s_i / n_i
    assert result.loss.item() == pytest.approx((-s0 + s1) / 2, abs=1e-12)
    torch.testing.assert_close(grad, _grad([[0, -s0 / 6, -s0 / 6, -s0 / 6], [0, s1 / 4, s1 / 4, 0]]), atol=1e-12, rtol=0)


def test_cispo_by_hand() -> None:
    result, grad = _loss(kind="cispo")
    # no lower bound, high 0.28: weights sg(clip(k, 0, 1.28)) = 1.28, 1.28, 0.25 | 0.9, 1.1
    # loss_t = -w A logp: 1.28*1.0 + 1.28*3.0 + 0.25*0.5 = 5.245 | -0.9*2.5 - 1.1*0.7 = -3.02
    # (5.245 - 3.02) / 5 = 0.445; every token keeps a gradient, -w A / 5
    assert clip_range(LossSettings(kind="cispo")) == (1.0, 0.28)
    assert result.loss.item() == pytest.approx(0.445, abs=1e-12)
    assert result.stats["clip_frac"] == pytest.approx(2 / 5)
    torch.testing.assert_close(grad, _grad([[0, -1.28 / 5, -1.28 / 5, -0.25 / 5], [0, 0.9 / 5, 1.1 / 5, 0]]),
                               atol=1e-12, rtol=0)


# --- corrections: ratio current/proximal = 1 (clip inactive), pg_t = -A, times w ---------------

def test_tis_by_hand() -> None:
    result, grad = _loss(correction="tis")
    # w = min(k, 2): 1.5, 2, 0.25 | 0.9, 1.1 -> (-1.5 - 2 - 0.25 + 0.9 + 1.1) / 5 = -0.35; one token cut
    assert result.loss.item() == pytest.approx(-0.35, abs=1e-12)
    assert result.stats["correction_masked_frac"] == pytest.approx(1 / 5)
    assert result.stats["clip_frac"] == 0.0 and result.stats["ratio_mean"] == 1.0
    # the gradient is w * grad log pi: the proximal logprobs are constants
    torch.testing.assert_close(grad, _grad([[0, -1.5 / 5, -2 / 5, -0.25 / 5], [0, 0.9 / 5, 1.1 / 5, 0]]),
                               atol=1e-12, rtol=0)


def test_icepop_by_hand() -> None:
    result, _ = _loss(correction="icepop")
    # band [0.5, 2]: 3 and 0.25 are zeroed, the rest keep w = k: (-1.5 + 0.9 + 1.1) / 5 = 0.1
    assert result.loss.item() == pytest.approx(0.1, abs=1e-12)
    assert result.stats["correction_masked_frac"] == pytest.approx(2 / 5)


def test_seq_mask_by_hand() -> None:
    kept, _ = _loss(correction="seq_mask")
    # geometric means 1.0400 and 0.99499 are inside [1/1.1, 1.1]: w = 1, (-3 + 2) / 5 = -0.2
    assert kept.loss.item() == pytest.approx(-0.2, abs=1e-12)
    assert kept.stats["correction_masked_frac"] == 0.0
    dropped, _ = _loss(correction="seq_mask", seq_mask_band=1.03)
    # 1.0400 > 1.03: seq 0 is dropped (its 3 tokens still count in the denominator): (1 + 1) / 5;
    # 0.99499 > 1/1.03 = 0.9709, and seq 1's masked e^3 token does not count in its mean
    assert dropped.loss.item() == pytest.approx(0.4, abs=1e-12)
    assert dropped.stats["correction_masked_frac"] == pytest.approx(3 / 5)


def test_kinds_with_corrections_by_hand() -> None:
    # gspo + tis: s_i = 1, loss_i = -A * mean of its w: -(1.5 + 2 + 0.25) / 3 = -1.25, (0.9 + 1.1) / 2 = 1 -> -0.125
    assert _loss(kind="gspo", correction="tis")[0].loss.item() == pytest.approx(-0.125, abs=1e-12)
    # cispo + icepop: clip(1) = 1, loss_t = -w A logp: 1.5 * 1.0 (others of seq0 zeroed), -0.9*2.5 - 1.1*0.7
    assert _loss(kind="cispo", correction="icepop")[0].loss.item() == pytest.approx((1.5 - 3.02) / 5, abs=1e-12)
    # dr_grpo + seq_mask 1.03: only seq 1, (1 + 1) / 8
    assert _loss(kind="dr_grpo", correction="seq_mask", seq_mask_band=1.03)[0].loss.item() == pytest.approx(0.25)
    # dapo + tis: the clip never cuts a ratio of 1, so as grpo + tis
    assert _loss(kind="dapo", correction="tis")[0].loss.item() == pytest.approx(-0.35, abs=1e-12)


def test_mismatch_statistics_by_hand() -> None:
    result, _ = _loss(correction="tis")
    # k3 of log k on the masked tokens: mean(k - 1 - log k); the masked e^3 token is left out
    assert result.stats["mismatch_kl"] == pytest.approx(sum(k - 1 - math.log(k) for k in KS) / 5, abs=1e-12)
    assert result.stats["logprob_mad_vs_inference"] == pytest.approx(sum(abs(math.log(k)) for k in KS) / 5)
    torch.testing.assert_close(result.log_weights.exp(), torch.tensor(KS, dtype=torch.float64))


# --- invariants -------------------------------------------------------------------------------

@pytest.mark.parametrize("correction", ["none", "tis", "icepop", "seq_mask"])
@pytest.mark.parametrize("kind", sorted(KINDS))
def test_micro_batches_add_up_to_the_full_batch(kind: str, correction: str) -> None:
    settings = LossSettings(kind=kind, correction=correction, seq_mask_band=1.03)
    logprobs, behaviour, adv, mask = _inputs()
    full = decoupled_loss(logprobs, behaviour, adv, mask, settings, max_seq_len=MAX_SEQ_LEN)
    (full_grad,) = torch.autograd.grad(full.loss, logprobs)
    denominator = loss_denominator(mask, aggregation_of(settings), MAX_SEQ_LEN)
    parts = [decoupled_loss(logprobs[i:i + 1], behaviour[i:i + 1], adv[i:i + 1], mask[i:i + 1], settings,
                            denominator=denominator, max_seq_len=MAX_SEQ_LEN) for i in range(2)]
    total = parts[0].loss + parts[1].loss
    assert total.item() == pytest.approx(full.loss.item(), abs=1e-12)
    (part_grad,) = torch.autograd.grad(total, logprobs)
    torch.testing.assert_close(part_grad, full_grad, atol=1e-12, rtol=0)


@pytest.mark.parametrize("correction", ["none", "tis", "icepop", "seq_mask"])
@pytest.mark.parametrize("kind", sorted(KINDS))
def test_gradient_flows_only_through_the_current_logprobs(kind: str, correction: str) -> None:
    logprobs, behaviour, adv, mask = _inputs()
    behaviour.requires_grad_(True)
    adv.requires_grad_(True)
    ref = (logprobs.detach() + 0.1).requires_grad_(True)
    settings = LossSettings(kind=kind, correction=correction, kl_coef=0.1)
    decoupled_loss(logprobs, behaviour, adv, mask, settings, ref_logprobs=ref, max_seq_len=MAX_SEQ_LEN).loss.backward()
    assert logprobs.grad is not None and behaviour.grad is None and ref.grad is None
    assert adv.grad is None


def _old_grpo(logprobs, old, adv, mask, clip_eps, aggregation):
    """The loss before the registry (main at 0a9d662), written out as the reference."""
    adv = adv.unsqueeze(-1).expand_as(logprobs)
    ratio = torch.exp(logprobs - old.detach())
    token_loss = torch.maximum(-adv * ratio, -adv * torch.clamp(ratio, 1.0 - clip_eps, 1.0 + clip_eps))
    if aggregation == "token_mean":
        return (token_loss * mask).sum() / max(float(mask.sum()), 1.0)
    per_seq = (token_loss * mask).sum(dim=-1) / mask.sum(dim=-1).clamp(min=1.0)
    return per_seq.sum() / max(float(mask.any(dim=-1).sum()), 1.0)


@pytest.mark.parametrize("aggregation", ["token_mean", "seq_mean"])
def test_none_grpo_is_the_old_loss_bit_for_bit(aggregation: str) -> None:
    g = torch.Generator().manual_seed(7)
    logprobs = (-torch.rand(6, 33, generator=g, dtype=torch.float32) * 5).requires_grad_(True)
    old = logprobs.detach() + 0.3 * torch.randn(6, 33, generator=g)
    adv, mask = torch.randn(6, generator=g), (torch.rand(6, 33, generator=g) > 0.3).float()
    new = decoupled_loss(logprobs, old, adv, mask, LossSettings(aggregation=aggregation)).loss
    (new_grad,) = torch.autograd.grad(new, logprobs)
    ref = _old_grpo(logprobs, old, adv, mask, 0.2, aggregation)
    (ref_grad,) = torch.autograd.grad(ref, logprobs)
    assert torch.equal(new, ref) and torch.equal(new_grad, ref_grad)
    assert torch.equal(policy_loss(logprobs, old, adv, mask, aggregation=aggregation)[0], ref)


# --- settings ---------------------------------------------------------------------------------

@pytest.mark.parametrize("bad, field", [
    ({"kind": "ppo"}, "kind"), ({"correction": "is"}, "correction"), ({"icepop_band": 0.5}, "icepop_band"),
    ({"seq_mask_band": 1.0}, "seq_mask_band"), ({"tis_cap": 0.5}, "tis_cap"),
    ({"kind": "dapo", "aggregation": "seq_mean"}, "aggregation"),
])
def test_settings_refuse_bad_values_naming_the_field(bad: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        LossSettings(**bad)


def test_dr_grpo_turns_std_scaling_off_and_refuses_it_on() -> None:
    assert TrainerSettings(loss={"kind": "dr_grpo"}).scale_advantage_by_std is False
    assert TrainerSettings().scale_advantage_by_std is True
    with pytest.raises(ValueError, match="scale_advantage_by_std"):
        TrainerSettings(loss={"kind": "dr_grpo"}, scale_advantage_by_std=True)


# --- a step's mismatch metrics ----------------------------------------------------------------

def test_a_tis_step_reports_the_mismatch(tiny_policy, make_batch) -> None:
    model, tok = tiny_policy
    trainer = PolicyTrainer(model, tok.pad_token_id, loss=LossSettings(correction="tis"),
                            alarm=SYNTHETIC_LOGPROBS,
                            batching=BatchingSettings(max_seq_len=64, micro_batch_tokens=128))
    same = trainer.train_step([make_batch(3, n=8, model=model, completion_len=(10, 20), noise=0.0)])
    # behaviour = the model's own logprobs (computed unpadded): no mismatch, nothing cut
    assert same["mismatch_kl"] < 1e-8 and same["correction_masked_frac"] == 0.0
    assert same["mismatch_ratio_p05"] == pytest.approx(1.0, abs=1e-3)
    assert same["mismatch_ratio_p95"] == pytest.approx(1.0, abs=1e-3)
    # behaviour logprobs perturbed by N(0, 0.5^2): log k ~ N(0, 0.25) (less the update of the
    # first step): k3 ~ e^(0.125) - 1 = 0.13, quantiles ~ exp(+-1.645 * 0.5) = 0.44 / 2.28,
    # P(k > 2) = P(z > 1.39) = 0.08
    noisy = trainer.train_step([make_batch(4, n=8, model=model, completion_len=(10, 20), noise=0.5, group_id=1)])
    assert noisy["micro_batches"] > 1 and noisy["skipped"] == 0
    assert 0.05 < noisy["mismatch_kl"] < 0.3
    assert noisy["mismatch_ratio_p05"] < 0.7 < 0.8 < noisy["mismatch_ratio_p50"] < 1.25 < 1.6 < noisy["mismatch_ratio_p95"]
    assert 0.01 < noisy["correction_masked_frac"] < 0.25
    assert math.isfinite(noisy["loss"]) and noisy["clip_frac"] == 0.0
