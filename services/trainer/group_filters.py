"""Group filters: a chain, from settings, that may drop a finished group before it is trained
on (``trainer.group_filters``). Zero-variance and all-failed groups are decided before the
chain (``trainer.zero_variance_groups``); the chain sees every other group, as the training
batch it would become.

Filters (each entry of the list is one):
- ``{"score_range": [lo, hi]}``: the group's mean reward must lie in [lo, hi] (drop groups
  the policy always or never solves);
- ``{"max_sampled_tokens": n}``: no member may have sampled more than n tokens;
- ``{"stop_reasons": [...]}``: no member may have ended with one of these stop reasons;
- ``"package.module:function"``: called with the ``TrainingBatch``; returns None to keep the
  group, or a string saying why it is dropped.

Invariants: the first filter that objects decides, and its reason is recorded in the group's
record (``filter_reason``) and counted (``groups_filtered``); a dropped group frees its
admission slot and is passed over by a step like a zero-variance one. A spec that names no
filter, or a path that does not import, is refused when settings load.
"""

from __future__ import annotations

from typing import Any, Callable

from shared.import_path import import_callable
from shared.schemas import TrainingBatch

GroupFilter = Callable[[TrainingBatch], "str | None"]


def _score_range(bounds: Any) -> GroupFilter:
    if not (isinstance(bounds, (list, tuple)) and len(bounds) == 2 and all(isinstance(b, (int, float)) for b in bounds)
            and bounds[0] <= bounds[1]):
        raise ValueError(f"score_range takes [low, high] with low <= high, got {bounds!r}")
    low, high = float(bounds[0]), float(bounds[1])

    def check(batch: TrainingBatch) -> str | None:
        members = [s for s in batch.samples if s.segment == 0]  # a trajectory's reward counts once
        mean = sum(s.reward for s in members) / len(members)
        return None if low <= mean <= high else f"score_range: mean reward {mean:.3g} outside [{low:g}, {high:g}]"
    return check


def _max_sampled_tokens(limit: Any) -> GroupFilter:
    if isinstance(limit, bool) or not isinstance(limit, int) or limit <= 0:
        raise ValueError(f"max_sampled_tokens takes a positive integer, got {limit!r}")

    def check(batch: TrainingBatch) -> str | None:
        sampled: dict[str, int] = {}
        for s in batch.samples:  # a member's segments add up
            sampled[s.trajectory_id] = sampled.get(s.trajectory_id, 0) + sum(s.loss_mask)
        longest = max(sampled.values())
        return None if longest <= limit else f"max_sampled_tokens: a member sampled {longest} > {limit}"
    return check


def _stop_reasons(reasons: Any) -> GroupFilter:
    if not isinstance(reasons, list) or not all(isinstance(r, str) for r in reasons):
        raise ValueError(f"stop_reasons takes a list of stop reasons, got {reasons!r}")
    refused = set(reasons)

    def check(batch: TrainingBatch) -> str | None:
        found = sorted({s.stop_reason.value for s in batch.samples} & refused)
        return f"stop_reasons: a member ended {found[0]}" if found else None
    return check


_BUILDERS: dict[str, Callable[[Any], GroupFilter]] = {
    "score_range": _score_range, "max_sampled_tokens": _max_sampled_tokens, "stop_reasons": _stop_reasons,
}


def build_filter(spec: str | dict[str, Any]) -> GroupFilter:
    """One filter from its settings entry; ``ValueError`` naming what is wrong."""
    if isinstance(spec, str):
        fn = import_callable(spec, "group filter")

        def custom(batch: TrainingBatch) -> str | None:
            verdict = fn(batch)
            return None if verdict is None else f"{spec}: {verdict}"
        return custom
    if not isinstance(spec, dict) or len(spec) != 1:
        raise ValueError(f"a group filter is 'module:function' or one of {{name: argument}} with a name in "
                         f"{sorted(_BUILDERS)}; got {spec!r}")
    [(name, argument)] = spec.items()
    if name not in _BUILDERS:
        raise ValueError(f"unknown group filter {name!r}; known: {sorted(_BUILDERS)} or 'module:function'")
    return _BUILDERS[name](argument)


def first_objection(filters: list[GroupFilter], batch: TrainingBatch) -> str | None:
    for check in filters:
        reason = check(batch)
        if reason is not None:
            return reason
    return None
