"""``conveyor retry``: failed trajectories back to the queue, through the ledger, one GRPO group
at a time.

A failed trajectory has already reached the trainer (its ``failed`` event), and the trainer
decides a group once, when all its members are terminal. So a retry re-opens a whole group:

Invariants:
- Only a group the trainer has decided with every member failed (``all_failed``) is retried.
  A group with a consumed member was trained on (or dropped) with its other members:
  retrying its failed ones would give the trainer a second look at a decided group, so it is
  left alone and reported. A group the trainer has not decided yet is left alone too (the
  trainer may hold the failed event), and reported.
- One Lua call per group does it all or nothing: every member is checked still ``failed``; the
  chosen members go failed -> queued, their failure reason, rollout and scoring attempts
  cleared (a fresh budget of ``ledger.max_attempts``); the other members' ``failed`` events go
  to the trainer again, so the re-opened group completes; the group leaves ``groups_done``,
  its admission slot is taken back (the staleness budget's ``filtered``) and the trainer
  counts ``groups_reopened``; each chosen member gets its dispatch deadline (``shared.state.ledger``).
  A retry racing another retry finds the members queued and does nothing.
- Then the group's chosen requests are published as one rollout task. Nothing consumed is
  touched, so nothing consumed can be duplicated; a trainer must be running to consume the
  re-opened groups (it writes their group record and metrics line again when it decides them).
"""

from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Callable

from redis import Redis

from shared.state import ledger_lua
from shared.state.group_registry import GroupRegistry
from shared.ids import parse_trajectory_id
from shared.state.ledger import DEFAULT_DISPATCH_TTL_S, ROLLOUT, Ledger
from shared.outcomes import kind_of
from shared.schemas import FailedEvent, RolloutRequest, TrajectoryState
from shared.state.staleness import StalenessBudget, budget_key
from shared.state.trainer_counters import TrainerCounter, TrainerCounters
from shared.state.trainer_stream import stream_key

NOT_DECIDED = "its group is not decided by the trainer yet (retry once it is)"
TRAINED = "its group was decided with members that did not fail (consumed): retrying would give the trainer a second look"


@dataclass
class RetryReport:
    retried: list[str] = field(default_factory=list)
    groups: list[int] = field(default_factory=list)
    left: dict[str, list[str]] = field(default_factory=dict)  # why -> failed trajectory ids not retried


def matches(failure_reason: str, wanted: str | None) -> bool:
    """``--reason``: a failure kind (``infra_error``) or the start of the reason."""
    return wanted is None or kind_of(failure_reason) == wanted or failure_reason.startswith(wanted)


def retry_failed(redis: Redis, run_id: str, wanted_reason: str | None, publish: Callable[[list[RolloutRequest]], None],
                 dispatch_ttl_s: float = DEFAULT_DISPATCH_TTL_S) -> RetryReport:
    """Retry the run's failed trajectories whose reason matches, group by group; a retried
    trajectory waits ``dispatch_ttl_s`` (``ledger.dispatch_ttl_s``) to be claimed."""
    ledger = Ledger(redis, dispatch_ttl_s)
    states = ledger.states(run_id)
    reasons = ledger.failure_reasons(run_id)
    members: dict[int, list[str]] = defaultdict(list)
    for tid in states:
        members[parse_trajectory_id(tid).group_id].append(tid)
    chosen: dict[int, set[str]] = defaultdict(set)
    for tid, state in states.items():
        if state == TrajectoryState.failed.value and matches(reasons.get(tid, ""), wanted_reason):
            chosen[parse_trajectory_id(tid).group_id].add(tid)
    script = redis.register_script(ledger_lua.RETRY_GROUP)
    report = RetryReport()
    keys = [*ledger.retry_keys(run_id), GroupRegistry(redis, run_id).done_key, stream_key(run_id),
            TrainerCounters(redis, run_id).key, budget_key(run_id), ROLLOUT.leases(run_id)]
    for group_id, retry in sorted(chosen.items()):
        argv: list[str] = [str(group_id), TrainerCounter.groups_reopened.value, StalenessBudget.FILTERED,
                           repr(ledger.dispatch_deadline())]
        for tid in sorted(members[group_id]):
            argv += [tid, "" if tid in retry else _failed_event(run_id, group_id, tid, reasons.get(tid, "failed"))]
        status, detail = script(keys=keys, args=argv)
        if status != "ok":
            why = NOT_DECIDED if detail == "not_decided" else TRAINED if detail == TrajectoryState.consumed.value else (
                f"a member of its group is {detail}")
            report.left.setdefault(why, []).extend(sorted(retry))
            continue
        publish([ledger.request(tid) for tid in sorted(retry)])
        report.retried += sorted(retry)
        report.groups.append(group_id)
    return report


def _failed_event(run_id: str, group_id: int, tid: str, failure_reason: str) -> str:
    event = FailedEvent(trajectory_id=tid, run_id=run_id, group_id=group_id,
                        failure_reason=failure_reason, at=time.time())
    return event.model_dump_json()
