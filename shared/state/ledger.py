"""The trajectory ledger in Redis: one state per trajectory, changed only by atomic Lua
transitions (``shared.state.ledger_lua``).

States: queued -> running -> uploaded -> scored -> consumed, or failed(reason) from any
non-terminal state.

Invariants, per run:
- Each trajectory has exactly one state; the per-state counters move in the same Lua call as
  the state, so ``sum(counts) == registered`` at all times and
  ``dispatched == consumed + failed + in flight``.
- A transition names the states it may start from; a redelivered or duplicated message finds
  the trajectory elsewhere and becomes a no-op. This is what makes rollout, scoring and
  consumption idempotent by trajectory id.
- Every stage that holds work holds it under a lease (a ``LeaseStage``: owner token + deadline
  in the stage's zset): rollout holds ``running`` trajectories, scoring holds ``uploaded`` ones.
  At most one attempt per stage holds a trajectory; only its owner can move it on, so a worker
  presumed dead cannot publish a second copy. Leaving the held state ends the lease in the same
  Lua call. Workers renew leases by heartbeat; the reaper (``shared.state.leases``) puts a
  trajectory whose lease ran out back where the stage claims from, to be re-dispatched, and
  fails it after ``max_attempts`` attempts of that stage. An owner that stops before its
  work is done (its worker shuts down) hands the trajectory back (``hand_back``): to the
  state its stage claims from, the lease ended and the attempt not counted, in one Lua call.
- Every state that holds work has a deadline in its stage's lease zset, written in the same Lua
  call as the state: a lease (``running``; ``uploaded`` being scored) or, for a trajectory
  waiting to be claimed (``queued``; ``uploaded`` not yet claimed by a scorer), a dispatch
  deadline with no owner. Registration, a requeue, a hand-back, an expired lease, ``conveyor
  retry`` and the upload each arm it; only a claim (which replaces it with a lease) or leaving
  the state ends it. A message that never reached a holder (its sender died before sending; the
  broker took it off its queue and its receiver died before recording the delivery; Redis
  restarted and lost the last second of writes) is therefore sent again by the stage's reaper
  once the deadline passes, whatever else was lost. The upload's deadline is short (the sender
  batches for at most ``rollout.scoring_linger_s``); once the batch is sent (``scoring_sent``) it
  moves ``dispatch_ttl_s`` ahead. A deadline that passes while the stage's broker queue still
  holds messages moves ``dispatch_ttl_s`` ahead instead, nothing sent: the message may be
  waiting there, and a copy would only join the back of the same queue. So a message only
  waiting (behind a backlog, or while an outage of Redis stalled every worker) is not copied,
  and a lost one goes out again once its queue is empty. Each re-send of an unclaimed
  trajectory doubles the next wait (up to 32x); every copy beyond the first is a no-op at the
  claim. So nothing waiting lives only in a process's memory or only in the broker.
- Registering a run's trajectories records the run's marker (``shared.state.run_marker``) in the
  same Lua call, so Redis never holds a run's trajectories without its marker.
- Hand-off to the trainer is atomic with the state change: ``mark_scored`` and ``fail`` append
  the TrainerEvent to the run's stream in the same Lua call. An event is never lost or doubled.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable, cast

import redis

from shared import ids
from shared.state import ledger_lua
from shared.ids import parse_trajectory_id
from shared.names import ROLLOUT_QUEUE, SCORING_QUEUE, RedisKeys
from shared.outage import redis_client, seconds_since_recovery
from shared.state.redis_scripts import ScriptCall, run_pipelined
from shared.state.run_marker import RedisDataLost, RunMarker, lost_message, marker_value, refuse_lost_run
from shared.state.trainer_stream import stream_key
from shared.schemas import FailedEvent, RolloutRequest, ScoredEvent, TrajectoryState
from shared.settings import LedgerSettings, OutageSettings

STATES = [s.value for s in TrajectoryState]
UNFINISHED = [TrajectoryState.queued, TrajectoryState.running, TrajectoryState.uploaded, TrajectoryState.scored]


@dataclass(frozen=True)
class LeaseStage:
    """A stage that holds a trajectory under a lease: it claims it in ``claim_from`` and holds
    it in ``held``; an expired lease puts it back in ``claim_from`` for a re-dispatch of the
    ``payload`` stored for it."""

    name: str
    claim_from: TrajectoryState
    held: TrajectoryState
    expired_reason: str  # failure reason once the lease expired max_attempts times
    leases: str  # zset trajectory id -> deadline, all runs
    owners: Callable[[str], str]  # run id -> hash trajectory id -> token
    attempts: Callable[[str], str]  # run id -> hash trajectory id -> attempts started
    payloads: Callable[[str], str]  # run id -> hash trajectory id -> what a re-dispatch publishes
    resends: Callable[[str], str]  # run id -> hash trajectory id -> re-sends since the last claim
    queue: str  # the broker queue its messages wait in (a Redis list: kombu's Redis transport)


ROLLOUT = LeaseStage(
    "rollout", TrajectoryState.queued, TrajectoryState.running, "lease_expired",
    RedisKeys.leases, RedisKeys.owners, RedisKeys.attempts, RedisKeys.requests, RedisKeys.resends, ROLLOUT_QUEUE,
)
SCORING = LeaseStage(  # the payload is the scoring task's argument list, as JSON
    "scoring", TrajectoryState.uploaded, TrajectoryState.uploaded, "scoring_lease_expired",
    RedisKeys.scoring_leases, RedisKeys.scoring_owners, RedisKeys.scoring_attempts, RedisKeys.scoring_tasks,
    RedisKeys.scoring_resends, SCORING_QUEUE,
)
LEASE_STAGES = (ROLLOUT, SCORING)  # each holds a different state


@dataclass(frozen=True)
class TransitionResult:
    ok: bool
    state: str  # the state before the transition when ok; the blocking state otherwise


DEFAULT_DISPATCH_TTL_S = LedgerSettings().dispatch_ttl_s


def redis_for(url: str, outage: OutageSettings | None = None) -> redis.Redis:
    """A client for the ledger and the other owners of Redis state. With ``outage`` (a
    long-running service), every call waits out an outage of Redis (``shared.outage``); without,
    a call fails at once (a one-shot command)."""
    return redis_client(url, outage) if outage is not None else redis.Redis.from_url(url, decode_responses=True)


class Ledger:
    def __init__(self, client: redis.Redis, dispatch_ttl_s: float = DEFAULT_DISPATCH_TTL_S):
        """``dispatch_ttl_s``: how long a trajectory may wait to be claimed before its message is
        presumed lost and sent again (``ledger.dispatch_ttl_s``)."""
        self.redis = client
        self.dispatch_ttl_s = dispatch_ttl_s
        self._register = client.register_script(ledger_lua.REGISTER)
        self._claim = client.register_script(ledger_lua.CLAIM)
        self._heartbeat = client.register_script(ledger_lua.HEARTBEAT)
        self._transition = client.register_script(ledger_lua.TRANSITION)
        self._expire = client.register_script(ledger_lua.EXPIRE)
        self._hand_back = client.register_script(ledger_lua.HAND_BACK)
        self._sent = client.register_script(ledger_lua.SENT)

    @classmethod
    def from_url(cls, url: str, outage: OutageSettings | None = None,
                 dispatch_ttl_s: float = DEFAULT_DISPATCH_TTL_S) -> "Ledger":
        """With ``outage``, a ledger whose calls wait out an outage of Redis: ``redis_for``."""
        return cls(redis_for(url, outage), dispatch_ttl_s)

    def dispatch_deadline(self, now: float | None = None) -> float:
        """When a trajectory entering a claim-from state now must have been claimed."""
        return (time.time() if now is None else now) + self.dispatch_ttl_s

    # --- intake -----------------------------------------------------------------------------
    def register(self, requests: list[RolloutRequest], require_marker: bool = False) -> int:
        """Record requests as queued, and the run's marker (``shared.state.run_marker``) if it has
        none. Already-known trajectory ids are left as they are. With ``require_marker`` (a run
        intake opened), a run whose marker is gone is refused: ``RedisDataLost``."""
        if not requests:
            return 0
        run_id = requests[0].run_id
        argv: list[str] = [run_id, marker_value(run_id), "1" if require_marker else "0", repr(self.dispatch_deadline())]
        for req in requests:
            argv += [req.trajectory_id, req.model_dump_json()]
        k = RedisKeys
        keys = [k.states(run_id), k.counts(run_id), k.requests(run_id), k.runs, RunMarker(self.redis, run_id).key,
                ROLLOUT.leases]
        added = int(self._register(keys=keys, args=argv))
        if added < 0:
            raise RedisDataLost(lost_message(run_id, "intake saw it when it opened the run", "registers nothing more of it"))
        return added

    # --- leases (rollout worker, scorer) ----------------------------------------------------
    def claim(
        self, trajectory_id: str, token: str, lease_ttl_s: float, stage: LeaseStage = ROLLOUT, payload: str = ""
    ) -> tuple[bool, str]:
        """Take the stage's lease (``claim_from`` -> ``held``); ``payload``, if given, is what the
        reaper re-dispatches. Returns (claimed, attempt-or-blocking-state)."""
        return self.claim_many([(trajectory_id, token, payload)], lease_ttl_s, stage)[0]

    def claim_many(self, claims: list[tuple[str, str, str]], lease_ttl_s: float,
                   stage: LeaseStage = ROLLOUT) -> list[tuple[bool, str]]:
        """``claim`` for each (trajectory id, token, payload), pipelined: one round trip for a
        whole group or scoring batch. Each claim is its own atomic call, as if made alone."""
        deadline = time.time() + lease_ttl_s
        calls = []
        for trajectory_id, token, payload in claims:
            run = parse_trajectory_id(trajectory_id).run_id
            keys = [RedisKeys.states(run), RedisKeys.counts(run), stage.owners(run), stage.leases, stage.attempts(run),
                    stage.payloads(run), stage.resends(run)]
            args = [trajectory_id, token, deadline, stage.claim_from.value, stage.held.value, payload]
            calls.append(ScriptCall(self._claim, keys, args))
        return [(status == "ok", detail) for status, detail in run_pipelined(self.redis, calls)]

    def heartbeat(self, leases: dict[str, str], lease_ttl_s: float, stage: LeaseStage = ROLLOUT) -> int:
        """Extend the leases still owned by these (trajectory id -> token); returns how many."""
        return len(leases) - len(self.renew(leases, lease_ttl_s, stage))

    def renew(self, leases: dict[str, str], lease_ttl_s: float, stage: LeaseStage = ROLLOUT) -> list[str]:
        """Extend the leases still owned by these (trajectory id -> token); returns the ids that
        are no longer theirs (failed meanwhile, e.g. superseded, or expired and claimed again)."""
        by_run: dict[str, list[str]] = {}
        for tid, token in leases.items():
            by_run.setdefault(parse_trajectory_id(tid).run_id, []).extend([tid, token])
        lost: list[str] = []
        deadline = time.time() + lease_ttl_s
        for run, pairs in by_run.items():
            keys = [RedisKeys.states(run), stage.owners(run), stage.leases]
            lost += [_text(tid) for tid in self._heartbeat(keys=keys, args=[deadline, stage.held.value, *pairs])]
        return lost

    def expired_leases(self, now: float | None = None, limit: int = 500, stage: LeaseStage = ROLLOUT) -> list[str]:
        now = time.time() if now is None else now
        return cast(list[str], self.redis.zrangebyscore(stage.leases, "-inf", now, start=0, num=limit))

    def expire(self, trajectory_id: str, max_attempts: int, now: float | None = None, stage: LeaseStage = ROLLOUT,
               forgive_before: float = 0.0) -> str:
        """A deadline passed. A lease: 'requeued' (publish the payload again) or 'failed'. A
        dispatch deadline of a trajectory still unclaimed: 'resent' (publish the payload again;
        no attempt counts), or 'waiting' while the stage's broker queue holds messages (its own
        may be among them: the deadline moves ahead, nothing is sent). Else 'skip'. A lease whose deadline is before ``forgive_before``
        (it was last renewed before Redis restarted) does not count its attempt."""
        ids = parse_trajectory_id(trajectory_id)
        now = time.time() if now is None else now
        reason = f"{stage.expired_reason} after {max_attempts} attempts"
        event = FailedEvent(
            trajectory_id=trajectory_id, run_id=ids.run_id, group_id=ids.group_id, failure_reason=reason, at=now,
        )
        k, run = RedisKeys, ids.run_id
        keys = [k.states(run), k.counts(run), stage.owners(run), stage.leases, stage.attempts(run), k.failures(run),
                stream_key(run), stage.resends(run), stage.queue]
        args: list[str | float] = [trajectory_id, now, max_attempts, event.model_dump_json(), stage.held.value, stage.claim_from.value,
                stage.expired_reason, self.dispatch_ttl_s, repr(forgive_before)]
        return self._expire(keys=keys, args=args)

    # --- transitions ------------------------------------------------------------------------
    def mark_uploaded(self, trajectory_id: str, token: str, scoring_payload: str = "",
                      send_within_s: float = 0.0) -> TransitionResult:
        """running -> uploaded by the rollout lease's owner. With ``scoring_payload``, the same
        call stores the scoring task and a send-by entry ``send_within_s`` ahead in the scoring
        lease zset: a scoring message not sent by then (the sender died; ``scoring_sent``
        clears the entry) is sent by the scoring reaper from the stored payload."""
        return self.mark_uploaded_many([(trajectory_id, token, scoring_payload)], send_within_s)[0]

    def mark_uploaded_many(self, moves: list[tuple[str, str, str]], send_within_s: float = 0.0) -> list[TransitionResult]:
        """``mark_uploaded`` for each (trajectory id, token, scoring payload), pipelined: one round
        trip for a bundle's members; each move is its own atomic call, by its own lease token."""
        send_by = time.time() + send_within_s
        for _, token, _ in moves:
            _require_token(token)
        return self._run_moves([
            self._move_call(trajectory_id, TrajectoryState.uploaded, [TrajectoryState.running], token=token,
                            next_payload=scoring_payload, send_by=send_by if scoring_payload else 0.0)
            for trajectory_id, token, scoring_payload in moves
        ])

    def scoring_sent(self, trajectory_ids: list[str]) -> int:
        """The scoring messages of these trajectories are out: their send-by deadlines move
        ``dispatch_ttl_s`` ahead, for a scorer to claim them (one call per run, pipelined; a
        scorer's lease that replaced an entry stays)."""
        by_run: dict[str, list[str]] = {}
        for tid in trajectory_ids:
            by_run.setdefault(parse_trajectory_id(tid).run_id, []).append(tid)
        deadline = repr(self.dispatch_deadline())
        calls = [ScriptCall(self._sent, [SCORING.owners(run), SCORING.leases], [deadline, *tids]) for run, tids in by_run.items()]
        return sum(run_pipelined(self.redis, calls))

    def requeue(self, trajectory_id: str, token: str) -> TransitionResult:
        """running -> queued by the lease owner, for a fresh attempt after an infra error (with
        its dispatch deadline: the owner publishes the request next)."""
        _require_token(token)
        return self._move(trajectory_id, TrajectoryState.queued, [TrajectoryState.running], token=token,
                          send_by=self.dispatch_deadline())

    def hand_back(self, trajectory_id: str, token: str, stage: LeaseStage = ROLLOUT) -> TransitionResult:
        """held -> claim_from by the lease owner, the attempt not counted: its worker is
        shutting down before the work was done (publish the payload again)."""
        _require_token(token)
        run = parse_trajectory_id(trajectory_id).run_id
        keys = [RedisKeys.states(run), RedisKeys.counts(run), stage.owners(run), stage.leases, stage.attempts(run)]
        args = [trajectory_id, token, stage.held.value, stage.claim_from.value, repr(self.dispatch_deadline())]
        status, detail = self._hand_back(keys=keys, args=args)
        return TransitionResult(status == "ok", detail)

    def mark_scored(self, trajectory_id: str, event: ScoredEvent, token: str | None = None) -> TransitionResult:
        """uploaded -> scored, appending the event; with a token, only by the scoring lease's owner."""
        return self.mark_scored_many([(trajectory_id, event, token)])[0]

    def mark_scored_many(self, moves: list[tuple[str, ScoredEvent, str | None]]) -> list[TransitionResult]:
        """``mark_scored`` for each (trajectory id, event, token), pipelined: one round trip for a
        scoring batch; each move is its own atomic call."""
        return self._run_moves([
            self._move_call(trajectory_id, TrajectoryState.scored, [TrajectoryState.uploaded], token=token, event=event)
            for trajectory_id, event, token in moves
        ])

    def mark_consumed(self, trajectory_id: str) -> TransitionResult:
        return self.mark_consumed_many([trajectory_id])[0]

    def mark_consumed_many(self, trajectory_ids: list[str]) -> list[TransitionResult]:
        """scored -> consumed for each, pipelined: one round trip for a decided group's
        members; each move is its own atomic call."""
        return self._run_moves([self._move_call(tid, TrajectoryState.consumed, [TrajectoryState.scored])
                                for tid in trajectory_ids])

    def fail(self, trajectory_id: str, reason: str, token: str | None = None) -> TransitionResult:
        """Any non-terminal state -> failed(reason); tells the trainer. With a token, only the
        owner of the lease holding the trajectory may fail it."""
        allowed = [stage.held for stage in LEASE_STAGES] if token else UNFINISHED
        return self._run_moves([self._fail_call(trajectory_id, reason, allowed, token)])[0]

    def fail_many(self, trajectory_ids: list[str], reason: str, allowed_from: list[TrajectoryState]) -> list[TransitionResult]:
        """Each of these still in one of ``allowed_from`` -> failed(reason), no owner check (a
        lease holder finds its lease gone at its next heartbeat); pipelined, each move its own
        atomic call."""
        return self._run_moves([self._fail_call(tid, reason, allowed_from) for tid in trajectory_ids])

    def _fail_call(self, trajectory_id: str, reason: str, allowed_from: list[TrajectoryState],
                   token: str | None = None) -> ScriptCall:
        ids = parse_trajectory_id(trajectory_id)
        event = FailedEvent(
            trajectory_id=trajectory_id, run_id=ids.run_id, group_id=ids.group_id, failure_reason=reason, at=time.time(),
        )
        return self._move_call(trajectory_id, TrajectoryState.failed, allowed_from, token=token, event=event, reason=reason)

    def _move(self, trajectory_id: str, to: TrajectoryState, allowed_from: list[TrajectoryState],
              **details: Any) -> TransitionResult:
        """The guarded transition, run alone (``_move_call`` names the details)."""
        return self._run_moves([self._move_call(trajectory_id, to, allowed_from, **details)])[0]

    def _run_moves(self, calls: list[ScriptCall]) -> list[TransitionResult]:
        return [TransitionResult(status == "ok", detail) for status, detail in run_pipelined(self.redis, calls)]

    def _move_call(
        self,
        trajectory_id: str,
        to: TrajectoryState,
        allowed_from: list[TrajectoryState],
        token: str | None = None,
        event: ScoredEvent | FailedEvent | None = None,
        reason: str = "",
        next_payload: str = "",
        send_by: float = 0.0,
    ) -> ScriptCall:
        """The guarded transition's script call, to be run alone or pipelined with others."""
        run = parse_trajectory_id(trajectory_id).run_id
        k = RedisKeys
        following = next((stage for stage in LEASE_STAGES if stage.claim_from is to), ROLLOUT)
        keys = [k.states(run), k.counts(run), k.failures(run), stream_key(run), following.payloads(run), following.leases]
        for stage in LEASE_STAGES:
            keys += [stage.owners(run), stage.leases]
        args = [trajectory_id, to.value, token or "", reason, event.model_dump_json() if event else ""]
        args += [",".join(s.value for s in allowed_from), next_payload, repr(send_by)]
        for stage in LEASE_STAGES:
            args += [stage.held.value, stage.claim_from.value]
        return ScriptCall(self._transition, keys, args)

    # --- reads ------------------------------------------------------------------------------
    # The client decodes replies (``decode_responses=True``, as ``from_url`` and ``redis_client``
    # make it), which redis-py's types cannot express: the casts below name the str it returns.
    def payload(self, trajectory_id: str, stage: LeaseStage = ROLLOUT) -> str:
        run_id = parse_trajectory_id(trajectory_id).run_id
        raw = self.redis.hget(stage.payloads(run_id), trajectory_id)
        if raw is None:
            raise KeyError(f"no {stage.name} payload recorded for {trajectory_id}")
        return cast(str, raw)

    def unclaimed_group_members(self, request: RolloutRequest) -> dict[str, str]:
        """Trajectory id -> stored request of the members of ``request``'s group that still wait
        in ``queued`` with no rollout lease (the request itself excluded). Reads only the group's
        own fields: the member ids follow from the request (``shared.ids``)."""
        task_seed = request.task_seed
        members = [ids.trajectory_id(request.run_id, request.group_id, index, task_seed + index)
                   for index in range(request.group_size) if index != request.episode_index]
        if not members:
            return {}
        run = request.run_id
        states = self.redis.hmget(RedisKeys.states(run), members)
        owners = self.redis.hmget(ROLLOUT.owners(run), members)
        waiting = [t for t, state, owner in zip(members, states, owners) if state == ROLLOUT.claim_from.value and owner is None]
        payloads = self.redis.hmget(ROLLOUT.payloads(run), waiting) if waiting else []
        return {t: cast(str, p) for t, p in zip(waiting, payloads) if p is not None}

    def request(self, trajectory_id: str) -> RolloutRequest:
        return RolloutRequest.model_validate_json(self.payload(trajectory_id, ROLLOUT))

    def state(self, trajectory_id: str) -> str | None:
        return cast(str | None, self.redis.hget(RedisKeys.states(parse_trajectory_id(trajectory_id).run_id), trajectory_id))

    def states(self, run_id: str) -> dict[str, str]:
        return cast(dict[str, str], self.redis.hgetall(RedisKeys.states(run_id)))

    def failure_reasons(self, run_id: str) -> dict[str, str]:
        return cast(dict[str, str], self.redis.hgetall(RedisKeys.failures(run_id)))

    def record(self, trajectory_id: str) -> tuple[str | None, str | None, str | None]:
        """The trajectory's state, failure reason and scoring task arguments (JSON), or None each."""
        run = parse_trajectory_id(trajectory_id).run_id
        fields = (RedisKeys.states(run), RedisKeys.failures(run), RedisKeys.scoring_tasks(run))
        state, failure, task = (cast(str | None, self.redis.hget(key, trajectory_id)) for key in fields)
        return state, failure, task

    def failures_scan(self, run_id: str, cursor: int, count: int) -> tuple[int, list[tuple[str, str, int]]]:
        """One HSCAN step over the run's failures: the next cursor and (trajectory id, reason, attempts)."""
        cursor, batch = cast(tuple[int, dict[str, str]], self.redis.hscan(RedisKeys.failures(run_id), cursor=cursor, count=count))
        attempts = cast(list[str | None], self.redis.hmget(RedisKeys.attempts(run_id), list(batch))) if batch else []
        return cursor, [(tid, reason, int(tries or 0)) for (tid, reason), tries in zip(batch.items(), attempts)]

    def retry_keys(self, run_id: str) -> list[str]:
        """The ledger's keys ``ledger_lua.RETRY_GROUP`` changes, in its KEYS order."""
        k = RedisKeys
        return [k.states(run_id), k.counts(run_id), k.failures(run_id), k.attempts(run_id), k.scoring_attempts(run_id)]

    def attempts(self, trajectory_id: str, stage: LeaseStage = ROLLOUT) -> int:
        run_id = parse_trajectory_id(trajectory_id).run_id
        return int(self.redis.hget(stage.attempts(run_id), trajectory_id) or 0)

    def lease_deadline(self, trajectory_id: str, stage: LeaseStage = ROLLOUT) -> float | None:
        return self.redis.zscore(stage.leases, trajectory_id)

    def lease_owner(self, trajectory_id: str, stage: LeaseStage = ROLLOUT) -> str | None:
        return cast(str | None, self.redis.hget(stage.owners(parse_trajectory_id(trajectory_id).run_id), trajectory_id))

    def counts(self, run_id: str) -> dict[str, int]:
        raw = self.redis.hgetall(RedisKeys.counts(run_id))
        return {state: int(raw.get(state, 0)) for state in STATES}

    def runs(self) -> list[str]:
        return sorted(cast(set[str], self.redis.smembers(RedisKeys.runs)))

    def retried(self, run_id: str, stage: LeaseStage = ROLLOUT) -> int:
        """How many of the run's trajectories the stage started more than once."""
        return sum(int(n) > 1 for n in self.redis.hvals(stage.attempts(run_id)))

    def has_run(self, run_id: str) -> bool:
        return bool(self.redis.sismember(RedisKeys.runs, run_id))

    def run_lost(self, run_id: str) -> bool:
        """Whether Redis lost the run (its marker is gone): ``shared.state.run_marker.refuse_lost_run``."""
        return refuse_lost_run(self.redis, run_id)

    # --- the Redis server that holds the ledger ---------------------------------------------
    def server_uptime_s(self) -> float:
        """How long the Redis server now answering has run (whole seconds, from its process's start)."""
        return float(self.redis.info("server").get("uptime_in_seconds", "inf"))

    def seconds_since_recovery(self) -> float:
        """Since this process last saw the ledger's Redis come back (inf: never saw it down)."""
        return seconds_since_recovery(self.redis)


def _require_token(token: str) -> None:
    if not token:
        raise ValueError("a lease token is required: an empty one would skip the owner check")


def _text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else value
