"""Group-relative advantages (GRPO).

``A_i = (r_i - mean(r)) / (std(r) + eps)`` over the group's scored members; with
``scale_by_std=False``, ``A_i = r_i - mean(r)`` (Dr. GRPO).

``std`` is the population standard deviation (divide by n) by default, or the
Bessel-corrected one (divide by n - 1, as ``torch.std`` and so TRL's GRPOTrainer compute it);
a group of one member has std 0 either way. A group whose rewards all agree carries no
learning signal: it is reported as zero-variance, and the caller drops it or keeps it with
advantages of 0 (``trainer.zero_variance_groups``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

ZERO_VARIANCE_TOL = 1e-9
StdKind = Literal["population", "bessel"]


@dataclass(frozen=True)
class GroupAdvantages:
    advantages: list[float]
    mean: float
    std: float

    @property
    def zero_variance(self) -> bool:
        return self.std <= ZERO_VARIANCE_TOL


def group_std(rewards: list[float], kind: StdKind = "population") -> float:
    n = len(rewards)
    if kind not in ("population", "bessel"):
        raise ValueError(f"unknown std kind {kind!r}: population or bessel")
    if n < 2:
        return 0.0
    mean = sum(rewards) / n
    return math.sqrt(sum((r - mean) ** 2 for r in rewards) / (n - 1 if kind == "bessel" else n))


def group_advantages(rewards: list[float], eps: float = 1e-6, scale_by_std: bool = True,
                     std_kind: StdKind = "population") -> GroupAdvantages:
    if not rewards:
        raise ValueError("a group needs at least one reward")
    mean = sum(rewards) / len(rewards)
    std = group_std(rewards, std_kind)
    scale = (std + eps) if scale_by_std else 1.0
    return GroupAdvantages([(r - mean) / scale for r in rewards], mean, std)
