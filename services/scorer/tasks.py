"""Celery entry point of the scorer: ``celery -A services.scorer.tasks worker -Q scoring``.

Each task scores one trajectory (``shared.scoring.scorer``) under a scoring lease. Every
scoring worker process renews the leases it holds and runs a scoring reaper: from its start
(a sweep for leases left by scorers that died while none was running), then every
``ledger.reaper_interval_s``. A scorer killed mid-task therefore delays its trajectories by at
most ``lease_ttl_s + reaper_interval_s`` while any scoring worker is alive, never by the
broker's visibility timeout.

A scoring message carries one ``ScoringTask`` or a list of them (a rollout worker batches its
uploads, ``services.rollout_worker.scoring_outbox``; ``shared.celery_app.publish_scoring``).
One that does not (a producer's bug, another version) never fails in Celery's argument check:
the task takes anything and hands each bad part to ``Scorer.reject``, which logs it,
dead-letters it and fails the trajectory it names if nothing else would score it; the good
parts of a batch are scored. Nothing waits for a message that will not come.
"""

from __future__ import annotations

import logging

from celery.signals import worker_ready, worker_shutdown

from shared.scoring.rewards import RewardCombiner
from shared.scoring.scorer import Scorer
from shared.celery_app import make_celery, publish_scoring, scoring_tasks_of
from shared.state.dead_letters import DeadLetters
from shared.state.leases import LeaseKeeper, LeaseReaper, one_by_one, settle_s
from shared.redis_clients import broker_client
from shared.state.ledger import SCORING, Ledger, redis_for
from shared.names import SCORING_TASK
from shared.prometheus import serve_metrics
from shared.schemas import BadMessage, ScoringTask, parse_message
from shared.settings import load_settings
from shared.storage import open_store

log = logging.getLogger(__name__)
settings = load_settings()
app = make_celery(settings)
_redis = redis_for(settings.redis.url, settings.outage)  # waits out an outage of Redis
_ledger = Ledger(_redis, settings.ledger.dispatch_ttl_s, broker_client(settings.redis, settings.outage))
_leases = LeaseKeeper(_ledger, settings.ledger.lease_ttl_s, settings.ledger.heartbeat_s, SCORING)
_scorer = Scorer(
    open_store(settings.storage, settings.outage),
    RewardCombiner(settings.rewards.weights, settings.rollout.max_episode_tokens),  # a bad reward config fails at start
    _leases,
    DeadLetters(_redis),
)
_reaper = LeaseReaper(
    _ledger, SCORING, settings.ledger.max_attempts, settings.ledger.reaper_interval_s,
    one_by_one(lambda tid, task_json: _redispatch(tid, task_json)),  # defined below
    settle_s=settle_s(settings.ledger.heartbeat_s, settings.outage), lease_ttl_s=settings.ledger.lease_ttl_s,
)


@worker_ready.connect
def _start_background(**_: object) -> None:
    serve_metrics(settings.metrics_port, _redis, _ledger.broker)
    _leases.start()
    _reaper.sweep()
    _reaper.start()


@worker_shutdown.connect
def _stop_background(**_: object) -> None:
    _reaper.stop()
    _leases.stop()


def _redispatch(trajectory_id: str, task_json: str) -> None:
    """Publish the task stored at the claim again; one that does not parse is rejected (and its
    trajectory failed) rather than left waiting for a message that never comes."""
    try:
        publish_scoring(app, parse_message(ScoringTask, task_json, "stored scoring task"))
    except BadMessage as exc:
        _scorer.reject(exc, trajectory_id)


def _reject(error: BadMessage, raw: object) -> str:
    """``Scorer.reject`` for a message (or element) that is not a ScoringTask, naming the
    trajectory it carries if it carries one."""
    outcome = _scorer.reject(error, raw.get("trajectory_id") if isinstance(raw, dict) else raw)
    log.info("scoring message %.200r: %s", raw, outcome)
    return outcome


@app.task(name=SCORING_TASK)
def score_trajectories(*args: object, **kwargs: object) -> list[str]:
    """Scores every ``ScoringTask`` of the message (``Scorer.score_batch``). Takes anything, so that a malformed
    message (or element) reaches ``Scorer.reject`` instead of failing in Celery's signature
    check with its trajectories left waiting; a bad element never stops the others."""
    try:
        tasks = scoring_tasks_of(args, kwargs)
    except BadMessage as exc:
        return [_reject(exc, args[0] if args else None)]
    items = args[0] if isinstance(args[0], list) else [args[0]]
    outcomes = [_reject(bad, raw) for bad, raw in zip(tasks, items) if isinstance(bad, BadMessage)]
    good = [t for t in tasks if isinstance(t, ScoringTask)]
    scored = _scorer.score_batch(good)
    for task, outcome in zip(good, scored):
        log.info("scoring %s: %s", task.trajectory_id, outcome)
    return outcomes + scored
