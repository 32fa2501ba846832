"""The process-group guard ends what a command started when the command is killed with SIGKILL, even
a child that ignores SIGTERM and its grandchildren, and leaves alone what the command ended
itself (real processes)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil

from shared.process_group_guard import read_groups

REPO = Path(__file__).parents[2]

# A command that starts two groups, each a shell that ignores SIGTERM with a grandchild,
# releases the second one after ending it itself, prints the pids and waits to be killed.
COMMAND = textwrap.dedent("""
    import os, signal, sys, time
    import shared.processes as processes
    processes.GUARD_GRACE_S = 1.0
    argv = ["sh", "-c", "trap '' TERM; sleep 600 & wait"]
    kept = processes.start_group_leader(argv)
    ended = processes.start_group_leader(argv)
    time.sleep(0.5)
    os.killpg(ended.pid, signal.SIGKILL); ended.wait()
    processes.release_group(ended.pid)
    print(kept.pid, processes._guard.pid, flush=True)
    time.sleep(600)
""")


def _group_members(pgid: int) -> list[psutil.Process]:
    members = []
    for proc in psutil.process_iter(["pid"]):
        try:
            if os.getpgid(proc.pid) == pgid and proc.status() != psutil.STATUS_ZOMBIE:
                members.append(proc)
        except (ProcessLookupError, psutil.NoSuchProcess):
            pass
    return members


def test_a_killed_command_leaves_no_group_behind():
    command = subprocess.Popen([sys.executable, "-c", COMMAND], stdout=subprocess.PIPE, text=True, cwd=REPO,
                               env={**os.environ, "PYTHONPATH": str(REPO)})
    kept_pgid, guard_pid = map(int, command.stdout.readline().split())
    try:
        assert len(_group_members(kept_pgid)) == 2  # the shell and its sleep
        command.kill()
        command.wait(10)
        # the kernel's SIGTERM is ignored; the guard's SIGKILL comes after its 1 s grace
        deadline = time.time() + 20
        while _group_members(kept_pgid) and time.time() < deadline:
            time.sleep(0.1)
        assert _group_members(kept_pgid) == []
        psutil.Process(guard_pid).wait(10)  # and the guard itself is gone
    finally:
        for member in _group_members(kept_pgid):
            member.kill()


def test_released_groups_are_forgotten_and_bad_lines_ignored():
    assert read_groups(["+10\n", "+11\n", "-10\n", "junk\n", "+\n", "-x\n", "+12"]) == {11, 12}
