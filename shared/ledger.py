"""The trajectory ledger in Redis: one state per trajectory, changed only by atomic Lua transitions.

States: queued -> running -> uploaded -> scored -> consumed, or failed(reason) from any
non-terminal state.

Invariants, per run:
- Each trajectory has exactly one state; the per-state counters move in the same Lua call as
  the state, so ``sum(counts) == registered`` at all times and
  ``dispatched == consumed + failed + in flight``.
- A transition names the states it may start from; a redelivered or duplicated message finds
  the trajectory elsewhere and becomes a no-op. This is what makes rollout, scoring and
  consumption idempotent by trajectory id.
- A running trajectory holds a lease (owner token + deadline in the ``leases`` zset). Only the
  lease owner can upload or fail it, so a worker that was presumed dead cannot publish a second
  copy. Workers renew leases by heartbeat; the reaper re-queues trajectories whose lease ran
  out, and fails them after ``max_attempts``.
- Hand-off to the trainer is atomic with the state change: ``mark_scored`` and ``fail`` append
  the TrainerEvent to the run's stream in the same Lua call. An event is never lost or doubled.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import redis

from shared.ids import parse_trajectory_id
from shared.names import RedisKeys
from shared.schemas import RolloutRequest, TrainerEvent, TrajectoryState

STATES = [s.value for s in TrajectoryState]

# KEYS: states, counts, requests, runs ; ARGV: run_id, then (tid, request_json) pairs
_REGISTER = """
local added = 0
redis.call('SADD', KEYS[4], ARGV[1])
for i = 2, #ARGV, 2 do
  if redis.call('HSETNX', KEYS[1], ARGV[i], 'queued') == 1 then
    redis.call('HSET', KEYS[3], ARGV[i], ARGV[i + 1])
    redis.call('HINCRBY', KEYS[2], 'queued', 1)
    added = added + 1
  end
end
return added
"""

# KEYS: states, counts, owners, attempts, leases ; ARGV: tid, token, deadline, max_attempts
# -> {"ok", attempt} | {"skip", state}
_CLAIM = """
local state = redis.call('HGET', KEYS[1], ARGV[1])
if state ~= 'queued' then return {'skip', state or 'unknown'} end
local attempt = redis.call('HINCRBY', KEYS[4], ARGV[1], 1)
redis.call('HSET', KEYS[1], ARGV[1], 'running')
redis.call('HINCRBY', KEYS[2], 'queued', -1)
redis.call('HINCRBY', KEYS[2], 'running', 1)
redis.call('HSET', KEYS[3], ARGV[1], ARGV[2])
redis.call('ZADD', KEYS[5], ARGV[3], ARGV[1])
return {'ok', tostring(attempt)}
"""

# KEYS: states, owners, leases ; ARGV: deadline, then (tid, token) pairs -> renewed count
_HEARTBEAT = """
local renewed = 0
for i = 2, #ARGV, 2 do
  if redis.call('HGET', KEYS[1], ARGV[i]) == 'running' and redis.call('HGET', KEYS[2], ARGV[i]) == ARGV[i + 1] then
    redis.call('ZADD', KEYS[3], 'XX', ARGV[1], ARGV[i])
    renewed = renewed + 1
  end
end
return renewed
"""

# Generic guarded transition.
# KEYS: states, counts, owners, leases, failures, stream
# ARGV: tid, to_state, token ('' = no owner check), failure_reason, event_json ('' = none),
#       then the allowed from-states
# -> {"ok", from_state} | {"skip", state}
_TRANSITION = """
local state = redis.call('HGET', KEYS[1], ARGV[1])
if not state then return {'skip', 'unknown'} end
local allowed = false
for i = 6, #ARGV do if ARGV[i] == state then allowed = true end end
if not allowed then return {'skip', state} end
if ARGV[3] ~= '' and redis.call('HGET', KEYS[3], ARGV[1]) ~= ARGV[3] then
  return {'skip', 'not_owner'}
end
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
redis.call('HINCRBY', KEYS[2], state, -1)
redis.call('HINCRBY', KEYS[2], ARGV[2], 1)
if state == 'running' then
  redis.call('ZREM', KEYS[4], ARGV[1])
  redis.call('HDEL', KEYS[3], ARGV[1])
end
if ARGV[4] ~= '' then redis.call('HSET', KEYS[5], ARGV[1], ARGV[4]) end
if ARGV[5] ~= '' then redis.call('XADD', KEYS[6], '*', 'event', ARGV[5]) end
return {'ok', state}
"""

# KEYS: states, counts, owners, leases, attempts, failures, stream
# ARGV: tid, now, max_attempts, failed_event_json
# -> "requeued" | "failed" | "skip"
_EXPIRE = """
local deadline = redis.call('ZSCORE', KEYS[4], ARGV[1])
if not deadline or tonumber(deadline) > tonumber(ARGV[2]) then return 'skip' end
redis.call('ZREM', KEYS[4], ARGV[1])
if redis.call('HGET', KEYS[1], ARGV[1]) ~= 'running' then return 'skip' end
redis.call('HDEL', KEYS[3], ARGV[1])
redis.call('HINCRBY', KEYS[2], 'running', -1)
local attempts = tonumber(redis.call('HGET', KEYS[5], ARGV[1]) or '0')
if attempts >= tonumber(ARGV[3]) then
  redis.call('HSET', KEYS[1], ARGV[1], 'failed')
  redis.call('HINCRBY', KEYS[2], 'failed', 1)
  redis.call('HSET', KEYS[6], ARGV[1], 'lease_expired after ' .. attempts .. ' attempts')
  redis.call('XADD', KEYS[7], '*', 'event', ARGV[4])
  return 'failed'
end
redis.call('HSET', KEYS[1], ARGV[1], 'queued')
redis.call('HINCRBY', KEYS[2], 'queued', 1)
return 'requeued'
"""


@dataclass(frozen=True)
class TransitionResult:
    ok: bool
    state: str  # the state before the transition when ok; the blocking state otherwise


class Ledger:
    def __init__(self, client: redis.Redis):
        self.redis = client
        self._register = client.register_script(_REGISTER)
        self._claim = client.register_script(_CLAIM)
        self._heartbeat = client.register_script(_HEARTBEAT)
        self._transition = client.register_script(_TRANSITION)
        self._expire = client.register_script(_EXPIRE)

    @classmethod
    def from_url(cls, url: str) -> "Ledger":
        return cls(redis.Redis.from_url(url, decode_responses=True))

    # --- intake -----------------------------------------------------------------------------
    def register(self, requests: list[RolloutRequest]) -> int:
        """Record requests as queued. Already-known trajectory ids are left as they are."""
        if not requests:
            return 0
        run_id = requests[0].run_id
        argv: list[str] = [run_id]
        for req in requests:
            argv += [req.trajectory_id, req.model_dump_json()]
        k = RedisKeys
        keys = [k.states(run_id), k.counts(run_id), k.requests(run_id), k.runs]
        return int(self._register(keys=keys, args=argv))

    # --- rollout worker ---------------------------------------------------------------------
    def claim(self, trajectory_id: str, token: str, lease_ttl_s: float) -> tuple[bool, str]:
        """queued -> running under a fresh lease. Returns (claimed, attempt-or-blocking-state)."""
        run_id = parse_trajectory_id(trajectory_id).run_id
        k = RedisKeys
        keys = [k.states(run_id), k.counts(run_id), k.owners(run_id), k.attempts(run_id), k.leases]
        status, detail = self._claim(keys=keys, args=[trajectory_id, token, time.time() + lease_ttl_s])
        return status == "ok", detail

    def heartbeat(self, leases: dict[str, str], lease_ttl_s: float) -> int:
        """Extend the leases still owned by these (trajectory id -> token); returns how many."""
        by_run: dict[str, list[str]] = {}
        for tid, token in leases.items():
            by_run.setdefault(parse_trajectory_id(tid).run_id, []).extend([tid, token])
        renewed = 0
        deadline = time.time() + lease_ttl_s
        for run_id, pairs in by_run.items():
            keys = [RedisKeys.states(run_id), RedisKeys.owners(run_id), RedisKeys.leases]
            renewed += int(self._heartbeat(keys=keys, args=[deadline, *pairs]))
        return renewed

    def mark_uploaded(self, trajectory_id: str, token: str) -> TransitionResult:
        _require_token(token)
        return self._move(trajectory_id, TrajectoryState.uploaded, [TrajectoryState.running], token=token)

    def requeue(self, trajectory_id: str, token: str) -> TransitionResult:
        """running -> queued by the lease owner, for a fresh attempt after an infra error."""
        _require_token(token)
        return self._move(trajectory_id, TrajectoryState.queued, [TrajectoryState.running], token=token)

    # --- scorer / trainer -------------------------------------------------------------------
    def mark_scored(self, trajectory_id: str, event: TrainerEvent) -> TransitionResult:
        return self._move(trajectory_id, TrajectoryState.scored, [TrajectoryState.uploaded], event=event)

    def mark_consumed(self, trajectory_id: str) -> TransitionResult:
        return self._move(trajectory_id, TrajectoryState.consumed, [TrajectoryState.scored])

    def fail(self, trajectory_id: str, reason: str, token: str | None = None) -> TransitionResult:
        """Any non-terminal state -> failed(reason); tells the trainer. With a token, only the
        lease owner may fail a running trajectory."""
        ids = parse_trajectory_id(trajectory_id)
        event = TrainerEvent(
            kind="failed", trajectory_id=trajectory_id, run_id=ids.run_id, group_id=ids.group_id,
            failure_reason=reason, at=time.time(),
        )
        allowed = [TrajectoryState.running] if token else [
            TrajectoryState.queued, TrajectoryState.running, TrajectoryState.uploaded, TrajectoryState.scored
        ]
        return self._move(trajectory_id, TrajectoryState.failed, allowed, token=token, event=event, reason=reason)

    def _move(
        self,
        trajectory_id: str,
        to: TrajectoryState,
        allowed_from: list[TrajectoryState],
        token: str | None = None,
        event: TrainerEvent | None = None,
        reason: str = "",
    ) -> TransitionResult:
        run_id = parse_trajectory_id(trajectory_id).run_id
        k = RedisKeys
        keys = [k.states(run_id), k.counts(run_id), k.owners(run_id), k.leases, k.failures(run_id), k.trainer_stream(run_id)]
        args = [trajectory_id, to.value, token or "", reason, event.model_dump_json() if event else ""]
        args += [s.value for s in allowed_from]
        status, detail = self._transition(keys=keys, args=args)
        return TransitionResult(status == "ok", detail)

    # --- reaper -----------------------------------------------------------------------------
    def expired_leases(self, now: float | None = None, limit: int = 500) -> list[str]:
        now = time.time() if now is None else now
        return self.redis.zrangebyscore(RedisKeys.leases, "-inf", now, start=0, num=limit)

    def expire(self, trajectory_id: str, max_attempts: int, now: float | None = None) -> str:
        """Lease ran out: 'requeued' (publish the request again), 'failed', or 'skip'."""
        ids = parse_trajectory_id(trajectory_id)
        now = time.time() if now is None else now
        event = TrainerEvent(
            kind="failed", trajectory_id=trajectory_id, run_id=ids.run_id, group_id=ids.group_id,
            failure_reason=f"lease_expired after {max_attempts} attempts", at=now,
        )
        k = RedisKeys
        run = ids.run_id
        keys = [k.states(run), k.counts(run), k.owners(run), k.leases, k.attempts(run), k.failures(run), k.trainer_stream(run)]
        return self._expire(keys=keys, args=[trajectory_id, now, max_attempts, event.model_dump_json()])

    # --- reads ------------------------------------------------------------------------------
    def request(self, trajectory_id: str) -> RolloutRequest:
        run_id = parse_trajectory_id(trajectory_id).run_id
        raw = self.redis.hget(RedisKeys.requests(run_id), trajectory_id)
        if raw is None:
            raise KeyError(f"no rollout request recorded for {trajectory_id}")
        return RolloutRequest.model_validate_json(raw)

    def state(self, trajectory_id: str) -> str | None:
        return self.redis.hget(RedisKeys.states(parse_trajectory_id(trajectory_id).run_id), trajectory_id)

    def states(self, run_id: str) -> dict[str, str]:
        return self.redis.hgetall(RedisKeys.states(run_id))

    def failure_reasons(self, run_id: str) -> dict[str, str]:
        return self.redis.hgetall(RedisKeys.failures(run_id))

    def attempts(self, trajectory_id: str) -> int:
        run_id = parse_trajectory_id(trajectory_id).run_id
        return int(self.redis.hget(RedisKeys.attempts(run_id), trajectory_id) or 0)

    def counts(self, run_id: str) -> dict[str, int]:
        raw = self.redis.hgetall(RedisKeys.counts(run_id))
        return {state: int(raw.get(state, 0)) for state in STATES}

    def runs(self) -> list[str]:
        return sorted(self.redis.smembers(RedisKeys.runs))


def _require_token(token: str) -> None:
    if not token:
        raise ValueError("a lease token is required: an empty one would skip the owner check")
