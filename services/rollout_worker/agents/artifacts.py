"""Files an agent leaves in its sandbox's artifacts directory, kept with its trajectory.

``agent_coding`` reads them out of the sandbox after the agent ends (``collect``); the episode
uploads them (``upload``) to ``shared.names.agent_artifact_key`` and records the keys in
``env_info['agent']['artifacts']``. A ``metrics.json`` holding a JSON object is also copied into
``env_info['agent']['metrics']``: what the agent measured about itself (a driver's boot time,
its outcome).

Invariants:
- Only regular files directly in the directory are taken, at most ``max_files`` of them, each
  at most ``max_bytes``; a larger file is skipped and named in ``skipped``, never cut.
- Names are plain file names (no ``/``), so a key never leaves the trajectory's prefix.
- Reading never fails the episode: a missing directory gives nothing, and an unreadable file is
  named in ``skipped``.
"""

from __future__ import annotations

import json
import re
import shlex
from dataclasses import dataclass, field

from shared.names import agent_artifact_key
from shared.storage import ObjectStore

METRICS_FILE = "metrics.json"
_PLAIN_NAME = re.compile(r"^[A-Za-z0-9._-]{1,128}$")
CONTENT_TYPES = {".json": "application/json", ".jsonl": "application/x-ndjson", ".txt": "text/plain; charset=utf-8",
                 ".log": "text/plain; charset=utf-8"}


@dataclass
class AgentArtifacts:
    files: dict[str, bytes] = field(default_factory=dict)
    skipped: dict[str, str] = field(default_factory=dict)  # name -> why

    def metrics(self) -> dict | None:
        try:
            metrics = json.loads(self.files[METRICS_FILE])
        except (KeyError, ValueError):
            return None
        return metrics if isinstance(metrics, dict) else None


async def collect(sandbox, directory: str, max_files: int, max_bytes: int) -> AgentArtifacts:
    """The artifacts in ``directory`` of the sandbox (``sandbox.exec`` / ``read_file``)."""
    found = AgentArtifacts()
    listing = await sandbox.exec(f"cd {shlex.quote(directory)} 2>/dev/null && find . -maxdepth 1 -type f | sort",
                                 max_output_bytes=64 << 10)
    names = [line.removeprefix("./") for line in listing.output.splitlines() if line.startswith("./")]
    for name in names:
        if not _PLAIN_NAME.match(name):
            found.skipped[name[:200]] = "not a plain file name"
        elif len(found.files) >= max_files:
            found.skipped[name] = f"more than {max_files} files"
        else:
            try:
                found.files[name] = await sandbox.read_file(f"{directory}/{name}", max_bytes=max_bytes)
            except Exception as exc:  # too large, vanished: named, not fatal
                found.skipped[name] = str(exc)[:300]
    return found


def upload(store: ObjectStore, run_id: str, trajectory_id: str, files: dict[str, bytes]) -> dict[str, str]:
    """Puts every file; returns its key, by name. Blocking."""
    keys = {}
    for name, data in files.items():
        keys[name] = agent_artifact_key(run_id, trajectory_id, name)
        suffix = name[name.rfind("."):] if "." in name else ""
        store.put_bytes(keys[name], data, content_type=CONTENT_TYPES.get(suffix, "application/octet-stream"))
    return keys
