"""``conveyor worker rollout`` and ``conveyor worker scoring``: the Celery workers.

Invariants:
- A rollout worker takes no task before Redis, the object store and its inference server
  answer; it waits for inference at most ``inference.startup_timeout_s``, saying what it waits for.
- Workers run without gossip and mingle: the ledger coordinates them, not each other.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Optional

import typer

from services.cli import errors
from services.cli.command_support import ConfigOption, command_settings, log_level, setup_logging, wait_for_redis
from services.cli.preflight import check_environments, require_model
from shared.settings import Settings

worker_app = typer.Typer(no_args_is_help=True, help="Celery workers.")


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
    setup_logging()
    level = log_level(loglevel, "--loglevel")
    settings = command_settings(config)
    check_environments(settings)
    require_model(settings)
    wait_for_redis(settings)
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
    setup_logging()
    level = log_level(loglevel, "--loglevel")
    wait_for_redis(command_settings(config))
    _celery_worker("services.scorer.tasks", "scoring", "threads", concurrency, name, level)
