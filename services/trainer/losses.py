"""The loss registry (``trainer.loss.kind``): one policy-gradient term per kind.

Each kind is a function of ``PolicyTerms`` that returns the per-token loss ``[B, T]`` before
the importance weight, the KL penalty and the aggregation (``services.trainer.loss`` applies
those), and which tokens its clip cut off. ``log_ratio = logp - anchor_logp``: the anchor is the
behaviour logprobs with correction ``none``, else the proximal ones (the module docstring of
``services.trainer.loss``). ``A`` is the advantage of the token (a sequence's, broadcast).

Invariants:
- Gradient flows only through ``terms.logprobs`` (and ``terms.log_ratio``, which is
  ``logprobs`` minus a constant).
- Per-sequence quantities (gspo's ratio) read one row only, so they are whole within a
  micro-batch: a sequence is one row of one micro-batch (``services.trainer.batching``).
- A kind's aggregation is its paper's: ``KINDS[kind].aggregation``; ``None`` means
  ``trainer.loss.aggregation`` (grpo only: settings refuse it for the others).
- Unset ``clip_eps`` / ``clip_eps_high`` take the kind's defaults (``clip_range``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Literal

import torch

from shared.settings import LossSettings

Aggregation = Literal["token_mean", "seq_mean", "constant_length"]


@dataclass(frozen=True)
class PolicyTerms:
    logprobs: torch.Tensor  # [B, T] current, with grad
    log_ratio: torch.Tensor  # [B, T] logprobs - anchor
    advantages: torch.Tensor  # [B, T]
    mask: torch.Tensor  # [B, T] 0/1, logprobs' dtype
    low: float  # ratio >= 1 - low
    high: float  # ratio <= 1 + high


KindLoss = Callable[[PolicyTerms], tuple[torch.Tensor, torch.Tensor]]


def _ppo_clip(ratio: torch.Tensor, t: PolicyTerms) -> tuple[torch.Tensor, torch.Tensor]:
    """The pessimistic PPO term ``max(-A r, -A clip(r, 1 - low, 1 + high))`` and where the clip won."""
    unclipped = -t.advantages * ratio
    clipped = -t.advantages * torch.clamp(ratio, 1.0 - t.low, 1.0 + t.high)
    return torch.maximum(unclipped, clipped), clipped > unclipped


def grpo(t: PolicyTerms) -> tuple[torch.Tensor, torch.Tensor]:
    """GRPO (DeepSeekMath, Shao et al. 2024): ``loss_t = max(-A r_t, -A clip(r_t, 1-eps, 1+eps_high))``,
    ``r_t = exp(log_ratio_t)``; aggregated by ``trainer.loss.aggregation``."""
    return _ppo_clip(torch.exp(t.log_ratio), t)


def dr_grpo(t: PolicyTerms) -> tuple[torch.Tensor, torch.Tensor]:
    """Dr. GRPO (Liu et al. 2025, "Understanding R1-Zero-Like Training"): GRPO's token term with
    advantages not scaled by the group's std (settings) and the token sum divided by a constant,
    ``max_seq_len * sequences``, not by each sequence's length (aggregation ``constant_length``)."""
    return grpo(t)


def dapo(t: PolicyTerms) -> tuple[torch.Tensor, torch.Tensor]:
    """DAPO (Yu et al. 2025): GRPO's token term with clip-higher (``eps_high`` 0.28 unless set,
    ``eps_low`` 0.2) and a token mean over the whole step (aggregation ``token_mean``)."""
    return grpo(t)


def gspo(t: PolicyTerms) -> tuple[torch.Tensor, torch.Tensor]:
    """GSPO (Zheng et al. 2025): one length-normalised ratio per sequence,
    ``s_i = exp(mean over its masked tokens of log_ratio)``, and
    ``loss_i = max(-A s_i, -A clip(s_i, 1-eps, 1+eps_high))`` (eps 3e-4, eps_high 4e-4 unless set, as
    in the paper); every token of the sequence carries ``loss_i`` and sequences are averaged
    (aggregation ``seq_mean``)."""
    tokens = t.mask.sum(dim=-1, keepdim=True).clamp(min=1.0)
    seq_ratio = torch.exp((t.log_ratio * t.mask).sum(dim=-1, keepdim=True) / tokens)
    return _ppo_clip(seq_ratio.expand_as(t.log_ratio), t)


def cispo(t: PolicyTerms) -> tuple[torch.Tensor, torch.Tensor]:
    """CISPO (MiniMax-M1, 2025): the clipped ratio is a stopped-gradient weight on every token,
    ``loss_t = -sg(clip(r_t, 1-eps, 1+eps_high)) * A * logp_t``, so no token loses its gradient;
    token mean. Unless set, no lower bound (eps 1) and eps_high 0.28 (the paper tunes eps_high
    only and does not fix its value)."""
    ratio = torch.exp(t.log_ratio)
    weight = torch.clamp(ratio, 1.0 - t.low, 1.0 + t.high).detach()
    return -weight * t.advantages * t.logprobs, (ratio < 1.0 - t.low) | (ratio > 1.0 + t.high)


@dataclass(frozen=True)
class LossKind:
    fn: KindLoss
    aggregation: Aggregation | None  # None: trainer.loss.aggregation
    low: float | None = None  # the clip when clip_eps is unset (None: the setting's default)
    high: float | None = None  # the clip when clip_eps_high is unset (None: the low clip)


KINDS: dict[str, LossKind] = {
    "grpo": LossKind(grpo, None),
    "dr_grpo": LossKind(dr_grpo, "constant_length"),
    "dapo": LossKind(dapo, "token_mean", high=0.28),
    "gspo": LossKind(gspo, "seq_mean", low=3e-4, high=4e-4),
    "cispo": LossKind(cispo, "token_mean", low=1.0, high=0.28),
}


def aggregation_of(settings: LossSettings) -> Aggregation:
    kind = KINDS[settings.kind]
    return kind.aggregation or settings.aggregation


def clip_range(settings: LossSettings) -> tuple[float, float]:
    """``(low, high)``: the ratio is clipped to ``[1 - low, 1 + high]``."""
    kind, given = KINDS[settings.kind], settings.model_fields_set
    low = settings.clip_eps if "clip_eps" in given or kind.low is None else kind.low
    if settings.clip_eps_high is not None:
        return low, settings.clip_eps_high
    return low, low if kind.high is None else kind.high
