"""``conveyor trainer``: the trainer process (one rank of it under torchrun).

Invariants:
- mode ``train`` loads the model (checked at start); mode ``assemble`` refuses torchrun, where
  several consumers of one stream would each assemble the same groups.
- SIGTERM finishes the group in hand, then exits; the stream keeps the rest. The logprob alarm
  exits 3 with its cause.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING, Optional

import typer

from services.cli import errors
from services.cli.command_support import ConfigOption, command_settings, console, setup_logging
from services.cli.preflight import check_environments, require_model
from shared.settings import Settings

if TYPE_CHECKING:  # imported where used: a command loads only what it runs
    from services.trainer.distributed import TrainerRanks
    from services.trainer.evaluation import Evaluator
    import redis

    from shared.storage import ObjectStore


def _evaluator(settings: Settings, client: "redis.Redis", store: "ObjectStore") -> "Evaluator | None":
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
    return Evaluator(settings, client, store, lambda requests: publish_rollouts(celery, requests), data.rows,
                     dataset_version=data.version, prompt_limit=PromptLimit.from_settings(settings))


def trainer(
    config: Optional[Path] = ConfigOption,
    exit_when_done: bool = typer.Option(False, help="exit once intake is done and every trajectory is terminal"),
) -> None:
    """Consume scored trajectories: assemble GRPO groups, compute advantages, emit batches;
    with trainer.mode train, also train, checkpoint and announce new versions.
    Under ``torchrun --nproc-per-node N -m services.cli.app trainer``, train sharded with FSDP2
    on N ranks: rank 0 does all of the above, the others train with it (services.trainer.distributed)."""
    setup_logging()
    settings = command_settings(config)
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

    trainer_process = TrainerProcess.from_settings(settings, ranks, lambda client, store: _evaluator(settings, client, store))
    on_sigterm(trainer_process.stop.set)  # SIGTERM: finish the group in hand, then exit; the stream keeps the rest
    alarm = None
    try:
        trainer_process.run(stop_when_idle=exit_when_done)
    except LogprobAlarm as exc:
        alarm = exc
    finally:
        trainer_process.close()
        if ranks is not None:
            ranks.leave()
    if alarm is not None:
        logging.getLogger("conveyor.trainer").error("%s", alarm)
        console.print(f"[red]trainer {settings.run_id} stopped: {alarm}[/red]")
        _end_rank(ranks, 3)
        raise typer.Exit(3)
    consumer = trainer_process.consumer
    if consumer.stopped is not None:
        console.print(f"trainer {settings.run_id}: the run was {consumer.stopped.describe()}; exiting")
    console.print(f"trainer {settings.run_id}: {consumer.counters()}")
    _end_rank(ranks, 0)


def _end_rank(ranks: "TrainerRanks | None", code: int) -> None:
    """Under torchrun, end this rank's process here (``exit_rank_process``: gloo's threads abort
    an interpreter shutting down); one process returns as always."""
    if ranks is not None:
        from services.trainer.distributed import exit_rank_process

        exit_rank_process(code)


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
    _end_rank(ranks, 0)
