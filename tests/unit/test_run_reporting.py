"""``shared.processes.run_reporting``: a long command in the foreground is never silent (its
latest line at most every ``every_s``), and a failure or a timeout says what the command printed
last. Real child processes (bash), no stand-ins."""

from __future__ import annotations

import subprocess

import pytest

from shared.processes import run_reporting


def test_a_long_command_reports_its_latest_line_at_most_every_interval():
    heard: list[str] = []
    run_reporting(["bash", "-c", "for i in 1 2 3 4 5 6; do echo step $i; sleep 0.25; done"], heard.append, every_s=0.5)
    assert heard, "a 1.5 s command with a 0.5 s interval reported nothing"
    assert len(heard) < 6, f"every line was reported, not the latest every 0.5 s: {heard}"
    assert all(line.startswith("step ") for line in heard)


def test_a_failure_raises_with_the_commands_last_lines():
    with pytest.raises(subprocess.CalledProcessError) as failed:
        run_reporting(["bash", "-c", "echo fetching; echo 'no such package' >&2; exit 3"], lambda _line: None)
    assert failed.value.returncode == 3
    assert "fetching" in failed.value.output and "no such package" in failed.value.output


def test_a_command_past_its_timeout_is_killed_and_says_so():
    with pytest.raises(subprocess.TimeoutExpired) as expired:
        run_reporting(["bash", "-c", "echo started; exec sleep 30"], lambda _line: None, timeout_s=1)
    assert "started" in expired.value.output
