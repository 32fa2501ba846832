"""Group filters: a chain, from settings, that may drop a finished group before it is trained
on (``trainer.group_filters``). Zero-variance and all-failed groups are decided before the
chain (``trainer.zero_variance_groups``); the chain sees every other group, as the training
batch it would become.

Filters (each entry of the list is one; their types, checked when settings load, are in
``shared.settings.group_filters``):
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

from typing import Callable

from shared.import_path import import_callable
from shared.schemas import TrainingBatch
from shared.settings.group_filters import (
    GroupFilterSpec,
    MaxSampledTokensFilter,
    ScoreRangeFilter,
    StopReasonsFilter,
)

GroupFilter = Callable[[TrainingBatch], "str | None"]


def _score_range(spec: ScoreRangeFilter) -> GroupFilter:
    low, high = spec.score_range

    def check(batch: TrainingBatch) -> str | None:
        members = [s for s in batch.samples if s.segment == 0]  # a trajectory's reward counts once
        mean = sum(s.reward for s in members) / len(members)
        return None if low <= mean <= high else f"score_range: mean reward {mean:.3g} outside [{low:g}, {high:g}]"
    return check


def _max_sampled_tokens(spec: MaxSampledTokensFilter) -> GroupFilter:
    limit = spec.max_sampled_tokens

    def check(batch: TrainingBatch) -> str | None:
        sampled: dict[str, int] = {}
        for s in batch.samples:  # a member's segments add up
            sampled[s.trajectory_id] = sampled.get(s.trajectory_id, 0) + sum(s.loss_mask)
        longest = max(sampled.values())
        return None if longest <= limit else f"max_sampled_tokens: a member sampled {longest} > {limit}"
    return check


def _stop_reasons(spec: StopReasonsFilter) -> GroupFilter:
    refused = {r.value for r in spec.stop_reasons}

    def check(batch: TrainingBatch) -> str | None:
        found = sorted({s.stop_reason.value for s in batch.samples} & refused)
        return f"stop_reasons: a member ended {found[0]}" if found else None
    return check


def _custom(path: str) -> GroupFilter:
    fn = import_callable(path, "group filter")

    def check(batch: TrainingBatch) -> str | None:
        verdict = fn(batch)
        return None if verdict is None else f"{path}: {verdict}"
    return check


def build_filter(spec: GroupFilterSpec) -> GroupFilter:
    """One filter from its validated settings entry (``shared.settings.group_filters``)."""
    if isinstance(spec, str):
        return _custom(spec)
    if isinstance(spec, ScoreRangeFilter):
        return _score_range(spec)
    if isinstance(spec, MaxSampledTokensFilter):
        return _max_sampled_tokens(spec)
    return _stop_reasons(spec)


def first_objection(filters: list[GroupFilter], batch: TrainingBatch) -> str | None:
    for check in filters:
        reason = check(batch)
        if reason is not None:
            return reason
    return None
