"""Trajectory artifacts of the coding environment, written to the object store.

Keys under ``artifacts/{run_id}/{trajectory_id}/``: ``diff.patch`` (the agent's final diff, whole),
``tests.txt`` (the tail of the hidden tests' output) and ``commands.jsonl`` (one JSON object per
tool call). Input is ``VerifyResult.info`` as ``CodingEnv.verify`` returns it (the trajectory's
``env_info``), so the writer can run anywhere the trajectory is: worker, scorer or offline.

Invariants:
- ``diff.patch`` is only ever a whole diff, so ``git apply`` on it applies everything the agent
  did. When the info holds a cut diff (larger than ``info_diff_bytes``), it goes to
  ``diff.cut.patch`` instead, behind a first line saying so, and ``diff.patch`` is not written.
- ``tests.txt`` and ``commands.jsonl`` are always written (empty when the info lacks the part).
- Every object carries its real content type (``CONTENT_TYPES``).
"""

from __future__ import annotations

import json
from typing import Any

from shared.storage import ObjectStore

ARTIFACT_NAMES = ("diff.patch", "diff.cut.patch", "tests.txt", "commands.jsonl")
CONTENT_TYPES = {"diff.patch": "text/x-diff; charset=utf-8", "diff.cut.patch": "text/plain; charset=utf-8",
                 "tests.txt": "text/plain; charset=utf-8", "commands.jsonl": "application/x-ndjson"}


def artifact_keys(run_id: str, trajectory_id: str) -> dict[str, str]:
    return {name: f"artifacts/{run_id}/{trajectory_id}/{name}" for name in ARTIFACT_NAMES}


def write_artifacts(store: ObjectStore, run_id: str, trajectory_id: str, info: dict[str, Any]) -> dict[str, str]:
    """Writes the artifacts; returns the keys written, by name."""
    keys = artifact_keys(run_id, trajectory_id)
    diff = str(info.get("diff") or "")
    if info.get("diff_truncated"):
        note = (f"# conveyor: CUT - the first {len(diff)} characters of a {info.get('diff_bytes')}-byte diff; "
                "this is not a valid patch\n")
        parts = {"diff.cut.patch": note + diff}
    else:
        parts = {"diff.patch": diff}
    parts["tests.txt"] = str(info.get("test_output") or "")
    parts["commands.jsonl"] = "".join(json.dumps(entry, sort_keys=True, default=str) + "\n"
                                      for entry in info.get("commands") or [])
    for name, text in parts.items():
        store.put_bytes(keys[name], text.encode(), content_type=CONTENT_TYPES[name])
    return {name: keys[name] for name in parts}
