"""The Celery application every Conveyor worker and producer shares.

Reliability settings (why each is here):
- ``task_acks_late`` + ``task_reject_on_worker_lost``: a task is acknowledged only after it
  finished, so a worker killed mid-task does not lose it.
- ``worker_prefetch_multiplier = 1``: a worker holds no more tasks than it has free slots,
  so a dead worker strands as little as possible.
- Redis' ``visibility_timeout`` is long (episodes run for minutes); it is a backstop, not the
  way a dead worker is noticed. Leases in the ledger do that (see ``shared.ledger``).
- No result backend: results flow through the ledger, S3 and the trainer stream.
"""

from __future__ import annotations

from celery import Celery
from kombu import Queue

from shared.names import ROLLOUT_QUEUE, ROLLOUT_TASK, SCORING_QUEUE, SCORING_TASK
from shared.settings import Settings


def make_celery(settings: Settings) -> Celery:
    app = Celery("conveyor", broker=settings.redis.url)
    app.conf.update(
        task_acks_late=True,
        task_reject_on_worker_lost=True,
        worker_prefetch_multiplier=1,
        task_ignore_result=True,
        result_backend=None,
        task_serializer="json",
        accept_content=["json"],
        broker_transport_options={"visibility_timeout": settings.ledger.visibility_timeout_s},
        broker_connection_retry_on_startup=True,
        task_queues=[Queue(ROLLOUT_QUEUE), Queue(SCORING_QUEUE)],
        task_routes={ROLLOUT_TASK: {"queue": ROLLOUT_QUEUE}, SCORING_TASK: {"queue": SCORING_QUEUE}},
        worker_hijack_root_logger=False,
        worker_send_task_events=True,  # Flower shows tasks
        task_send_sent_event=True,
    )
    return app


def publish_rollouts(app: Celery, requests: list) -> None:
    """One rollout task carrying these requests (a group, or re-dispatched members)."""
    app.send_task(ROLLOUT_TASK, args=[[r.model_dump(mode="json") for r in requests]])
