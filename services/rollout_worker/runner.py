"""Runs a batch of rollout requests (a GRPO group, or the members of one being re-dispatched)
concurrently in one event loop, and hands each finished trajectory on.

Invariants, per trajectory:
- It runs only if this worker won the ledger claim (queued -> running); a redelivered or
  duplicated request is skipped.
- The trajectory object is written before the ledger moves to ``uploaded``, under a key that
  carries the attempt, so an attempt presumed dead can never overwrite the attempt that won.
- Only the lease owner moves it on; then exactly one scoring task is published.
- ``infra_error`` puts it back in the queue (a fresh attempt) while attempts remain;
  ``env_error`` fails it with its reason. Nothing is dropped silently.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from dataclasses import dataclass
from typing import Callable

from services.rollout_worker.chat_tokens import ChatTokens
from services.rollout_worker.environments.coding.artifacts import write_artifacts
from services.rollout_worker.episode import EpisodeLimits, run_episode
from services.rollout_worker.inference_client import InferenceClient
from services.rollout_worker.leases import LeaseKeeper
from shared.ledger import Ledger
from shared.names import RedisKeys, trajectory_key
from shared.schemas import RolloutRequest, StopReason, Trajectory, TrajectoryState
from shared.settings import Settings
from shared.storage import ObjectStore, put_model

log = logging.getLogger(__name__)


@dataclass
class RolloutContext:
    settings: Settings
    ledger: Ledger
    store: ObjectStore
    leases: LeaseKeeper
    chat: ChatTokens
    enqueue_scoring: Callable[[str, str, float], None]  # (trajectory_id, object key, upload_s)
    redispatch: Callable[[RolloutRequest], None]
    worker_name: str
    inference: InferenceClient  # shared by every episode of the process (one event loop)


async def run_requests(ctx: RolloutContext, requests: list[RolloutRequest]) -> dict[str, str]:
    """Returns trajectory id -> what happened ("uploaded", "failed:...", "skipped:<state>")."""
    outcomes = await asyncio.gather(*(_run_one(ctx, ctx.inference, r) for r in requests))
    return dict(zip((r.trajectory_id for r in requests), outcomes))


async def _run_one(ctx: RolloutContext, client: InferenceClient, request: RolloutRequest) -> str:
    tid = request.trajectory_id
    token = uuid.uuid4().hex
    claimed, detail = await asyncio.to_thread(ctx.ledger.claim, tid, token, ctx.settings.ledger.lease_ttl_s)
    if not claimed:
        log.info("skip %s: already %s", tid, detail)
        return f"skipped:{detail}"
    attempt = int(detail)
    ctx.leases.hold(tid, token)
    try:
        limits = EpisodeLimits.from_settings(ctx.settings.rollout, ctx.settings.inference.max_model_len, request.task.env_config)
        version_key = RedisKeys.policy_version(request.run_id)
        trajectory = await run_episode(
            request, client, ctx.chat, limits,
            policy_version=lambda: int(ctx.ledger.redis.get(version_key) or 0),
            attempt=attempt, worker=ctx.worker_name,
        )
        return await asyncio.to_thread(_hand_on, ctx, trajectory, token)
    except Exception as exc:  # a bug or a storage outage: keep the trajectory accounted for
        log.exception("rollout of %s failed", tid)
        return await asyncio.to_thread(_retry_or_fail, ctx, request, token, attempt, f"infra_error: {type(exc).__name__}: {exc}")
    finally:
        ctx.leases.release(tid)


def _hand_on(ctx: RolloutContext, trajectory: Trajectory, token: str) -> str:
    request = trajectory.request
    key = trajectory_key(request.run_id, request.group_id, request.trajectory_id).replace(
        ".json.gz", f".a{trajectory.attempt}.json.gz"
    )
    t0 = time.perf_counter()
    put_model(ctx.store, key, trajectory)
    if "diff" in trajectory.env_info:  # a sandboxed environment's diff, test output and command log
        write_artifacts(ctx.store, request.run_id, request.trajectory_id, trajectory.env_info)
    upload_s = time.perf_counter() - t0
    if trajectory.stop_reason is StopReason.infra_error:
        return _retry_or_fail(ctx, request, token, trajectory.attempt, f"infra_error: {trajectory.error}")
    if trajectory.stop_reason is StopReason.env_error:
        ctx.ledger.fail(request.trajectory_id, f"env_error: {trajectory.error}", token=token)
        return "failed:env_error"
    moved = ctx.ledger.mark_uploaded(request.trajectory_id, token)
    if not moved.ok:
        log.warning("%s: lost the lease before upload (%s); this attempt's result is dropped", request.trajectory_id, moved.state)
        return f"skipped:{moved.state}"
    ctx.enqueue_scoring(request.trajectory_id, key, upload_s)
    return TrajectoryState.uploaded.value


def _retry_or_fail(ctx: RolloutContext, request: RolloutRequest, token: str, attempt: int, reason: str) -> str:
    if attempt < ctx.settings.ledger.max_attempts:
        moved = ctx.ledger.requeue(request.trajectory_id, token)
        if moved.ok:
            ctx.redispatch(request)
            return "requeued"
        return f"skipped:{moved.state}"
    ctx.ledger.fail(request.trajectory_id, f"{reason} (after {attempt} attempts)", token=token)
    return "failed:infra_error"
