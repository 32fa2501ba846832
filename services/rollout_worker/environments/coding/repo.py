"""The task's workspace, prepared on the host: a repo clone at ``base_commit``, as a tar archive.

The repository is cloned on the host (a local path, ``file://`` or any URL git can fetch), the
commit's tree is checked out, and a fresh one-commit repository is made of it; the archive of that
directory is what ``Sandbox.provision(workspace=...)`` copies in. Blocking: call it through
``asyncio.to_thread``.

Invariants:
- The workspace repository holds exactly one commit, whose tree is ``base_commit``'s tree, with
  no history, remotes or other refs: nothing written after ``base_commit`` (such as the upstream
  fix) can reach the agent. Its commit id (``base_sha``) is deterministic for a given tree.
- Prepared once per (source, commit) per host: archives are cached on disk under a content key,
  written atomically, so concurrent trajectories of a group and concurrent workers share them.
  Without a commit (the default branch's HEAD, which moves) only the process memory caches it.
- The host's git never runs hooks or filters of the source repository's config on the archive
  (a fresh ``git init``; clones do not copy config).
"""

from __future__ import annotations

import hashlib
import io
import os
import shutil
import subprocess
import tarfile
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path

_BASE_IDENTITY = {
    "GIT_AUTHOR_NAME": "conveyor", "GIT_AUTHOR_EMAIL": "conveyor@localhost", "GIT_AUTHOR_DATE": "2000-01-01T00:00:00Z",
    "GIT_COMMITTER_NAME": "conveyor", "GIT_COMMITTER_EMAIL": "conveyor@localhost",
    "GIT_COMMITTER_DATE": "2000-01-01T00:00:00Z",
}
_locks: dict[str, threading.Lock] = {}
_locks_guard = threading.Lock()
_memory: dict[str, Workspace] = {}
_MEMORY_ENTRIES = 8


class RepoError(RuntimeError):
    """The task's repository or commit cannot be prepared (a bad task or an unreachable source)."""


@dataclass(frozen=True)
class Workspace:
    key: str  # content key of (source, commit)
    archive: bytes  # tar of the workspace directory's contents
    base_sha: str  # the one commit of the workspace repository


def workspace_key(source: str, commit: str | None) -> str:
    return hashlib.sha256(f"v1\0{source}\0{commit or 'HEAD'}".encode()).hexdigest()[:20]


def default_cache_dir() -> Path:
    return Path(tempfile.gettempdir()) / "conveyor-workspaces"


def prepare_workspace(source: str, commit: str | None, cache_dir: str | Path | None = None) -> Workspace:
    key = workspace_key(source, commit)
    cached = _memory.get(key)
    if cached is not None:
        return cached
    cache = Path(cache_dir) if cache_dir else default_cache_dir()
    with _lock(key):
        archive_path, sha_path = cache / f"{key}.tar", cache / f"{key}.sha"
        if commit is None:  # a moving target: memory only, so one process's group agrees
            workspace = Workspace(key, *_build(source, commit))
        else:
            if not (archive_path.exists() and sha_path.exists()):
                cache.mkdir(parents=True, exist_ok=True)
                archive, sha = _build(source, commit)
                _atomic_write(archive_path, archive)
                _atomic_write(sha_path, sha.encode())
            workspace = Workspace(key, archive_path.read_bytes(), sha_path.read_text().strip())
    with _locks_guard:
        while len(_memory) >= _MEMORY_ENTRIES:
            _memory.pop(next(iter(_memory)))
        _memory[key] = workspace
    return workspace


def _lock(key: str) -> threading.Lock:
    with _locks_guard:
        return _locks.setdefault(key, threading.Lock())


def _git(*args: str, cwd: Path | None = None, env: dict[str, str] | None = None, timeout: float = 600) -> str:
    full_env = {**os.environ, "GIT_TERMINAL_PROMPT": "0", "GIT_CONFIG_NOSYSTEM": "1", **(env or {})}
    try:
        done = subprocess.run(["git", "-c", "core.hooksPath=/dev/null", "-c", "core.autocrlf=false", *args],
                              check=False, cwd=cwd, env=full_env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as exc:
        raise RepoError(f"git {args[0]} took longer than {timeout:.0f}s") from exc
    if done.returncode != 0:
        raise RepoError(f"git {' '.join(args[:2])} failed: {done.stderr.strip()[-500:]}")
    return done.stdout


def _build(source: str, commit: str | None) -> tuple[bytes, str]:
    with tempfile.TemporaryDirectory(prefix="conveyor-clone-") as tmp:
        tree = Path(tmp, "repo")
        _git("clone", "--quiet", "--no-checkout", source, str(tree))
        target = commit or "HEAD"
        try:
            _git("checkout", "--quiet", "--detach", "--force", f"{target}^{{commit}}", cwd=tree)
        except RepoError as exc:
            raise RepoError(f"commit {target} is not in {source}: {exc}") from None
        shutil.rmtree(tree / ".git")
        _git("init", "--quiet", "--initial-branch=main", cwd=tree)
        _git("add", "--all", "--force", cwd=tree)  # every checked-out file was tracked upstream
        _git("commit", "--quiet", "--allow-empty", "--no-verify", "-m", f"base {target}", cwd=tree, env=_BASE_IDENTITY)
        sha = _git("rev-parse", "HEAD", cwd=tree).strip()
        return _tar(tree), sha


def _tar(root: Path) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as archive:
        for path in sorted(root.iterdir()):
            archive.add(path, arcname=path.name)
    return buf.getvalue()


def _atomic_write(path: Path, data: bytes) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "wb") as out:
            out.write(data)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
