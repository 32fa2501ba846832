"""The ledger's reads (``LedgerReads``): what a trajectory, a run or the ledger's Redis server
holds now (``shared.state.ledger``).

Invariants:
- A read never writes: every change of the ledger is a transition of ``Ledger``
  (``shared.state.ledger.transitions``), one Lua call each.
- A read of one trajectory finds its run's keys from its id (``shared.ids``); a read of a run
  touches only that run's keys (and the set of runs). A read across runs (``expired_leases``)
  goes run by run through the run registry, never a script over two runs' keys.
- Replies are decoded (``decode_responses=True``, as ``redis_for`` and ``shared.outage`` make the
  client): the casts name the str redis-py returns.
"""

from __future__ import annotations

import time
from typing import cast

import redis

from shared import ids
from shared.ids import parse_trajectory_id
from shared.names import RedisKeys
from shared.outage import seconds_since_recovery
from shared.schemas import RolloutRequest
from shared.state.ledger.stages import ROLLOUT, STATES, LeaseStage
from shared.state.run_marker import refuse_lost_run


class LedgerReads:
    """The ledger as a reader sees it; ``Ledger`` is this plus the transitions."""

    # The client decodes replies (``decode_responses=True``, as ``redis_for`` and ``redis_client``
    # make it), which redis-py's types cannot express: the casts below name the str it returns.
    def __init__(self, client: redis.Redis):
        self.redis = client

    def expired_leases(self, now: float | None = None, limit: int = 500, stage: LeaseStage = ROLLOUT) -> list[str]:
        """The stage's passed deadlines, up to ``limit`` per run, of every run in the registry:
        one ZRANGEBYSCORE per run (each run's lease zset is its own), pipelined."""
        now = time.time() if now is None else now
        pipe = self.redis.pipeline(transaction=False)
        for run_id in self.runs():
            pipe.zrangebyscore(stage.leases(run_id), "-inf", now, start=0, num=limit)
        return [tid for expired in pipe.execute() for tid in cast(list[str], expired)]

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
                   for index in range(request.members_dispatched) if index != request.episode_index]
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

    def inline_trajectories(self, trajectory_ids: list[str]) -> list[str | None]:
        """The Trajectory JSON of each one carried inline (``shared.inline_trajectories``), None
        for one Redis does not hold (never inline, or consumed or failed since); one HMGET per run."""
        by_run: dict[str, list[str]] = {}
        for tid in trajectory_ids:
            by_run.setdefault(parse_trajectory_id(tid).run_id, []).append(tid)
        found: dict[str, str | None] = {}
        for run, tids in by_run.items():
            found |= dict(zip(tids, cast(list[str | None], self.redis.hmget(RedisKeys.inline_trajectories(run), tids))))
        return [found[tid] for tid in trajectory_ids]

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
        return self.redis.zscore(stage.leases(parse_trajectory_id(trajectory_id).run_id), trajectory_id)

    def lease_owner(self, trajectory_id: str, stage: LeaseStage = ROLLOUT) -> str | None:
        return cast(str | None, self.redis.hget(stage.owners(parse_trajectory_id(trajectory_id).run_id), trajectory_id))

    def counts(self, run_id: str) -> dict[str, int]:
        raw = self.redis.hgetall(RedisKeys.counts(run_id))
        return {state: int(raw.get(state, 0)) for state in STATES}

    def describe_counts(self, run_id: str) -> str:
        """``trajectories 8 queued, 24 running`` (states with none left out), for progress lines."""
        counts = self.counts(run_id)
        return "trajectories " + (", ".join(f"{n} {state}" for state, n in counts.items() if n) or "none yet")

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
