"""Runs a batch of rollout requests (a GRPO group, or the members of one being re-dispatched)
concurrently in one event loop, and hands each finished trajectory on.

Invariants, per trajectory:
- It runs only if this worker won the ledger claim (queued -> running); a redelivered or
  duplicated request is skipped.
- The trajectory object is written before the ledger moves to ``uploaded``, under a key that
  carries the attempt and its lease token, so no other attempt (one presumed dead, or one from
  before a ``conveyor retry``) can ever overwrite the attempt that won.
- Only the lease owner moves it on, storing its scoring task in the same ledger call; the task
  is then sent in a batch with the others of the process (``scoring_outbox``), and the scoring
  reaper sends it should this process die first.
- An outage of Redis or of the S3 server is waited out by the ledger and the store
  (``shared.outage``); an outage of inference by the inference client (``inference_gate``).
  Neither is an ``infra_error`` nor costs an attempt. Inference unreachable for longer than
  ``outage.limit_s`` fails the trajectory at once: ``inference_outage``, naming the outage.
- A request whose run Redis lost (``shared.run_marker``) is refused, with one error line per
  run: nothing of the run is recreated.
- Failures are classified (``shared.outcomes.FailureKind``), narrowly:
  - a known infra error (``INFRA_ERRORS``) puts the trajectory back in the queue after a
    backoff (``rollout.retry_backoff_s``, doubling per attempt) while attempts remain, then
    fails it as ``infra_error``;
  - the environment raising (``env_error``), inference refusing the request
    (``inference_rejected``), or a task this worker cannot run, an environment it does not
    have or an ``env_config`` its ``Config`` refuses (``config_error``), fails it at once;
  - any other exception is a bug: it fails the trajectory at once, never retried, with the
    traceback in the failure reason.
  Nothing is dropped silently.
- A worker shutting down hands its running trajectories back (``in_flight``): queued again
  with the attempt not counted.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
import traceback
from dataclasses import dataclass, field
from typing import Callable

import kombu.exceptions
import redis

from services.rollout_worker.agent_episode import is_agent_driven, run_agent_episode
from services.rollout_worker.agent_proxy import AgentProxy
from services.rollout_worker.chat_tokens import ChatTokens
from services.rollout_worker.environments.coding.artifacts import write_artifacts
from services.rollout_worker.episode import EpisodeLimits, run_episode
from services.rollout_worker.in_flight import HandBack, InFlight, LeaseLost
from services.rollout_worker.inference_client import InferenceClient, InferenceOutage, InferenceRejected, InferenceUnavailable
from services.rollout_worker.sandbox.errors import SandboxInfraError
from services.rollout_worker.scoring_outbox import ScoringOutbox
from shared.environments import EnvironmentConfigError, EnvironmentUnavailable, registry_for
from shared.leases import LeaseKeeper
from shared.ledger import Ledger, TransitionResult
from shared.names import trajectory_key
from shared.outage import OutageTooLong
from shared.policy_version import PolicyVersion
from shared.outcomes import FailureKind, RolloutOutcome, RolloutResult, reason
from shared.prometheus import EPISODES_IN_FLIGHT
from shared.run_marker import refuse_lost_run
from shared.schemas import RolloutRequest, ScoringTask, StopReason, Trajectory
from shared.settings import RolloutSettings, Settings
from shared.storage import ObjectStore, StorageError, put_model

log = logging.getLogger(__name__)

# Transient failures of what a rollout depends on, once the layer below gave up on them: a
# fresh attempt may succeed. Inference unreachable (an outage) is waited out below this and
# is not here: past outage.limit_s it is InferenceOutage, which fails at once.
INFRA_ERRORS: tuple[type[BaseException], ...] = (
    InferenceUnavailable, SandboxInfraError, StorageError, OutageTooLong,
    redis.ConnectionError, redis.TimeoutError, kombu.exceptions.OperationalError,
)
MAX_TRACEBACK_CHARS = 8000


@dataclass
class RolloutContext:
    settings: Settings
    ledger: Ledger
    store: ObjectStore
    leases: LeaseKeeper
    chat: ChatTokens
    scoring: ScoringOutbox  # batches the scoring messages of the process's uploads
    redispatch: Callable[[RolloutRequest], None]
    worker_name: str
    inference: InferenceClient  # shared by every episode of the process (one event loop)
    in_flight: InFlight = field(default_factory=InFlight)  # what a shutdown hands back
    agent_proxy: AgentProxy | None = None  # started on the first agent-driven episode (agent_proxy_of)
    _agent_proxy_lock: asyncio.Lock = field(default_factory=asyncio.Lock)


async def run_requests(ctx: RolloutContext, requests: list[RolloutRequest]) -> dict[str, RolloutResult]:
    """Returns trajectory id -> what happened to it."""
    outcomes = await asyncio.gather(*(_run_one(ctx, r) for r in requests))
    await ctx.scoring.flush()  # the task's uploads go to scoring in one message
    return dict(zip((r.trajectory_id for r in requests), outcomes))


async def _run_one(ctx: RolloutContext, request: RolloutRequest) -> RolloutResult:
    tid = request.trajectory_id
    token, detail = await asyncio.to_thread(ctx.leases.claim, tid)
    if token is None:
        if detail == "unknown" and await asyncio.to_thread(refuse_lost_run, ctx.ledger.redis, request.run_id):
            return RolloutResult(RolloutOutcome.refused, "redis_data_lost")
        log.info("skip %s: already %s", tid, detail)
        return RolloutResult(RolloutOutcome.skipped, detail)
    attempt = int(detail)
    EPISODES_IN_FLIGHT.inc()
    try:
        return await _roll_out(ctx, request, token, attempt)
    finally:
        EPISODES_IN_FLIGHT.dec()
        ctx.leases.release(tid)


async def _roll_out(ctx: RolloutContext, request: RolloutRequest, token: str, attempt: int) -> RolloutResult:
    tid = request.trajectory_id
    try:
        trajectory = await ctx.in_flight.run(_episode(ctx, request, attempt), tid)
        result, scoring = await asyncio.to_thread(_hand_on, ctx, trajectory, token)
        if scoring is not None:
            await ctx.scoring.add(scoring)
        return result
    except HandBack:
        return await asyncio.to_thread(_hand_back, ctx, request, token)
    except LeaseLost:  # superseded by its group's redundancy, or its lease expired: the ledger says so already
        log.info("%s cancelled: its lease is no longer this worker's", tid)
        return RolloutResult(RolloutOutcome.skipped, "lease_lost")
    except InferenceOutage as exc:
        log.error("%s failed: %s", tid, exc)
        return await asyncio.to_thread(_fail, ctx, tid, token, FailureKind.inference_outage, str(exc))
    except InferenceRejected as exc:
        log.error("%s failed: %s", tid, exc)
        return await asyncio.to_thread(_fail, ctx, tid, token, FailureKind.inference_rejected, str(exc))
    except (EnvironmentUnavailable, EnvironmentConfigError) as exc:  # this deployment cannot run the task
        log.error("%s failed: %s", tid, exc)
        return await asyncio.to_thread(_fail, ctx, tid, token, FailureKind.config_error, str(exc))
    except INFRA_ERRORS as exc:
        return await _retry_or_fail(ctx, request, token, attempt, f"{type(exc).__name__}: {exc}")
    except Exception as exc:  # a bug: retrying would run it again, so fail now and keep the traceback
        log.exception("rollout of %s failed with an unexpected exception (a bug): failed, not retried", tid)
        detail = f"{type(exc).__name__}: {exc}\n{traceback.format_exc()[-MAX_TRACEBACK_CHARS:]}"
        return await asyncio.to_thread(_fail, ctx, tid, token, FailureKind.bug, detail)


async def _episode(ctx: RolloutContext, request: RolloutRequest, attempt: int) -> Trajectory:
    env = registry_for(ctx.settings.environments).make(request.task.env_name, request.task.env_config)
    limits = EpisodeLimits.from_settings(ctx.settings.rollout, ctx.settings.inference.max_model_len, env.config)
    served = PolicyVersion(ctx.ledger.redis, request.run_id)
    if is_agent_driven(env):
        return await run_agent_episode(request, env, await agent_proxy_of(ctx), limits, policy_version=served.get,
                                       attempt=attempt, worker=ctx.worker_name, store=ctx.store)
    return await run_episode(
        request, env, ctx.inference, ctx.chat, limits,
        policy_version=served.get,
        attempt=attempt, worker=ctx.worker_name,
    )


async def agent_proxy_of(ctx: RolloutContext) -> AgentProxy:
    """The process's recording proxy, started once, in the episodes' event loop."""
    async with ctx._agent_proxy_lock:
        if ctx.agent_proxy is None:
            rollout = ctx.settings.rollout
            proxy = AgentProxy(ctx.inference, ctx.chat, ctx.settings.inference.model, rollout.sampling.temperature,
                               rollout.sampling.top_p, socket_dir=rollout.agent_socket_dir / f"w{os.getpid()}")
            await proxy.start()
            ctx.agent_proxy = proxy
        return ctx.agent_proxy


def _hand_on(ctx: RolloutContext, trajectory: Trajectory, token: str) -> tuple[RolloutResult, ScoringTask | None]:
    """Upload the trajectory and move it to ``uploaded`` with its scoring task stored; the task
    comes back to be sent (batched) when the move was this attempt's."""
    request = trajectory.request
    if trajectory.stop_reason is StopReason.env_error:
        return _fail(ctx, request.trajectory_id, token, FailureKind.env_error, trajectory.error or ""), None
    key = trajectory_key(request.run_id, request.group_id, request.trajectory_id).replace(
        ".json.gz", f".a{trajectory.attempt}-{token[:8]}.json.gz"
    )
    t0 = time.perf_counter()
    put_model(ctx.store, key, trajectory)
    if "diff" in trajectory.env_info:  # a sandboxed environment's diff, test output and command log
        write_artifacts(ctx.store, request.run_id, request.trajectory_id, trajectory.env_info)
    scoring = ScoringTask(trajectory_id=request.trajectory_id, trajectory_key=key, upload_s=time.perf_counter() - t0)
    moved = ctx.ledger.mark_uploaded(request.trajectory_id, token, scoring.model_dump_json(),
                                     send_within_s=ctx.settings.ledger.lease_ttl_s + ctx.settings.rollout.scoring_linger_s)
    if not moved.ok and moved.state == "uploaded" and ctx.ledger.attempts(request.trajectory_id) == trajectory.attempt:
        # Redis went away with the reply of a move that took: no later attempt was claimed, so
        # the upload is this attempt's own, and its scoring must still be sent
        log.warning("%s: the ledger's reply to the upload was lost; the move was this attempt's", request.trajectory_id)
        moved = TransitionResult(True, "running")
    if not moved.ok and moved.state == "unknown" and refuse_lost_run(ctx.ledger.redis, request.run_id):
        return RolloutResult(RolloutOutcome.refused, "redis_data_lost"), None
    if not moved.ok:
        log.warning("%s: lost the lease before upload (%s); this attempt's result is dropped", request.trajectory_id, moved.state)
        return RolloutResult(RolloutOutcome.skipped, moved.state), None
    return RolloutResult(RolloutOutcome.uploaded), scoring


def _fail(ctx: RolloutContext, tid: str, token: str, kind: FailureKind, detail: str) -> RolloutResult:
    moved = ctx.ledger.fail(tid, reason(kind, detail), token=token)
    if not moved.ok:
        return RolloutResult(RolloutOutcome.skipped, moved.state)
    return RolloutResult(RolloutOutcome.failed, kind.value)


def _hand_back(ctx: RolloutContext, request: RolloutRequest, token: str) -> RolloutResult:
    moved = ctx.ledger.hand_back(request.trajectory_id, token)
    if not moved.ok:
        return RolloutResult(RolloutOutcome.skipped, moved.state)
    ctx.redispatch(request)
    log.info("%s handed back: this worker is shutting down", request.trajectory_id)
    return RolloutResult(RolloutOutcome.handed_back)


def retry_delay_s(attempt: int, rollout: RolloutSettings) -> float:
    """The backoff after failed attempt ``attempt`` (1-based): doubling, capped."""
    return min(rollout.retry_backoff_s * 2 ** (attempt - 1), rollout.retry_backoff_max_s)


async def _retry_or_fail(ctx: RolloutContext, request: RolloutRequest, token: str, attempt: int, problem: str) -> RolloutResult:
    tid, max_attempts = request.trajectory_id, ctx.settings.ledger.max_attempts
    if attempt >= max_attempts:
        log.error("%s failed: %s (attempt %d of %d)", tid, problem, attempt, max_attempts)
        return await asyncio.to_thread(_fail, ctx, tid, token, FailureKind.infra_error, f"{problem} (after {attempt} attempts)")
    delay = retry_delay_s(attempt, ctx.settings.rollout)
    log.warning("%s: %s (attempt %d of %d); queued again in %.1fs", tid, problem, attempt, max_attempts, delay)
    try:  # the lease stays renewed meanwhile; a shutdown cuts the wait short, the attempt still counts
        await ctx.in_flight.run(asyncio.sleep(delay))
    except HandBack:
        pass
    moved = await asyncio.to_thread(ctx.ledger.requeue, tid, token)
    if not moved.ok:
        return RolloutResult(RolloutOutcome.skipped, moved.state)
    await asyncio.to_thread(ctx.redispatch, request)
    return RolloutResult(RolloutOutcome.requeued, FailureKind.infra_error.value)
