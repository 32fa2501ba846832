"""Row adapters: one dataset row -> a TaskProfile for an environment.

The row names its environment (``env_key`` or ``env_name``, else intake's ``env_name``); the
environment, resolved through the one registry (``shared.environments.registry``), owns what
its rows look like (``task_from_row``), its settings model (``Config``) and its intake checks
(``check_task``). Shapes every environment accepts:
- ``{"task_data": {...}, "env_config": {...}?, "id": ...?}``;
- task-file JSON with ``task_key`` and ``env_key`` (and ``task_data`` or the task's fields);
- the environment's own flat fields (question/answer for ``qa``, SWE-bench and swe-agent-13k
  rows for ``coding``, ...).

Invariant: an adapter either returns a valid TaskProfile or raises ``RowRejected`` with a
reason that names the missing or bad field, or the environment. It never returns half a task,
and never raises anything else (an unknown environment, an ``env_config`` its ``Config``
refuses and a bad row are all ``RowRejected``); ``tests/unit/test_adapters_fuzz.py`` holds it to
that.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from pydantic import ValidationError

from shared.environments import EnvironmentConfigError, EnvironmentRegistry, EnvironmentUnavailable, RowRejected
from shared.environments import registry_for
from shared.schemas import TaskProfile

__all__ = ["RowRejected", "adapt_row"]


def _task_id(row: dict[str, Any]) -> str:
    for key in ("id", "task_id", "task_key", "instance_id"):
        if key in row and row[key] not in (None, ""):
            return str(row[key])
    return hashlib.sha256(json.dumps(row, sort_keys=True, default=str).encode()).hexdigest()[:16]


def adapt_row(row: Any, default_env: str, source: str = "", default_env_config: dict[str, Any] | None = None,
              registry: EnvironmentRegistry | None = None) -> TaskProfile:
    registry = registry or registry_for()
    if not isinstance(row, dict):
        raise RowRejected(f"row must be a JSON object, got {type(row).__name__}")
    env_name = row.get("env_key") or row.get("env_name") or default_env
    if not isinstance(env_name, str):
        raise RowRejected(f"field 'env_key'/'env_name' must be a string naming an environment, got {env_name!r}")
    data = row.get("task_data")
    if data is None:  # columnar datasets give absent columns as None
        data = row
    if not isinstance(data, dict):
        raise RowRejected("field 'task_data' must be an object")
    env_config = row.get("env_config") or {}
    if not isinstance(env_config, dict):
        raise RowRejected("field 'env_config' must be an object")
    env_config = {**(default_env_config or {}), **env_config}
    try:
        env_type = registry.resolve(env_name)
        config = registry.config(env_name, env_config)
        task_data = env_type.task_from_row(data)
        task_data = env_type.check_task(task_data, config)
        return TaskProfile(task_id=_task_id(row), env_name=env_name, task_data=task_data, env_config=env_config, source=source)
    except (EnvironmentUnavailable, EnvironmentConfigError) as exc:
        raise RowRejected(str(exc)) from None
    except ValidationError as exc:
        problems = "; ".join(f"{'.'.join(map(str, e['loc'])) or 'row'}: {e['msg']}" for e in exc.errors()[:3])
        raise RowRejected(f"{exc.title}: {problems}") from None


def admit_row(row: Any, source: str, env_name: str, env_config: dict[str, Any], registry: EnvironmentRegistry,
              dataset_version: str = "", prompt_limit: Any = None) -> TaskProfile:
    """What intake and ``conveyor data validate`` both do with a row: adapt it, stamp the dataset
    version, and check its prompt against the context (``limits.PromptLimit``, if given)."""
    task = adapt_row(row, env_name, source, env_config, registry)
    if dataset_version:
        task = task.model_copy(update={"dataset_version": dataset_version})
    if prompt_limit is not None:
        prompt_limit.check(task, registry.resolve(task.env_name).prompt_text(task.task_data))
    return task
