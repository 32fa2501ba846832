"""Stopping a run: the request ``conveyor run stop`` records, and how the run's unfinished
trajectories end.

The request is one Redis key per run, ``RedisKeys.run_stop`` (JSON ``RunStop``: reason, by whom,
when). This module owns it: ``request_stop`` writes it, ``stop_of`` reads it; no other module
touches the key.

Invariants:
- A stop is final. The key is written once (SET NX: a second stop keeps the first one's reason
  and says the run was stopped already) and nothing deletes it; ``conveyor intake --resume``
  refuses a stopped run, so its id is never published into again.
- Every trajectory of a stopped run ends consumed or failed; the ones the stop ends are failed
  as ``run_stopped: <reason> (by <whom>)`` (``shared.outcomes``), through the ledger's guarded
  transition (``Ledger.fail_many``), so the counts stay exact and the trainer's stream is told.
  Who fails what:
  - ``conveyor run stop`` (``end_unfinished``): at once, the queued and running ones; with no
    trainer reading the run, the uploaded and scored ones too. A running episode is cut: its
    worker's heartbeat finds the lease gone and cancels it (``shared.state.leases``), its result is
    dropped, and the worker goes on with other runs' tasks.
  - the trainer, when it sees the stop between two reads: everything of the run still
    unfinished, then it exits 0 with its last step's checkpoint and state.
  - a rollout worker that claims a trajectory of a stopped run (intake published a group as
    the stop landed, or the reaper re-sent one): fails it instead of running it.
  The stop is written before ``end_unfinished`` reads the ledger, so a trajectory a worker
  claims after that read is one whose worker sees the stop: nothing of the run runs on.
- Intake checks the stop before each group and publishes nothing after it.
"""

from __future__ import annotations

import getpass
import json
import os
import socket
import time
from dataclasses import asdict, dataclass
from typing import Any

from shared.state.ledger import Ledger
from shared.names import RedisKeys
from shared.outcomes import FailureKind, reason
from shared.schemas import TrajectoryState


@dataclass(frozen=True)
class RunStop:
    reason: str
    by: str  # user@host of the `conveyor run stop`
    at: float  # unix seconds

    def detail(self) -> str:
        return f"{self.reason} (by {self.by})"

    def failure_reason(self) -> str:
        return reason(FailureKind.run_stopped, self.detail())

    def describe(self) -> str:
        when = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(self.at))
        return f"stopped by {self.by} at {when}: {self.reason}"


def stop_of(client: Any, run_id: str) -> RunStop | None:
    """The run's stop request; None while it runs."""
    raw = client.get(RedisKeys.run_stop(run_id))
    return None if raw is None else RunStop(**json.loads(raw))


def _user() -> str:
    """The login name; a container's user often has no passwd entry, then its uid."""
    try:
        return getpass.getuser()
    except (KeyError, OSError):
        return f"uid {os.getuid()}"


def request_stop(client: Any, run_id: str, why: str) -> tuple[RunStop, bool]:
    """Record the stop (once); returns the stop in force and whether this call recorded it."""
    stop = RunStop(why, f"{_user()}@{socket.gethostname()}", time.time())
    recorded = bool(client.set(RedisKeys.run_stop(run_id), json.dumps(asdict(stop)), nx=True))
    in_force = stop if recorded else stop_of(client, run_id)
    if in_force is None:  # SET NX found it, GET did not: something deleted it in between
        raise RuntimeError(f"the stop request of run {run_id} vanished while it was being read")
    return in_force, recorded


def end_unfinished(ledger: Ledger, run_id: str, stop: RunStop, states: list[TrajectoryState]) -> int:
    """Fail the run's trajectories that are in one of ``states``; returns how many moved."""
    wanted = {state.value for state in states}
    tids = [tid for tid, state in ledger.states(run_id).items() if state in wanted]
    return sum(moved.ok for moved in ledger.fail_many(tids, stop.failure_reason(), states))
