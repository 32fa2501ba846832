"""``conveyor run ...``: the runs a stack holds, read from Redis as the services left them.

``conveyor run list`` shows, per run: its groups (published, done), its trajectories by ledger
state, its trainer (the last step and how long ago; or that none started, or that none reads
the run's events), the policy version its rollouts are served with, and whether it was stopped.
``conveyor run stop RUN`` ends a run (``shared.state.run_stop``). ``conveyor run submit`` and ``run logs``
live in ``services.cli.run_submit`` and ``services.cli.run_logs``.

Invariants:
- ``run list`` is read only. Every key read or written has its owner elsewhere (the ledger,
  the group registry, the trainer's step stream, the policy version, the run's stop;
  ``shared.names``), and whether a trainer reads the run comes from the stream's own records
  (``shared.state.trainer_reads``).
- ``run stop`` writes through ``shared.state.run_stop`` only, and is idempotent: a second stop keeps
  the first one's reason and fails what is left unfinished by the same rule.
- A run id in use is refused in one place, ``refuse_run_in_use``: intake and ``run submit`` both
  ask it, so a run is continued only with ``--resume``, and a stopped run never.
- A run is listed once Redis holds any of it (``Ledger.runs``); a run id that is not there is an
  error naming the runs that are.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

import typer
from rich.console import Console
from rich.table import Table

from services.cli import errors

if TYPE_CHECKING:
    from shared.state.ledger import LedgerReads

run_app = typer.Typer(no_args_is_help=True, help="Runs on the stack: what each holds and where its trainer is.")

# a trainer reads its events at least this often between steps (trainer.block_ms is far below it)
NOT_READING_AFTER_S = 120.0
READING = "reading"  # trainer_status of a run whose trainer reads its events


@dataclass(frozen=True)
class RunSummary:
    run_id: str
    groups_published: int
    groups_done: int
    trajectories: dict[str, int]  # ledger state -> count
    trainer_step: int | None  # the last optimizer step on the run's step stream; None: no step yet
    last_step_age_s: float | None
    trainer: str  # "not started", "reading", "not reading for Ns"
    served_version: int
    stopped: str | None = None  # who stopped the run, when and why (``conveyor run stop``); None: not stopped

    def trainer_text(self) -> str:
        if self.trainer_step is None:
            return f"no step yet ({self.trainer})"
        return f"step {self.trainer_step}, {self.last_step_age_s:.0f}s ago ({self.trainer})"


def summarize(client: Any, ledger: Any, run_id: str) -> RunSummary:
    from shared.state.group_registry import GroupRegistry
    from shared.state.policy_version import PolicyVersion
    from shared.state.run_stop import stop_of
    from shared.state.step_metrics import StepMetrics

    groups = GroupRegistry(client, run_id)
    last = StepMetrics(client, run_id).newest(1)
    step, age = None, None
    if last:
        entry_id, line = last[0]
        step = int(line["step"])
        seconds, microseconds = client.time()  # Redis' clock: the one the entry id comes from
        age = max(0.0, seconds + microseconds / 1e6 - int(entry_id.split("-")[0]) / 1000)
    stop = stop_of(client, run_id)
    return RunSummary(run_id, groups.published_count(), len(groups.done()), ledger.counts(run_id), step, age,
                      trainer_status(client, run_id), PolicyVersion(client, run_id).get(),
                      None if stop is None else stop.describe())


def trainer_status(client: Any, run_id: str) -> str:
    """"not started", "reading" or "not reading for Ns" (``shared.state.trainer_reads``)."""
    from shared.state.trainer_reads import trainer_reading

    reading = trainer_reading(client, run_id)
    if not reading.started:
        return "not started"
    if reading.oldest_unread_s is not None and reading.oldest_unread_s > NOT_READING_AFTER_S:
        return f"not reading for {reading.oldest_unread_s:.0f}s"
    return READING


def require_run(ledger: "LedgerReads", run_id: str) -> None:
    """A ``CommandError`` naming the runs Redis holds, unless it holds ``run_id``."""
    known = ledger.runs()
    if run_id not in known:
        raise errors.CommandError(f"Redis holds no run {run_id!r} (runs: {', '.join(known[-5:]) or 'none'})")


def refuse_stopped(client: Any, run_id: str, instead: str) -> None:
    """A ``CommandError`` if the run was stopped (``conveyor run stop``): a stopped run is over."""
    from shared.state.run_stop import stop_of

    stop = stop_of(client, run_id)
    if stop is not None:
        raise errors.CommandError(f"run {run_id} was {stop.describe()}; a stopped run is over: {instead}")


NEW_RUN_ID = "set a new run id (CONVEYOR_RUN_ID, or run_id in the --config file)"


def refuse_run_in_use(client: Any, run_id: str, resume: bool) -> None:
    """A ``CommandError`` if the run was stopped, or if Redis holds it already and ``resume`` is
    not set: a run id in use is continued only on purpose (intake and ``run submit`` both ask here)."""
    from services.intake.publisher import run_history

    refuse_stopped(client, run_id, NEW_RUN_ID)
    history = run_history(client, run_id)
    if history.started and not resume:
        raise errors.CommandError(
            f"run {run_id} is already in Redis: {history.describe()}. Pass --resume to continue it (the groups "
            f"it published are skipped and reported), or {NEW_RUN_ID}")


@run_app.command("list")
def list_runs(
    config: Optional[Path] = typer.Option(None, "--config", "-c", help="YAML settings file (or set CONVEYOR_CONFIG)"),
    as_json: bool = typer.Option(False, "--json", help="machine-readable output"),
    run: Optional[str] = typer.Option(None, help="only this run"),
) -> None:
    """Every run in Redis: groups, trajectories by state, the trainer's last step, the served version, whether stopped."""
    from shared.state.ledger import STATES, LedgerReads

    client = _redis(config)
    ledger = LedgerReads(client)
    if run is not None:
        require_run(ledger, run)
    summaries = [summarize(client, ledger, r) for r in ([run] if run else ledger.runs())]
    if as_json:
        print(json.dumps({"runs": [asdict(s) for s in summaries]}))
        return
    table = Table(title="Conveyor runs")
    table.add_column("run", no_wrap=True)
    for column in ("groups", "trajectories", "trainer", "served", "stopped"):
        table.add_column(column)
    for s in summaries:
        states = ", ".join(f"{s.trajectories[k]} {k}" for k in STATES if s.trajectories[k]) or "none"
        table.add_row(s.run_id, f"{s.groups_published} published, {s.groups_done} done", states, s.trainer_text(),
                      f"version {s.served_version}", s.stopped or "no")
    Console().print(table)


@run_app.command("stop")
def stop_run(
    run: str = typer.Argument(..., help="the run id"),
    reason: str = typer.Option("stopped by hand", "--reason", help="why: kept with the run and in each failure it causes"),
    config: Optional[Path] = typer.Option(None, "--config", "-c", help="YAML settings file (or set CONVEYOR_CONFIG)"),
) -> None:
    """End a run: intake publishes no more, its queued and running trajectories fail as run_stopped,
    its trainer exits after its step in hand. The workers go on serving other runs."""
    from shared.state.ledger import UNFINISHED, Ledger
    from shared.state.run_stop import end_unfinished, request_stop
    from shared.schemas import TrajectoryState

    client = _redis(config)
    ledger = Ledger(client)
    require_run(ledger, run)
    stop, recorded = request_stop(client, run, reason)
    reading = trainer_status(client, run) == READING
    # a reading trainer ends what reached it (uploaded, scored) itself, after its step in hand
    states = [TrajectoryState.queued, TrajectoryState.running] if reading else UNFINISHED
    failed = end_unfinished(ledger, run, stop, states)
    print(f"run {run} {'' if recorded else 'was already '}{stop.describe()}; {failed} unfinished trajectories failed now"
          + ("; its trainer fails the rest and exits after its step in hand" if reading else ""))


def _redis(config: Optional[Path]) -> Any:
    from shared.settings import load_settings
    from shared.state.ledger import redis_for

    settings = load_settings(yaml_file=config)
    return redis_for(settings.redis.url, settings.outage)
