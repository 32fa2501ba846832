"""The Cline driver's reading of a task's last message (``agent_drivers.cline_task.task_end``),
and its process-tree accounting (``cline_processes.descendants``), on real processes."""

from __future__ import annotations

import os
import subprocess
import time

import pytest

from services.rollout_worker.agent_drivers.cline_processes import descendants, is_alive
from services.rollout_worker.agent_drivers.cline_task import task_end


def say(kind: str, text: str = "", partial: bool = False) -> dict:
    return {"ts": 1, "type": "say", "say": kind, "text": text, "partial": partial}


def ask(kind: str, text: str = "", partial: bool = False) -> dict:
    return {"ts": 1, "type": "ask", "ask": kind, "text": text, "partial": partial}


@pytest.mark.parametrize("message, outcome", [
    (say("completion_result", "done"), "completed"),
    (ask("completion_result"), "completed"),
    (ask("api_req_failed", "502"), "failed"),
    (ask("mistake_limit_reached"), "failed"),
    (say("error", "[YOLO MODE] Task failed: Too many consecutive mistakes (3)."), "failed"),
    (ask("followup", "Which file?"), "unanswerable_ask"),
    (ask("plan_mode_respond"), "unanswerable_ask"),
])
def test_messages_that_end_the_task(message, outcome):
    assert task_end(message)[0] == outcome


@pytest.mark.parametrize("message", [
    None, say("text", "thinking"), say("api_req_started"), say("error", "a tool failed"),
    say("completion_result", "do", partial=True), ask("followup", partial=True),
    ask("tool"), ask("command"), ask("resume_task"),  # approvals are answered; resume is a cancelled task's
])
def test_messages_that_do_not(message):
    assert task_end(message) is None


def test_descendants_are_the_whole_live_tree():
    shell = subprocess.Popen(["sh", "-c", "sleep 30 & sleep 30 & wait"])
    try:
        deadline = time.monotonic() + 5
        while len(sleeps := descendants(shell.pid)) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(sleeps) == 2 and {shell.pid, *sleeps} <= set(descendants(os.getpid()))
    finally:
        for pid in [*descendants(shell.pid), shell.pid]:
            os.kill(pid, 9)
        shell.wait()
    assert not is_alive(shell.pid) and descendants(shell.pid) == []
