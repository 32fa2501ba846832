"""Intake-time checks of coding rows: a row that cannot grade is rejected before any episode runs.

For a row with hidden tests: its repository is fetched and ``base_commit`` checked out (the same
cached workspace the episodes use, ``repo.prepare_workspace``), and ``test_patch`` must apply to
it (``git apply --check``). A patch that only lacks its final newline was already normalised by
``task.coding_task``.

Invariant: ``check_gradable`` returns the task data unchanged or raises ``RowRejected`` naming
the commit, the source and git's reason. Blocking (a clone on first use): intake calls it per
row; ``env_config.intake_checks: false`` turns it off (e.g. intake on a machine with no access
to the repositories).
"""

from __future__ import annotations

import io
import subprocess
import tarfile
import tempfile
from typing import Any

from shared.environments import RowRejected

from .config import CodingConfig
from .repo import RepoError, prepare_workspace
from .task import CodingTask


def check_gradable(task_data: dict[str, Any], config: CodingConfig) -> dict[str, Any]:
    task = CodingTask.from_data(task_data)
    if not config.intake_checks or not task.has_tests:
        return task_data
    source = task.source_url(config.repo_url_template)
    try:
        workspace = prepare_workspace(source, task.base_commit, config.workspace_cache_dir)
    except RepoError as exc:
        raise RowRejected(f"base_commit {task.base_commit} cannot be checked out from {source}: {exc}") from None
    if task.test_patch.strip():
        problem = _apply_check(workspace.archive, task.test_patch)
        if problem is not None:
            raise RowRejected(f"test_patch does not apply to base_commit {task.base_commit} of {source}: {problem}")
    return task_data


def _apply_check(archive: bytes, patch: str) -> str | None:
    with tempfile.TemporaryDirectory(prefix="conveyor-intake-") as tree:
        with tarfile.open(fileobj=io.BytesIO(archive)) as workspace:
            workspace.extractall(tree, filter="data")
        done = subprocess.run(["git", "-c", "core.hooksPath=/dev/null", "apply", "--check", "-"], cwd=tree,
                              input=patch.encode(), capture_output=True, timeout=120, check=False)
    return None if done.returncode == 0 else done.stderr.decode(errors="replace").strip()[-500:] or "git apply failed"
