"""The ledger's states and the stages that hold a trajectory under a lease (``shared.state.ledger``).

Invariants:
- ``STATES`` are the ``TrajectoryState`` values, in order; ``UNFINISHED`` are those a trajectory
  can still leave.
- Each ``LeaseStage`` holds a different state (``LEASE_STAGES``): rollout holds ``running``,
  scoring holds ``uploaded``. A stage names its own keys (lease zset, owners, attempts,
  payloads, resends), each one per run, under the run's hash tag (``shared.names.RedisKeys``) and the broker queue its messages wait in; the ledger's Lua is given them
  (``shared.state.ledger_lua``), so one script serves both stages.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from shared.names import ROLLOUT_QUEUE, SCORING_QUEUE, RedisKeys
from shared.schemas import TrajectoryState

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
    leases: Callable[[str], str]  # run id -> zset trajectory id -> deadline
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
