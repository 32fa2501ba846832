"""The rollout worker's sandbox janitor: removes sandbox containers nobody owns any more, on every
sandbox provider the worker's settings name (``providers.configured``).

Invariants:
- A container is removed only if it belongs to this worker's stack (``conveyor.stack``, see
  ``shared.stack_id``), and only once its trajectory is no longer ``running`` (its rollout lease
  is over, so no live worker can still use it) or its time to live is over.
- Sandboxes with no stack label (made by a Conveyor before the label) are never removed; the
  first sweep that sees them logs one warning with the command that removes them by hand.
"""

from __future__ import annotations

import logging
import threading
from typing import TYPE_CHECKING

from shared.state.leases import loop_thread
from shared.state.ledger import Ledger
from shared.stack_id import current_stack_id

if TYPE_CHECKING:
    from services.rollout_worker.sandbox.provider import SandboxProvider

log = logging.getLogger(__name__)


class SandboxJanitor:
    """Removes this stack's sandbox containers whose trajectory is no longer running here (or
    whose time to live is over): at worker start, then every ``interval_s``. No Docker daemon: it
    says so once and stays idle, since text-only workers need none."""

    def __init__(self, ledger: Ledger, interval_s: float = 60.0, stack_id: str | None = None):
        self.ledger, self.interval_s = ledger, interval_s
        self.stack_id = stack_id or current_stack_id()
        self._stop = threading.Event()
        self._legacy_reported = False

    def is_done_with(self, trajectory_id: str) -> bool:
        try:
            state = self.ledger.state(trajectory_id)
        except ValueError:  # not a Conveyor trajectory id: leave it to its time to live
            return False
        return state is not None and state != "running"

    def sweep(self) -> int:
        """One pass over every provider this worker may create sandboxes on (``providers.configured``);
        one that does not answer is skipped this time. None answers: the janitor says so and stops."""
        from services.rollout_worker.sandbox.providers import configured

        answering, reason = [], None
        try:
            providers = configured()
        except Exception as exc:  # the local daemon's client cannot even be made: no socket
            providers, reason = [], exc
        for provider in providers:
            try:
                provider.health()
                answering.append(provider)
            except Exception as exc:
                reason = exc
                log.info("sandbox janitor skips %r: it does not answer (%s)", provider, exc)
        if not answering:
            log.info("sandbox janitor idle: no sandbox provider answers, no Docker daemon (%s)", reason)
            self._stop.set()
            return 0
        return sum(self._sweep_one(provider) for provider in answering)

    def _sweep_one(self, provider: SandboxProvider) -> int:
        from services.rollout_worker.sandbox.janitor import legacy_sandboxes, reap

        if not self._legacy_reported:
            self._legacy_reported = True
            if legacy := legacy_sandboxes(provider):
                log.warning("sandbox janitor of stack %s leaves %d sandbox containers without a conveyor.stack label "
                            "alone (made before stack labels); remove them by hand once no old worker runs: "
                            "docker rm -f %s", self.stack_id, len(legacy), " ".join(c[:12] for c in legacy))
        return len(reap(provider, stack_id=self.stack_id, is_terminal=self.is_done_with))

    def start(self) -> None:
        self.sweep()
        if not self._stop.is_set():
            loop_thread("sandbox-janitor", self.interval_s, self.sweep, self._stop)

    def stop(self) -> None:
        self._stop.set()
