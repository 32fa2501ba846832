"""The trainer's metrics file: one JSON line per completed group (``trainer.metrics_path``).

Invariants:
- Exactly one line per decision of a group, however often the trainer dies and replays: the
  consumer writes a group's line before the transaction that marks the group done, and the
  write is idempotent by (group id, the stream entry that completed the group). A trainer
  killed between the two replays the group's pending entries on restart, completes it on the
  same entry, and finds its line already written; one killed before the line finds none and
  writes it. So a crash can neither double a line nor lose one. (A group re-opened by
  ``conveyor retry`` completes on a new entry, and its new decision gets its own line.)
- The lines already written are read once, at start, from the file itself (which may hold
  other runs' lines too: a line is known by its run id, group id and ``completed_by``). A line
  cut short by a crash of the machine is left as it is and ignored, and the next line starts
  on a new line.
- Each line goes out in one ``write`` and is flushed to disk before the group is marked done.
  A fault of the disk (full, read-only, unavailable) is waited out
  (``shared.storage_faults.wait_out_disk_faults``): the trainer says why it waits and goes on.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from pathlib import Path
from typing import Any

from shared.storage_faults import wait_out_disk_faults

log = logging.getLogger(__name__)


class GroupMetricsLog:
    def __init__(self, path: Path, run_id: str):
        self.path, self.run_id = Path(path), run_id
        self.path.parent.mkdir(parents=True, exist_ok=True)
        # (group id, completing entry) of this run's lines in the file (None: a line without the field)
        self.written: set[tuple[int | None, str | None]] = set()
        self._ends_cleanly = True
        self._lock = threading.Lock()
        self._read_written()

    def _read_written(self) -> None:
        if not self.path.exists():
            return
        data = self.path.read_bytes()
        self._ends_cleanly = not data or data.endswith(b"\n")
        for raw in data.splitlines():
            try:
                line = json.loads(raw)
            except ValueError:
                log.warning("%s: ignoring a line that is not JSON (cut short by a crash?): %.80r", self.path, raw)
                continue
            if isinstance(line, dict) and line.get("run_id") == self.run_id:
                self.written.add((line.get("group_id"), line.get("completed_by")))

    def write(self, line: dict[str, Any], completed_by: str) -> bool:
        """Append the group's line unless it is already there; True if this call wrote it.
        ``completed_by``: the id of the stream entry that completed the group."""
        key = (line["group_id"], completed_by)
        with self._lock:  # the consumer assembles sibling groups in threads: one line at a time
            if key in self.written:
                log.info("group %d: metrics line already written (a replay after a restart)", key[0])
                return False
            wait_out_disk_faults("trainer metrics file", lambda: self._append(
                json.dumps({**line, "run_id": self.run_id, "completed_by": completed_by}) + "\n"))
            self.written.add(key)
            return True

    def _append(self, text: str) -> None:
        """One whole line, on a line of its own: a write cut short by a fault of the disk leaves
        a partial line, which the next write ends first (and a reader passes over)."""
        if not self._ends_cleanly:
            text = "\n" + text
        self._ends_cleanly = False
        with self.path.open("a") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
        self._ends_cleanly = True
