"""Which train-queue entries step ``v + 1`` takes: a pure function of the queue from the step's
cursor, the version, and settings, so a restarted trainer selects the same groups.

Invariants:
- Entries are taken in queue order. A stale group (oldest turn more than
  ``max_staleness_at_use``, by default ``max_off_policy_steps``, behind ``v``) is passed over and counted; a ``skip`` entry (a dropped
  group) is passed over and counted toward the cap on extra groups; an entry that does not
  parse is passed over and counted (``bad``).
- Mixing (``trainer.min_env_share``): each environment ``e`` with a share gets at least
  ``ceil(share × G)`` of the step's G groups. A fresh group is deferred, not taken, when taking
  it would leave too few slots for the environments still short of their quota. Deferred
  entries go back on the queue's tail with the selection's commit (once per version), so no
  group is lost and none is taken twice. Once ``mixing_window`` entries were deferred the step
  stops deferring and fills its slots in order: a quota the queue cannot meet never stalls
  training, and the shortfall is counted (``quota_short``).
- The selection ends at the entry that fills the step; entries behind it are not looked at, so
  the deferred entries appended at the commit lie beyond it and a replay after a restart scans
  the very same entries.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable, Sequence

from shared.schemas import BadMessage, SkippedGroupEntry, TrainBatchEntry, TrainQueueEntry, parse_message


@dataclass
class Selection:
    """What step ``v + 1`` takes from the train queue."""

    keys: list[str]  # batch objects of the groups it trains on
    cursor: int  # queue position after the last entry it passed
    envs: list[str] = field(default_factory=list)  # the environment of each key's group
    stale: int = 0
    dropped: int = 0  # zero-variance and filtered groups passed over
    dropped_filtered: int = 0  # of them, dropped by trainer.group_filters
    bad: dict[int, str] = field(default_factory=dict)  # position -> why an entry did not parse
    dropped_rewards: list[float] = field(default_factory=list)
    deferred: list[str | bytes] = field(default_factory=list)  # raw entries to append to the queue again
    quota_short: int = 0  # slots the step's quotas did not get
    complete: bool = False  # False: the queue does not hold the step's groups yet


def quotas(min_env_share: dict[str, float], groups_per_step: int) -> dict[str, int]:
    return {env: math.ceil(share * groups_per_step) for env, share in min_env_share.items() if share > 0}


def select(
    raw_entries: Sequence[str | bytes], cursor: int, version: int, groups_per_step: int, is_stale: Callable[[int, int], bool],
    max_extra_groups: int | None = None, min_env_share: dict[str, float] | None = None, mixing_window: int = 0,
) -> Selection:
    """The next step's groups among ``raw_entries`` (the queue from ``cursor``); not
    ``complete`` while the queue does not hold them yet."""
    wanted = quotas(min_env_share or {}, groups_per_step)
    taken: Counter[str] = Counter()
    selection = Selection(keys=[], cursor=cursor)
    for raw in raw_entries:
        selection.cursor += 1
        try:
            entry = parse_message(TrainQueueEntry, raw)
        except BadMessage as exc:
            selection.bad[selection.cursor - 1] = str(exc)
            continue
        if isinstance(entry, SkippedGroupEntry):
            selection.dropped_rewards.extend(entry.rewards)
            selection.dropped += 1
            selection.dropped_filtered += entry.skip == "filtered"
        elif is_stale(entry.oldest_policy_version, version):
            selection.stale += 1
            continue
        elif _defer(entry, wanted, taken, groups_per_step - len(selection.keys)) and len(selection.deferred) < mixing_window:
            selection.deferred.append(raw)
            continue
        else:
            selection.keys.append(entry.key)
            selection.envs.append(entry.env_name)
            taken[entry.env_name] += 1
        full = len(selection.keys) == groups_per_step
        if full or max_extra_groups is not None and len(selection.keys) + selection.dropped >= groups_per_step + max_extra_groups:
            selection.quota_short = sum(max(0, n - taken[env]) for env, n in wanted.items())
            selection.complete = True
            return selection
    return selection


def _defer(entry: TrainBatchEntry, wanted: dict[str, int], taken: Counter[str], free_slots: int) -> bool:
    """Taking ``entry`` would leave fewer free slots than the other environments still need."""
    if not wanted or taken[entry.env_name] < wanted.get(entry.env_name, 0):
        return False
    short = sum(max(0, n - taken[env]) for env, n in wanted.items() if env != entry.env_name)
    return free_slots - 1 < short
