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
import logging
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Optional

import typer
from rich.console import Console
from rich.table import Table

from services.cli import errors
from services.cli.data import data_app
from services.cli.preflight import check_environments, require_model
from services.cli.progress import progress
from services.cli.runs import refuse_run_in_use, refuse_stopped, require_run, run_app
from services.cli.run_logs import logs_command
from services.cli.run_submit import submit_command
from services.cli.trajectories import inspect_command, replay_command
from shared.settings import Settings, load_settings

if TYPE_CHECKING:  # imported where used: a command loads only what it runs
    from services.trainer.distributed import TrainerRanks
    from services.trainer.evaluation import Evaluator
    from shared.state.ledger import Ledger
    from shared.storage import ObjectStore

# no locals in a traceback: they would print the settings' secrets
app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_show_locals=False,
                  help="Conveyor: event-driven rollouts for agentic RL.")
worker_app = typer.Typer(no_args_is_help=True, help="Celery workers.")
app.add_typer(worker_app, name="worker")
app.add_typer(data_app, name="data")
app.add_typer(run_app, name="run")
run_app.command("submit")(submit_command)
run_app.command("logs")(logs_command)
app.command("inspect")(inspect_command)
app.command("replay")(replay_command)
console = Console(stderr=True, soft_wrap=True)

ConfigOption = typer.Option(None, "--config", "-c", help="YAML settings file (or set CONVEYOR_CONFIG)")
ResumeOption = typer.Option(False, "--resume", help="continue a run id that is already in Redis: its published groups are "
                            "skipped and reported (without it, a run id in use is an error)")


@app.callback()
def _every_command(debug: bool = typer.Option(False, "--debug", help="show the traceback of a known failure too")) -> None:
    errors.state.debug = debug
    _log_level(os.environ.get("CONVEYOR_LOG_LEVEL", "INFO"), "CONVEYOR_LOG_LEVEL")


def _log_level(name: str, source: str) -> str:
    if name.upper() not in logging.getLevelNamesMapping():
        raise errors.CommandError(f"{source}: unknown log level {name!r}; use DEBUG, INFO, WARNING, ERROR or CRITICAL")
    return name.upper()


def _settings(config: Optional[Path]) -> Settings:
    errors.state.settings = load_settings(config)
    return errors.state.settings


def _logging() -> None:
    level = _log_level(os.environ.get("CONVEYOR_LOG_LEVEL", "INFO"), "CONVEYOR_LOG_LEVEL")
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # minio's transport logs each of its retries; the storage layer reports the outcome
    # (a StorageError naming the endpoint), so an unreachable S3 server is one line, not six
    logging.getLogger("urllib3.connectionpool").setLevel(logging.ERROR)
    # httpx logs every request at INFO: a rollout worker would write a line per turn
    logging.getLogger("httpx").setLevel(logging.WARNING)


def _wait_for_redis(settings: Settings) -> None:
    """A worker waits for Redis at start, as through any outage (``shared.outage``: logged,
    bounded by outage.limit_s, then one line and exit 2); a refused password stops it at once."""
    from shared.outage import redis_client

    redis_client(settings.redis.url, settings.outage).ping()


@app.command()
def intake(
    config: Optional[Path] = ConfigOption,
    dataset: Optional[str] = typer.Option(None, help="JSONL file or saved HF dataset dir (overrides intake.dataset)"),
    demo_tasks: Optional[int] = typer.Option(None, min=1, help="instead of a dataset: N generated guess-the-number tasks (the demo's)"),
    resume: bool = ResumeOption,
) -> None:
    """Publish the dataset's groups of rollout tasks on queue 'rollouts'."""
    _logging()
    _publish_dataset(_settings(config), dataset, demo_tasks, resume)


def _publish_dataset(settings: Settings, dataset: Optional[str], demo_tasks: Optional[int], resume: bool) -> None:
    """What ``conveyor intake`` does: the dataset's groups to queue 'rollouts', a summary line,
    and a ``CommandError`` when every row was rejected, or when the run id is in use and
    ``resume`` is not set (checked before anything is written)."""
    from services.intake.datasets import read_dataset
    from services.intake.limits import PromptLimit
    from services.intake.publisher import run_intake
    from shared.celery_app import make_celery, publish_rollouts
    from shared.state.ledger import Ledger
    from shared.storage import open_store

    if demo_tasks is not None:
        import tempfile

        from services.cli.demo import write_demo_dataset

        dataset = str(write_demo_dataset(Path(tempfile.mkdtemp(prefix="conveyor-demo-")) / "guess.jsonl", demo_tasks))
    check_environments(settings)
    path = dataset or settings.intake.dataset
    if not path:
        raise errors.CommandError("no dataset: pass --dataset or set intake.dataset")
    data = read_dataset(path, settings.intake.split, settings.intake.dataset_label, settings.intake.max_row_bytes)
    celery = make_celery(settings)
    ledger = Ledger.from_url(settings.redis.url, settings.outage, settings.ledger.dispatch_ttl_s)  # waits out an outage of Redis
    refuse_run_in_use(ledger, settings.run_id, resume)
    store = open_store(settings.storage, settings.outage)  # keeps the run's marker (shared.state.run_marker)
    groups = settings.intake.num_groups if settings.intake.mode == "sample" else len(data.rows)
    with progress(f"intake {settings.run_id}: publishing groups", total=groups) as advance:
        report = run_intake(settings, data.rows, ledger, lambda reqs: publish_rollouts(celery, reqs), store=store,
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
    _logging()
    settings = _settings(config)
    from aiohttp import web

    from services.viewer.app import make_app, tokenizer_decode
    from services.viewer.data import ViewerData
    from shared.outage import redact_url, redis_client
    from shared.storage import open_store

    data = ViewerData(redis_client(settings.redis.url, settings.outage), open_store(settings.storage, settings.outage))
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
    _logging()
    settings = _settings(config)
    from services.cli.data import check_export_options, export_run
    from services.trainer.consumer import TrainerConsumer
    from services.trainer.process import TrainerProcess
    from shared.state.ledger import Ledger
    from shared.storage import open_store

    check_export_options(fmt, form)
    if settings.trainer.mode != "assemble":  # nothing trains: intake must not wait for a trainer
        console.print(f"process mode: trainer.mode {settings.trainer.mode} ignored, no trainer runs")
        settings = settings.model_copy(update={"trainer": settings.trainer.model_copy(update={"mode": "assemble"})})
    _publish_dataset(settings, dataset, None, resume)
    consumer = TrainerConsumer(settings, Ledger.from_url(settings.redis.url, settings.outage), open_store(settings.storage, settings.outage))
    TrainerProcess(consumer).run(stop_when_idle=True)  # groups assembled, advantages computed, every trajectory terminal
    counts = consumer.ledger.counts(settings.run_id)
    console.print(f"process {settings.run_id}: {counts['consumed']} trajectories scored, {counts['failed']} failed")
    export_run(settings.run_id, out, fmt, form, min_reward, max_reward, config, min_margin, settings=settings)


def _celery_worker(module: str, queue: str, pool: str, concurrency: int, name: str, loglevel: str) -> None:
    import importlib

    from shared import outage

    outage.exit_on_limit()  # past outage.limit_s a task's thread ends the worker: one line, exit 2
    celery = importlib.import_module(module).app
    # No gossip and no mingle: workers share nothing among themselves (the ledger coordinates
    # them), and Gossip's consumer raised a traceback on every restart of the broker. Task
    # events (-E) and heartbeats still go out for Flower, and remote control (ping) still answers.
    celery.worker_main(["worker", "-Q", queue, "-P", pool, "-c", str(concurrency), "-n", f"{name}@%h", "--loglevel", loglevel,
                        "-E", "--without-gossip", "--without-mingle"])


def _wait_for_inference(settings: Settings) -> None:
    """A worker takes no task before its inference server serves: it waits (checking at most
    outage.backoff_max_s apart, so it starts within that of the server's readiness, however
    long the server took), logs what it waits for, and gives up after
    inference.startup_timeout_s with one line."""
    import time

    from services.inference.server import check_inference

    log = logging.getLogger("conveyor.worker")
    url, limit_s, outage = settings.inference.base_url, settings.inference.startup_timeout_s, settings.outage
    started = time.monotonic()
    last_logged = None
    delay = 0.1
    while True:
        health = check_inference(url, timeout=max(1.0, outage.backoff_max_s))
        if health["ok"]:
            log.info("inference at %s serves %s (waited %.0fs)", url, health["model"], time.monotonic() - started)
            return
        waited = time.monotonic() - started
        if waited > limit_s:
            raise errors.CommandError(f"inference at {url} not ready after {limit_s:g}s (inference.startup_timeout_s): {health['detail']}")
        if last_logged is None or time.monotonic() - last_logged >= outage.log_every_s:
            last_logged = time.monotonic()
            log.warning("waiting for inference at %s before taking tasks (%.0fs so far, at most %gs): %s",
                        url, waited, limit_s, health["detail"])
        time.sleep(delay)
        delay = min(delay * 2, outage.backoff_max_s)


@worker_app.command("rollout")
def worker_rollout(
    config: Optional[Path] = ConfigOption,
    concurrency: Optional[int] = typer.Option(None, help="thread slots (default rollout.worker_concurrency)"),
    name: str = typer.Option("rollout", help="worker node name"),
    loglevel: str = typer.Option("INFO"),
) -> None:
    """Run a rollout worker (Celery, thread pool) on queue 'rollouts'; it starts consuming only
    once Redis, the object store and the inference service answer (waiting up to
    outage.limit_s for the first two and inference.startup_timeout_s for inference)."""
    _logging()
    level = _log_level(loglevel, "--loglevel")
    settings = _settings(config)
    check_environments(settings)
    require_model(settings)
    _wait_for_redis(settings)
    from shared.storage import open_store

    open_store(settings.storage, settings.outage)  # checks the bucket, waiting out an outage
    _wait_for_inference(settings)
    _celery_worker("services.rollout_worker.tasks", "rollouts", "threads", concurrency or settings.rollout.worker_concurrency, name, level)


@worker_app.command("scoring")
def worker_scoring(
    config: Optional[Path] = ConfigOption,
    concurrency: int = typer.Option(4),
    name: str = typer.Option("scoring"),
    loglevel: str = typer.Option("INFO"),
) -> None:
    """Run a scoring worker (Celery) on queue 'scoring'."""
    _logging()
    level = _log_level(loglevel, "--loglevel")
    _wait_for_redis(_settings(config))
    _celery_worker("services.scorer.tasks", "scoring", "threads", concurrency, name, level)


def _evaluator(settings: Settings, ledger: "Ledger", store: "ObjectStore") -> "Evaluator | None":
    """The trainer's evaluator when ``evaluation`` is on: the eval rows read once, at start."""
    if not settings.evaluation.enabled:
        return None
    from services.intake.datasets import read_dataset
    from services.intake.limits import PromptLimit
    from services.trainer.evaluation import Evaluator
    from shared.celery_app import make_celery, publish_rollouts

    check_environments(settings)
    path = settings.evaluation.dataset or settings.intake.dataset
    if not path:
        raise errors.CommandError("evaluation is on but there is no dataset: set evaluation.dataset or intake.dataset")
    data = read_dataset(path, settings.intake.split, settings.intake.dataset_label, settings.intake.max_row_bytes)
    celery = make_celery(settings)
    return Evaluator(settings, ledger, store, lambda requests: publish_rollouts(celery, requests), data.rows,
                     dataset_version=data.version, prompt_limit=PromptLimit.from_settings(settings))


@app.command()
def trainer(
    config: Optional[Path] = ConfigOption,
    exit_when_done: bool = typer.Option(False, help="exit once intake is done and every trajectory is terminal"),
) -> None:
    """Consume scored trajectories: assemble GRPO groups, compute advantages, emit batches;
    with trainer.mode train, also train, checkpoint and announce new versions.
    Under ``torchrun --nproc-per-node N -m services.cli.app trainer``, train sharded with FSDP2
    on N ranks: rank 0 does all of the above, the others train with it (services.trainer.distributed)."""
    _logging()
    settings = _settings(config)
    ranks = None
    if settings.trainer.mode == "train":  # it loads the model
        require_model(settings)
        ranks = _join_ranks(settings)
    elif int(os.environ.get("WORLD_SIZE", "1")) > 1:  # N consumers of one stream would each assemble groups
        raise errors.CommandError("under torchrun the trainer must train: set trainer.mode: train")
    if ranks is not None and not ranks.leader:
        _follow(settings, ranks)
        return
    from services.trainer.alarm import LogprobAlarm
    from services.trainer.process import TrainerProcess
    from shared.processes import on_sigterm

    trainer_process = TrainerProcess.from_settings(settings, ranks, lambda ledger, store: _evaluator(settings, ledger, store))
    on_sigterm(trainer_process.stop.set)  # SIGTERM: finish the group in hand, then exit; the stream keeps the rest
    try:
        trainer_process.run(stop_when_idle=exit_when_done)
    except LogprobAlarm as exc:
        logging.getLogger("conveyor.trainer").error("%s", exc)
        console.print(f"[red]trainer {settings.run_id} stopped: {exc}[/red]")
        raise typer.Exit(3) from None
    finally:
        trainer_process.close()
        if ranks is not None:
            ranks.leave()
    consumer = trainer_process.consumer
    if consumer.stopped is not None:
        console.print(f"trainer {settings.run_id}: the run was {consumer.stopped.describe()}; exiting")
    console.print(f"trainer {settings.run_id}: {consumer.counters()}")


def _join_ranks(settings: Settings) -> "TrainerRanks | None":
    """This process's rank when torchrun started it (WORLD_SIZE > 1), else None."""
    from services.trainer.distributed import join_from_env

    try:
        return join_from_env(settings)
    except ValueError as exc:
        raise errors.CommandError(str(exc)) from None


def _follow(settings: Settings, ranks: "TrainerRanks") -> None:
    """A rank other than 0: train what rank 0 orders until it stops; SIGTERM waits for that order."""
    from services.trainer.distributed import follow
    from shared.processes import on_sigterm
    from shared.storage import open_store

    on_sigterm(lambda: logging.getLogger("conveyor.trainer").info("rank %d: stopping with rank 0", ranks.rank))
    try:
        version = follow(settings, open_store(settings.storage, settings.outage), ranks)
    finally:
        ranks.leave()
    console.print(f"trainer {settings.run_id} rank {ranks.rank}: stopped at version {version}")


@app.command("tiny-model")
def tiny_model(
    out_dir: Path = typer.Argument(..., help="directory to write the checkpoint to"),
    layout: str = typer.Option("llama", help="llama, llama-tied or qwen2"),
    seed: int = typer.Option(0),
) -> None:
    """Generate the tiny random test model (a pure function of its options; no download)."""
    from services.inference.tiny_model import generate_tiny_model

    try:
        generate_tiny_model(out_dir, seed=seed, end_of_turn_bias=4.0, layout=layout)
    except ValueError as exc:  # an unknown layout
        raise errors.CommandError(str(exc)) from exc
    console.print(f"tiny model ({layout}, seed {seed}) in {out_dir}")


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

    from services.weights.base import BaseWeightsError
    from services.weights.follower import WeightFollower
    from services.inference.server import VllmServer, check_inference
    from shared.required import required

    if check:
        health = check_inference(settings.inference.base_url)
        print(json.dumps(health))
        raise typer.Exit(0 if health.get("ok") else 1)
    stop = threading.Event()
    if settings.metrics_port:
        from shared.outage import redis_client
        from shared.prometheus import serve_metrics

        serve_metrics(settings.metrics_port, redis_client(settings.redis.url, settings.outage))
    if attach:
        with WeightFollower.from_settings(settings, base_urls=replica or None) as follower:
            try:
                follower.run(stop)
            except KeyboardInterrupt:
                stop.set()
            except BaseWeightsError as exc:
                raise errors.CommandError(str(exc)) from None
        return
    if generate_tiny:
        from services.inference.tiny_model import generate_tiny_model

        generate_tiny_model(Path(settings.inference.model_path))
    require_model(settings)
    server = VllmServer.from_settings(settings.inference, lora_rank=settings.trainer.lora.served_rank)
    server.start()
    try:
        server.wait_ready(settings.inference.startup_timeout_s, report_every_s=15)
        console.print(f"vLLM ready: {json.dumps(server.health())}")
        failed: list[BaseWeightsError] = []

        def follow() -> None:
            try:
                follower.run(stop)
            except BaseWeightsError as exc:  # the run must not start on weights it did not check
                failed.append(exc)
                server.stop()

        with WeightFollower.from_settings(settings, base_urls=[server.base_url]) as follower:
            # server.stop() (the follower's failure) clears it
            process = required(server.process, "the vLLM server's process (start sets it)")
            thread = threading.Thread(target=follow, name="weight-follower", daemon=True)
            thread.start()
            process.wait()
        if failed:
            raise errors.CommandError(str(failed[0]))
    finally:
        stop.set()
        server.stop()


@app.command()
def status(
    config: Optional[Path] = ConfigOption,
    as_json: bool = typer.Option(False, "--json", help="machine-readable output"),
    run: Optional[str] = typer.Option(None, help="only this run"),
    failures: Optional[str] = typer.Option(None, "--failures", metavar="RUN",
                                           help="why RUN's trajectories failed: counts per reason with examples, and rejected intake rows"),
) -> None:
    """Where every trajectory is: counts per run and ledger state."""
    settings = _settings(config)
    from shared.state.ledger import STATES, Ledger, redis_for

    client = redis_for(settings.redis.url)
    ledger = Ledger(client)
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
    settings = _settings(config)
    from services.cli.failures import print_retry, retry_summary
    from shared.celery_app import make_celery, publish_rollouts
    from shared.state.ledger import Ledger, redis_for
    from shared.state.ledger_retry import retry_failed

    client = redis_for(settings.redis.url)
    ledger = Ledger(client, settings.ledger.dispatch_ttl_s)
    require_run(ledger, run)
    refuse_stopped(client, run, "its failures stay as they are")
    celery = make_celery(settings)
    summary = retry_summary(run, retry_failed(ledger, run, reason, lambda requests: publish_rollouts(celery, requests)))
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


def main() -> None:
    from shared.processes import exit_on_sigterm

    exit_on_sigterm()
    errors.run(app)


if __name__ == "__main__":
    main()
