"""Child processes that never outlive the command that started them, and SIGTERM that ends a
command the way Ctrl-C does.

Invariants:
- ``exit_on_sigterm()``: the first SIGTERM raises ``Terminated`` (a ``SystemExit``, code 143) in
  the main thread, so every ``finally`` and context manager on the way out runs; a command
  stops the processes it started before it exits. SIGTERM and SIGINT that come while it is
  stopping are ignored, so a second signal cannot cut the clean-up short (a SIGKILL still can:
  see below). The same after a first Ctrl-C.
- ``die_with_parent`` (a ``preexec_fn``) asks the kernel to send the child SIGTERM when the
  thread that started it ends, which covers a parent killed with SIGKILL. Start children from
  the main thread (or one that lives as long as they should).
- ``start_group_leader`` starts a child as the leader of its own process group, with
  ``die_with_parent``, and registers the group with the command's process-group guard
  (``shared.process_group_guard``): if the command dies without ending the group
  (``release_group``), the guard SIGTERMs it and SIGKILLs what is left after the grace
  period. SIGTERM alone is not enough: a child may be somewhere it cannot act on it (vLLM
  between its API server and its engine starting), and grandchildren (vLLM's engine, Celery's
  pool) get no signal from the kernel at all.
- ``run_reporting`` runs a long command in the foreground without leaving its caller silent:
  its latest output line goes to ``report`` at most every ``every_s`` seconds, and a failure
  raises with the command's last lines.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from types import FrameType
from typing import IO, Any, Callable, cast

PR_SET_PDEATHSIG = 1


class Terminated(SystemExit):
    """The command got SIGTERM."""

    def __init__(self) -> None:
        super().__init__(128 + signal.SIGTERM)


def _stop_listening() -> None:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def _on_sigterm(_signum: int, _frame: FrameType | None) -> None:
    _stop_listening()
    raise Terminated


def _on_sigint(_signum: int, _frame: FrameType | None) -> None:
    _stop_listening()
    raise KeyboardInterrupt


def exit_on_sigterm() -> None:
    """Install the handlers (in the main thread)."""
    signal.signal(signal.SIGTERM, _on_sigterm)
    signal.signal(signal.SIGINT, _on_sigint)


def on_sigterm(callback: Callable[[], None]) -> None:
    """Instead of raising: call ``callback`` on SIGTERM or Ctrl-C and let the command finish
    what it is doing (a consumer between two messages)."""

    def handler(_signum: int, _frame: FrameType | None) -> None:
        _stop_listening()
        callback()

    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, handler)


def die_with_parent(sig: int = signal.SIGTERM) -> Callable[[], None]:
    """A ``preexec_fn`` for ``subprocess.Popen``: the child gets ``sig`` when its parent dies."""
    parent = os.getpid()

    def preexec() -> None:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0)
        if os.getppid() != parent:  # the parent died before prctl took effect
            os.kill(os.getpid(), sig)

    return preexec


GUARD_GRACE_S = 15.0
_guard: subprocess.Popen[bytes] | None = None
_guard_lock = threading.Lock()


def _tell_guard(line: str) -> None:
    global _guard
    with _guard_lock:
        if _guard is None or _guard.poll() is not None:
            if line.startswith("-"):
                return  # no guard watches anything: nothing to forget
            _guard = subprocess.Popen(
                [sys.executable, "-m", "shared.process_group_guard", str(GUARD_GRACE_S)],
                stdin=subprocess.PIPE, start_new_session=True, cwd=os.path.dirname(os.path.dirname(__file__)),
            )
        try:
            guard_stdin = cast(IO[bytes], _guard.stdin)  # started with stdin=PIPE: never None
            guard_stdin.write(f"{line}\n".encode())
            guard_stdin.flush()
        except (BrokenPipeError, ValueError):  # it died: the next registration starts another
            _guard = None


def start_group_leader(argv: list[str], **popen_kwargs: Any) -> subprocess.Popen:
    """``subprocess.Popen`` in a new process group (pgid = the child's pid) that ends when
    this process ends, however it ends. End it with ``killpg`` and call ``release_group``."""
    proc = subprocess.Popen(argv, start_new_session=True, preexec_fn=die_with_parent(), **popen_kwargs)
    _tell_guard(f"+{proc.pid}")
    return proc


def release_group(pgid: int) -> None:
    """This process ended the group itself: the guard forgets it."""
    _tell_guard(f"-{pgid}")


def run_reporting(argv: list[str], report: Callable[[str], None], every_s: float = 10.0,
                  timeout_s: float | None = None) -> None:
    """Run ``argv`` to its end (stdout and stderr merged), passing its latest line to ``report``
    at most every ``every_s`` seconds; raise ``subprocess.CalledProcessError`` (its ``output``: the
    last 20 lines) on a non-zero exit, ``subprocess.TimeoutExpired`` after ``timeout_s``."""
    last = time.monotonic()
    tail: deque[str] = deque(maxlen=20)
    with subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, errors="replace") as proc:
        timed_out = threading.Event()

        def expire() -> None:
            timed_out.set()
            proc.kill()

        watchdog = threading.Timer(timeout_s, expire) if timeout_s is not None else None
        if watchdog is not None:
            watchdog.start()
        try:
            for raw in cast(IO[str], proc.stdout):
                if not (line := " ".join(raw.split())):
                    continue
                tail.append(line)
                if time.monotonic() - last >= every_s:
                    last = time.monotonic()
                    report(line)
            returncode = proc.wait()
        finally:
            if watchdog is not None:
                watchdog.cancel()
    if timed_out.is_set():
        raise subprocess.TimeoutExpired(argv, cast(float, timeout_s), output="\n".join(tail))
    if returncode != 0:
        raise subprocess.CalledProcessError(returncode, argv, output="\n".join(tail))
