"""Per-token rewards and advantages (``trainer.token_rewards``), the seeds' reward placements.

- ``terminal`` (the default): no per-token advantages. Every sampled token of a sample gets the
  sample's group-relative advantage: plain GRPO.
- ``last_token`` / ``distributed``: each turn's own reward (``Turn.reward``, the environment's
  step reward) is placed on that turn's sampled tokens, on its last one or spread evenly. What
  the turn rewards do not account for of the trajectory's scored reward ``R`` (``R - sum r_k``)
  goes on the last sampled token, so a sample's token rewards always sum to ``R``.

Invariants:
- A token's return ``G_t`` is the sum of the token rewards from ``t`` to the end; its advantage is
  ``(G_t - mean) / scale`` with the group's mean and scale of ``R``, the statistics GRPO uses.
  So with no turn rewards every token's advantage is the sample's GRPO advantage, and in every
  mode the first sampled token's return is ``R``.
- Tokens that were not sampled (prompts, observations) get 0. The list is aligned with
  ``Trajectory.flatten()``.
"""

from __future__ import annotations

from typing import Literal

from shared.schemas import Trajectory

TokenRewards = Literal["terminal", "last_token", "distributed"]


def place_rewards(trajectory: Trajectory, reward: float, mode: TokenRewards) -> list[float]:
    """Token rewards aligned with ``trajectory.flatten()``, summing to ``reward``."""
    placed: list[float] = []
    for turn in trajectory.turns:
        placed += [0.0] * len(turn.prompt_token_ids)
        sampled = [0.0] * len(turn.sampled_token_ids)
        if sampled and mode == "distributed":
            sampled = [turn.reward / len(sampled)] * len(sampled)
        elif sampled and mode == "last_token":
            sampled[-1] = turn.reward
        placed += sampled
    last_sampled = _last_sampled_position(trajectory)
    if last_sampled is not None:
        placed[last_sampled] += reward - sum(placed)
    return placed


def _last_sampled_position(trajectory: Trajectory) -> int | None:
    position, last = 0, None
    for turn in trajectory.turns:
        position += len(turn.prompt_token_ids) + len(turn.sampled_token_ids)
        if turn.sampled_token_ids:
            last = position - 1
    return last


def token_advantages(placed: list[float], sampled: list[int], mean: float, scale: float) -> list[float]:
    """``(G_t - mean) / scale`` on sampled tokens, 0 elsewhere (``sampled``: the loss mask)."""
    advantages = [0.0] * len(placed)
    to_go = 0.0
    for t in range(len(placed) - 1, -1, -1):
        to_go += placed[t]
        if sampled[t]:
            advantages[t] = (to_go - mean) / scale
    return advantages
