"""Import paths ``package.module:attribute``: how users name their own code in settings and rows
(a ``reward_fn``, a reward function in ``rewards.weights``).

Invariant: ``import_callable`` returns a callable or raises ``ImportPathError`` (a ValueError)
whose message names the path and the cause (bad shape, the import error, a missing attribute,
not callable). Settings, intake, the scorer and the environments all resolve paths here, so a
bad path reads the same wherever it is found.
"""

from __future__ import annotations

import importlib
from typing import Any, Callable


class ImportPathError(ValueError):
    pass


def import_callable(path: str, what: str = "import path") -> Callable[..., Any]:
    """``what`` names the path in the message: ``reward_fn 'pkg.mod:fn' cannot be imported: ...``."""
    module_name, _, attr = path.partition(":")
    if not module_name or not attr:
        raise ImportPathError(f"{what} {path!r} must look like 'package.module:function'")
    try:
        fn = getattr(importlib.import_module(module_name), attr)
    except Exception as exc:  # user code: whatever its import raises is why the path is unusable
        raise ImportPathError(f"{what} {path!r} cannot be imported: {type(exc).__name__}: {exc}") from exc
    if not callable(fn):
        raise ImportPathError(f"{what} {path!r} is not callable")
    return fn
