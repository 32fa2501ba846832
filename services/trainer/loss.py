"""The GRPO policy loss: PPO-clipped token-level ratio against the inference (behaviour) policy.

For every token t of sequence i with ``loss_mask[i, t] = 1``:

    ratio  = exp(logp - old_logp)          old_logp: the logprob vLLM returned when it sampled
    pg     = -min(ratio * A_i, clip(ratio, 1 - clip_eps, 1 + clip_eps_high) * A_i)
    k3     = exp(ref_logp - logp) - (ref_logp - logp) - 1          (only with kl_coef > 0)
    loss_t = pg + kl_coef * k3

Invariants:
- All per-token tensors are ``[B, T]``; ``advantages`` is ``[B]`` (one per sequence, broadcast
  over its tokens) or already ``[B, T]``. Only tokens with ``loss_mask = 1`` count anywhere:
  in the loss, its gradient and every statistic.
- Gradient flows only through ``logprobs``; ``old_logprobs`` and ``ref_logprobs`` are constants.
- Aggregation ``token_mean``: sum of ``loss_t`` over masked tokens / number of masked tokens.
  ``seq_mean``: mean over sequences of each sequence's token mean; a sequence with no masked
  token (e.g. an overlong-masked one) is not a sequence of the loss at all.
- ``denominator`` (keyword) replaces the count that divides the sum: the number of masked
  tokens (token_mean) or of sequences with a masked token (seq_mean) *of the whole optimizer
  step*. With it, micro-batch losses add up to the full-batch loss, and so do their gradients.
- Statistics are means over this call's masked tokens, with ``loss_tokens`` as their weight,
  so a caller can combine micro-batches exactly.
"""

from __future__ import annotations

from typing import Literal

import torch

Aggregation = Literal["token_mean", "seq_mean"]


def loss_denominator(loss_mask: torch.Tensor, aggregation: Aggregation) -> int:
    """What the loss sum is divided by for this mask: masked tokens, or sequences with one."""
    mask = loss_mask.bool()
    if aggregation == "token_mean":
        return int(mask.sum())
    if aggregation == "seq_mean":
        return int(mask.any(dim=-1).sum())
    raise ValueError(f"unknown loss aggregation {aggregation!r}")


def policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    clip_eps: float = 0.2,
    clip_eps_high: float | None = None,
    kl_coef: float = 0.0,
    ref_logprobs: torch.Tensor | None = None,
    aggregation: Aggregation = "token_mean",
    *,
    denominator: float | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Returns the scalar loss and its statistics (see the module docstring)."""
    if logprobs.dim() != 2 or old_logprobs.shape != logprobs.shape or loss_mask.shape != logprobs.shape:
        raise ValueError(
            f"logprobs, old_logprobs and loss_mask must share one [B, T] shape, got "
            f"{tuple(logprobs.shape)}, {tuple(old_logprobs.shape)}, {tuple(loss_mask.shape)}"
        )
    if kl_coef > 0 and ref_logprobs is None:
        raise ValueError("kl_coef > 0 needs ref_logprobs from the frozen reference")
    if advantages.dim() == 1:
        advantages = advantages.unsqueeze(-1)
    advantages = advantages.to(logprobs.dtype).expand_as(logprobs)
    mask = loss_mask.to(logprobs.dtype)
    old_logprobs = old_logprobs.detach().to(logprobs.dtype)
    high = clip_eps if clip_eps_high is None else clip_eps_high

    log_ratio = logprobs - old_logprobs
    ratio = torch.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - clip_eps, 1.0 + high)
    token_loss = torch.maximum(unclipped, clipped)

    kl = torch.zeros_like(logprobs)
    if ref_logprobs is not None:
        ref_diff = ref_logprobs.detach().to(logprobs.dtype) - logprobs
        kl = torch.exp(ref_diff) - ref_diff - 1.0
        if kl_coef > 0:
            token_loss = token_loss + kl_coef * kl

    if denominator is None:
        denominator = loss_denominator(loss_mask, aggregation)
    denominator = max(float(denominator), 1.0)  # an all-masked batch gives loss 0, not NaN
    if aggregation == "token_mean":
        loss = (token_loss * mask).sum() / denominator
    elif aggregation == "seq_mean":
        per_seq_tokens = mask.sum(dim=-1).clamp(min=1.0)
        loss = ((token_loss * mask).sum(dim=-1) / per_seq_tokens).sum() / denominator
    else:
        raise ValueError(f"unknown loss aggregation {aggregation!r}")

    with torch.no_grad():
        tokens = float(mask.sum())
        n = max(tokens, 1.0)
        stats = {
            "loss_tokens": tokens,
            "clip_frac": float(((clipped > unclipped).to(mask.dtype) * mask).sum() / n),
            "ratio_mean": float((ratio * mask).sum() / n),
            "kl": float((kl * mask).sum() / n),
            "logprob_mad_vs_inference": float((log_ratio.abs() * mask).sum() / n),
        }
    return loss, stats
