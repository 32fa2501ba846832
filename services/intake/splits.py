"""Train/eval splits of a dataset: hash-based, stable across runs, stratified by environment.

Invariants:
- A task's split depends only on its environment, its task id, the salt and the split
  settings, never on the order of the rows or the machine.
- Stratified: within each environment, the tasks are ranked by ``sha256(salt:env:task_id)``
  and the first ``round(eval_fraction × n)`` are eval, so each environment gives its share
  (at least one task when the fraction is above 0). Adding rows moves only tasks near the
  boundary.
- ``holdout_envs``: every task of those environments is eval, never train.
- ``eval_cap_per_env``: at most that many eval tasks per environment, the lowest-ranked ones;
  the rest go to train, except in a held-out environment, where they are left out.
"""

from __future__ import annotations

import hashlib
from collections import defaultdict
from typing import Literal

from shared.schemas import TaskProfile
from shared.settings import SplitSettings

Split = Literal["train", "eval", "none"]


def _rank(salt: str, env_name: str, task_id: str) -> bytes:
    return hashlib.sha256(f"{salt}:{env_name}:{task_id}".encode()).digest()


def assign_splits(tasks: list[TaskProfile], settings: SplitSettings) -> list[Split]:
    """The split of each task, in the order given."""
    by_env: dict[str, list[int]] = defaultdict(list)
    for index, task in enumerate(tasks):
        by_env[task.env_name].append(index)
    splits: list[Split] = ["train"] * len(tasks)
    for env_name, indices in by_env.items():
        ranked = sorted(indices, key=lambda i: _rank(settings.salt, env_name, tasks[i].task_id))
        held_out = env_name in settings.holdout_envs
        eval_count = len(ranked) if held_out else _share(len(ranked), settings.eval_fraction)
        if settings.eval_cap_per_env is not None:
            eval_count = min(eval_count, settings.eval_cap_per_env)
        for position, index in enumerate(ranked):
            if position < eval_count:
                splits[index] = "eval"
            elif held_out:
                splits[index] = "none"  # over the cap of a held-out environment: in no split
    return splits


def _share(n: int, fraction: float) -> int:
    if fraction <= 0:
        return 0
    return max(1, min(n, round(fraction * n)))
