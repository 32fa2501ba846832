"""Runs a batch of rollout requests (a GRPO group, or the members of one being re-dispatched)
concurrently in one event loop, and hands each finished trajectory on.

Invariants, per trajectory:
- It runs only if this worker won the ledger claim (queued -> running); a redelivered or
  duplicated request is skipped.
- The trajectory is written before the ledger moves to ``uploaded``, together with the task's
  other finished trajectories (``upload_outbox``: one object, a bundle, and one pipelined
  ledger round trip), under a key that carries its first member's attempt and lease token, so
  no other attempt (one presumed dead, or one from before a ``conveyor retry``) can ever
  overwrite the attempt that won. Until then it stays ``running`` under this worker's lease:
  a crash re-runs it, never loses it. Its scoring task names its member (``key#index``). A
  small one (``ledger.inline_max_bytes``) is instead written by that move itself, into the
  ledger's Redis, only if the move is this attempt's (``shared.inline_trajectories``); its
  scoring task names its inline ref.
- Only the lease owner moves it on, storing its scoring task in the same ledger call; the task
  is then sent in a batch with the others of the process (``scoring_outbox``), and the scoring
  reaper sends it should this process die first. Where the reward functions may run in the
  worker (``worker_scoring``), the bundle's trajectories are scored here right after that move,
  through the scorer's own steps, and only what could not be scored here is sent.
- An outage of Redis or of the S3 server is waited out by the ledger and the store
  (``shared.outage``); an outage of inference by the inference client (``inference_gate``).
  An episode calls the server its request names (a run's own: ``inference_targets``), else the
  worker's own, whether it is driven by the token loop or by an agent through the recording proxy.
  Neither is an ``infra_error`` nor costs an attempt. Inference unreachable for longer than
  ``outage.limit_s`` fails the trajectory at once: ``inference_outage``, naming the outage.
- A request whose run Redis lost (``shared.state.run_marker``) is refused, with one error line per
  run: nothing of the run is recreated.
- An environment that needs the main thread (a signal handler: ``signal only works in main
  thread`` on the event-loop thread) moves to a host process's main thread and its episode goes
  on (``environments.main_thread``); it is not an ``env_error``.
- Failures are classified (``shared.outcomes.FailureKind``), narrowly:
  - a known infra error (``INFRA_ERRORS``) puts the trajectory back in the queue after a
    backoff (``rollout.retry_backoff_s``, doubling per attempt) while attempts remain, then
    fails it as ``infra_error``;
  - the environment raising (``env_error``), inference refusing the request
    (``inference_rejected``), or a task this worker cannot run, an environment it does not
    have or an ``env_config`` its ``Config`` refuses, or a run's own inference server it cannot
    serve (``inference_targets``) (``config_error``), fails it at once;
  - any other exception is a bug: it fails the trajectory at once, never retried, with the
    traceback in the failure reason.
  Nothing is dropped silently.
- A trajectory of a stopped run (``shared.state.run_stop``) is claimed, then failed as ``run_stopped``
  and not run; an episode running when its run is stopped is cut when ``conveyor run stop``
  fails it (the heartbeat finds the lease gone: ``LeaseLost``). Other runs' tasks go on.
- A worker shutting down hands its running trajectories back (``in_flight``): queued again
  with the attempt not counted.
- A request with ``generate_from_version`` (``trainer.admit_before_served``) starts its episode
  only once that version is served (``ServedVersion.at_least``): its wait is counted in the
  trajectory's queue wait, not in the episode's time or its timeout, and it holds the lease
  like a running episode (a stop or a shutdown ends it the same way). A long wait is logged
  with the version it waits for and the one served, at doubling intervals.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable

import kombu.exceptions
import redis

from services.rollout_worker.agents.proxy import AgentProxy
from services.rollout_worker.chat_tokens import ChatTokens
from services.rollout_worker.episode.loop import EpisodeLimits
from services.rollout_worker.episode.drivers import AgentDriver, TokenLoopDriver, driver_for
from services.rollout_worker.in_flight import HandBack, InFlight, LeaseLost
from services.rollout_worker.inference_client import InferenceClient, InferenceOutage, InferenceRejected, InferenceUnavailable
from services.rollout_worker.inference_targets import InferenceTargetError, RunServers, Served
from services.rollout_worker.sandbox.errors import SandboxInfraError
from services.rollout_worker.scoring_outbox import ScoringOutbox
from services.rollout_worker.upload_outbox import UploadOutbox
from services.rollout_worker.worker_scoring import WorkerScoring
from shared.environments import EnvironmentConfigError, EnvironmentUnavailable, registry_for
from shared.inline_trajectories import inline_json, inline_ref
from shared.state.admission_wake import AdmissionWake
from shared.state.leases import LeaseKeeper
from shared.state.ledger import Ledger, TransitionResult
from shared.names import trajectory_bundle_key
from shared.outage import OutageTooLong
from shared.state.policy_version import PolicyVersion
from services.rollout_worker.served_version import ServedVersion
from shared.outcomes import FailureKind, RolloutOutcome, RolloutResult, reason
from shared.prometheus import EPISODES_IN_FLIGHT
from shared.state.run_stop import RunStop, stop_of
from shared.schemas import RolloutRequest, ScoringTask, StopReason, Trajectory
from shared.settings import RolloutSettings, Settings
from shared.storage import ObjectStore, StorageError, put_bundle

log = logging.getLogger(__name__)

# Transient failures of what a rollout depends on, once the layer below gave up on them: a
# fresh attempt may succeed. Inference unreachable (an outage) is waited out below this and
# is not here: past outage.limit_s it is InferenceOutage, which fails at once.
INFRA_ERRORS: tuple[type[BaseException], ...] = (
    InferenceUnavailable, SandboxInfraError, StorageError, OutageTooLong,
    redis.ConnectionError, redis.TimeoutError, kombu.exceptions.OperationalError,
)
MAX_TRACEBACK_CHARS = 8000
VERSION_WAIT_LOG_S, MAX_VERSION_WAIT_LOG_S = 60.0, 600.0  # a wait for a version not yet served is logged
FinishedEpisode = tuple[Trajectory, str]  # a finished trajectory and its attempt's lease token
HandedOn = tuple[RolloutResult, ScoringTask | None]  # its outcome, and its scoring task to send
Uploads = UploadOutbox[FinishedEpisode, HandedOn]


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
    redis: Any  # the process's Redis client: the ledger's, and the other owners' of Redis state (shared.state)
    in_flight: InFlight = field(default_factory=InFlight)  # what a shutdown hands back
    agent_proxy: AgentProxy | None = None  # started on the first agent-driven episode (agent_proxy_of)
    _agent_proxy_lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    served_versions: dict[str, ServedVersion] = field(default_factory=dict)  # run id -> its version, read shared
    worker_scoring: WorkerScoring | None = None  # scores uploads here, no scoring hop (rewards.in_worker)
    # the runs' own inference servers (RolloutRequest.inference), made on the first request naming one
    run_servers: RunServers | None = None


async def run_requests(ctx: RolloutContext, requests: list[RolloutRequest]) -> dict[str, RolloutResult]:
    """Returns trajectory id -> what happened to it."""
    claims = await asyncio.to_thread(ctx.leases.claim_many, [(r.trajectory_id, "") for r in requests])  # one round trip
    rollout = ctx.settings.rollout
    uploads: Uploads = UploadOutbox(lambda finished: upload_and_score(ctx, finished),
                                    [r.trajectory_id for r, (token, _) in zip(requests, claims) if token is not None],
                                    rollout.upload_linger_s, rollout.upload_bundle_max)
    stops = await asyncio.to_thread(lambda: {run: stop_of(ctx.redis, run) for run in {r.run_id for r in requests}})
    outcomes = await asyncio.gather(*(_run_one(ctx, uploads, r, token, detail, stops[r.run_id])
                                      for r, (token, detail) in zip(requests, claims)))
    await ctx.scoring.flush()  # the task's uploads go to scoring in one message
    return dict(zip((r.trajectory_id for r in requests), outcomes))


async def _run_one(ctx: RolloutContext, uploads: Uploads, request: RolloutRequest, token: str | None, detail: str,
                   stop: RunStop | None) -> RolloutResult:
    """``token``, ``detail``: this worker's claim of the request (``LeaseKeeper.claim``); ``stop``:
    its run's stop, if any (``shared.state.run_stop``)."""
    tid = request.trajectory_id
    if token is None:
        if detail == "unknown" and await asyncio.to_thread(ctx.ledger.run_lost, request.run_id):
            return RolloutResult(RolloutOutcome.refused, "redis_data_lost")
        log.info("skip %s: already %s", tid, detail)
        return RolloutResult(RolloutOutcome.skipped, detail)
    attempt = int(detail)
    EPISODES_IN_FLIGHT.inc()
    try:
        if stop is not None:
            log.info("%s not run: its run was %s", tid, stop.describe())
            return await asyncio.to_thread(_fail, ctx, tid, token, FailureKind.run_stopped, stop.detail())
        return await _roll_out(ctx, uploads, request, token, attempt)
    finally:
        uploads.finished(tid)
        EPISODES_IN_FLIGHT.dec()
        ctx.leases.release(tid)


async def _roll_out(ctx: RolloutContext, uploads: Uploads, request: RolloutRequest, token: str, attempt: int) -> RolloutResult:
    tid = request.trajectory_id
    try:
        trajectory = await ctx.in_flight.run(_episode(ctx, request, attempt), tid)
        if trajectory.stop_reason is StopReason.env_error:
            return await asyncio.to_thread(_fail, ctx, tid, token, FailureKind.env_error, trajectory.error or "")
        result, scoring = await uploads.hand_on(tid, (trajectory, token))
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
    except (EnvironmentUnavailable, EnvironmentConfigError, InferenceTargetError) as exc:  # this deployment cannot run the task
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
    served = ctx.served_versions.get(request.run_id)
    if served is None:  # one per run for the process: its episodes' turns share the reads
        served = ctx.served_versions[request.run_id] = ServedVersion(PolicyVersion(ctx.redis, request.run_id).get,
                                                                     AdmissionWake(ctx.redis, request.run_id))
    if request.generate_from_version:  # admitted before its weights were served (trainer.admit_before_served)
        await _wait_for_version(served, request)
    if ctx.run_servers is None:
        ctx.run_servers = RunServers.from_settings(ctx.settings)
    own = Served(ctx.inference, ctx.chat, ctx.settings.inference.max_model_len)
    server = await ctx.run_servers.for_request(request, own)
    limits = EpisodeLimits.from_settings(ctx.settings.rollout, server.max_model_len, env.config)
    driver = driver_for(env, TokenLoopDriver(server.client, server.chat, ctx.store),
                        AgentDriver(lambda: agent_proxy_of(ctx), ctx.store, server))
    return await driver.run(request, env, limits, policy_version=served, attempt=attempt, worker=ctx.worker_name)


async def _wait_for_version(served: ServedVersion, request: RolloutRequest) -> None:
    """Wait until the request's ``generate_from_version`` is served, saying so at doubling
    intervals from ``VERSION_WAIT_LOG_S`` (a trainer that stopped serving new versions holds the
    episode here, as it would hold intake without the setting)."""
    wanted, every, waited = request.generate_from_version, VERSION_WAIT_LOG_S, 0.0
    arrival = asyncio.ensure_future(served.at_least(wanted))
    try:
        while not (await asyncio.wait({arrival}, timeout=every))[0]:
            waited += every
            log.warning("%s waits %.0fs for policy version %d to be served (trainer.admit_before_served admitted it "
                        "before its weights were served; served now: %d): the trainer's log says whether it still "
                        "trains and syncs", request.trajectory_id, waited, wanted, served())
            every = min(2 * every, MAX_VERSION_WAIT_LOG_S)
        arrival.result()
    finally:
        arrival.cancel()  # cancelled itself (a lost lease, a shutdown): the shared wait goes on for the others


async def agent_proxy_of(ctx: RolloutContext) -> AgentProxy:
    """The process's recording proxy, started once, in the episodes' event loop."""
    async with ctx._agent_proxy_lock:
        if ctx.agent_proxy is None:
            rollout = ctx.settings.rollout
            proxy = AgentProxy(ctx.inference, ctx.chat, ctx.settings.inference.model, rollout.sampling.temperature,
                               rollout.sampling.top_p, socket_dir=rollout.agent_socket_dir / f"w{os.getpid()}",
                               limits=rollout.agent_proxy)
            await proxy.start()
            ctx.agent_proxy = proxy
        return ctx.agent_proxy


def upload_bundle(ctx: RolloutContext, finished: list[FinishedEpisode]) -> list[HandedOn]:
    """Write finished trajectories as one object per run (a bundle; artifacts keep objects of
    their own, which the episode drivers wrote), except the small ones carried inline
    (``shared.inline_trajectories``), then move each to ``uploaded`` with its scoring task (and
    an inline one with itself) stored, in one pipelined round trip; each one's task comes back to
    be sent (batched) when the move was its attempt's."""
    by_run: dict[str, list[FinishedEpisode]] = {}
    for trajectory, token in finished:
        by_run.setdefault(trajectory.request.run_id, []).append((trajectory, token))
    handed_on: dict[str, HandedOn] = {}
    for members in by_run.values():
        inline = {t.trajectory_id: text for t, _ in members
                  if (text := inline_json(t, ctx.settings.ledger.inline_max_bytes)) is not None}
        t0 = time.perf_counter()
        refs = {t.trajectory_id: inline_ref(t) for t, _ in members if t.trajectory_id in inline}
        refs |= _put_objects(ctx.store, [(t, token) for t, token in members if t.trajectory_id not in inline])
        upload_s = time.perf_counter() - t0
        scorings = [ScoringTask(trajectory_id=t.trajectory_id, trajectory_key=refs[t.trajectory_id], upload_s=upload_s) for t, _ in members]
        moves = ctx.ledger.mark_uploaded_many([(s.trajectory_id, token, s.model_dump_json()) for s, (_, token) in zip(scorings, members)],
                                              send_within_s=ctx.settings.ledger.lease_ttl_s + ctx.settings.rollout.scoring_linger_s,
                                              inline=inline)
        for (trajectory, _), scoring, moved in zip(members, scorings, moves):
            handed_on[trajectory.trajectory_id] = _after_upload(ctx, trajectory, scoring, moved)
    return [handed_on[trajectory.trajectory_id] for trajectory, _ in finished]


def _put_objects(store: ObjectStore, members: list[FinishedEpisode]) -> dict[str, str]:
    """One run's trajectories as one bundle named after its first member's attempt; trajectory id -> its ref."""
    if not members:
        return {}
    first, first_token = members[0]
    key = trajectory_bundle_key(first.request.run_id, first.request.group_id, first.trajectory_id, first.attempt, first_token)
    refs = put_bundle(store, key, [trajectory for trajectory, _ in members])  # artifacts: their drivers wrote them
    return {trajectory.trajectory_id: ref for (trajectory, _), ref in zip(members, refs)}


def upload_and_score(ctx: RolloutContext, finished: list[FinishedEpisode]) -> list[HandedOn]:
    """``upload_bundle``, then, with ``ctx.worker_scoring``, the scoring of what it moved: each
    trajectory scored here hands on no scoring task."""
    handed_on = upload_bundle(ctx, finished)
    if ctx.worker_scoring is None:
        return handed_on
    to_send = ctx.worker_scoring.score_uploaded([(trajectory, task) for (trajectory, _), (_, task) in zip(finished, handed_on)])
    return [(result, task) for (result, _), task in zip(handed_on, to_send)]


def _after_upload(ctx: RolloutContext, trajectory: Trajectory, scoring: ScoringTask, moved: TransitionResult) -> HandedOn:
    """What the ledger's move of one uploaded trajectory means for this attempt."""
    request = trajectory.request
    if not moved.ok and moved.state == "uploaded" and ctx.ledger.attempts(request.trajectory_id) == trajectory.attempt:
        # Redis went away with the reply of a move that took: no later attempt was claimed, so
        # the upload is this attempt's own, and its scoring must still be sent
        log.warning("%s: the ledger's reply to the upload was lost; the move was this attempt's", request.trajectory_id)
        moved = TransitionResult(True, "running")
    if not moved.ok and moved.state == "unknown" and ctx.ledger.run_lost(request.run_id):
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
