"""Pruning the delta weight chain (``inference.weight_sync: delta``): the trainer deletes the
versions no replica can still need, after each full version it publishes.

The rule: the chain keeps every version from ``floor`` on, and deletes every version below it,
where ``floor`` is the lower of
- the full version before the newest full one (the newest full one itself while there is no
  other): a replica whose follower planned a catch-up to a version of the previous segment
  still finds it whole, however far the trainer has moved on;
- the full version that starts the segment of the version the run serves (``policy_version``):
  a restarted replica is re-synced to that version itself (``WeightFollower``'s lagging
  replicas), and every other target is above it, so every plan starts at or after that full
  version.

Why nothing needed goes (``delta_chain.ChainReader.plan`` walks back from a target by ``base``
links and stops at the first full version): a plan to a target ``t`` reads only the versions
from the newest full version at or below ``t`` to ``t``, and every target a follower holds
(the served version or one above it) or will hold (the newest) has that full version at or
above ``floor``. A trainer resumes from its newest committed checkpoint, at or above the newest chain
version (a checkpoint is committed before its chain version): its re-announced version is never
below the newest full one. A checkpoint announced by its checkpoint prefix (a trainer that died
between the two) does not read the chain at all.

Invariants:
- Only full-version publishes prune, so the chain holds at most three segments (two while the
  served version keeps up): about ``2 * full_every`` versions.
- A version's ``COMMITTED`` is deleted before its payload, and versions oldest first: a reader
  never finds a manifest whose payload is gone unless it read the manifest before the prune (then
  ``fetch`` raises ``ChainBroken`` and the sync falls back to the newest full version, loudly).
- A segment whose manifests cannot be walked (``ChainBroken``) prunes nothing this time, with a
  warning: what it would have kept cannot be told.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from services.weights.delta_chain import ChainBroken, ChainReader
from shared.names import CHECKPOINT_COMMITTED, weight_chain_of_run
from shared.storage import ObjectStore

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Pruned:
    floor: int | None  # the oldest version kept (None: nothing pruned)
    deleted: tuple[int, ...]  # versions whose objects were deleted, oldest first
    seconds: float


def chain_versions(store: ObjectStore, run_id: str) -> dict[int, list[str]]:
    """Every version under the run's chain (committed or not), with its keys."""
    root = weight_chain_of_run(run_id)
    versions: dict[int, list[str]] = {}
    for key in store.list_keys(root):
        head = key[len(root):].split("/", 1)[0]
        if head.isdigit():
            versions.setdefault(int(head), []).append(key)
    return versions


def _segment_start(reader: ChainReader, committed: list[int], at: int) -> int | None:
    """The full version a plan to the newest committed version at or below ``at`` starts from."""
    below = [v for v in committed if v <= at]
    return reader.plan(max(below))[0].version if below else None


def prune_floor(reader: ChainReader, committed: list[int], served: int) -> int | None:
    """The oldest version to keep (see the module's rule); None: keep everything."""
    if not committed:
        return None
    newest_full = _segment_start(reader, committed, max(committed))
    assert newest_full is not None
    previous_full = _segment_start(reader, committed, newest_full - 1)
    floor = previous_full if previous_full is not None else newest_full
    serving_full = _segment_start(reader, committed, served)
    return floor if serving_full is None else min(floor, serving_full)


def prune_chain(store: ObjectStore, run_id: str, served: int) -> Pruned:
    """Delete the chain's versions below ``prune_floor`` (``served``: the run's ``policy_version``)."""
    t0 = time.perf_counter()
    versions = chain_versions(store, run_id)
    committed = sorted(v for v, keys in versions.items() if any(k.endswith("/" + CHECKPOINT_COMMITTED) for k in keys))
    try:
        floor = prune_floor(ChainReader(store, run_id), committed, served)
    except ChainBroken as exc:
        log.warning("delta chain of run %s not pruned: %s", run_id, exc)
        return Pruned(None, (), time.perf_counter() - t0)
    deleted = tuple(v for v in sorted(versions) if floor is not None and v < floor)
    for version in deleted:
        keys = sorted(versions[version], key=lambda k: not k.endswith("/" + CHECKPOINT_COMMITTED))  # COMMITTED first
        store.delete_keys(keys)
    if deleted:
        log.info("delta chain of run %s pruned below version %s: %d version(s) deleted", run_id, floor, len(deleted))
    return Pruned(floor, deleted, time.perf_counter() - t0)
