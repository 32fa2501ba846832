"""Trajectory artifacts of the coding environment, written to the object store.

Keys: ``artifacts/{run_id}/{trajectory_id}/diff.patch`` (the agent's final diff),
``tests.txt`` (the tail of the hidden tests' output) and ``commands.jsonl`` (one JSON object per
tool call). Input is ``VerifyResult.info`` as ``CodingEnv.verify`` returns it (the trajectory's
``env_info``), so the writer can run anywhere the trajectory is: worker, scorer or offline.
Invariant: all three keys are written, empty when the info lacks the part.
"""

from __future__ import annotations

import json
from typing import Any

from shared.storage import ObjectStore

ARTIFACT_NAMES = ("diff.patch", "tests.txt", "commands.jsonl")


def artifact_keys(run_id: str, trajectory_id: str) -> dict[str, str]:
    return {name: f"artifacts/{run_id}/{trajectory_id}/{name}" for name in ARTIFACT_NAMES}


def write_artifacts(store: ObjectStore, run_id: str, trajectory_id: str, info: dict[str, Any]) -> dict[str, str]:
    keys = artifact_keys(run_id, trajectory_id)
    commands = "".join(json.dumps(entry, sort_keys=True, default=str) + "\n" for entry in info.get("commands") or [])
    store.put_bytes(keys["diff.patch"], str(info.get("diff") or "").encode())
    store.put_bytes(keys["tests.txt"], str(info.get("test_output") or "").encode())
    store.put_bytes(keys["commands.jsonl"], commands.encode())
    return keys
