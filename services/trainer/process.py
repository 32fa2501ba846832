"""The trainer process: one loop over its two halves, the group consumer
(``services.trainer.consumer``) and, with ``trainer.mode: train``, the training loop
(``services.trainer.loop``).

Invariants:
- One pass of the loop: the consumer reads the stream once (deciding every group that
  completes), the logprob alarm is checked, then every step whose groups are in is trained.
  A restarted process first replays the consumer's pending entries (``TrainerConsumer.recover``).
- It returns only between two reads or two steps, never within a group or a step:
  once ``stop`` is set (SIGTERM), before the next read; once the run is stopped
  (``shared.state.run_stop``), before the next read or step, the run's unfinished trajectories failed
  first (``TrainerConsumer.end_if_stopped``; ``consumer.stopped`` says so); once the training
  loop is done (``trainer.max_steps``); with ``stop_when_idle``, once a read found nothing and
  every trajectory of the run is terminal with intake done.
- It never waits silently: after ``WAIT_REPORT_EVERY_S`` with no group decided and no step
  trained, it logs what it waits for and where the run's trajectories are (``WaitReport``), and
  again every ``WAIT_REPORT_EVERY_S`` until something moves.
- A run whose data Redis lost (``RedisDataLost``) and a logprob alarm (``LogprobAlarm``)
  propagate; ``close`` ends the training loop's background work either way.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

import redis

from services.trainer.batch_handoff import BatchHandoff
from services.trainer.consumer import TrainerConsumer
from shared.state.ledger import redis_for
from shared.required import required
from shared.settings import Settings
from shared.storage import ObjectStore, open_store

if TYPE_CHECKING:
    from services.trainer.distributed import TrainerRanks
    from services.trainer.evaluation import Evaluator
    from services.trainer.loop import TrainingLoop

log = logging.getLogger(__name__)

WAIT_REPORT_EVERY_S = 15.0
EvaluatorFactory = Callable[[redis.Redis, ObjectStore], "Evaluator | None"]


@dataclass
class TrainerProcess:
    consumer: TrainerConsumer
    learner: "TrainingLoop | None" = None  # None: trainer.mode assemble, nothing trains
    stop: threading.Event = field(default_factory=threading.Event)  # set on SIGTERM by the caller
    wait_report_every_s: float = WAIT_REPORT_EVERY_S

    @classmethod
    def from_settings(cls, settings: Settings, ranks: "TrainerRanks | None" = None,
                      evaluator: EvaluatorFactory | None = None) -> "TrainerProcess":
        """The trainer of ``settings``: its consumer, its metrics endpoint and, with
        ``trainer.mode: train``, the training loop (loading the model); ``ranks``: rank 0 of a
        torchrun job; ``evaluator``: builds the evaluation during training, if any."""
        from shared.prometheus import serve_metrics
        from shared.redis_clients import broker_client

        store = open_store(settings.storage, settings.outage)  # both wait out an outage (shared.outage)
        consumer = TrainerConsumer(settings, redis_for(settings.redis.url, settings.outage), store)
        trainer = settings.trainer
        serve_metrics(trainer.prometheus_port or settings.metrics_port, consumer.client,
                      broker_client(settings.redis, settings.outage))
        if trainer.mode != "train":
            return cls(consumer)
        from services.trainer.loop import TrainingLoop
        from services.trainer.metrics import MetricsSink

        sink = MetricsSink(trainer.step_metrics_path, trainer.prometheus_port or settings.metrics_port,
                           trainer.wandb_project, settings.run_id)
        consumer.handoff = BatchHandoff(trainer.batches_in_memory)  # the consumer's batches to the loop, in memory
        learner = TrainingLoop(settings, store, required(consumer.budget, "the staleness budget of mode train"), sink, ranks=ranks,
                               evaluator=None if evaluator is None else evaluator(consumer.client, store),
                               handoff=consumer.handoff, marker=consumer.marker)
        return cls(consumer, learner)

    def run(self, stop_when_idle: bool = False) -> None:
        consumer, learner = self.consumer, self.learner
        consumer.recover()
        waiting = WaitReport(self.waiting_for, self.wait_report_every_s)
        while not self.stop.is_set():
            if not consumer.keep_reading():
                return
            handled = consumer.poll()
            trained = False
            if learner is not None:
                learner.check_alarms()
                while not learner.done() and learner.ready():
                    if consumer.end_if_stopped():  # between two steps too: a backlog of ready steps is not trained
                        return
                    learner.train_once()
                    trained = True
                if learner.done():
                    return
            if stop_when_idle and not handled and consumer.finished():
                return
            if handled or trained:
                waiting.moved()
            else:
                waiting.idle()

    def waiting_for(self) -> str:
        run_id, ledger = self.consumer.run_id, self.consumer.ledger
        what = (f"step {self.learner.version + 1} waits for its {self.learner.groups_per_step} groups"
                if self.learner is not None else "waiting for scored trajectories")
        counts = ledger.counts(run_id)
        hint = "" if counts["running"] or counts["uploaded"] or counts["scored"] else \
            " (none running: the rollout workers may wait for inference, or intake for the staleness bound; their logs say which)"
        return f"run {run_id}: {what}; {ledger.describe_counts(run_id)}{hint}"

    def close(self) -> None:
        if self.learner is not None:
            self.learner.close()


class WaitReport:
    """Logs ``describe()`` once ``every_s`` has passed with nothing moving, then every ``every_s``."""

    def __init__(self, describe: Callable[[], str], every_s: float = WAIT_REPORT_EVERY_S):
        self.describe, self.every_s = describe, every_s
        self.since = self.said = time.monotonic()

    def moved(self) -> None:
        self.since = self.said = time.monotonic()

    def idle(self) -> None:
        now = time.monotonic()
        if now - self.said >= self.every_s:
            self.said = now
            log.info("%s (%.0fs with no new group or step)", self.describe(), now - self.since)
