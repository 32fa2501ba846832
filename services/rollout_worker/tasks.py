"""Celery entry point of the rollout worker: ``celery -A services.rollout_worker.tasks worker -Q rollouts``.

One task carries a list of rollout requests (a whole GRPO group from intake, or single
members re-dispatched by the reaper); their episodes run concurrently in the process's one
event loop (``event_loop``), sharing one connection pool to the inference service.
The thread pool's slots times the group size is the number of concurrent episodes a
process runs (default 32 slots). Episodes are I/O bound, so threads, not processes.

Invariants:
- The task itself never raises on one bad request or one failed episode: every outcome is
  recorded in the ledger (see ``runner``). It does raise on an unparseable payload, which
  Celery then rejects with the validation error in the log.
- The worker takes tasks only while its inference server answers: ``conveyor worker rollout``
  waits for Redis, S3 and inference before it starts consuming, and while inference is
  unreachable later (``inference_gate``) the worker stops consuming the rollouts queue and
  resumes once the server is back. The episodes it holds wait; the backlog stays queued.
- On SIGTERM (a warm shutdown) the worker takes nothing more; running episodes get
  ``rollout.shutdown_grace_s`` to finish, then are cancelled and handed back through the
  ledger (``in_flight``), so the process exits soon after the grace period with nothing lost.
- Where every reward function is declared cheap and ``rewards.in_worker`` is ``auto``, the
  process scores its own uploads (``worker_scoring``) under a scoring lease of its own, renewed
  by a second heartbeat; the scorer service's reaper finishes what it leaves should it die.
- The process never imports torch: it only tokenizes, and ``tokenizer_loading`` builds
  ``AutoTokenizer``'s tokenizer without it (``tests/unit/test_rollout_worker_imports.py``).
"""

from __future__ import annotations

import logging
import os
import socket
import threading
from typing import Any

from celery.signals import worker_ready, worker_shutdown, worker_shutting_down

from services.rollout_worker.chat_tokens import load_chat_tokens
from services.rollout_worker.event_loop import background_loop
from services.rollout_worker.in_flight import InFlight
from services.rollout_worker.inference_client import InferenceClient
from services.rollout_worker.runner import RolloutContext, run_requests
from services.rollout_worker.sandbox.providers import configure as configure_sandbox_providers
from services.rollout_worker.sandbox.worker_janitor import SandboxJanitor
from services.rollout_worker.scoring_outbox import ScoringOutbox
from services.rollout_worker.worker_scoring import worker_scoring_for
from shared.celery_app import make_celery, publish_rollouts, publish_rollouts_by_group, publish_scoring
from shared.state.leases import LeaseKeeper, LeaseReaper, settle_s
from shared.redis_clients import broker_client
from shared.state.ledger import ROLLOUT, Ledger, redis_for
from shared.model_source import resolve_model_source
from shared.names import ROLLOUT_QUEUE, ROLLOUT_TASK
from shared.prometheus import serve_metrics
from shared.schemas import RolloutRequest, ScoringTask
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
            configure_sandbox_providers(settings.sandbox)  # where each environment's sandboxes run
            client = redis_for(settings.redis.url, settings.outage)  # waits out an outage of Redis
            ledger = Ledger(client, settings.ledger.dispatch_ttl_s, broker_client(settings.redis, settings.outage))
            in_flight = InFlight()
            loop = background_loop().loop

            def cancel_lost(trajectory_ids: list[str]) -> None:  # heartbeat thread -> the episodes' loop
                loop.call_soon_threadsafe(in_flight.cancel, trajectory_ids)

            leases = LeaseKeeper(ledger, settings.ledger.lease_ttl_s, settings.ledger.heartbeat_s, on_lost=cancel_lost)
            leases.start()
            store = open_store(settings.storage, settings.outage)
            _ctx = RolloutContext(
                in_flight=in_flight,
                settings=settings,
                ledger=ledger,
                store=store,
                leases=leases,
                chat=load_chat_tokens(resolve_model_source(settings.inference.model_path).value,
                                      settings.rollout.agent_proxy.prompt_cache_bytes),
                scoring=ScoringOutbox(lambda batch: _send_scoring(ledger, batch), settings.rollout.scoring_linger_s,
                                      settings.rollout.scoring_batch_max),
                redispatch=lambda request: publish_rollouts(app, [request]),
                worker_name=f"{socket.gethostname()}:{os.getpid()}",
                inference=background_loop().run(_make_inference_client()),
                redis=client,
                worker_scoring=worker_scoring_for(settings, ledger, store, client),
            )
        return _ctx


def _send_scoring(ledger: Ledger, batch: list[ScoringTask]) -> None:
    """One scoring message for the batch, then its send-by entries go (``scoring_outbox``)."""
    publish_scoring(app, batch)
    ledger.scoring_sent([task.trajectory_id for task in batch])


async def _make_inference_client() -> InferenceClient:
    inference = settings.inference
    return InferenceClient(inference.base_url, inference.model, inference.request_timeout_s, inference.max_retries,
                           outage=settings.outage, on_outage_change=_rollout_queue_switch.inference_up,
                           lora_adapters=settings.trainer.lora.served_rank is not None)


class _RolloutQueueSwitch:
    """Turns this worker's taking of rollout tasks off while inference is down, and on again when
    it is back (not intake: the Celery consumer's queue, ROLLOUT_QUEUE)."""

    def __init__(self) -> None:
        self.celery_consumer: Any = None  # Celery's message consumer, from worker_ready

    def inference_up(self, up: bool) -> None:
        consumer = self.celery_consumer
        if consumer is None:
            return
        if up:
            consumer.call_soon(consumer.add_task_queue, ROLLOUT_QUEUE)
            log.warning("inference is back: taking rollout tasks again")
        else:
            consumer.call_soon(consumer.cancel_task_queue, ROLLOUT_QUEUE)
            log.warning("inference is unreachable: taking no rollout task until it is back")


_rollout_queue_switch = _RolloutQueueSwitch()


@app.task(name=ROLLOUT_TASK)
def run_trajectories(payload: list[dict]) -> dict[str, str]:
    requests = [RolloutRequest.model_validate(item) for item in payload]
    results = background_loop().run(run_requests(_context(), requests))
    outcomes = {tid: str(result) for tid, result in results.items()}
    log.info("rollout task done: %s", outcomes)
    return outcomes


_reaper: LeaseReaper | None = None
_janitor: SandboxJanitor | None = None


@worker_ready.connect
def _start_background(sender: object = None, **_: object) -> None:
    """Load the tokenizer, clean up sandboxes left by a dead worker, and start heartbeat and
    reaper before the first task arrives."""
    global _reaper, _janitor
    _rollout_queue_switch.celery_consumer = sender
    ctx = _context()
    serve_metrics(settings.metrics_port, ctx.redis, ctx.ledger.broker)
    _reaper = LeaseReaper(
        ctx.ledger, ROLLOUT, settings.ledger.max_attempts, settings.ledger.reaper_interval_s,
        lambda items: publish_rollouts_by_group(app, [RolloutRequest.model_validate_json(r) for _, r in items]),
        settle_s=settle_s(settings.ledger.heartbeat_s, settings.outage), lease_ttl_s=settings.ledger.lease_ttl_s,
    )
    _reaper.sweep()  # leases left by a worker that died while this one was down
    _reaper.start()
    _janitor = SandboxJanitor(ctx.ledger)
    _janitor.start()


@worker_shutting_down.connect
def _hand_back_after_grace(**_: object) -> None:
    """Runs in the signal handler: start the grace period's clock, nothing more."""
    if _ctx is None:
        return
    grace = settings.rollout.shutdown_grace_s
    log.warning("shutting down: %d running episodes get %gs (rollout.shutdown_grace_s) to finish, then are handed back",
                len(_ctx.in_flight), grace)
    loop = background_loop().loop
    timer = threading.Timer(grace, loop.call_soon_threadsafe, args=(_hand_back_all,))
    timer.daemon = True
    timer.start()


def _hand_back_all() -> None:
    if _ctx is not None and (cancelled := _ctx.in_flight.stop()):
        log.warning("grace period over: handing back %d unfinished episodes", cancelled)


@worker_shutdown.connect
def _stop_background(**_: object) -> None:
    if _reaper:
        _reaper.stop()
    if _janitor:
        _janitor.stop()
    if _ctx:
        _ctx.leases.stop()
        if _ctx.worker_scoring:
            _ctx.worker_scoring.scorer.leases.stop()
