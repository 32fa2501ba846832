"""A warm pool of pre-started sandboxes for one spec (image, limits, isolation).

Invariants:
- A pooled sandbox has exactly the isolation of its spec. It is labelled with the pool's
  run id, ``group_id="pool"``, ``trajectory_id="pool-<id>"`` and the spec's time to live.
  Docker labels cannot change after creation, so the trajectory that takes it is recorded on the
  ``Sandbox`` (``assigned_to``), and a leaked pooled container is reaped by its time to live.
- A sandbox goes to exactly one trajectory and never back to the pool: the trajectory's
  teardown removes it, as for any sandbox. So no state leaks from one trajectory to the next.
- The episode clock starts when a trajectory takes the sandbox, not when it was pre-started.
- ``acquire`` never waits for a refill: with the pool empty it provisions a fresh sandbox for
  the trajectory. Each acquire starts one refill in the background. ``close()`` tears every idle
  sandbox down.
"""

from __future__ import annotations

import asyncio
import uuid

from .limiter import ProvisionLimiter
from .placement import SandboxTarget
from .retry import provision_with_retry
from .sandbox import Sandbox
from .spec import SandboxSpec


class WarmPool:
    def __init__(self, spec: SandboxSpec, size: int, *, limiter: ProvisionLimiter | None = None,
                 provider: SandboxTarget | None = None):
        if size < 0:
            raise ValueError("pool size must be >= 0")
        self.spec, self.size, self.limiter, self.provider = spec, size, limiter, provider
        self._idle: list[Sandbox] = []
        self._refills: set[asyncio.Task] = set()
        self._closed = False

    @property
    def idle(self) -> int:
        return len(self._idle)

    async def start(self) -> None:
        """Fill the pool; returns when every sandbox answers."""
        await asyncio.gather(*(self._add_one() for _ in range(self.size - len(self._idle))))

    async def acquire(self, *, run_id: str, group_id: str, trajectory_id: str) -> Sandbox:
        """A running sandbox for this trajectory: a pooled one when there is one, else a fresh one."""
        labelled = self.spec.for_trajectory(run_id=run_id, group_id=group_id, trajectory_id=trajectory_id)
        while self._idle:
            sandbox = self._idle.pop()
            if sandbox.alive:
                self._refill()
                sandbox.restart_episode_clock()
                sandbox.assigned_to = trajectory_id
                return sandbox
            await sandbox.teardown()
        sandbox = await provision_with_retry(labelled, limiter=self.limiter, provider=self.provider)
        sandbox.assigned_to = trajectory_id
        return sandbox

    async def close(self) -> None:
        self._closed = True
        for task in list(self._refills):
            task.cancel()
        await asyncio.gather(*self._refills, return_exceptions=True)
        idle, self._idle = self._idle, []
        await asyncio.gather(*(s.teardown() for s in idle), return_exceptions=True)

    async def __aenter__(self) -> "WarmPool":
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def _refill(self) -> None:
        task = asyncio.get_running_loop().create_task(self._add_one())
        self._refills.add(task)
        task.add_done_callback(self._refills.discard)

    async def _add_one(self) -> None:
        pooled = self.spec.for_trajectory(run_id=self.spec.labels.run_id, group_id="pool",
                                          trajectory_id=f"pool-{uuid.uuid4().hex[:12]}")
        sandbox = await provision_with_retry(pooled, limiter=self.limiter, provider=self.provider)
        sandbox.assigned_to = None
        if self._closed:
            await sandbox.teardown()
            return
        self._idle.append(sandbox)
