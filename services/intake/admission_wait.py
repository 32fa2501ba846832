"""Intake's waits, said out loud: intake never waits without saying why. It waits on the
staleness bound (``AdmissionWait``) and on its share of the rollout queue
(``services.intake.queue_share``); both wait through ``wait_saying_why``.

Invariants:
- A group is admitted exactly as ``StalenessBudget.try_admit`` admits it (one Lua call per try);
  this module adds only what is said. A try follows each announcement that the bound may have
  moved (``shared.state.admission_wake``) and, failing those, comes every ``poll_s``.
- A wait longer than ``intake.wait_log_every_s`` logs one warning that names the run, the groups
  held against the bound and the bound's terms, the run's trajectories still on their way, what
  the trainer did since the wait began, and whether a trainer reads the run at all
  (``shared.state.trainer_reads``). The line comes again at doubling intervals, at most
  ``MAX_LOG_INTERVAL_S`` apart, and a wait that was logged logs its end.
- A wait ends, unadmitted, once the run is stopped (``shared.state.run_stop``); intake then checks
  the stop and publishes no more.
- ``wait_saying_why`` is the one wait loop: a run's stop ends it, a long wait is logged with its
  reason at doubling intervals, and a logged wait logs its end.
- Every other wait of intake is an outage of Redis or of the S3 server, which ``shared.outage``
  logs.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Callable

import redis

from shared.state.admission_wake import AdmissionWake
from shared.state.ledger import Ledger
from shared.state.run_marker import RunMarker
from shared.state.run_stop import stop_of
from shared.state.staleness import StalenessBudget
from shared.state.trainer_reads import TRAINER_CONSUMER_GROUP, TrainerReading, trainer_reading

log = logging.getLogger(__name__)
MAX_LOG_INTERVAL_S = 300.0


@dataclass(frozen=True)
class WaitStart:
    monotonic: float
    consumed: int
    trainer_step: int


@dataclass
class AdmissionWait:
    budget: StalenessBudget
    client: redis.Redis  # the run's Redis: its ledger counts, its stop, its trainer's reading
    log_every_s: float
    poll_s: float = 0.2
    marker: RunMarker | None = None  # the run intake opened: each try refuses it once Redis lost it (StalenessBudget.admit_for)
    ledger: Ledger = field(init=False)
    wake: AdmissionWake = field(init=False)

    def __post_init__(self) -> None:
        self.ledger = Ledger(self.client)  # read only: its counts
        self.wake = AdmissionWake(self.client, self.budget.run_id)

    def try_now(self) -> int | None:
        """One try of the budget, never a wait: admitted (counted), the earliest version the
        group's rollouts may start on (``StalenessBudget.admit_for``); None: the bound is full."""
        return self.budget.admit_for(self.marker)

    def admit(self) -> int:
        """Block until the budget admits one group, saying why while it waits, or until the run
        is stopped (``shared.state.run_stop``: the trainer holding the bound has exited; 0, nothing
        admitted). Admitted: the earliest version the group's rollouts may start on."""
        first = self.budget.admit_for(self.marker)
        if first is not None:
            return first
        run = self.budget.run_id
        start = WaitStart(time.monotonic(), self.ledger.counts(run)["consumed"], self.budget.state().trainer_step)
        admitted: list[int] = []

        def ready() -> bool:
            version = self.budget.admit_for(self.marker)
            if version is not None:
                admitted.append(version)
            return version is not None

        try:
            wait_saying_why(self.client, run, ready, lambda waited: self.why(start, start.monotonic + waited),
                            self.log_every_s, "the staleness bound admits groups again", self.poll_s, self.wake.pause)
        finally:
            self.wake.close()  # subscribed only while waiting: no announcements pile up between waits
        return admitted[0] if admitted else 0

    def why(self, start: WaitStart, now: float) -> str:
        run, budget = self.budget.run_id, self.budget
        terms, counts = budget.terms(), self.ledger.counts(run)
        parts = [
            f"intake of run {run} waiting {now - start.monotonic:.0f}s to publish its next group: {terms.held} groups held "
            f"(in flight, or accepted and not yet trained) against the staleness bound of {terms.bound} = "
            f"(trainer.max_off_policy_steps {budget.max_off_policy_steps} + step {terms.step} + 1) x "
            f"trainer.groups_per_step {budget.groups_per_step}",
            f"the run's trajectories: {counts['queued']} queued, {counts['running']} running, {counts['uploaded']} uploaded, "
            f"{counts['scored']} scored",
            f"since the wait began the trainer consumed {counts['consumed'] - start.consumed} trajectories and advanced "
            f"{terms.trainer_step - start.trainer_step} steps (now at step {terms.trainer_step})",
        ]
        if terms.served_version < terms.trainer_step:
            parts.append(f"the inference service serves policy version {terms.served_version}, behind trainer step "
                         f"{terms.trainer_step}: the bound waits for the weight sync")
        parts.append(_trainer_line(run, trainer_reading(self.client, run)))
        return "; ".join(parts)


def wait_saying_why(client: redis.Redis, run: str, ready: Callable[[], bool], why: Callable[[float], str],
                    log_every_s: float, ended: str, poll_s: float = 0.2,
                    pause: Callable[[float], None] = time.sleep) -> None:
    """Check ``ready`` after each ``pause(poll_s)`` (a sleep, or a wait that a wake-up ends
    early) until it is true or the run is stopped. A wait longer than ``log_every_s``
    logs ``why(seconds waited)``, then at doubling intervals (at most ``MAX_LOG_INTERVAL_S`` apart), and a
    wait that was logged logs its end (``ended``)."""
    started = time.monotonic()
    interval = log_every_s
    next_line, logged = started + interval, False
    while not ready():
        if stop_of(client, run) is not None:
            return
        now = time.monotonic()
        if now >= next_line:
            log.warning("%s", why(now - started))
            logged = True
            interval = min(2 * interval, max(MAX_LOG_INTERVAL_S, log_every_s))
            next_line = now + interval
        pause(poll_s)
    if logged:
        log.warning("intake of run %s: %s after %.0fs", run, ended, time.monotonic() - started)


def _trainer_line(run: str, reading: TrainerReading) -> str:
    if not reading.started:
        return (f"no trainer has read run {run}'s events yet (its stream has no consumer group {TRAINER_CONSUMER_GROUP!r}): "
                "none was started with this run id, or it is still starting")
    if reading.oldest_unread_s is None:
        return f"the trainer has taken every event of run {run} so far"
    return (f"the oldest event of run {run} the trainer has not taken waited {reading.oldest_unread_s:.0f}s: "
            "no trainer is reading the run unless one is in a training step that long")
