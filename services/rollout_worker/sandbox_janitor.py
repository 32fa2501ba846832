"""The rollout worker's sandbox janitor: removes sandbox containers nobody owns any more.

Invariant: a container is removed only once its trajectory is no longer ``running`` (its
rollout lease is over, so no live worker can still use it) or its time to live is over.
"""

from __future__ import annotations

import logging
import threading

from shared.leases import loop_thread
from shared.ledger import Ledger

log = logging.getLogger(__name__)


class SandboxJanitor:
    """Removes sandbox containers whose trajectory is no longer running here (or whose time to
    live is over): at worker start, then every ``interval_s``. No Docker daemon: it says so
    once and stays idle, since text-only workers need none."""

    def __init__(self, ledger: Ledger, interval_s: float = 60.0):
        self.ledger, self.interval_s = ledger, interval_s
        self._stop = threading.Event()

    def is_done_with(self, trajectory_id: str) -> bool:
        try:
            state = self.ledger.state(trajectory_id)
        except ValueError:  # not a Conveyor trajectory id: leave it to its time to live
            return False
        return state is not None and state != "running"

    def sweep(self) -> int:
        import docker

        from services.rollout_worker.sandbox.client import default_client
        from services.rollout_worker.sandbox.janitor import reap

        try:
            client = default_client()
            client.ping()
        except docker.errors.DockerException as exc:
            log.info("sandbox janitor idle: no Docker daemon (%s)", exc)
            self._stop.set()
            return 0
        return len(reap(client, is_terminal=self.is_done_with))

    def start(self) -> None:
        self.sweep()
        if not self._stop.is_set():
            loop_thread("sandbox-janitor", self.interval_s, self.sweep, self._stop)

    def stop(self) -> None:
        self._stop.set()
