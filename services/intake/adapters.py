"""Row adapters: one dataset row -> a TaskProfile for an environment.

Accepted row shapes (see the architecture page):
- ``{"task_data": {...}, "env_config": {...}?, "id": ...?}``, for any environment;
- task-file JSON with ``task_key`` and ``env_key`` (and ``task_data`` or the task's fields);
- question/answer keys (``question`` + ``answer``, or ``prompt`` + ``answer``) for ``qa``;
- ``prompt`` rows for ``single_turn`` (a user's task: the row goes to their reward function,
  ``env_config.reward_fn``, which must import);
- SWE-bench rows and swe-agent-13k rows for ``coding`` (see ``environments/coding/task.py``);
- flat ``target``/``low``/``high`` rows for ``guess_number``.

Invariant: an adapter either returns a valid TaskProfile or raises ``RowRejected`` with a
reason that names the missing or bad field. It never returns half a task, and never raises
anything else (a settings model refusing the row's ``env_config`` is a ``RowRejected`` too);
``tests/unit/test_adapters_fuzz.py`` holds it to that.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any, Callable

from pydantic import ValidationError

from shared.import_path import ImportPathError, import_callable
from shared.schemas import TaskProfile


class RowRejected(ValueError):
    pass


def _task_id(row: dict[str, Any]) -> str:
    for key in ("id", "task_id", "task_key", "instance_id"):
        if key in row and row[key] not in (None, ""):
            return str(row[key])
    return hashlib.sha256(json.dumps(row, sort_keys=True, default=str).encode()).hexdigest()[:16]


def _require_int(data: dict[str, Any], field: str) -> int:
    value = data.get(field)
    if isinstance(value, bool) or not isinstance(value, int):
        raise RowRejected(f"field {field!r} must be an integer, got {value!r}")
    return value


def guess_number_task(data: dict[str, Any]) -> dict[str, Any]:
    low, high, target = (_require_int(data, f) for f in ("low", "high", "target"))
    if not low <= target <= high:
        raise RowRejected(f"target {target} is outside [{low}, {high}]")
    return {"low": low, "high": high, "target": target}


def qa_task(data: dict[str, Any]) -> dict[str, Any]:
    question = data.get("question") or data.get("prompt")
    if not isinstance(question, str) or not question.strip():
        raise RowRejected("field 'question' (or 'prompt') must be a non-empty string")
    if data.get("answer") in (None, ""):
        raise RowRejected("field 'answer' is missing")
    return {"question": question, "answer": str(data["answer"])}


def single_turn_task(data: dict[str, Any]) -> dict[str, Any]:
    prompt = data.get("prompt") or data.get("question")
    if not isinstance(prompt, str) or not prompt.strip():
        raise RowRejected("field 'prompt' (or 'question') must be a non-empty string")
    return {"prompt": prompt, "row": data}


def coding_task(data: dict[str, Any]) -> dict[str, Any]:
    # imported on use: the coding task module imports RowRejected from here, and intake
    # should not load the sandbox (docker) stack for text-only datasets
    from services.rollout_worker.environments.coding.task import coding_task as adapt

    return adapt(data)


def coding_row_gradable(task_data: dict[str, Any], env_config: dict[str, Any]) -> dict[str, Any]:
    """Rejects a coding row whose repository, commit or test patch cannot grade (fetches the repo)."""
    from services.rollout_worker.environments.coding.gradable import check_gradable

    return check_gradable(task_data, env_config)


def single_turn_reward_fn(task_data: dict[str, Any], env_config: dict[str, Any]) -> dict[str, Any]:
    """Rejects a row whose ``reward_fn`` is missing or cannot be imported: every episode of it
    would fail, with the reason only in the ledger."""
    if "reward_fn" not in env_config:
        raise RowRejected("env_config.reward_fn is missing: single_turn rows are scored by it")
    try:
        import_callable(str(env_config["reward_fn"]), "env_config.reward_fn")
    except ImportPathError as exc:
        raise RowRejected(str(exc)) from None
    return task_data


# Checks that need the environment's settings too, run after the row's validator.
ROW_CHECKS: dict[str, Callable[[dict[str, Any], dict[str, Any]], dict[str, Any]]] = {
    "coding": coding_row_gradable,
    "single_turn": single_turn_reward_fn,
}

TASK_VALIDATORS: dict[str, Callable[[dict[str, Any]], dict[str, Any]]] = {
    "guess_number": guess_number_task,
    "qa": qa_task,
    "single_turn": single_turn_task,
    "coding": coding_task,
}


def adapt_row(row: Any, default_env: str, source: str = "", default_env_config: dict[str, Any] | None = None) -> TaskProfile:
    if not isinstance(row, dict):
        raise RowRejected(f"row must be a JSON object, got {type(row).__name__}")
    env_name = row.get("env_key") or row.get("env_name") or default_env
    if not isinstance(env_name, str):
        raise RowRejected(f"field 'env_key'/'env_name' must be a string naming an environment, got {env_name!r}")
    validator = TASK_VALIDATORS.get(env_name)
    if validator is None:
        raise RowRejected(f"unknown environment {env_name!r}; known: {sorted(TASK_VALIDATORS)}")
    data = row.get("task_data")
    if data is None:  # columnar datasets give absent columns as None
        data = row
    if not isinstance(data, dict):
        raise RowRejected("field 'task_data' must be an object")
    env_config = row.get("env_config") or {}
    if not isinstance(env_config, dict):
        raise RowRejected("field 'env_config' must be an object")
    env_config = {**(default_env_config or {}), **env_config}
    task_data = validator(data)
    check = ROW_CHECKS.get(env_name)
    try:
        if check is not None:
            task_data = check(task_data, env_config)  # may read env_config through a settings model
        return TaskProfile(task_id=_task_id(row), env_name=env_name, task_data=task_data, env_config=env_config, source=source)
    except ValidationError as exc:
        problems = "; ".join(f"{'.'.join(map(str, e['loc'])) or 'row'}: {e['msg']}" for e in exc.errors()[:3])
        raise RowRejected(f"{exc.title}: {problems}") from None
