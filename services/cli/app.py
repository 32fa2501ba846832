"""``conveyor``: the one command line for every Conveyor service.

Every subcommand loads the settings first (``--config`` YAML, ``CONVEYOR_*`` environment
variables), so a bad value stops the command at start with the field's name.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.table import Table

from shared.settings import Settings, SettingsError, load_settings

app = typer.Typer(add_completion=False, no_args_is_help=True, help="Conveyor: event-driven rollouts for agentic RL.")
worker_app = typer.Typer(no_args_is_help=True, help="Celery workers.")
app.add_typer(worker_app, name="worker")
console = Console(stderr=True, soft_wrap=True)

ConfigOption = typer.Option(None, "--config", "-c", help="YAML settings file (or set CONVEYOR_CONFIG)")


def _settings(config: Optional[Path]) -> Settings:
    try:
        return load_settings(config)
    except SettingsError as exc:
        console.print(f"[red]{exc}[/red]")
        raise typer.Exit(2) from None


def _logging() -> None:
    logging.basicConfig(level=os.environ.get("CONVEYOR_LOG_LEVEL", "INFO"), format="%(asctime)s %(levelname)s %(name)s: %(message)s")


@app.command()
def intake(
    config: Optional[Path] = ConfigOption,
    dataset: Optional[str] = typer.Option(None, help="JSONL file or saved HF dataset dir (overrides intake.dataset)"),
) -> None:
    """Publish the dataset's groups of rollout tasks on queue 'rollouts'."""
    _logging()
    settings = _settings(config)
    from services.intake.datasets import read_rows
    from services.intake.publisher import run_intake
    from shared.celery_app import make_celery, publish_rollouts
    from shared.ledger import Ledger

    path = dataset or settings.intake.dataset
    if not path:
        console.print("[red]no dataset: pass --dataset or set intake.dataset[/red]")
        raise typer.Exit(2)
    try:
        rows = read_rows(path, settings.intake.split)
    except (FileNotFoundError, KeyError) as exc:
        console.print(f"[red]{exc}[/red]")
        raise typer.Exit(2) from None
    celery = make_celery(settings)
    report = run_intake(settings, rows, Ledger.from_url(settings.redis.url), lambda reqs: publish_rollouts(celery, reqs))
    console.print(
        f"intake {settings.run_id}: {report.groups} groups, {report.trajectories} trajectories published, "
        f"{report.already_known} already known, {len(report.rejected)} rows rejected"
    )
    for rejection in report.rejected:
        console.print(f"  rejected {rejection['source']}: {rejection['reason']}")


def _celery_worker(module: str, queue: str, pool: str, concurrency: int, name: str, loglevel: str) -> None:
    import importlib

    celery = importlib.import_module(module).app
    celery.worker_main(["worker", "-Q", queue, "-P", pool, "-c", str(concurrency), "-n", f"{name}@%h", "--loglevel", loglevel, "-E"])


@worker_app.command("rollout")
def worker_rollout(
    config: Optional[Path] = ConfigOption,
    concurrency: Optional[int] = typer.Option(None, help="thread slots (default rollout.worker_concurrency)"),
    name: str = typer.Option("rollout", help="worker node name"),
    loglevel: str = typer.Option("INFO"),
) -> None:
    """Run a rollout worker (Celery, thread pool) on queue 'rollouts'."""
    settings = _settings(config)
    _celery_worker("services.rollout_worker.tasks", "rollouts", "threads", concurrency or settings.rollout.worker_concurrency, name, loglevel)


@worker_app.command("scoring")
def worker_scoring(
    config: Optional[Path] = ConfigOption,
    concurrency: int = typer.Option(4),
    name: str = typer.Option("scoring"),
    loglevel: str = typer.Option("INFO"),
) -> None:
    """Run a scoring worker (Celery) on queue 'scoring'."""
    _settings(config)
    _celery_worker("services.scorer.tasks", "scoring", "threads", concurrency, name, loglevel)


@app.command()
def trainer(
    config: Optional[Path] = ConfigOption,
    exit_when_done: bool = typer.Option(False, help="exit once intake is done and every trajectory is terminal"),
) -> None:
    """Consume scored trajectories: assemble GRPO groups, compute advantages, emit batches;
    with trainer.max_off_policy_steps set, also train, checkpoint and announce new versions."""
    _logging()
    settings = _settings(config)
    from services.trainer.consumer import TrainerConsumer
    from shared.ledger import Ledger
    from shared.storage import open_store

    store = open_store(settings.storage)
    consumer = TrainerConsumer(settings, Ledger.from_url(settings.redis.url), store)
    loop = None
    if consumer.budget is not None:  # a staleness bound is set: train, not only assemble
        from services.trainer.loop import TrainingLoop
        from services.trainer.metrics import MetricsSink

        t = settings.trainer
        sink = MetricsSink(t.step_metrics_path, t.prometheus_port, t.wandb_project, settings.run_id)
        loop = TrainingLoop(settings, store, consumer.budget, sink)
    consumer.run_forever(stop_when_idle=exit_when_done, loop=loop)
    console.print(f"trainer {settings.run_id}: {consumer.counters()}")


@app.command()
def inference(
    config: Optional[Path] = ConfigOption,
    check: bool = typer.Option(False, "--check", help="only report the health of the configured server"),
    generate_tiny: bool = typer.Option(False, help="generate the tiny test model at inference.model_path first"),
    attach: bool = typer.Option(False, help="do not launch vLLM: follow weight updates for the server(s) at inference.base_url"),
    replica: Optional[list[str]] = typer.Option(None, help="with --attach: a replica base URL (repeatable)"),
) -> None:
    """Launch vLLM's OpenAI-compatible server for the configured model, wait until ready, and
    keep it on the newest checkpoint of the run (the weight-sync control plane)."""
    _logging()
    settings = _settings(config)
    import threading

    from services.inference.control_plane import WeightFollower
    from services.inference.server import VllmServer, check_inference

    if check:
        health = check_inference(settings.inference.base_url)
        print(json.dumps(health))
        raise typer.Exit(0 if health.get("ok") else 1)
    stop = threading.Event()
    if attach:
        with WeightFollower.from_settings(settings, base_urls=replica or None) as follower:
            try:
                follower.run(stop)
            except KeyboardInterrupt:
                stop.set()
        return
    if generate_tiny:
        from services.inference.tiny_model import generate_tiny_model

        generate_tiny_model(Path(settings.inference.model_path))
    server = VllmServer.from_settings(settings.inference)
    server.start()
    try:
        server.wait_ready(settings.inference.startup_timeout_s)
        console.print(f"vLLM ready: {json.dumps(server.health())}")
        with WeightFollower.from_settings(settings, base_urls=[server.base_url]) as follower:
            thread = threading.Thread(target=follower.run, args=(stop,), name="weight-follower", daemon=True)
            thread.start()
            server.process.wait()
    finally:
        stop.set()
        server.stop()


@app.command()
def status(
    config: Optional[Path] = ConfigOption,
    as_json: bool = typer.Option(False, "--json", help="machine-readable output"),
    run: Optional[str] = typer.Option(None, help="only this run"),
) -> None:
    """Where every trajectory is: counts per run and ledger state."""
    settings = _settings(config)
    from shared.ledger import STATES, Ledger

    ledger = Ledger.from_url(settings.redis.url)
    runs = [run] if run else ledger.runs()
    counts = {r: ledger.counts(r) for r in runs}
    if as_json:
        print(json.dumps({"runs": counts}))
        return
    table = Table(title="Conveyor trajectories by state")
    table.add_column("run")
    for state in STATES:
        table.add_column(state, justify="right")
    table.add_column("total", justify="right")
    for r, c in counts.items():
        table.add_row(r, *(str(c[s]) for s in STATES), str(sum(c.values())))
    Console().print(table)


@app.command()
def demo(
    config: Optional[Path] = ConfigOption,
    tasks: int = typer.Option(8, help="tasks (GRPO groups) in the demo dataset"),
    workdir: Path = typer.Option(Path(".conveyor/demo"), help="where models, logs and objects go"),
) -> None:
    """Run the whole pipeline as local processes on a small dataset, then shut it all down."""
    from services.cli.demo import run_demo

    sys.exit(run_demo(config, tasks, workdir))


@app.command("learn-demo")
def learn_demo(
    steps: int = typer.Option(20, help="optimizer steps"),
    max_off_policy_steps: int = typer.Option(1, help="staleness bound (0: synchronous)"),
    workdir: Path = typer.Option(Path(".conveyor/learn-demo"), help="where models, logs, metrics and the curve go"),
) -> None:
    """Train the tiny model on a toy task through the whole system; write the reward curve PNG."""
    from services.cli.learning_demo import run_learning

    run = run_learning(workdir, steps, max_off_policy_steps)
    console.print(f"mean reward per step: {' '.join(f'{r:.2f}' for r in run.rewards)}")
    console.print(f"reward curve: {run.reward_curve}  metrics: {workdir / 'train_steps.jsonl'}  wall: {run.wall_s:.0f}s")


def main() -> None:
    app()


if __name__ == "__main__":
    main()
