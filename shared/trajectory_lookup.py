"""Finding one trajectory's objects by its id, for ``conveyor inspect``, ``conveyor replay`` and
the viewer: no scan of a run's objects, only the trajectory's own key prefixes (a member of a
scored bundle costs a scan of the run's trainer stream); and a scored event's
Trajectory for the trainer and the exporter (``trajectory_of_event``).

Invariants:
- A trajectory id names its run and group (``shared.ids``), so its uploads are under one
  prefix of ``trajectory_key`` (one object per rollout attempt) and its scores under one
  prefix of ``scored_key`` (one per scoring attempt).
- The attempt shown is the one the scorer was given (the ledger's scoring task), else the
  latest upload. Its score is the one the trainer was told about (the run's trainer stream),
  else the latest scoring of that object.
- A trajectory uploaded or scored in a bundle (``shared.object_bundles``) is not under its own
  prefix: with Redis, the ledger's scoring task names its upload and the trainer stream its
  score; without Redis only objects of its own are found.
- A trajectory carried inline (``shared.inline_trajectories``) has no object while in flight:
  the ledger's scoring task names its inline ref, read from Redis, or once consumed from its
  group's spill, which is found without Redis too. Every Trajectory is read by
  ``shared.inline_trajectories.read_trajectory``, whatever its ref.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from shared.ids import parse_trajectory_id
from shared.names import scored_key, trajectory_key
from shared.schemas import ScoredEvent, ScoredTrajectory, StopReason, Trajectory
from shared.inline_trajectories import inline_ref, is_inline_ref, read_trajectory, spilled_trajectory
from shared.object_bundles import is_bundle_key, split_ref
from shared.storage import ObjectStore, StorageError, get_model
from shared.state.ledger import Ledger
from shared.state.trainer_stream import stream_entries

_ATTEMPT = re.compile(r"\.a(\d+)-[0-9a-f]+\.json\.gz$")
_SCORING = re.compile(r"\.s(\d+)\.json\.gz$")


class TrajectoryNotFound(LookupError):
    pass


@dataclass
class FoundTrajectory:
    key: str
    trajectory: Trajectory
    scored: ScoredTrajectory | None
    state: str | None  # the ledger's, when Redis was given
    failure: str | None


def _attempt_of(key: str) -> int:
    match = _ATTEMPT.search(key)
    return int(match.group(1)) if match else 0


def _objects_of(store: ObjectStore, key: str, trajectory_id: str) -> list[str]:
    """The objects next to ``key`` that belong to this trajectory alone (not to one whose id it
    prefixes, nor a bundle named after it: a bundle's members are found by their refs)."""
    return [k for k in store.list_keys(key.removesuffix(".json.gz"))
            if k.rsplit("/", 1)[-1].startswith(f"{trajectory_id}.") and not is_bundle_key(k)]


def _scored_ref_in_stream(redis: Any, run_id: str, trajectory_id: str) -> str | None:
    """The ScoredTrajectory the trainer was told about (its scored event's ``scored_key``): a
    scan of the run's trainer stream, for one trajectory of a bundle, which no listing finds.
    Only entries that mention the id are parsed."""
    needle = f'"{trajectory_id}"'
    for _, raw in stream_entries(redis, run_id):
        if needle in raw and (event := json.loads(raw)).get("trajectory_id") == trajectory_id and event.get("kind") == "scored":
            return event["scored_key"]
    return None


def find_trajectory(store: ObjectStore, trajectory_id: str, redis: Any = None) -> FoundTrajectory:
    try:
        ids = parse_trajectory_id(trajectory_id)
    except ValueError as exc:
        raise TrajectoryNotFound(str(exc)) from None
    plain = trajectory_key(ids.run_id, ids.group_id, trajectory_id)
    uploads = [k for k in _objects_of(store, plain, trajectory_id) if k == plain or _ATTEMPT.search(k)]
    state = failure = given = None
    if redis is not None:
        state, failure, task = Ledger(redis).record(trajectory_id)
        given = json.loads(task)["trajectory_key"] if task else None
    if given is not None and (split_ref(given) is not None or is_inline_ref(given)):  # the ledger names its member or inline ref
        uploads.append(given)
    if not uploads and redis is None and (spilled := spilled_trajectory(store, trajectory_id)) is not None:
        uploads.append(inline_ref(spilled))  # carried inline, then consumed: its group's spill holds it
    if not uploads:
        where = f"; the ledger says {state}" + (f" ({failure})" if failure else "") if state else ""
        raise TrajectoryNotFound(f"no uploaded trajectory {trajectory_id} under {plain.rsplit('/', 1)[0]}/{where}")
    key = given if given in uploads else max(uploads, key=_attempt_of)
    scores = _objects_of(store, scored_key(ids.run_id, ids.group_id, trajectory_id), trajectory_id)
    scores = sorted(scores, key=lambda k: int(m.group(1)) if (m := _SCORING.search(k)) else 1, reverse=True)
    if redis is not None and state in ("scored", "consumed") and (told := _scored_ref_in_stream(redis, ids.run_id, trajectory_id)):
        scores = [told] + [k for k in scores if k != told]
    scored = None
    for score_key in scores:
        candidate = get_model(store, score_key, ScoredTrajectory)
        if candidate.trajectory_key == key:
            scored = candidate
            break
    try:
        trajectory = read_trajectory(store, redis, key)
    except StorageError as exc:
        if not is_inline_ref(key):
            raise
        raise TrajectoryNotFound(f"{exc}; the ledger says {state}" + (f" ({failure})" if failure else "")) from None
    return FoundTrajectory(key, trajectory, scored, state, failure)


def trajectory_of_event(store: ObjectStore, event: ScoredEvent, redis: Any = None) -> Trajectory:
    """The Trajectory a scored event names: one read, or two for an event written before schema
    1.1 (it names only the ScoredTrajectory, which names the Trajectory). ``redis``: the ledger's,
    for one carried inline (without it, only a consumed one's spill is found)."""
    key = event.trajectory_key or get_model(store, event.scored_key, ScoredTrajectory).trajectory_key
    return read_trajectory(store, redis, key)


def stop_reason_of_event(store: ObjectStore, event: ScoredEvent) -> StopReason:
    """The scored trajectory's stop reason: the event's, or its ScoredTrajectory's before schema 1.1."""
    return event.stop_reason or get_model(store, event.scored_key, ScoredTrajectory).stop_reason
