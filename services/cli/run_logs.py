"""``conveyor run logs RUN``: the logs a submitted run's processes wrote on this host.

``conveyor run submit`` (``services.cli.run_submit``) gives each process of a run its own log,
``<runs_dir>/<run id>/logs/<process>.log`` (``runs_dir`` in settings): ``trainer``, ``follower``
(the weight follower), ``intake``, and ``supervisor`` when it was submitted with ``--detach``.

Invariants:
- Read only: nothing is written, no process is signalled.
- With several logs shown, every line carries its process's name (``[trainer] ...``); with one,
  lines are shown as written.
- A run with no log here is an error that says where it looked.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Optional

import typer

from services.cli import errors
from shared.settings import Settings, load_settings

FOLLOW_POLL_S = 0.5


def run_logs_dir(settings: Settings, run_id: str) -> Path:
    """Where ``run submit`` puts the run's process logs."""
    return Path(settings.runs_dir).resolve() / run_id / "logs"


def logs_command(
    run: str = typer.Argument(..., help="the run id"),
    process: Optional[str] = typer.Option(None, "--process", "-p", help="only this process: trainer, follower, intake "
                                          "(or supervisor, of a --detach submit)"),
    follow: bool = typer.Option(False, "--follow", "-f", help="then print new lines as they come, until Ctrl-C"),
    lines: int = typer.Option(40, "--lines", "-n", min=0, help="how many of each log's last lines"),
    config: Optional[Path] = typer.Option(None, "--config", "-c", help="YAML settings file (or set CONVEYOR_CONFIG): "
                                          "its runs_dir is where the logs are"),
) -> None:
    """Print a submitted run's process logs (``conveyor run submit``), prefixed by process when several."""
    settings = load_settings(config)
    errors.state.settings = settings
    folder = run_logs_dir(settings, run)
    found = sorted(folder.glob("*.log")) if folder.is_dir() else []
    if not found:
        raise errors.CommandError(f"run {run} has no logs on this host: looked in {folder} (runs_dir; `conveyor run "
                                  "submit` writes them there, on the host it ran on)")
    chosen = [path for path in found if process is None or path.stem == process]
    if not chosen:
        raise errors.CommandError(f"run {run} has no {process} log in {folder}; it has: "
                                  f"{', '.join(path.stem for path in found)}")
    prefixed = len(chosen) > 1
    offsets = dict.fromkeys(chosen, 0)
    for path in chosen:
        for line in _whole_lines(path, offsets)[-lines:] if lines else []:
            _say(path, line, prefixed)
    if follow:
        _follow(offsets, prefixed)


def _whole_lines(path: Path, offsets: dict[Path, int]) -> list[str]:
    """The whole lines written to ``path`` since ``offsets[path]``, which moves past them; a
    half-written line waits for its end, so following after the tail loses and splits nothing."""
    with path.open("rb") as log:
        log.seek(offsets[path])
        new = log.read()
    complete = new[: new.rfind(b"\n") + 1]
    offsets[path] += len(complete)
    return complete.decode(errors="replace").splitlines()


def _say(path: Path, line: str, prefixed: bool) -> None:
    print(f"[{path.stem}] {line}" if prefixed else line, flush=True)


def _follow(offsets: dict[Path, int], prefixed: bool) -> None:
    """Print what is appended to each log, a whole line at a time, until Ctrl-C (or SIGTERM)."""
    try:
        while True:
            for path in offsets:
                for line in _whole_lines(path, offsets):
                    _say(path, line, prefixed)
            time.sleep(FOLLOW_POLL_S)
    except KeyboardInterrupt:
        return
