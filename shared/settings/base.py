"""The building blocks of every settings section: ``Section`` (unknown keys are errors) and the
number types that refuse booleans.

Part of ``shared.settings`` (its docstring states the invariants every section keeps).
"""

from __future__ import annotations

import os
from typing import Annotated, Any

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
