"""The ledger's transitions (``Ledger``): every change of a trajectory's state, each one atomic
Lua call (``shared.state.ledger_lua``); the invariants are the ledger's (``shared.state.ledger``).

Invariants:
- A transition names the states it may start from, and a lease-held move names its owner's token:
  a copy of a move finds the trajectory elsewhere (or the lease another's) and is a no-op.
- A pipelined batch (``*_many``) runs each move as its own atomic call, as if made alone.
- Every state entered that waits to be claimed gets its dispatch deadline (``dispatch_ttl_s``
  ahead) in the same call; a lease-held state gets its lease.
- ``Ledger`` reads as ``LedgerReads`` does (``shared.state.ledger.reads``); it adds only writes.
- On a Redis Cluster, a registration or a guarded transition (``_run_moves``) returns only once
  the run's master has it on its replica, or has none a failover could promote
  (``shared.state.replica_ack``): an acknowledged write survives a failover.
"""

from __future__ import annotations

import time
from typing import Any, Mapping

import redis

from shared.state import ledger_lua
from shared.ids import parse_trajectory_id
from shared.names import RedisKeys
from shared.redis_clients import redis_for
from shared.state.ledger.reads import LedgerReads
from shared.state.ledger.stages import LEASE_STAGES, ROLLOUT, SCORING, UNFINISHED, LeaseStage, TransitionResult
from shared.state.redis_scripts import ScriptCall, run_pipelined
from shared.state.replica_ack import ReplicaAck
from shared.state.run_marker import INTAKE_STOPS, RedisDataLost, RunMarker, lost_message, marker_value
from shared.state.trainer_stream import stream_key
from shared.schemas import FailedEvent, RolloutRequest, ScoredEvent, TrajectoryState
from shared.settings import LedgerSettings, OutageSettings

DEFAULT_DISPATCH_TTL_S = LedgerSettings().dispatch_ttl_s


class Ledger(LedgerReads):
    def __init__(self, client: redis.Redis, dispatch_ttl_s: float = DEFAULT_DISPATCH_TTL_S,
                 broker: redis.Redis | None = None):
        """``dispatch_ttl_s``: how long a trajectory may wait to be claimed before its message is
        presumed lost and sent again (``ledger.dispatch_ttl_s``). ``broker``: the Redis holding
        the broker's queues (``redis.broker_url``), when it is not the ledger's own."""
        super().__init__(client)
        self.dispatch_ttl_s = dispatch_ttl_s
        self.broker = client if broker is None else broker
        self._register = client.register_script(ledger_lua.REGISTER)
        self._claim = client.register_script(ledger_lua.CLAIM)
        self._heartbeat = client.register_script(ledger_lua.HEARTBEAT)
        self._transition = client.register_script(ledger_lua.TRANSITION)
        self._expire = client.register_script(ledger_lua.EXPIRE)
        self._hand_back = client.register_script(ledger_lua.HAND_BACK)
        self._sent = client.register_script(ledger_lua.SENT)
        self._replicas = ReplicaAck(client)

    @classmethod
    def from_url(cls, url: str, outage: OutageSettings | None = None,
                 dispatch_ttl_s: float = DEFAULT_DISPATCH_TTL_S) -> "Ledger":
        """With ``outage``, a ledger whose calls wait out an outage of Redis: ``redis_for``."""
        return cls(redis_for(url, outage), dispatch_ttl_s)

    def queue_busy(self, stage: LeaseStage) -> bool:
        """Whether the stage's broker queue (kombu's Redis list) holds messages now."""
        return int(self.broker.llen(stage.queue)) > 0

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
        argv: list[str] = [marker_value(run_id), "1" if require_marker else "0", repr(self.dispatch_deadline())]
        for req in requests:
            argv += [req.trajectory_id, req.model_dump_json()]
        k = RedisKeys
        keys = [k.states(run_id), k.counts(run_id), k.requests(run_id), RunMarker(self.redis, run_id).key,
                ROLLOUT.leases(run_id)]
        # The run registry is cross-run (another slot on a cluster): added first, on every
        # registration, so no trajectory is ever registered in a run the reapers do not visit.
        self.redis.sadd(k.runs, run_id)
        added = self._replicas.write([keys[0]], lambda: [int(self._register(keys=keys, args=argv))],
                                     lambda first, again: first)[0]
        if added < 0:
            raise RedisDataLost(lost_message(run_id, "intake saw it when it opened the run", INTAKE_STOPS))
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
            keys = [RedisKeys.states(run), RedisKeys.counts(run), stage.owners(run), stage.leases(run), stage.attempts(run),
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
            keys = [RedisKeys.states(run), stage.owners(run), stage.leases(run)]
            lost += [_text(tid) for tid in self._heartbeat(keys=keys, args=[deadline, stage.held.value, *pairs])]
        return lost


    def expire(self, trajectory_id: str, max_attempts: int, now: float | None = None, stage: LeaseStage = ROLLOUT,
               forgive_before: float = 0.0, queue_busy: bool | None = None) -> str:
        """A deadline passed. A lease: 'requeued' (publish the payload again) or 'failed'. A
        dispatch deadline of a trajectory still unclaimed: 'resent' (publish the payload again;
        no attempt counts), or 'waiting' while the stage's broker queue holds messages (its own
        may be among them: the deadline moves ahead, nothing is sent). Else 'skip'. A lease whose deadline is before ``forgive_before``
        (it was last renewed before Redis restarted) does not count its attempt. ``queue_busy``:
        whether the stage's broker queue holds messages, read by the caller (a reaper reads it
        once per sweep); None reads it now (``queue_busy``)."""
        ids = parse_trajectory_id(trajectory_id)
        now = time.time() if now is None else now
        reason = f"{stage.expired_reason} after {max_attempts} attempts"
        event = FailedEvent(
            trajectory_id=trajectory_id, run_id=ids.run_id, group_id=ids.group_id, failure_reason=reason, at=now,
        )
        k, run = RedisKeys, ids.run_id
        keys = [k.states(run), k.counts(run), stage.owners(run), stage.leases(run), stage.attempts(run), k.failures(run),
                stream_key(run), stage.resends(run), k.inline_trajectories(run)]
        busy = self.queue_busy(stage) if queue_busy is None else queue_busy
        args: list[str | float] = [trajectory_id, now, max_attempts, event.model_dump_json(), stage.held.value, stage.claim_from.value,
                stage.expired_reason, self.dispatch_ttl_s, repr(forgive_before), "1" if busy else "0"]
        return self._expire(keys=keys, args=args)

    # --- transitions ------------------------------------------------------------------------
    def mark_uploaded(self, trajectory_id: str, token: str, scoring_payload: str = "",
                      send_within_s: float = 0.0) -> TransitionResult:
        """running -> uploaded by the rollout lease's owner. With ``scoring_payload``, the same
        call stores the scoring task and a send-by entry ``send_within_s`` ahead in the scoring
        lease zset: a scoring message not sent by then (the sender died; ``scoring_sent``
        clears the entry) is sent by the scoring reaper from the stored payload."""
        return self.mark_uploaded_many([(trajectory_id, token, scoring_payload)], send_within_s)[0]

    def mark_uploaded_many(self, moves: list[tuple[str, str, str]], send_within_s: float = 0.0,
                           inline: Mapping[str, str] | None = None) -> list[TransitionResult]:
        """``mark_uploaded`` for each (trajectory id, token, scoring payload), pipelined: one round
        trip for a bundle's members; each move is its own atomic call, by its own lease token.
        ``inline``: trajectory id -> the Trajectory's JSON, for those carried inline
        (``shared.inline_trajectories``): stored by the same call that moves it, only if it moves."""
        send_by = time.time() + send_within_s
        inline = inline or {}
        for _, token, _ in moves:
            _require_token(token)
        return self._run_moves([
            self._move_call(trajectory_id, TrajectoryState.uploaded, [TrajectoryState.running], token=token,
                            next_payload=scoring_payload, send_by=send_by if scoring_payload else 0.0,
                            inline=inline.get(trajectory_id, ""))
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
        calls = [ScriptCall(self._sent, [SCORING.owners(run), SCORING.leases(run)], [deadline, *tids]) for run, tids in by_run.items()]
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
        keys = [RedisKeys.states(run), RedisKeys.counts(run), stage.owners(run), stage.leases(run), stage.attempts(run)]
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
        def run() -> list[TransitionResult]:
            return [TransitionResult(status == "ok", detail) for status, detail in run_pipelined(self.redis, calls)]

        def merge(first: list[TransitionResult], again: list[TransitionResult]) -> list[TransitionResult]:
            """After a failover during the moves: a copy that moved the trajectory (the first move
            was lost) or found it in the target state (the first survived) keeps the first reply."""
            return [f if (a.ok or a.state == call.args[1]) and f.ok else a for f, a, call in zip(first, again, calls)]

        return self._replicas.write([call.keys[0] for call in calls], run, merge)

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
        inline: str = "",
    ) -> ScriptCall:
        """The guarded transition's script call, to be run alone or pipelined with others."""
        run = parse_trajectory_id(trajectory_id).run_id
        k = RedisKeys
        following = next((stage for stage in LEASE_STAGES if stage.claim_from is to), ROLLOUT)
        keys = [k.states(run), k.counts(run), k.failures(run), stream_key(run), following.payloads(run), following.leases(run),
                k.inline_trajectories(run)]
        for stage in LEASE_STAGES:
            keys += [stage.owners(run), stage.leases(run)]
        args = [trajectory_id, to.value, token or "", reason, event.model_dump_json() if event else ""]
        args += [",".join(s.value for s in allowed_from), next_payload, repr(send_by), inline]
        for stage in LEASE_STAGES:
            args += [stage.held.value, stage.claim_from.value]
        return ScriptCall(self._transition, keys, args)


def _require_token(token: str) -> None:
    if not token:
        raise ValueError("a lease token is required: an empty one would skip the owner check")


def _text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else value
