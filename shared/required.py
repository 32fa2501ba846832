"""A value that a lifecycle step sets (``reset``, ``start``, a spawn) taken where that step has run.

Invariants:
- ``required(value, what)`` returns ``value`` unchanged when it is set; when it is None it raises
  ``RuntimeError`` naming ``what``, so a call out of order fails with its cause rather than an
  ``AttributeError`` on None further on. It also tells the type checker the value is not None.
"""

from __future__ import annotations

from typing import TypeVar

T = TypeVar("T")


def required(value: T | None, what: str) -> T:
    if value is None:
        raise RuntimeError(f"{what} is not set: called before the step that sets it, or after the one that clears it")
    return value
