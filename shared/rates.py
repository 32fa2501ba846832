"""Rates for people to read: a count over an interval, and how to print one.

Invariant: a rate with no interval (no previous event, zero or negative elapsed time, a NaN or
an infinite count or interval) is unknown: ``None`` as a number and ``-`` as text, never
``nan``, ``inf`` or a ``ZeroDivisionError``.
"""

from __future__ import annotations

import math

UNKNOWN = "-"


def per_second(count: float, seconds: float | None) -> float | None:
    """``count / seconds``, or ``None`` where there is no interval to divide by."""
    if seconds is None or not math.isfinite(seconds) or seconds <= 0 or not math.isfinite(count):
        return None
    return count / seconds


def show(value: float | None, spec: str = ".1f", suffix: str = "") -> str:
    """``value`` formatted with ``spec`` and ``suffix``, or ``-`` for an unknown (``None`` or non-finite) value."""
    if value is None or not math.isfinite(value):
        return UNKNOWN
    return f"{format(value, spec)}{suffix}"
