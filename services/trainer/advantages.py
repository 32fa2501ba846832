"""Group-relative advantages (GRPO).

``A_i = (r_i - mean(r)) / (std(r) + eps)`` over the group's scored members, with the
population standard deviation; with ``scale_by_std=False``, ``A_i = r_i - mean(r)``
(Dr. GRPO). A group whose rewards all agree carries no learning signal: it is reported as
zero-variance and the caller drops it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

ZERO_VARIANCE_TOL = 1e-9


@dataclass(frozen=True)
class GroupAdvantages:
    advantages: list[float]
    mean: float
    std: float

    @property
    def zero_variance(self) -> bool:
        return self.std <= ZERO_VARIANCE_TOL


def group_advantages(rewards: list[float], eps: float = 1e-6, scale_by_std: bool = True) -> GroupAdvantages:
    if not rewards:
        raise ValueError("a group needs at least one reward")
    mean = sum(rewards) / len(rewards)
    std = math.sqrt(sum((r - mean) ** 2 for r in rewards) / len(rewards))
    scale = (std + eps) if scale_by_std else 1.0
    return GroupAdvantages([(r - mean) / scale for r in rewards], mean, std)
