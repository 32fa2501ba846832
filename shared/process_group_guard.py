"""The process that ends a command's process groups when the command itself is gone.

``shared.processes.start_group_leader`` starts each child of a command (vLLM, Redis, a
Celery worker) as the leader of its own process group and tells this guard about it over a
pipe: ``+<pgid>`` when the group starts, ``-<pgid>`` when the command ended it itself. When the
pipe closes, however the command ended (a clean exit, an exception, SIGKILL), the guard does
what the command's own ``stop()`` would have done to every group still on its list: SIGTERM,
then SIGKILL to whatever is left after the grace period. Then it exits.

Invariants:
- It runs in its own session, so Ctrl-C in the command's terminal and a signal to the
  command's process group do not reach it; it ignores SIGINT and SIGHUP as well.
- It only ever signals groups it was told about and not told to forget, so a clean exit (every
  group released) signals nothing.
- It never waits longer than the grace period plus a few seconds.

Usage (by ``shared.processes`` only): ``python -m shared.process_group_guard <grace_s>``.
"""

from __future__ import annotations

import os
import signal
import sys
import time


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # a member we may not signal: not ours to end
        return False
    return True


def _signal_groups(groups: set[int], sig: int) -> None:
    for pgid in groups:
        try:
            os.killpg(pgid, sig)
        except (ProcessLookupError, PermissionError):
            pass


def end_groups(groups: set[int], grace_s: float) -> set[int]:
    """SIGTERM each group, SIGKILL what is left after ``grace_s``; returns the groups that
    needed SIGKILL."""
    alive = {pgid for pgid in groups if _group_alive(pgid)}
    _signal_groups(alive, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while alive and time.monotonic() < deadline:
        time.sleep(0.1)
        alive = {pgid for pgid in alive if _group_alive(pgid)}
    _signal_groups(alive, signal.SIGKILL)
    return alive


def read_groups(lines) -> set[int]:
    """The groups still watched once the stream of ``+pgid`` / ``-pgid`` lines ends."""
    groups: set[int] = set()
    for line in lines:
        line = line.strip()
        if len(line) > 1 and line[0] in "+-" and line[1:].isdigit():
            (groups.add if line[0] == "+" else groups.discard)(int(line[1:]))
    return groups


def main(argv: list[str]) -> int:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    grace_s = float(argv[1]) if len(argv) > 1 else 15.0
    groups = read_groups(sys.stdin)  # returns when the command's end of the pipe closes
    killed = end_groups(groups, grace_s)
    if killed:
        print(f"[process-group-guard] SIGKILL to process groups {sorted(killed)}: still running {grace_s:.0f}s after SIGTERM",
              file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
