"""A run's share of the rollout queue (``intake.max_queued_groups``): fair share between runs that
share the rollout workers.

The rollout queue is first in, first out, and workers take its tasks in order. A run that
publishes its whole dataset at once puts every later run's groups behind all of its own. With
``max_queued_groups = Q``, intake publishes a run's next group only while fewer than Q groups'
worth of the run's trajectories wait in the queue unclaimed (ledger state ``queued``):

    queued(run) < Q * members_per_group          members_per_group = group_size + redundancy

So the queue holds at most Q groups of each run, and as workers take them in order, each run
that has work gets an equal share of the workers, whatever the size of its dataset. A run alone
keeps the workers busy as long as Q groups cover the time intake needs to publish the next one.

Invariants:
- Only ``queued`` counts: groups being rolled out, scored or trained are not held against the
  share (the staleness bound holds those, ``shared.state.staleness``), so the share never
  throttles a run that the workers keep up with.
- ``None`` (the default) publishes as fast as rows are read, as before.
- The wait says why (``admission_wait.wait_saying_why``) and ends when the run is stopped.
- The count is read from the ledger's per-run state counts (``Ledger.counts``, one hash read), so
  the check is as exact as the ledger; several intake processes of one run may overshoot the
  share by one group each, never more.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import redis

from services.intake.admission_wait import wait_saying_why
from shared.state.ledger import Ledger


@dataclass
class QueueShare:
    client: redis.Redis  # the run's Redis: its ledger counts and its stop
    run: str
    max_queued_groups: int
    members_per_group: int
    log_every_s: float
    poll_s: float = 0.2
    ledger: Ledger = field(init=False)

    def __post_init__(self) -> None:
        self.ledger = Ledger(self.client)  # read only: its counts

    @property
    def max_queued(self) -> int:
        return self.max_queued_groups * self.members_per_group

    def has_room(self) -> bool:
        return self.ledger.counts(self.run)["queued"] < self.max_queued

    def wait_for_room(self) -> None:
        """Block until the run has room for one more group in the queue, or until it is stopped."""
        wait_saying_why(self.client, self.run, self.has_room, self.why, self.log_every_s,
                        "the rollout queue has room for its groups again", self.poll_s)

    def why(self, waited_s: float) -> str:
        counts = self.ledger.counts(self.run)
        return (f"intake of run {self.run} waiting {waited_s:.0f}s to publish its next group: {counts['queued']} of its trajectories "
                f"wait in the rollout queue unclaimed, the share intake.max_queued_groups {self.max_queued_groups} x "
                f"{self.members_per_group} members allows {self.max_queued}; {counts['running']} are running. "
                "No rollout worker has taken one since, or the workers are busy with other runs' groups")
