"""The Celery application every Conveyor worker and producer shares.

Invariant: work is recovered by leases, never by the broker. Every stage that holds work
(rollout, scoring) claims its trajectory with a lease in the ledger as the task's first Redis
call (``shared.state.ledger.LeaseStage``); a lease that runs out is re-dispatched by a reaper within
``lease_ttl_s + reaper_interval_s``, and every copy of a message beyond the first that claims
is a no-op. The settings below are chosen to agree with that:
- ``task_acks_late`` + ``task_reject_on_worker_lost``: a task is acknowledged only after it
  finished, so a message that a worker received but had not yet claimed when it died is not
  lost: it comes back (at once when a prefork child dies, after ``visibility_timeout`` when
  the whole worker does). That window is the only one the broker covers, and it is the time
  between delivery and the claim; past the claim, the lease covers it.
- ``worker_prefetch_multiplier = 1``: a worker holds no more tasks than it has free slots, so
  no received task waits unclaimed behind a busy slot.
- Redis' ``visibility_timeout`` (``ledger.visibility_timeout_s``, 5 minutes) must exceed
  ``lease_ttl_s + reaper_interval_s`` (checked here): a broker redelivery then comes after
  the lease's recovery, and finds the trajectory claimed or done. It bounds the one case the
  leases do not cover: a worker that received a task and died before claiming any of its
  members (a busy worker receives its slots' tasks at once, so this is not only a
  millisecond window). A task still running when it expires gets a copy that is a no-op at
  the claim, never a second execution.
- ``task_acks_on_failure_or_timeout`` (Celery's default): a task that raised is acknowledged;
  the lease it left runs out and the reaper retries it, up to ``ledger.max_attempts``.
- No result backend: results flow through the ledger, S3 and the trainer stream.

Invariant: an outage of the broker (Redis) is waited out, never a reason to exit or to drop a
message. The consumer reconnects for ever (``broker_connection_max_retries = None``), at start
too, at most ``outage.backoff_max_s`` apart (``OutageConsumer``); a task that loses the broker
keeps running (its lease, not its message, guards it). Publishing waits out the outage
(``shared.outage``), bounded by ``outage.limit_s``; a worker process exits with code 2 past the
limit (``shared.outage.exit_on_limit``, its heartbeat and reaper call Redis every few seconds).
"""

from __future__ import annotations

import functools

import kombu.exceptions
import kombu.transport.redis
import redis
from celery import Celery
from celery.worker.consumer import Consumer
from kombu import Queue

from shared.names import ROLLOUT_QUEUE, ROLLOUT_TASK, SCORING_QUEUE, SCORING_TASK
from shared.outage import Dependency, redact_url
from shared.schemas import BadMessage, ScoringTask, parse_message
from shared.settings import LedgerSettings, Settings, SettingsError


def make_celery(settings: Settings) -> Celery:
    check_lease_timing(settings.ledger)
    app = Celery("conveyor", broker=settings.redis.broker)
    app.conf.update(
        task_acks_late=True,
        task_reject_on_worker_lost=True,
        worker_prefetch_multiplier=1,
        task_ignore_result=True,
        result_backend=None,
        task_serializer="json",
        accept_content=["json"],
        broker_transport_options={
            "visibility_timeout": settings.ledger.visibility_timeout_s,
            "socket_keepalive": True, "socket_connect_timeout": 5, "health_check_interval": 15,
        },
        broker_connection_retry=True,
        broker_connection_retry_on_startup=True,
        broker_connection_max_retries=None,  # for ever: outage.limit_s is enforced by shared.outage
        worker_consumer="shared.celery_app:OutageConsumer",
        broker_transport="shared.celery_app:OutageRedisTransport" if settings.redis.broker.startswith("redis://") else None,
        worker_cancel_long_running_tasks_on_connection_loss=False,
        task_queues=[Queue(ROLLOUT_QUEUE), Queue(SCORING_QUEUE)],
        task_routes={ROLLOUT_TASK: {"queue": ROLLOUT_QUEUE}, SCORING_TASK: {"queue": SCORING_QUEUE}},
        worker_hijack_root_logger=False,
        worker_send_task_events=True,  # Flower shows tasks
        task_send_sent_event=True,
    )
    app.conveyor_outage = settings.outage  # for OutageConsumer and _publish
    return app


class OutageConsumer(Consumer):
    """Celery's consumer, reconnecting to a broker that is down every 0.5 s at first, then at
    most ``outage.backoff_max_s`` apart, instead of kombu's steps of 2 s up to 30 s (which
    would leave a worker idle up to half a minute after Redis is back)."""

    def ensure_connected(self, conn):  # noqa: ANN001, ANN201 (Celery's signature)
        cap = self.app.conveyor_outage.backoff_max_s
        conn.ensure_connection = functools.partial(
            conn.ensure_connection, interval_start=min(0.5, cap), interval_step=0.5, interval_max=cap,
        )
        return super().ensure_connected(conn)


class _Channel(kombu.transport.redis.Channel):
    def _connparams(self, asynchronous: bool = False) -> dict:
        if self.connection.client is None:  # kombu 5.7 closed this channel's connection after a loss
            raise redis.ConnectionError("the broker connection of this channel was closed after a connection loss")
        return super()._connparams(asynchronous)


class OutageRedisTransport(kombu.transport.redis.Transport):
    """kombu's Redis transport, but a channel whose connection was closed after a loss raises a
    connection error instead of AttributeError. kombu 5.7 closes a lost connection's channel
    twice, and the ack of a task that ran through the outage goes to the old channel; with
    AttributeError either stopped the worker ("Unrecoverable error": a scoring worker exited
    when Redis restarted). As a connection error, Celery logs it and goes on; the message stays
    in Redis' unacked set and comes back after the visibility timeout, a no-op: its work is
    claimed or done."""

    Channel = _Channel


def check_lease_timing(ledger: LedgerSettings) -> None:
    """Leases, not the broker, recover work; a live worker's leases never run out."""
    if ledger.heartbeat_s >= ledger.lease_ttl_s:
        raise SettingsError(f"ledger.heartbeat_s ({ledger.heartbeat_s}) must be below ledger.lease_ttl_s ({ledger.lease_ttl_s})")
    recovery_s = ledger.lease_ttl_s + ledger.reaper_interval_s
    if ledger.visibility_timeout_s <= recovery_s:
        raise SettingsError(
            f"ledger.visibility_timeout_s ({ledger.visibility_timeout_s}) must exceed ledger.lease_ttl_s + "
            f"ledger.reaper_interval_s ({recovery_s}): the broker's redelivery must come after the lease's recovery"
        )


def _broker_transient(exc: BaseException) -> bool:
    return isinstance(exc, (kombu.exceptions.OperationalError, redis.ConnectionError, redis.TimeoutError, OSError))


def _publish(app: Celery, task: str, args: list) -> None:
    """Send a task, waiting out an outage of the broker (a message sent twice is harmless: the
    ledger claim runs it once)."""
    dependency = Dependency.named(f"Redis at {redact_url(app.conf.broker_url)}", app.conveyor_outage)
    dependency.call(lambda: app.send_task(task, args=args), _broker_transient)


def publish_rollouts(app: Celery, requests: list) -> None:
    """One rollout task carrying these requests (a group, or re-dispatched members)."""
    _publish(app, ROLLOUT_TASK, [[r.model_dump(mode="json") for r in requests]])


def publish_rollouts_by_group(app: Celery, requests: list) -> int:
    """One rollout task per GRPO group among these requests (what a reaper sends again), in the
    order each group first appears; returns the tasks published."""
    groups: dict[tuple[str, int], list] = {}
    for request in requests:
        groups.setdefault((request.run_id, request.group_id), []).append(request)
    for members in groups.values():
        publish_rollouts(app, members)
    return len(groups)


def publish_scoring(app: Celery, tasks: ScoringTask | list[ScoringTask]) -> None:
    """One scoring message: a ``ScoringTask``, or a list of them (a batch: the members of a
    group, usually), as its only argument (``scoring_tasks_of`` reads either)."""
    if isinstance(tasks, ScoringTask):
        _publish(app, SCORING_TASK, [tasks.model_dump(mode="json")])
    else:
        _publish(app, SCORING_TASK, [[task.model_dump(mode="json") for task in tasks]])


def scoring_tasks_of(args: tuple | list, kwargs: dict) -> list[ScoringTask | BadMessage]:
    """The ``ScoringTask``s a scoring message carries, in order; an element that is not one is
    its ``BadMessage`` (the others still score). A message that is neither one task object nor a
    list of them raises ``BadMessage``."""
    if len(args) != 1 or kwargs or not isinstance(args[0], (dict, list)):
        raise BadMessage("scoring task", f"expected one ScoringTask object or a list of them as the only argument, got "
                         f"{len(args)} positional and {sorted(kwargs)} keyword arguments", list(args))
    items = args[0] if isinstance(args[0], list) else [args[0]]
    tasks: list[ScoringTask | BadMessage] = []
    for index, item in enumerate(items):
        what = "scoring task" if isinstance(args[0], dict) else f"scoring task {index} of {len(items)}"
        try:
            if not isinstance(item, dict):
                raise BadMessage(what, "expected a ScoringTask object", item)
            tasks.append(parse_message(ScoringTask, item, what))
        except BadMessage as exc:
            tasks.append(exc)
    return tasks
