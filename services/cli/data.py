"""``conveyor data ...``: look at a dataset before a run uses it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.table import Table

from services.cli import errors
from services.cli.progress import progress
from shared.state.trainer_stream import stream_length
from shared.settings import Settings, load_settings

data_app = typer.Typer(no_args_is_help=True, help="Datasets: validate before publishing.")
console = Console(stderr=True)


@data_app.command("validate")
def validate_dataset(
    dataset: str = typer.Argument(..., help="JSONL file or saved Hugging Face dataset directory"),
    config: Optional[Path] = typer.Option(None, "--config", "-c", help="settings YAML (else CONVEYOR_CONFIG)"),
    as_json: bool = typer.Option(False, "--json", help="the report as JSON on stdout"),
) -> None:
    """Check every row with its environment's own adapter and the intake limits; publish nothing.
    Exit code 0 when every row is valid, 1 when some are rejected."""
    from services.intake.datasets import read_dataset
    from services.intake.limits import PromptLimit
    from services.intake.validation import validate
    from shared.environments import check_startup, registry_for

    settings = load_settings(config)
    errors.state.settings = settings
    registry = registry_for(settings.environments)
    check_startup(registry, settings.intake.env_name, settings.intake.env_config, settings.environments)
    data = read_dataset(dataset, settings.intake.split, settings.intake.dataset_label, settings.intake.max_row_bytes)
    report = validate(data, settings.intake.env_name, settings.intake.env_config, registry,
                      PromptLimit.from_settings(settings), settings.intake.splits)
    if as_json:
        print(json.dumps(report.as_json(), indent=1))
    else:
        console.print(f"dataset {dataset}, version {report.version}: {report.rows} rows, {report.valid} valid, "
                      f"{report.rejected} rejected")
        for env_name, count in sorted(report.by_environment.items()):
            split = report.splits.get(env_name)
            shares = f" (train {split['train']}, eval {split['eval']}, in no split {split['none']})" if split else ""
            console.print(f"  {env_name}: {count} valid{shares}")
        if report.errors:
            table = Table(title="rejected rows, by field")
            for column in ("field", "rows", "first errors"):
                table.add_column(column)
            for name, found in sorted(report.errors.items()):
                table.add_row(name, str(found.count), "\n".join(f"{s}: {r}" for s, r in found.first))
            console.print(table)
    raise typer.Exit(0 if report.rejected == 0 else 1)


def check_export_options(fmt: str, form: str) -> None:
    if fmt not in ("jsonl", "parquet", "hf") or form not in ("chat", "tokens", "pairs"):
        raise errors.CommandError(f"--format must be jsonl, parquet or hf and --form chat, tokens or pairs; got {fmt!r}, {form!r}")


def export_run(run_id: str, out: Path, fmt: str, form: str, min_reward: Optional[float], max_reward: Optional[float],
               config: Optional[Path], min_margin: float = 0.0, settings: "Settings | None" = None) -> int:
    """``conveyor export``: the run's consumed trajectories (or pairs of them) to ``out``; returns how many."""
    from services.trainer.export import export_records, write_records
    from shared.redis_clients import redis_for
    from shared.storage import open_store

    settings = settings or load_settings(config)
    errors.state.settings = settings
    client = redis_for(settings.redis.url, settings.outage)
    store = open_store(settings.storage, settings.outage)
    with progress(f"export {run_id}: reading trajectories", total=stream_length(client, run_id)) as advance:
        records = []
        for record in export_records(client, store, run_id, form, min_reward, max_reward, min_margin):  # type: ignore[arg-type]
            records.append(record)
            advance(1)
    if not records:
        what = "group with a pair" if form == "pairs" else "consumed trajectory"
        raise errors.CommandError(f"run {run_id}: no {what} to export (within the reward bounds)")
    write_records(records, out, fmt)  # type: ignore[arg-type]
    unit = "pairs" if form == "pairs" else "trajectories"
    console.print(f"exported {len(records)} {unit} of run {run_id} to {out} ({fmt}, {form} form)")
    return len(records)
