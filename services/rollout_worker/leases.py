"""A rollout worker's background upkeep: the heartbeat that keeps leases of running
trajectories, the reaper that collects expired ones, and the janitor that removes sandbox
containers nobody owns any more.

Invariants:
- A worker process renews all leases it holds in one Redis call per heartbeat; if the
  process dies, its leases stop being renewed and run out after ``lease_ttl_s``.
- The reaper only acts through ``Ledger.expire`` (atomic): any number of reapers may run, in
  any number of workers; a trajectory is re-queued or failed once per expiry.
- A re-queued trajectory is published again at once with its stored request; the claim in the
  ledger makes the copy that loses the race a no-op.
"""

from __future__ import annotations

import logging
import threading
from typing import Callable

from shared.ledger import Ledger
from shared.schemas import RolloutRequest

log = logging.getLogger(__name__)


class LeaseKeeper:
    def __init__(self, ledger: Ledger, lease_ttl_s: float, heartbeat_s: float):
        self.ledger, self.lease_ttl_s, self.heartbeat_s = ledger, lease_ttl_s, heartbeat_s
        self._held: dict[str, str] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def hold(self, trajectory_id: str, token: str) -> None:
        with self._lock:
            self._held[trajectory_id] = token

    def release(self, trajectory_id: str) -> None:
        with self._lock:
            self._held.pop(trajectory_id, None)

    def beat(self) -> int:
        with self._lock:
            held = dict(self._held)
        return self.ledger.heartbeat(held, self.lease_ttl_s) if held else 0

    def start(self) -> None:
        self._thread = _loop_thread("lease-heartbeat", self.heartbeat_s, self.beat, self._stop)

    def stop(self) -> None:
        self._stop.set()


class Reaper:
    def __init__(self, ledger: Ledger, max_attempts: int, interval_s: float, redispatch: Callable[[RolloutRequest], None]):
        self.ledger, self.max_attempts, self.interval_s = ledger, max_attempts, interval_s
        self.redispatch = redispatch
        self._stop = threading.Event()

    def sweep(self) -> dict[str, int]:
        outcome = {"requeued": 0, "failed": 0}
        for trajectory_id in self.ledger.expired_leases():
            result = self.ledger.expire(trajectory_id, self.max_attempts)
            if result == "requeued":
                self.redispatch(self.ledger.request(trajectory_id))
                log.warning("lease of %s expired: re-dispatched", trajectory_id)
            elif result == "failed":
                log.warning("lease of %s expired %d times: failed", trajectory_id, self.max_attempts)
            if result in outcome:
                outcome[result] += 1
        return outcome

    def start(self) -> None:
        _loop_thread("lease-reaper", self.interval_s, self.sweep, self._stop)

    def stop(self) -> None:
        self._stop.set()


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
            _loop_thread("sandbox-janitor", self.interval_s, self.sweep, self._stop)

    def stop(self) -> None:
        self._stop.set()


def _loop_thread(name: str, interval_s: float, fn: Callable[[], object], stop: threading.Event) -> threading.Thread:
    def loop() -> None:
        while not stop.wait(interval_s):
            try:
                fn()
            except Exception:  # Redis blip: try again next tick, never kill the thread
                log.exception("%s tick failed", name)

    thread = threading.Thread(target=loop, name=name, daemon=True)
    thread.start()
    return thread
