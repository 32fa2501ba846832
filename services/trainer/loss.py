"""The policy loss: a registry kind (``services.trainer.losses``) on three logprobs per token,
with a bounded importance weight for off-policy samples.

Three logprobs of each sampled token are kept apart:
- behaviour ``mu``: what vLLM returned when it sampled (``old_logprobs``; a constant). It is
  per token: the turns of one trajectory may come from different policy versions (a weight
  sync lands mid-episode: partial rollouts), and each token's ``mu`` is the logprob of the
  weights that sampled it, so every weight below corrects each turn against its own version
  (tests/test_partial_rollouts.py checks the logprobs each turn carries);
- proximal ``pi_prox``: the trainer's, under the weights that start this optimizer step (no grad);
- current ``pi``: the trainer's, with grad (``logprobs``).

Decoupled PPO (AReaL) takes the trust region around the proximal policy and corrects the gap
between proximal and behaviour by a separate importance weight:
``loss_t = w_t * pg(pi / pi_prox)``, ``w_t = f(pi_prox / mu)``. Conveyor takes *one* optimizer
step per ``train_step`` on a batch, so the proximal policy is the policy at the start of the
update: its logprobs are the current ones' values, ``proximal = logprobs.detach()``, and no
extra forward is needed. Then ``r = pi / pi_prox`` is 1 in value with the gradient
``grad log pi``, so a PPO clip never cuts within the step; the bounded ``w`` is the whole trust
region. Approximation (AReaL's too): for a sample of an older version the proximal policy is
the trainer's current pre-update weights, not the version that sampled it, so ``w`` corrects
staleness and engine mismatch together.

``trainer.loss.correction`` (``k = exp(proximal - behaviour)`` per token, always detached):
- ``none`` (default): no weight, and the ratio is against the *behaviour* logprobs, as before
  there were three: ``r = exp(logp - old_logp)``, the PPO clip bounding staleness and mismatch.
- ``tis``: ``w = min(k, tis_cap)`` (truncated IS).
- ``icepop``: ``w = k`` inside ``[1/icepop_band, icepop_band]``, else 0 (IcePop's masked IS,
  Ling team 2025; our band is symmetric, default 2: ``[0.5, 2]``).
- ``seq_mask``: ``w = 1``, but 0 on every token of a sequence whose geometric mean
  ``exp(mean over its masked tokens of log k)`` is outside ``[1/seq_mask_band, seq_mask_band]``.
A zeroed token or dropped sequence still counts in the denominator.

    per kind: pg_t (services.trainer.losses); loss_t = w_t * pg_t + kl_coef * k3_t
    k3 = exp(ref_logp - logp) - (ref_logp - logp) - 1          (only with kl_coef > 0)

Invariants:
- All per-token tensors are ``[B, T]``; ``advantages`` is ``[B]`` (one per sequence, broadcast
  over its tokens) or already ``[B, T]``. Only tokens with ``loss_mask = 1`` count anywhere:
  in the loss, its gradient and every statistic.
- Gradient flows only through ``logprobs``; ``old_logprobs``, the proximal logprobs, ``w``,
  ``advantages`` and ``ref_logprobs`` are constants.
- Aggregation ``token_mean``: sum of ``loss_t`` over masked tokens / number of masked tokens.
  ``seq_mean``: mean over sequences of each sequence's token mean; a sequence with no masked
  token (e.g. an overlong-masked one) is not a sequence of the loss at all.
  ``constant_length`` (dr_grpo): sum over masked tokens / (``max_seq_len`` * sequences with one).
- ``denominator`` (keyword) replaces the count that divides the sum: the number of masked
  tokens (token_mean), of sequences with a masked token (seq_mean), or that times
  ``max_seq_len`` (constant_length) *of the whole optimizer step*. With it, micro-batch losses
  add up to the full-batch loss, and so do their gradients, for every kind and correction.
- Statistics are means over this call's masked tokens, with ``loss_tokens`` as their weight,
  so a caller can combine micro-batches exactly; ``mismatch_kl`` is k3 of ``log k``, an
  estimate of KL(behaviour || proximal) on the sampled tokens. ``LossResult.log_weights`` are
  the masked tokens' ``log k``, for quantiles over a whole step.
- ``policy_loss`` keeps its signature: kind grpo, correction none (the loss before the registry).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from services.trainer.losses import KINDS, Aggregation, PolicyTerms, aggregation_of, clip_range
from shared.settings import LossSettings


def k3(log_ratio: torch.Tensor) -> torch.Tensor:
    """The k3 estimator of KL per token, ``exp(x) - x - 1`` of ``x = log(p / q)`` with the token
    drawn from q: non-negative, and unbiased for KL(q || p)."""
    return torch.exp(log_ratio) - log_ratio - 1.0


def loss_denominator(loss_mask: torch.Tensor, aggregation: Aggregation, max_seq_len: int | None = None) -> int:
    """What the loss sum is divided by for this mask: masked tokens, sequences with one, or
    ``max_seq_len`` per sequence with one."""
    mask = loss_mask.bool()
    if aggregation == "token_mean":
        return int(mask.sum())
    if aggregation == "seq_mean":
        return int(mask.any(dim=-1).sum())
    if aggregation == "constant_length":
        if max_seq_len is None:
            raise ValueError("aggregation constant_length (dr_grpo) needs max_seq_len")
        return int(mask.any(dim=-1).sum()) * max_seq_len
    raise ValueError(f"unknown loss aggregation {aggregation!r}")


def importance_weights(log_k: torch.Tensor, mask: torch.Tensor, settings: LossSettings) -> tuple[torch.Tensor, torch.Tensor]:
    """``(w, cut)``: the correction's weight from ``log k = proximal - behaviour`` and the tokens
    it truncated, zeroed or dropped (module docstring). Detached."""
    log_k = log_k.detach()
    k = torch.exp(log_k)
    if settings.correction == "none":
        return torch.ones_like(k), torch.zeros_like(k, dtype=torch.bool)
    if settings.correction == "tis":
        cut = k > settings.tis_cap
        return torch.clamp(k, max=settings.tis_cap), cut
    if settings.correction == "icepop":
        band = settings.icepop_band
        cut = (k < 1.0 / band) | (k > band)
        return torch.where(cut, torch.zeros_like(k), k), cut
    if settings.correction == "seq_mask":
        band = settings.seq_mask_band
        geo = torch.exp((log_k * mask).sum(dim=-1, keepdim=True) / mask.sum(dim=-1, keepdim=True).clamp(min=1.0))
        cut = ((geo < 1.0 / band) | (geo > band)).expand_as(k)
        return (~cut).to(k.dtype), cut
    raise ValueError(f"unknown correction {settings.correction!r}")


@dataclass(frozen=True)
class LossResult:
    loss: torch.Tensor  # scalar, with grad
    stats: dict[str, float]
    log_weights: torch.Tensor  # [masked tokens] log(proximal / behaviour), detached


def decoupled_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    settings: LossSettings,
    *,
    ref_logprobs: torch.Tensor | None = None,
    denominator: float | None = None,
    max_seq_len: int | None = None,
) -> LossResult:
    """The loss of ``settings`` (kind, correction, clip, KL) and its statistics (module docstring).
    ``old_logprobs`` are the behaviour logprobs; the proximal ones are ``logprobs.detach()``."""
    if logprobs.dim() != 2 or old_logprobs.shape != logprobs.shape or loss_mask.shape != logprobs.shape:
        raise ValueError(
            f"logprobs, old_logprobs and loss_mask must share one [B, T] shape, got "
            f"{tuple(logprobs.shape)}, {tuple(old_logprobs.shape)}, {tuple(loss_mask.shape)}"
        )
    if settings.kl_coef > 0 and ref_logprobs is None:
        raise ValueError("kl_coef > 0 needs ref_logprobs from the frozen reference")
    if advantages.dim() == 1:
        advantages = advantages.unsqueeze(-1)
    advantages = advantages.detach().to(logprobs.dtype).expand_as(logprobs)
    mask = loss_mask.to(logprobs.dtype)
    behaviour = old_logprobs.detach().to(logprobs.dtype)
    proximal = logprobs.detach()
    log_k = (proximal - behaviour) * mask
    weight, cut = importance_weights(log_k, mask, settings)
    anchor = behaviour if settings.correction == "none" else proximal
    low, high = clip_range(settings)
    log_ratio = logprobs - anchor
    token_loss, clipped = KINDS[settings.kind].fn(PolicyTerms(logprobs, log_ratio, advantages, mask, low, high))
    if settings.correction != "none":  # none: no product at all, so the loss is the old one bit for bit
        token_loss = weight * token_loss

    kl = torch.zeros_like(logprobs)
    if ref_logprobs is not None:
        ref_diff = ref_logprobs.detach().to(logprobs.dtype) - logprobs
        kl = k3(ref_diff)
        if settings.kl_coef > 0:
            token_loss = token_loss + settings.kl_coef * kl

    aggregation = aggregation_of(settings)
    if denominator is None:
        denominator = loss_denominator(loss_mask, aggregation, max_seq_len)
    denominator = max(float(denominator), 1.0)  # an all-masked batch gives loss 0, not NaN
    if aggregation in ("token_mean", "constant_length"):
        loss = (token_loss * mask).sum() / denominator
    elif aggregation == "seq_mean":
        per_seq_tokens = mask.sum(dim=-1).clamp(min=1.0)
        loss = ((token_loss * mask).sum(dim=-1) / per_seq_tokens).sum() / denominator
    else:
        raise ValueError(f"unknown loss aggregation {aggregation!r}")

    with torch.no_grad():
        tokens = mask.sum()
        n = tokens.clamp(min=1.0)
        sums = {
            "clip_frac": clipped.to(mask.dtype), "ratio_mean": torch.exp(log_ratio), "kl": kl,
            "logprob_mad_vs_inference": log_k.abs(), "mismatch_kl": k3(log_k),
            "correction_masked_frac": cut.to(mask.dtype),
        }
        # one transfer from the device for every statistic, not one per statistic
        values = torch.stack([tokens] + [(v * mask).sum() / n for v in sums.values()]).tolist()
        stats = {"loss_tokens": values[0], **dict(zip(sums, values[1:]))}
    return LossResult(loss, stats, log_k[loss_mask.bool()].detach())


def policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    clip_eps: float = 0.2,
    clip_eps_high: float | None = None,
    kl_coef: float = 0.0,
    ref_logprobs: torch.Tensor | None = None,
    aggregation: Literal["token_mean", "seq_mean"] = "token_mean",
    *,
    denominator: float | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """GRPO with no correction: the scalar loss and its statistics (see the module docstring)."""
    settings = LossSettings.model_construct(clip_eps=clip_eps, clip_eps_high=clip_eps_high, kl_coef=kl_coef,
                                            aggregation=aggregation)
    result = decoupled_loss(logprobs, old_logprobs, advantages, loss_mask, settings, ref_logprobs=ref_logprobs,
                            denominator=denominator)
    return result.loss, result.stats
