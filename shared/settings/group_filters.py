"""The entries of ``trainer.group_filters``, as types: each entry is one of the built-in filters,
``{name: argument}``, or a ``"package.module:function"`` path, told apart by its shape
(a discriminated union). ``services.trainer.group_filters`` turns each into the check it runs.

Invariant: an entry that names no filter, a built-in's bad argument, or a path that does not
import is refused when settings load, with the entry's place (``trainer.group_filters.0...``)
in the message; the trainer never meets an entry it cannot build.

Part of ``shared.settings`` (its docstring states the invariants every section keeps).
"""

from __future__ import annotations

from typing import Annotated, Any, Union

from pydantic import AfterValidator, BaseModel, BeforeValidator, Discriminator, Field, Tag, field_validator

from shared.import_path import import_callable
from shared.schemas import StopReason
from shared.settings.base import Float, Int, Section


class ScoreRangeFilter(Section):
    """The group's mean reward must lie in [low, high] (drop groups the policy always or never solves)."""

    score_range: tuple[Float, Float]

    @field_validator("score_range")
    @classmethod
    def _ordered(cls, bounds: tuple[float, float]) -> tuple[float, float]:
        if bounds[0] > bounds[1]:
            raise ValueError(f"score_range takes [low, high] with low <= high, got {list(bounds)}")
        return bounds


class MaxSampledTokensFilter(Section):
    """No member may have sampled more than this many tokens."""

    max_sampled_tokens: Int = Field(gt=0)


class StopReasonsFilter(Section):
    """No member may have ended with one of these stop reasons."""

    stop_reasons: list[StopReason]


BUILT_IN_FILTERS: dict[str, type[BaseModel]] = {
    "score_range": ScoreRangeFilter, "max_sampled_tokens": MaxSampledTokensFilter, "stop_reasons": StopReasonsFilter,
}
_PATH = "module:function"


def _imports(path: str) -> str:
    import_callable(path, "group filter")  # ImportPathError (a ValueError) names the path and the cause
    return path


# a user's filter: called with the TrainingBatch, returns None to keep the group or why it is dropped
FilterPath = Annotated[str, AfterValidator(_imports)]


def _kind(spec: Any) -> str | None:
    """Which filter an entry is: its shape says (a path, or the one key of ``{name: argument}``)."""
    if isinstance(spec, str):
        return _PATH
    if isinstance(spec, dict) and len(spec) == 1:
        return str(next(iter(spec)))
    if isinstance(spec, BaseModel):
        return next(iter(type(spec).model_fields))
    return None


def _names_a_filter(spec: Any) -> Any:
    kind = _kind(spec)
    if kind is None:
        raise ValueError(f"a group filter is 'module:function' or one {{name: argument}} with a name in "
                         f"{sorted(BUILT_IN_FILTERS)}; got {spec!r}")
    if kind != _PATH and kind not in BUILT_IN_FILTERS:
        raise ValueError(f"unknown group filter {kind!r}; known: {sorted(BUILT_IN_FILTERS)} or 'module:function'")
    return spec


GroupFilterSpec = Annotated[
    Union[
        Annotated[FilterPath, Tag(_PATH)],
        Annotated[ScoreRangeFilter, Tag("score_range")],
        Annotated[MaxSampledTokensFilter, Tag("max_sampled_tokens")],
        Annotated[StopReasonsFilter, Tag("stop_reasons")],
    ],
    Discriminator(_kind),
    BeforeValidator(_names_a_filter),
]
