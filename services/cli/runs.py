"""``conveyor run ...``: the runs a stack holds, read from Redis as the services left them.

``conveyor run list`` shows, per run: its groups (published, done), its trajectories by ledger
state, its trainer (the last step and how long ago; or that none started, or that none reads
the run's events), and the policy version its rollouts are served with.

Invariants:
- Read only: nothing here writes to Redis. Every key read has its owner elsewhere (the ledger,
  the group registry, the trainer's step stream, the policy version; ``shared.names``), and
  whether a trainer reads the run comes from the stream's own records (``shared.trainer_reads``).
- A run is listed once Redis holds any of it (``Ledger.runs``); a run id that is not there is an
  error naming the runs that are.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Optional

import typer
from rich.console import Console
from rich.table import Table

from services.cli import errors

run_app = typer.Typer(no_args_is_help=True, help="Runs on the stack: what each holds and where its trainer is.")

# a trainer reads its events at least this often between steps (trainer.block_ms is far below it)
NOT_READING_AFTER_S = 120.0


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

    def trainer_text(self) -> str:
        if self.trainer_step is None:
            return f"no step yet ({self.trainer})"
        return f"step {self.trainer_step}, {self.last_step_age_s:.0f}s ago ({self.trainer})"


def summarize(client: Any, ledger: Any, run_id: str) -> RunSummary:
    from shared.group_registry import GroupRegistry
    from shared.names import RedisKeys
    from shared.policy_version import PolicyVersion
    from shared.trainer_reads import trainer_reading

    groups = GroupRegistry(client, run_id)
    last = client.xrevrange(RedisKeys.step_metrics(run_id), count=1)
    step, age = None, None
    if last:
        entry_id, fields = last[0]
        step = int(json.loads(fields["metrics"])["step"])
        seconds, microseconds = client.time()  # Redis' clock: the one the entry id comes from
        age = max(0.0, seconds + microseconds / 1e6 - int(entry_id.split("-")[0]) / 1000)
    reading = trainer_reading(client, run_id)
    if not reading.started:
        trainer = "not started"
    elif reading.oldest_unread_s is not None and reading.oldest_unread_s > NOT_READING_AFTER_S:
        trainer = f"not reading for {reading.oldest_unread_s:.0f}s"
    else:
        trainer = "reading"
    return RunSummary(run_id, groups.published_count(), len(groups.done()), ledger.counts(run_id), step, age, trainer,
                      PolicyVersion(client, run_id).get())


def require_run(ledger: Any, run_id: str) -> None:
    """A ``CommandError`` naming the runs Redis holds, unless it holds ``run_id``."""
    known = ledger.runs()
    if run_id not in known:
        raise errors.CommandError(f"Redis holds no run {run_id!r} (runs: {', '.join(known[-5:]) or 'none'})")


@run_app.command("list")
def list_runs(
    config: Optional[Path] = typer.Option(None, "--config", "-c", help="YAML settings file (or set CONVEYOR_CONFIG)"),
    as_json: bool = typer.Option(False, "--json", help="machine-readable output"),
    run: Optional[str] = typer.Option(None, help="only this run"),
) -> None:
    """Every run in Redis: groups, trajectories by state, the trainer's last step, the served version."""
    from shared.ledger import STATES, Ledger
    from shared.settings import load_settings

    settings = load_settings(yaml_file=config)
    ledger = Ledger.from_url(settings.redis.url, settings.outage)
    if run is not None:
        require_run(ledger, run)
    summaries = [summarize(ledger.redis, ledger, r) for r in ([run] if run else ledger.runs())]
    if as_json:
        print(json.dumps({"runs": [asdict(s) for s in summaries]}))
        return
    table = Table(title="Conveyor runs")
    table.add_column("run", no_wrap=True)
    for column in ("groups", "trajectories", "trainer", "served"):
        table.add_column(column)
    for s in summaries:
        states = ", ".join(f"{s.trajectories[k]} {k}" for k in STATES if s.trajectories[k]) or "none"
        table.add_row(s.run_id, f"{s.groups_published} published, {s.groups_done} done", states, s.trainer_text(),
                      f"version {s.served_version}")
    Console().print(table)
