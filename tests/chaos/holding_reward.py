"""A test-only reward function that lets a chaos test catch a scorer in the act, without timing
luck: in a process whose environment names ``CHAOS_HOLD_DIR``, every call after the first
``CHAOS_HOLD_AFTER`` writes its trajectory id into that directory and then blocks until the
process is killed. Meanwhile the scorer holds the task's message and the trajectory's scoring
lease, and keeps the lease renewed. Anywhere else it returns 0 at once (give it weight 0)."""

from __future__ import annotations

import itertools
import os
import threading
from pathlib import Path

from shared.schemas import Trajectory

_calls = itertools.count(1)
_lock = threading.Lock()


def hold_when_told(trajectory: Trajectory) -> float:
    hold_dir = os.environ.get("CHAOS_HOLD_DIR")
    if hold_dir:
        with _lock:
            call = next(_calls)
        if call > int(os.environ.get("CHAOS_HOLD_AFTER", "0")):
            (Path(hold_dir) / trajectory.trajectory_id).touch()
            threading.Event().wait()  # until SIGKILL
    return 0.0
