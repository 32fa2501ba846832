"""Small trajectories carried inline in the ledger's Redis instead of an object each (issue 28:
the upload's PUT, and each reader's GET, were on a synchronous step's critical path).

A trajectory whose JSON is at most ``ledger.inline_max_bytes`` (0: none is) is stored by the
ledger's own move to ``uploaded`` (``Ledger.mark_uploaded_many(inline=...)``), in the run's hash
``RedisKeys.inline_trajectories``, which the ledger owns; where an object key would be (the
scoring task, the ScoredTrajectory, the scored event) its ref is ``inline:{trajectory_id}.a{attempt}``.
A larger one keeps its object (a bundle member, ``shared.object_bundles``).

Invariants:
- One way to read a trajectory by its ref, whatever it is (an object key, a bundle member's ref,
  an inline ref): ``read_trajectory`` / ``read_trajectories``. The scorer, the trainer, the
  exporter, the viewer and ``conveyor trajectories`` (``shared.trajectory_lookup``) all read
  through it.
- Durability as an object's: the trajectory is written by the same Lua call that moves it to
  ``uploaded``, and only if that move is its attempt's (the lease owner's). A Redis that holds
  the state holds the trajectory, on a cluster acknowledged by the replica with it
  (``shared.state.replica_ack``); a worker that dies after the move loses nothing.
- Redis holds an inline trajectory only while it is in flight: the ledger's move into
  ``consumed`` or ``failed`` (and a lease expiring for the last time) deletes it in the same
  call. So its memory is at most ``inline_max_bytes`` per trajectory uploaded or scored and
  not yet consumed (16,384 in flight at 16 KiB: at most 256 MiB).
- Before the trainer consumes a group it writes the group's inline members as one bundle
  (``spill_group``; ``shared.names.inline_spill_key``), so a consumed trajectory is read from
  there, by the same ref. A trajectory failed after its upload keeps no copy (the ledger keeps
  its failure reason); an object-stored one does.
- A ref names its attempt: a stored trajectory of another attempt is never returned for it.
- A ref that cannot be read is a ``StorageError`` naming it, as a missing object is.
"""

from __future__ import annotations

import json
import re
from typing import Any, Mapping, Sequence

from shared.ids import parse_trajectory_id
from shared.names import inline_spill_key
from shared.object_bundles import cache_of
from shared.schemas import Trajectory
from shared.state.ledger import LedgerReads
from shared.storage import ObjectStore, StorageError, get_model, put_bundle

INLINE_PREFIX = "inline:"
_REF = re.compile(r"^" + re.escape(INLINE_PREFIX) + r"(.+)\.a(\d+)$")


def inline_ref(trajectory: Trajectory) -> str:
    return f"{INLINE_PREFIX}{trajectory.trajectory_id}.a{trajectory.attempt}"


def split_inline_ref(ref: str) -> tuple[str, int] | None:
    """(trajectory id, attempt) for an inline ref, None for an object key or a bundle member's ref."""
    match = _REF.match(ref)
    return (match.group(1), int(match.group(2))) if match else None


def is_inline_ref(ref: str) -> bool:
    return split_inline_ref(ref) is not None


def inline_json(trajectory: Trajectory, max_bytes: int) -> str | None:
    """The trajectory's JSON when it is to be carried inline (at most ``max_bytes`` of it), else None."""
    if max_bytes <= 0:
        return None
    text = trajectory.model_dump_json()
    return text if len(text.encode()) <= max_bytes else None


def read_trajectory(store: ObjectStore, redis: Any, ref: str) -> Trajectory:
    return read_trajectories(store, redis, [ref])[0]


def read_trajectories(store: ObjectStore, redis: Any, refs: Sequence[str]) -> list[Trajectory]:
    """The Trajectory each ref names, in order. Inline ones: from Redis while in flight (one HMGET
    per run), else from their group's spilled bundle; ``redis`` (the ledger's client, or the
    ledger itself) None reads only the spill. The others: from the store
    (``shared.storage.get_model``)."""
    inline = {index: parsed for index, ref in enumerate(refs) if (parsed := split_inline_ref(ref)) is not None}
    held: list[str | None] = [None] * len(inline)
    if inline and redis is not None:
        ledger = redis if isinstance(redis, LedgerReads) else LedgerReads(redis)
        held = ledger.inline_trajectories([tid for tid, _ in inline.values()])
    found = dict(zip(inline, held))
    read: list[Trajectory] = []
    for index, ref in enumerate(refs):
        if index not in inline:
            read.append(get_model(store, ref, Trajectory))
            continue
        trajectory_id, attempt = inline[index]
        raw = found[index]
        trajectory = Trajectory.model_validate_json(raw) if raw is not None else None
        if trajectory is None or trajectory.attempt != attempt:
            trajectory = spilled_trajectory(store, trajectory_id, attempt)
        if trajectory is None:
            raise StorageError(f"inline trajectory {ref!r}: Redis no longer holds it and its group's "
                               f"{inline_spill_key(*_run_and_group(trajectory_id))!r} does not either (failed after its upload?)")
        read.append(trajectory)
    return read


def spilled_trajectory(store: ObjectStore, trajectory_id: str, attempt: int | None = None) -> Trajectory | None:
    """The trajectory as its consumed group's spill holds it (``attempt`` None: whichever), or None
    when there is no spill or it is not in it. The spill is read once per process (its bundle cached)."""
    key = inline_spill_key(*_run_and_group(trajectory_id))
    try:
        members = cache_of(store).members(key, lambda: store.get_bytes(key))
    except StorageError:
        return None
    needle = json.dumps(trajectory_id).encode()
    for member in members:
        if needle in member and (trajectory := Trajectory.model_validate_json(member)).trajectory_id == trajectory_id:
            if attempt is None or trajectory.attempt == attempt:
                return trajectory
    return None


def spill_group(store: ObjectStore, redis: Any, run_id: str, group_id: int, refs: Sequence[str],
                known: Mapping[str, Trajectory] | None = None) -> str | None:
    """Before a decided group's members are consumed (which deletes their inline copies): its
    inline members written as one bundle; its key, or None when it has none. ``known``: ref ->
    Trajectory already read (the group's decision read them), so only the others are read
    again. Written again on a replay, it holds the same trajectories."""
    inline = [ref for ref in refs if is_inline_ref(ref)]
    if not inline:
        return None
    known = known or {}
    missing = [ref for ref in inline if ref not in known]
    read = dict(zip(missing, read_trajectories(store, redis, missing))) if missing else {}
    key = inline_spill_key(run_id, group_id)
    put_bundle(store, key, [known[ref] if ref in known else read[ref] for ref in inline])
    return key


def _run_and_group(trajectory_id: str) -> tuple[str, int]:
    ids = parse_trajectory_id(trajectory_id)
    return ids.run_id, ids.group_id
