"""The building blocks of every settings section: ``Section`` (unknown keys are errors), the
number types that refuse booleans, and how a setting with modes reads its input: ``read_mode``
(a bare mode string, a mapping without its mode) and ``fold_names`` (the older flat names a
section's ``FOLDED_NAMES`` moves under their nested setting).

Part of ``shared.settings`` (its docstring states the invariants every section keeps).
"""

from __future__ import annotations

import os
from typing import Annotated, Any, ClassVar

from pydantic import BaseModel, BeforeValidator, ConfigDict


def _not_a_bool(value: Any) -> Any:
    if isinstance(value, bool):
        raise ValueError("must be a number, not a boolean")
    return value


# Numbers that refuse booleans: pydantic's lax mode would read YAML `true` as 1.
Int = Annotated[int, BeforeValidator(_not_a_bool)]
Float = Annotated[float, BeforeValidator(_not_a_bool)]
# A path kept as written (Path would drop a leading "./"), or a Hugging Face model name.
PathOrName = Annotated[str, BeforeValidator(lambda v: os.fspath(v) if isinstance(v, os.PathLike) else v)]


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid")
    # older flat names of nested settings, {old name: (field, key)}: read as field.key by a
    # section's before-validator (fold_names), and known to the CONVEYOR_* checks
    # (shared.settings_sources) so their variables still work
    FOLDED_NAMES: ClassVar[dict[str, tuple[str, str]]] = {}


def read_mode(tag: str, default: str) -> BeforeValidator:
    """How a setting with modes (a union of sections told apart by ``Field(discriminator=tag)``)
    reads its input: a bare string is the mode alone (``weight_sync: nccl`` is
    ``{mode: nccl}``, the variant's defaults for the rest), and a mapping without the tag is the
    ``default`` mode (``CONVEYOR_STORAGE__ENDPOINT=...`` alone is an s3 store, as before there
    were modes)."""
    def read(value: Any) -> Any:
        if isinstance(value, str):
            return {tag: value}
        if isinstance(value, dict) and tag not in value:
            return {**value, tag: default}
        return value
    return BeforeValidator(read)


def _as_dict(value: Any, tag: str) -> dict[str, Any]:
    if isinstance(value, BaseModel):  # what was set, and its mode
        return {**value.model_dump(exclude_unset=True), tag: getattr(value, tag)}
    if isinstance(value, str):
        return {tag: value}
    return dict(value) if isinstance(value, dict) else {}


def fold_names(section: type[Section], data: Any) -> Any:
    """``data`` with each older flat name of ``section.FOLDED_NAMES`` moved under its field
    (``weight_sync_host: x`` reads as ``weight_sync: {host: x}``, on the field's value or its
    default). A key written both ways is refused: one would be silently dropped."""
    if not isinstance(data, dict) or not section.FOLDED_NAMES.keys() & data.keys():
        return data
    data = dict(data)
    for old, (field, key) in section.FOLDED_NAMES.items():
        if old in data:
            info = section.model_fields[field]
            nested = _as_dict(data.get(field, info.default), str(info.discriminator))
            if key in nested:
                raise ValueError(f"{old} and {field}.{key} are the same setting: set one")
            nested[key] = data.pop(old)
            data[field] = nested
    return data
