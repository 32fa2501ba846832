"""Small real git repositories for tests: run git with a fixed identity, commit a set of files."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

_IDENTITY = {"GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@t"}


def git(cwd: Path, *args: str) -> str:
    return subprocess.run(["git", *args], cwd=cwd, env={**os.environ, **_IDENTITY}, check=True, capture_output=True,
                          text=True).stdout


def write_files(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def diff_of(repo: Path, files: dict[str, str]) -> str:
    """The diff that would add ``files`` to HEAD; the repository is left as it was."""
    write_files(repo, files)
    git(repo, "add", "-A")
    patch = git(repo, "diff", "--cached", "HEAD")
    git(repo, "reset", "-q", "--hard")
    return patch
