"""``conveyor``: the one command line for every Conveyor service.

Every subcommand loads the settings first (``--config`` YAML, ``CONVEYOR_*`` environment
variables, ``./.env``), so a bad value stops the command at start with the field's name.
A known failure (``services.cli.errors``) is one line on stderr and exit code 2; the global
``--debug`` flag shows its traceback. SIGTERM ends a command as Ctrl-C does
(``shared.processes``): the processes it started are stopped before it exits, and the
long-running ones hand their work back (the trainer between two stream reads, Celery workers
through their warm shutdown).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.table import Table

from services.cli import errors
from services.cli.command_support import (ConfigOption, ResumeOption, command_settings, console, log_level,
                                          setup_logging)
from services.cli.data import data_app
from services.cli.inference_commands import inference, tiny_model
from services.cli.preflight import check_environments
from services.cli.progress import progress
from services.cli.runs import refuse_run_in_use, refuse_stopped, require_run, run_app
from services.cli.run_logs import logs_command
from services.cli.run_submit import submit_command
from services.cli.trainer_command import trainer
from services.cli.trajectories import inspect_command, replay_command
from services.cli.worker_commands import worker_app
from shared.settings import Settings, assembling

# no locals in a traceback: they would print the settings' secrets
app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_show_locals=False,
                  help="Conveyor: event-driven rollouts for agentic RL.")
app.add_typer(worker_app, name="worker")
app.add_typer(data_app, name="data")
app.add_typer(run_app, name="run")
run_app.command("submit")(submit_command)
run_app.command("logs")(logs_command)
app.command("inspect")(inspect_command)
app.command("replay")(replay_command)


@app.callback()
def _every_command(debug: bool = typer.Option(False, "--debug", help="show the traceback of a known failure too")) -> None:
    errors.state.debug = debug
    log_level(os.environ.get("CONVEYOR_LOG_LEVEL", "INFO"), "CONVEYOR_LOG_LEVEL")


@app.command()
def intake(
    config: Optional[Path] = ConfigOption,
    dataset: Optional[str] = typer.Option(None, help="JSONL file or saved HF dataset dir (overrides intake.dataset)"),
    demo_tasks: Optional[int] = typer.Option(None, min=1, help="instead of a dataset: N generated tasks of the --demo task"),
    demo: str = typer.Option("guess", help="with --demo-tasks: 'guess' (guess-the-number, multi-turn) or 'digits' "
                                           "(the learning demo's toy task, which the tiny model learns)"),
    resume: bool = ResumeOption,
) -> None:
    """Publish the dataset's groups of rollout tasks on queue 'rollouts'."""
    setup_logging()
    _publish_dataset(command_settings(config), dataset, demo_tasks, resume, demo)


def _publish_dataset(settings: Settings, dataset: Optional[str], demo_tasks: Optional[int], resume: bool,
                     demo: str = "guess") -> None:
    """What ``conveyor intake`` does: the dataset's groups to queue 'rollouts', a summary line,
    and a ``CommandError`` when every row was rejected, or when the run id is in use and
    ``resume`` is not set (checked before anything is written)."""
    from services.intake.datasets import read_dataset
    from services.intake.limits import PromptLimit
    from services.intake.publisher import run_intake
    from shared.celery_app import make_celery, publish_rollouts
    from shared.state.ledger import redis_for
    from shared.storage import open_store

    if demo_tasks is not None:
        import tempfile

        from services.cli.demo import demo_dataset

        try:
            demo_path, environment = demo_dataset(demo, demo_tasks, Path(tempfile.mkdtemp(prefix="conveyor-demo-")))
        except ValueError as e:
            raise errors.CommandError(str(e)) from None
        dataset = str(demo_path)
        settings = settings.model_copy(update={"intake": settings.intake.model_copy(update=environment)})
    check_environments(settings)
    path = dataset or settings.intake.dataset
    if not path:
        raise errors.CommandError("no dataset: pass --dataset or set intake.dataset")
    data = read_dataset(path, settings.intake.split, settings.intake.dataset_label, settings.intake.max_row_bytes)
    celery = make_celery(settings)
    client = redis_for(settings.redis.url, settings.outage)  # waits out an outage of Redis
    refuse_run_in_use(client, settings.run_id, resume)
    store = open_store(settings.storage, settings.outage)  # keeps the run's marker (shared.state.run_marker)
    groups = settings.intake.num_groups if settings.intake.mode == "sample" else len(data.rows)
    with progress(f"intake {settings.run_id}: publishing groups", total=groups) as advance:
        report = run_intake(settings, data.rows, client, lambda reqs: publish_rollouts(celery, reqs), store=store,
                            dataset_version=data.version, prompt_limit=PromptLimit.from_settings(settings),
                            on_group=lambda _group_id: advance(1))
    console.print(
        f"intake {settings.run_id}: dataset {data.version}: {report.groups} groups, {report.trajectories} trajectories "
        f"published, {report.already_known} already published (skipped), {len(report.rejected)} rows rejected"
    )
    for rejection in report.rejected:
        console.print(f"  rejected {rejection['source']}: {rejection['reason']}")
    if report.stopped:
        console.print(f"intake {settings.run_id}: the run was {report.stopped}; published no more groups")
        return
    if report.groups == 0 and report.already_known == 0:
        raise errors.CommandError(f"intake published nothing from {path}: all {len(report.rejected)} rows were rejected "
                                  "(conveyor data validate shows why, per field)")


@app.command()
def export(
    run_id: str = typer.Argument(..., help="the run whose consumed trajectories to export"),
    out: Path = typer.Option(..., "--out", "-o", help="a .jsonl or .parquet file, or a directory (hf)"),
    fmt: str = typer.Option("jsonl", "--format", help="jsonl, parquet or hf (a saved Hugging Face dataset)"),
    form: str = typer.Option("chat", "--form", help="chat (messages), tokens (ids, loss mask, logprobs) or pairs "
                                                    "(DPO: each group's best against its worst)"),
    min_reward: Optional[float] = typer.Option(None, help="only trajectories with at least this reward"),
    max_reward: Optional[float] = typer.Option(None, help="only trajectories with at most this reward"),
    min_margin: float = typer.Option(0.0, help="pairs: only groups whose best and worst rewards differ by more"),
    config: Optional[Path] = ConfigOption,
) -> None:
    """Write a run's scored trajectories, with rewards and advantages, for SFT, DPO or analysis."""
    from services.cli.data import check_export_options, export_run

    check_export_options(fmt, form)
    export_run(run_id, out, fmt, form, min_reward, max_reward, config, min_margin)


@app.command()
def viewer(
    config: Optional[Path] = ConfigOption,
    host: str = typer.Option("127.0.0.1", help="the interface to listen on (0.0.0.0 in a container)"),
    port: int = typer.Option(8090, help="the port to listen on"),
) -> None:
    """A web viewer of runs, groups, trajectories (turn by turn, with a token view) and failures."""
    setup_logging()
    settings = command_settings(config)
    from aiohttp import web

    from services.viewer.app import make_app, tokenizer_decode
    from services.viewer.data import ViewerData
    from shared.outage import redact_url
    from shared.redis_clients import redis_for
    from shared.storage import open_store

    data = ViewerData(redis_for(settings.redis.url, settings.outage), open_store(settings.storage, settings.outage))
    console.print(f"viewer on http://{host}:{port}/ (Redis {redact_url(settings.redis.url)})")
    web.run_app(make_app(data, tokenizer_decode(str(settings.inference.model_path))), host=host, port=port, print=None)


@app.command()
def process(
    out: Path = typer.Option(..., "--out", "-o", help="where the rollouts go: a .jsonl or .parquet file, or a directory (hf)"),
    config: Optional[Path] = ConfigOption,
    dataset: Optional[str] = typer.Option(None, help="JSONL file or saved HF dataset dir (overrides intake.dataset)"),
    fmt: str = typer.Option("jsonl", "--format", help="jsonl, parquet or hf"),
    form: str = typer.Option("chat", "--form", help="chat (SFT), tokens, or pairs (DPO)"),
    min_reward: Optional[float] = typer.Option(None, help="only trajectories with at least this reward (rejection sampling)"),
    max_reward: Optional[float] = typer.Option(None, help="only trajectories with at most this reward"),
    min_margin: float = typer.Option(0.0, help="pairs: only groups whose best and worst rewards differ by more"),
    resume: bool = ResumeOption,
) -> None:
    """Offline mode: roll the dataset out and score it with the running workers, no trainer, then
    write the scored rollouts (for SFT, DPO or rejection sampling). Takes the trainer's place for the run."""
    setup_logging()
    settings = command_settings(config)
    from services.cli.data import check_export_options, export_run
    from services.trainer.consumer import TrainerConsumer
    from services.trainer.process import TrainerProcess
    from shared.state.ledger import redis_for
    from shared.storage import open_store

    check_export_options(fmt, form)
    if settings.trainer.mode != "assemble":  # nothing trains: intake must not wait for a trainer
        console.print(f"process mode: trainer.mode {settings.trainer.mode} ignored, no trainer runs")
        settings = settings.model_copy(update={"trainer": assembling(settings.trainer)})
    _publish_dataset(settings, dataset, None, resume)
    consumer = TrainerConsumer(settings, redis_for(settings.redis.url, settings.outage), open_store(settings.storage, settings.outage))
    TrainerProcess(consumer).run(stop_when_idle=True)  # groups assembled, advantages computed, every trajectory terminal
    counts = consumer.ledger.counts(settings.run_id)
    console.print(f"process {settings.run_id}: {counts['consumed']} trajectories scored, {counts['failed']} failed")
    export_run(settings.run_id, out, fmt, form, min_reward, max_reward, config, min_margin, settings=settings)


@app.command()
def status(
    config: Optional[Path] = ConfigOption,
    as_json: bool = typer.Option(False, "--json", help="machine-readable output"),
    run: Optional[str] = typer.Option(None, help="only this run"),
    failures: Optional[str] = typer.Option(None, "--failures", metavar="RUN",
                                           help="why RUN's trajectories failed: counts per reason with examples, and rejected intake rows"),
) -> None:
    """Where every trajectory is: counts per run and ledger state."""
    settings = command_settings(config)
    from shared.state.ledger import STATES, LedgerReads, redis_for

    client = redis_for(settings.redis.url)
    ledger = LedgerReads(client)
    if failures is not None:
        from services.cli.failures import failure_report, print_failures

        require_run(ledger, failures)
        report = failure_report(client, failures)
        print(json.dumps(report)) if as_json else print_failures(report, Console())
        return
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
def retry(
    run: str = typer.Argument(..., help="the run id"),
    reason: Optional[str] = typer.Option(None, help="only failures of this kind (infra_error, inference_outage, bug, "
                                                    "...) or whose reason starts with this text"),
    config: Optional[Path] = ConfigOption,
    as_json: bool = typer.Option(False, "--json", help="machine-readable output"),
) -> None:
    """Queue RUN's failed trajectories again, whole groups at a time, through the ledger (with a
    fresh attempt budget); groups with a consumed member are left alone, so nothing consumed
    is duplicated."""
    settings = command_settings(config)
    from services.cli.failures import print_retry, retry_summary
    from shared.celery_app import make_celery, publish_rollouts
    from shared.state.ledger import Ledger, redis_for
    from shared.state.ledger_retry import retry_failed

    client = redis_for(settings.redis.url)
    ledger = Ledger(client, settings.ledger.dispatch_ttl_s)
    require_run(ledger, run)
    refuse_stopped(client, run, "its failures stay as they are")
    celery = make_celery(settings)
    summary = retry_summary(run, retry_failed(client, run, reason, lambda requests: publish_rollouts(celery, requests),
                                                  settings.ledger.dispatch_ttl_s))
    print(json.dumps(summary)) if as_json else print_retry(summary, console)


@app.command()
def demo(
    config: Optional[Path] = ConfigOption,
    tasks: int = typer.Option(8, min=1, help="tasks (GRPO groups) in the demo dataset"),
    workdir: Path = typer.Option(Path(".conveyor/demo"), help="where models, logs and objects go"),
) -> None:
    """Run the whole pipeline as local processes on a small dataset, then shut it all down."""
    from services.cli.demo import run_demo

    sys.exit(run_demo(config, tasks, workdir))


@app.command("learn-demo")
def learn_demo(
    steps: int = typer.Option(20, min=1, help="optimizer steps"),
    max_off_policy_steps: int = typer.Option(1, min=0, help="staleness bound (0: synchronous)"),
    workdir: Path = typer.Option(Path(".conveyor/learn-demo"), help="where models, logs, metrics and the curve go"),
) -> None:
    """Train the tiny model on a toy task through the whole system; write the reward curve PNG."""
    from services.cli.learning_demo import run_learning

    run = run_learning(workdir, steps, max_off_policy_steps)
    console.print(f"mean reward per step: {' '.join(f'{r:.2f}' for r in run.rewards)}")
    console.print(f"reward curve: {run.reward_curve}  metrics: {workdir / 'train_steps.jsonl'}  wall: {run.wall_s:.0f}s")


# after the commands above, so `conveyor --help` lists them in the data flow's order
app.command("trainer")(trainer)
app.command("tiny-model")(tiny_model)
app.command("inference")(inference)


def main() -> None:
    from shared.processes import exit_on_sigterm

    exit_on_sigterm()
    errors.run(app)


if __name__ == "__main__":
    main()
