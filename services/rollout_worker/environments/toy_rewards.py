"""Reward functions for the toy tasks that show learning end to end with the tiny model.

Each takes ``(completion_text, row)`` and returns a float, the signature ``single_turn``
environments expect of a user's ``reward_fn``.
"""

from __future__ import annotations

from typing import Any


def digit_share(completion: str, row: dict[str, Any]) -> float:
    """Share of the reply's visible characters that are ASCII digits: 0 for a random reply of
    the tiny model most of the time, 1 for a reply of digits only. Learnable from scratch."""
    visible = [c for c in completion if not c.isspace()]
    if not visible:
        return 0.0
    return sum(c in "0123456789" for c in visible) / len(visible)
