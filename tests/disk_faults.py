"""Real faults of a disk, for tests: a small tmpfs that fills up, and a bind mount that goes
away and comes back. They need root (mount); a test that uses them is skipped, with the
reason, where mounting is not allowed."""

from __future__ import annotations

import contextlib
import errno
import os
import subprocess
from pathlib import Path
from typing import Iterator

import pytest


def _mount(*args: str) -> None:
    subprocess.run(["mount", *args], check=True, capture_output=True, text=True)


def _umount(path: Path) -> None:
    subprocess.run(["umount", "-l", str(path)], check=False, capture_output=True)


def require_mount() -> None:
    if os.geteuid() != 0:
        pytest.skip("disk faults need root to mount a small tmpfs (CI runs as root)")


@contextlib.contextmanager
def small_tmpfs(path: Path, size_kib: int) -> Iterator[Path]:
    """``path`` as a tmpfs of ``size_kib`` KiB, for as long as the block runs."""
    require_mount()
    path.mkdir(parents=True, exist_ok=True)
    try:
        _mount("-t", "tmpfs", "-o", f"size={size_kib}k", "tmpfs", str(path))
    except subprocess.CalledProcessError as exc:
        pytest.skip(f"cannot mount a tmpfs here: {exc.stderr.strip()}")
    try:
        yield path
    finally:
        _umount(path)


def fill(path: Path) -> Path:
    """Write a filler file under ``path`` until its filesystem is full; returns the file."""
    filler = path / "filler.bin"
    block = b"\0" * 4096
    with open(filler, "ab", buffering=0) as fh:
        while True:
            try:
                fh.write(block)
            except OSError as exc:
                if exc.errno != errno.ENOSPC:
                    raise
                break
    return filler


class BindMount:
    """``target`` shows ``source`` while mounted; ``unmount`` leaves the empty mount point behind,
    as when a volume vanishes, and ``mount`` brings it back with its data."""

    def __init__(self, source: Path, target: Path):
        require_mount()
        self.source, self.target = source, target
        source.mkdir(parents=True, exist_ok=True)
        target.mkdir(parents=True, exist_ok=True)

    def mount(self) -> None:
        try:
            _mount("--bind", str(self.source), str(self.target))
        except subprocess.CalledProcessError as exc:
            pytest.skip(f"cannot bind-mount here: {exc.stderr.strip()}")

    def unmount(self) -> None:
        _umount(self.target)

    def __enter__(self) -> "BindMount":
        self.mount()
        return self

    def __exit__(self, *_: object) -> None:
        self.unmount()
