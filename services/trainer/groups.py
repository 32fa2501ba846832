"""GRPO group assembly from the trainer's event stream.

Invariants:
- A group is complete when every one of its ``expected_size`` members is terminal: scored
  or failed; with redundancy (``keep`` > 0), as soon as ``keep`` members are scored. It
  completes exactly once. A redundant group's ``scored`` are its first ``keep`` scored
  members in stream order, which a replay after a restart sees in the same order.
- An event for a trajectory the group already holds (a redelivery) is a duplicate and is
  ignored; an event for a group that already completed is late and is ignored. Both are
  counted, neither changes a decided group. Whether a group completed is asked (``is_done``)
  when an event would open it: a group pending here has not completed, since only its one
  consumer completes it, and it leaves ``pending`` as it completes.
- The assembler keeps no state that cannot be rebuilt: after a restart the consumer replays
  its pending stream entries into a fresh assembler and gets the same groups.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Literal

from shared.schemas import FailedEvent, ScoredEvent, TrainerEvent


@dataclass
class PendingGroup:
    group_id: int
    expected_size: int
    keep: int = 0  # redundancy: decided once this many are scored; 0: once every member is terminal
    events: dict[str, TrainerEvent] = field(default_factory=dict)  # trajectory id -> event, in stream order
    entry_ids: list[str] = field(default_factory=list)  # stream entries to acknowledge

    @property
    def complete(self) -> bool:
        if self.keep and sum(e.kind == "scored" for e in self.events.values()) >= self.keep:
            return True
        return len(self.events) >= self.expected_size

    @property
    def scored(self) -> list[ScoredEvent]:
        arrived = [e for e in self.events.values() if e.kind == "scored"]
        return sorted(arrived[: self.keep] if self.keep else arrived, key=lambda e: e.trajectory_id)

    @property
    def failed(self) -> list[FailedEvent]:
        return sorted((e for e in self.events.values() if e.kind == "failed"), key=lambda e: e.trajectory_id)


AddOutcome = Literal["added", "duplicate", "late"]


class GroupAssembler:
    def __init__(self, expected_size: Callable[[int], int], is_done: Callable[[int], bool],
                 keep: Callable[[int], int] = lambda group_id: 0):
        self._expected_size = expected_size
        self._is_done = is_done
        self._keep = keep
        self.pending: dict[int, PendingGroup] = {}

    def add(self, event: TrainerEvent, entry_id: str) -> tuple[AddOutcome, PendingGroup | None]:
        """Returns the outcome and, when this event completed its group, the group."""
        group_id = event.group_id
        group = self.pending.get(group_id)
        if group is None:
            if self._is_done(group_id):
                return "late", None
            group = self.pending[group_id] = PendingGroup(group_id, self._expected_size(group_id), self._keep(group_id))
        group.entry_ids.append(entry_id)
        if event.trajectory_id in group.events:
            return "duplicate", None
        group.events[event.trajectory_id] = event
        if group.complete:
            del self.pending[group_id]
            return "added", group
        return "added", None
