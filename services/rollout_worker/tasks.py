"""Celery entry point of the rollout worker: ``celery -A services.rollout_worker.tasks worker -Q rollouts``.

One task carries a list of rollout requests (a whole GRPO group from intake, or single
members re-dispatched by the reaper); their episodes run concurrently in the process's one
event loop (``event_loop``), sharing one connection pool to the inference service.
The thread pool's slots times the group size is the number of concurrent episodes a
process runs (default 32 slots). Episodes are I/O bound, so threads, not processes.

Invariant: the task itself never raises on one bad request or one failed episode: every
outcome is recorded in the ledger (see ``runner``). It does raise on an unparseable payload,
which Celery then rejects with the validation error in the log.
"""

from __future__ import annotations

import logging
import os
import socket
import threading

from celery.signals import worker_ready, worker_shutdown

from services.rollout_worker.chat_tokens import load_chat_tokens
from services.rollout_worker.event_loop import background_loop
from services.rollout_worker.inference_client import InferenceClient
from services.rollout_worker.leases import LeaseKeeper, Reaper, SandboxJanitor
from services.rollout_worker.runner import RolloutContext, run_requests
from shared.celery_app import make_celery, publish_rollouts
from shared.ledger import Ledger
from shared.names import ROLLOUT_TASK, SCORING_TASK
from shared.schemas import RolloutRequest
from shared.settings import load_settings
from shared.storage import open_store

log = logging.getLogger(__name__)
settings = load_settings()
app = make_celery(settings)

_ctx: RolloutContext | None = None
_ctx_lock = threading.Lock()


def _context() -> RolloutContext:
    global _ctx
    with _ctx_lock:
        if _ctx is None:
            ledger = Ledger.from_url(settings.redis.url)
            leases = LeaseKeeper(ledger, settings.ledger.lease_ttl_s, settings.ledger.heartbeat_s)
            leases.start()
            _ctx = RolloutContext(
                settings=settings,
                ledger=ledger,
                store=open_store(settings.storage),
                leases=leases,
                chat=load_chat_tokens(settings.inference.model_path),
                enqueue_scoring=lambda tid, key, upload_s: app.send_task(SCORING_TASK, args=[tid, key, upload_s]),
                redispatch=lambda request: publish_rollouts(app, [request]),
                worker_name=f"{socket.gethostname()}:{os.getpid()}",
                inference=background_loop().run(_make_inference_client()),
            )
        return _ctx


async def _make_inference_client() -> InferenceClient:
    inference = settings.inference
    return InferenceClient(inference.base_url, inference.model, inference.request_timeout_s, inference.max_retries)


@app.task(name=ROLLOUT_TASK)
def run_trajectories(payload: list[dict]) -> dict[str, str]:
    requests = [RolloutRequest.model_validate(item) for item in payload]
    outcomes = background_loop().run(run_requests(_context(), requests))
    log.info("rollout task done: %s", outcomes)
    return outcomes


_reaper: Reaper | None = None
_janitor: SandboxJanitor | None = None


@worker_ready.connect
def _start_background(**_: object) -> None:
    """Load the tokenizer, clean up sandboxes left by a dead worker, and start heartbeat and
    reaper before the first task arrives."""
    global _reaper, _janitor
    ctx = _context()
    _reaper = Reaper(ctx.ledger, settings.ledger.max_attempts, settings.ledger.reaper_interval_s, ctx.redispatch)
    _reaper.sweep()  # leases left by a worker that died while this one was down
    _reaper.start()
    _janitor = SandboxJanitor(ctx.ledger)
    _janitor.start()


@worker_shutdown.connect
def _stop_background(**_: object) -> None:
    if _reaper:
        _reaper.stop()
    if _janitor:
        _janitor.stop()
    if _ctx:
        _ctx.leases.stop()
