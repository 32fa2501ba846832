"""Dataset rows -> the coding environment's task data (pure; no I/O).

Two row formats:

- SWE-bench: ``repo`` ("owner/name"), ``base_commit``, ``problem_statement``, ``test_patch``,
  ``FAIL_TO_PASS``, ``PASS_TO_PASS`` (lists of pytest node ids, or JSON strings of lists), and
  optionally ``EXPECTED_SKIP`` (graded ids whose skip counts as a pass; any other skip fails),
  ``repo_url`` (a local path, ``file://`` or remote URL; otherwise the environment
  builds one from ``env_config.repo_url_template``), ``language``, ``image``, ``test_command`` (kept in
  the task data but not used: the grader always runs its own pytest invocation, see ``grading``).
- swe-agent-13k: ``repo_name``, ``repo_url``, ``language``, ``conversations`` (``conversations[1]``
  from ``human`` is the prompt). No tests: the reward is a dataset label (``reward``, ``score``,
  ``resolved`` or ``label``) when present, else 0 with ``verifier: none`` in the info.

Invariants:
- ``coding_task`` returns a complete task or raises ``RowRejected`` naming the bad field. A
  ``test_patch`` missing its final newline is normalised. Whether the row can grade at all (repo,
  commit, patch applies) is checked at intake by ``gradable``.
- A task with tests always has at least one FAIL_TO_PASS id (otherwise the reward would be
  decided by nothing the agent does).
- The task data is plain JSON (it travels in rollout messages); ``CodingTask.from_data`` reads it.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from typing import Any

from shared.environments import RowRejected

_COMMIT = re.compile(r"^[0-9a-fA-F]{7,40}$")
LABEL_FIELDS = ("reward", "score", "resolved", "label")
LANGUAGE_ALIASES = {"py": "python", "python3": "python", "javascript": "node", "js": "node", "typescript": "node",
                    "ts": "node", "golang": "go", "c++": "c", "cpp": "c"}


def normalize_language(value: Any) -> str:
    language = str(value or "python").strip().lower()
    return LANGUAGE_ALIASES.get(language, language)


def _text(row: dict[str, Any], field: str) -> str:
    value = row.get(field)
    if not isinstance(value, str) or not value.strip():
        raise RowRejected(f"field {field!r} must be a non-empty string, got {value!r:.80}")
    return value


def _id_list(row: dict[str, Any], field: str) -> list[str]:
    value = row.get(field)
    if value is None:
        return []
    if isinstance(value, str):
        try:
            value = json.loads(value) if value.strip() else []
        except json.JSONDecodeError as exc:
            raise RowRejected(f"field {field!r} is a string but not a JSON list ({exc.msg})") from None
    if not isinstance(value, list) or not all(isinstance(v, str) and v.strip() for v in value):
        raise RowRejected(f"field {field!r} must be a list of test ids (non-empty strings), got {value!r:.120}")
    return list(dict.fromkeys(value))


def _optional_text(row: dict[str, Any], field: str) -> str | None:
    value = row.get(field)
    if value in (None, ""):
        return None
    if not isinstance(value, str):
        raise RowRejected(f"field {field!r} must be a string, got {value!r:.80}")
    return value


def _commit(row: dict[str, Any], required: bool) -> str | None:
    value = row.get("base_commit") or row.get("commit")
    if value is None and not required:
        return None
    if not isinstance(value, str) or not _COMMIT.match(value):
        raise RowRejected(f"field 'base_commit' must be a 7-40 digit hex commit id, got {value!r:.80}")
    return value.lower()


def _swe_bench(row: dict[str, Any]) -> dict[str, Any]:
    f2p, p2p = _id_list(row, "FAIL_TO_PASS"), _id_list(row, "PASS_TO_PASS")
    if not f2p:
        raise RowRejected("field 'FAIL_TO_PASS' is empty: there would be nothing for the agent's change to fix")
    test_patch = row.get("test_patch")
    if not isinstance(test_patch, str):
        raise RowRejected(f"field 'test_patch' must be a string (a unified diff), got {test_patch!r:.80}")
    if test_patch.strip() and not test_patch.endswith("\n"):
        test_patch += "\n"  # a diff that only lacks its final newline is fine; git apply would call it corrupt
    return {
        "format": "swe_bench",
        "repo": _text(row, "repo"),
        "repo_url": _optional_text(row, "repo_url"),
        "base_commit": _commit(row, required=True),
        "problem_statement": _text(row, "problem_statement"),
        "test_patch": test_patch,
        "fail_to_pass": f2p,
        "pass_to_pass": [t for t in p2p if t not in f2p],
        "expected_skip": [t for t in _id_list(row, "EXPECTED_SKIP") if t in f2p or t in p2p],
        "language": normalize_language(row.get("language")),
        "image": _optional_text(row, "image"),
        "test_command": _optional_text(row, "test_command"),
        "label_reward": None,
    }


def _human_prompt(row: dict[str, Any]) -> str:
    conversations = row.get("conversations")
    if not isinstance(conversations, list) or len(conversations) < 2 or not isinstance(conversations[1], dict):
        raise RowRejected("field 'conversations' must be a list whose second entry is the human's task message")
    turn = conversations[1]
    speaker = turn.get("from", turn.get("role"))
    if speaker not in ("human", "user"):
        raise RowRejected(f"conversations[1] must come from 'human', got {speaker!r}")
    text = turn.get("value", turn.get("content"))
    if not isinstance(text, str) or not text.strip():
        raise RowRejected("conversations[1] has no text ('value')")
    return text


def _label(row: dict[str, Any]) -> float | None:
    for field in LABEL_FIELDS:
        value = row.get(field)
        if value is None:
            continue
        if isinstance(value, bool):
            return float(value)
        if isinstance(value, (int, float)) and math.isfinite(number := _as_float(value)):
            return number
        raise RowRejected(f"label field {field!r} must be a finite number or a boolean, got {value!r:.80}")
    return None


def _as_float(value: int | float) -> float:
    try:
        return float(value)
    except OverflowError:  # an integer beyond any float
        return math.inf


def _swe_agent(row: dict[str, Any]) -> dict[str, Any]:
    return {
        "format": "swe_agent",
        "repo": _text(row, "repo_name"),
        "repo_url": _text(row, "repo_url"),
        "base_commit": _commit(row, required=False),
        "problem_statement": _human_prompt(row),
        "test_patch": "",
        "fail_to_pass": [],
        "pass_to_pass": [],
        "expected_skip": [],
        "language": normalize_language(row.get("language")),
        "image": _optional_text(row, "image"),
        "test_command": None,
        "label_reward": _label(row),
    }


def coding_task(row: dict[str, Any]) -> dict[str, Any]:
    """A SWE-bench or swe-agent-13k row -> task data for ``CodingEnv``; ``RowRejected`` otherwise."""
    if not isinstance(row, dict):
        raise RowRejected(f"row must be an object, got {type(row).__name__}")
    if "FAIL_TO_PASS" in row or "test_patch" in row or "problem_statement" in row:
        return _swe_bench(row)
    if "conversations" in row or "repo_name" in row:
        return _swe_agent(row)
    raise RowRejected("not a coding row: expected SWE-bench fields (repo, base_commit, problem_statement, "
                      "test_patch, FAIL_TO_PASS, PASS_TO_PASS) or swe-agent fields (repo_name, repo_url, conversations)")


@dataclass(frozen=True)
class CodingTask:
    format: str
    repo: str
    repo_url: str | None
    base_commit: str | None
    problem_statement: str
    test_patch: str
    fail_to_pass: tuple[str, ...]
    pass_to_pass: tuple[str, ...]
    language: str
    image: str | None
    test_command: str | None
    label_reward: float | None
    expected_skip: tuple[str, ...] = ()  # graded ids whose skip counts as a pass (``EXPECTED_SKIP``)

    @classmethod
    def from_data(cls, data: dict[str, Any]) -> CodingTask:
        """Task data as ``coding_task`` makes it (re-validated: ``task_data`` rows bypass adapters)."""
        if data.get("format") not in ("swe_bench", "swe_agent"):
            data = coding_task(data)
        fields: dict[str, Any] = {name: data.get(name) for name in cls.__dataclass_fields__}
        fields["fail_to_pass"] = tuple(fields["fail_to_pass"] or ())
        fields["pass_to_pass"] = tuple(fields["pass_to_pass"] or ())
        fields["expected_skip"] = tuple(fields["expected_skip"] or ())
        fields["test_patch"] = fields["test_patch"] or ""
        fields["language"] = normalize_language(fields["language"])
        return cls(**fields)

    @property
    def has_tests(self) -> bool:
        return bool(self.fail_to_pass)

    def source_url(self, template: str) -> str:
        return self.repo_url or template.format(repo=self.repo)
