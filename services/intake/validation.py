"""``conveyor data validate``: every row of a dataset through the same admission intake uses
(``adapters.admit_row``: the environment's own adapter and Config, the size, UTF-8 and prompt
limits), before anything is published.

Invariant: validation publishes nothing and writes nothing; it reads the dataset once and
reports counts per environment and, per field, how many rows it rejected and the first few
(source, reason) pairs. A reason names its field as ``field 'x'``, ``env_config.x`` or a leading
``snake_case`` name (``test_patch does not apply``); a reason that names none is grouped under
the kind of problem (row size, encoding, prompt length) or its first words.
"""

from __future__ import annotations

import re
from collections import Counter, defaultdict
from dataclasses import dataclass, field

from services.intake.adapters import RowRejected, admit_row
from services.intake.datasets import BadRow, Dataset
from services.intake.limits import PromptLimit
from services.intake.splits import assign_splits
from shared.environments import EnvironmentRegistry
from shared.schemas import TaskProfile
from shared.settings import SplitSettings

FIRST_ERRORS = 3
_FIELD = re.compile(r"(?:field|label field) '([^']+)'|(env_config\.[A-Za-z0-9_.]+)|'(env_key|env_name|task_data|env_config)'")
_LEADING_NAME = re.compile(r"^([a-z]+_[a-z_]+|[A-Z]+_[A-Z_]+)\b")
_KIND = re.compile(r"^(row is \d+ bytes|not valid UTF-8|not valid JSON|not readable JSON|prompt is \d+ tokens|"
                   r"unknown environment|row must be)")


@dataclass
class FieldErrors:
    count: int = 0
    first: list[tuple[str, str]] = field(default_factory=list)  # (source, reason)


@dataclass
class ValidationReport:
    version: str
    rows: int = 0
    valid: int = 0
    by_environment: Counter = field(default_factory=Counter)
    errors: dict[str, FieldErrors] = field(default_factory=lambda: defaultdict(FieldErrors))
    splits: dict[str, Counter] = field(default_factory=dict)  # env -> {train, eval, none}: counts

    @property
    def rejected(self) -> int:
        return self.rows - self.valid

    def reject(self, source: str, reason: str) -> None:
        errors = self.errors[field_of(reason)]
        errors.count += 1
        if len(errors.first) < FIRST_ERRORS:
            errors.first.append((source, reason))

    def as_json(self) -> dict:
        return {"dataset_version": self.version, "rows": self.rows, "valid": self.valid, "rejected": self.rejected,
                "by_environment": dict(self.by_environment),
                "splits": {env: dict(counts) for env, counts in sorted(self.splits.items())},
                "errors": {name: {"count": e.count, "first": [{"source": s, "reason": r} for s, r in e.first]}
                           for name, e in sorted(self.errors.items())}}


def field_of(reason: str) -> str:
    """The field a rejection names, else the kind of problem (``row is N bytes`` -> ``row size``)."""
    match = _FIELD.search(reason)
    if match:
        return next(g for g in match.groups() if g)
    leading = _LEADING_NAME.match(reason)  # "test_patch does not apply ...", "base_commit abc cannot ..."
    if leading:
        return leading.group(1)
    kind = _KIND.match(reason)
    if kind:
        words = kind.group(1)
        return {"row is": "row size", "not valid UTF-8": "encoding", "prompt is": "prompt length"}.get(
            next((k for k in ("row is", "not valid UTF-8", "prompt is") if words.startswith(k)), ""), words)
    return reason.split(":", 1)[0][:60]


def validate(data: Dataset, env_name: str, env_config: dict, registry: EnvironmentRegistry,
             prompt_limit: PromptLimit | None = None, splits: SplitSettings | None = None) -> ValidationReport:
    """``splits``: also count each environment's valid tasks per split."""
    report = ValidationReport(version=data.version)
    tasks: list[TaskProfile] = []
    for row in data.rows:
        report.rows += 1
        if isinstance(row, BadRow):
            report.reject(row.source, row.reason)
            continue
        try:
            task = admit_row(row.value, row.source, env_name, env_config, registry, data.version, prompt_limit)
        except (RowRejected, ValueError) as exc:
            report.reject(row.source, str(exc))
            continue
        report.valid += 1
        report.by_environment[task.env_name] += 1
        tasks.append(task)
    if splits is not None and (splits.eval_fraction > 0 or splits.holdout_envs):
        for task, split in zip(tasks, assign_splits(tasks, splits)):
            report.splits.setdefault(task.env_name, Counter())[split] += 1
    return report
