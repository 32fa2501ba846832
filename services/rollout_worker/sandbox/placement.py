"""Placement over several Docker hosts (``sandbox.provider: {kind: docker_hosts, hosts: [...]}``):
each new sandbox goes to one host, and lives there through that host's provider.

``HostPlacement.place(spec)`` picks the host; ``Sandbox.provision`` then creates on it, and the
sandbox keeps the chosen ``PlacedHost`` as its provider for the rest of its life (session, files,
removal), so every call reaches the daemon that holds it.

Invariants:
- Load is what this worker process has on a host: sandboxes placed there and not yet removed
  (being created, or live). It is counted when the host is chosen, under one lock, so the
  sandboxes of a burst spread before any of them exists. No daemon is asked for it.
- A new sandbox goes to the least loaded host that answers and holds ``spec.image`` by content
  (the image id of the first listed host that holds the tag, looked up once per tag); ties go to
  the host listed first. A host without the image is chosen only when every host with it holds
  ``max_sandboxes_per_host`` or more; the image is then shipped to it from the first answering
  host that holds it (``images.ship_image``), once per host however many sandboxes wait for it.
  With no answering host holding it, ``place`` raises ``SandboxInfraError`` (``image_not_found``).
  What a host holds is remembered, and forgotten when a create there misses its image (pruned
  since): that attempt fails as an infra error, and the next placement looks again. With every host full, the least loaded
  host with the image takes it: placement never waits (the rate limits do).
- A host is lost when a call to it fails as ``daemon_unreachable`` or its health check fails
  (no answer within ``docker_provider.HEALTH_TIMEOUT_S``: a host that stays silent is lost too);
  a host in use is pinged every ``recheck_s``, in the background (never by a placement that
  waits for it). A lost host gets no new sandbox for ``recheck_s``, then is pinged the same way
  and used again once it answers. With every host lost,
  ``place`` raises ``SandboxInfraError`` (``daemon_unreachable``): retried as any infra error,
  which is how sandboxes that failed on a lost host go to another (``retry``).
- Each host keeps its own provider, settings and rate limit on creation (``providers``); the
  janitor sweeps each host as a provider of its own (``providers.configured``).
"""

from __future__ import annotations

import threading
import time
from typing import Callable, Union

from .blocking import run_blocking, submit
from .docker_provider import DockerProvider
from .errors import SandboxError, SandboxInfraError
from .images import image_exists, ship_image
from .limiter import ProvisionLimiter
from .provider import ListedSandbox, SandboxHandle, SandboxProvider, SandboxSession
from .spec import SandboxSpec


class PlacedHost:
    """One host of a placement: its docker provider, with this worker's load on it and whether it
    answers. A ``SandboxProvider`` (it delegates), so a sandbox placed here lives through it."""

    def __init__(self, provider: DockerProvider, *, recheck_s: float):
        self.provider = provider
        self.kind, self.limiter, self.client_errors = provider.kind, provider.limiter, provider.client_errors
        self.recheck_s = recheck_s
        self._lock = threading.Lock()
        self._creating = 0
        self._live: set[str] = set()
        self.placed = 0  # sandboxes placed here in this process (for benchmarks and tests)
        self.peak_load = 0
        self.lost_at: float | None = None
        self.checked_at = time.monotonic()  # when the host last answered a ping (or was added)
        self._probing = False
        self.images: set[str] = set()  # image ids known to be there (forgotten when a create misses one)

    def __repr__(self) -> str:
        return f"PlacedHost({self.provider!r}, load={self.load}, lost={self.lost_at is not None})"

    @property
    def load(self) -> int:
        return self._creating + len(self._live)

    def reserve(self) -> None:
        with self._lock:
            self._creating += 1
            self.placed += 1
            self.peak_load = max(self.peak_load, self.load)

    def release(self) -> None:
        """A placed sandbox that will not be created here (its placement failed before create)."""
        with self._lock:
            self._creating -= 1

    def usable(self, now: float) -> bool:
        """Answers, as far as this worker knows. Every ``recheck_s`` the host is pinged in the
        background: one that answered is lost if the ping fails, a lost one usable again once
        it answers."""
        with self._lock:
            answering = self.lost_at is None
            due = now - (self.checked_at if answering else self.lost_at or 0.0) >= self.recheck_s
            if due and not self._probing:
                self._probing = True
                submit(self._probe)
        return answering

    def _probe(self) -> None:
        try:
            self.health()
        except Exception:
            pass
        finally:
            self._probing = False

    def _note(self, error: SandboxError) -> SandboxError:
        if error.reason == "daemon_unreachable":
            self.lost_at = time.monotonic()
        return error

    # -- SandboxProvider, by delegation ------------------------------------------------------------

    async def create(self, spec: SandboxSpec, limiter: ProvisionLimiter) -> SandboxHandle:
        try:
            handle = await self.provider.create(spec, limiter)
        except BaseException as exc:
            self.release()  # the caller classifies the error (``classify`` notes a lost host)
            if isinstance(exc, Exception) and self.provider.classify(exc, during="create").reason == "image_not_found":
                self.images.clear()  # removed there since (pruned): looked for again at the next placement
            raise
        with self._lock:
            self._creating -= 1
            self._live.add(handle.id)
        return handle

    async def open_session(self, spec: SandboxSpec, handle: SandboxHandle) -> SandboxSession:
        return await self.provider.open_session(spec, handle)

    async def copy_in(self, handle: SandboxHandle, archive: bytes, *, dest: str, user: str | None) -> None:
        await self.provider.copy_in(handle, archive, dest=dest, user=user)

    async def remove(self, sandbox_id: str) -> None:
        with self._lock:  # no longer this worker's load, removed or not (the janitor's then)
            self._live.discard(sandbox_id)
        await self.provider.remove(sandbox_id)

    async def describe_exit(self, sandbox_id: str) -> str:
        return await self.provider.describe_exit(sandbox_id)

    def classify(self, exc: BaseException, *, during: str) -> SandboxError:
        return self._note(self.provider.classify(exc, during=during))

    def list_sandboxes(self, labels: list[str]) -> list[ListedSandbox]:
        return self.provider.list_sandboxes(labels)

    def remove_now(self, sandbox_id: str) -> None:
        with self._lock:
            self._live.discard(sandbox_id)
        self.provider.remove_now(sandbox_id)

    def health(self) -> None:
        try:
            self.provider.health()
        except Exception:
            self.lost_at = time.monotonic()
            raise
        self.lost_at, self.checked_at = None, time.monotonic()


class HostPlacement:
    """The ``docker_hosts`` provider setting: several hosts, and the choice among them."""

    kind = "docker_hosts"

    def __init__(self, providers: list[DockerProvider], *, max_sandboxes_per_host: int, recheck_s: float):
        self.hosts = [PlacedHost(p, recheck_s=recheck_s) for p in providers]
        self.room = max_sandboxes_per_host
        self._lock = threading.Lock()
        self._image_ids: dict[str, str] = {}  # tag -> content id (image id)
        self._shipping: dict[tuple[int, str], threading.Lock] = {}

    def __repr__(self) -> str:
        return f"HostPlacement({self.hosts!r})"

    async def place(self, spec: SandboxSpec) -> PlacedHost:
        """The host a new sandbox of ``spec`` is created on, its load already counted there; the
        image is there when this returns. Raises ``SandboxInfraError`` when no host answers."""
        now = time.monotonic()
        usable = [host for host in self.hosts if host.usable(now)]
        if not usable:
            raise SandboxInfraError(f"no sandbox host answers: {self.hosts!r}", reason="daemon_unreachable")
        image_id = await run_blocking(self._image_id, spec.image, usable)
        holders = await run_blocking(self._holding, image_id, usable)
        if not holders:
            raise SandboxInfraError(f"no sandbox host that answers holds the image {spec.image}",
                                    reason="image_not_found")
        holding = {id(host) for host in holders}
        with self._lock:
            host = choose(usable, has_image=lambda h: id(h) in holding, room=self.room)
            host.reserve()
        if id(host) not in holding:
            try:
                await run_blocking(self._ship, spec.image, image_id, holders[0], host)
            except Exception as exc:
                host.release()
                raise host.classify(exc, during=f"ship {spec.image}") from exc
            except BaseException:
                host.release()
                raise
        return host

    def _image_id(self, tag: str, usable: list[PlacedHost]) -> str:
        """Looked up once per tag: a Conveyor image's tag names its content (``images``)."""
        if tag in self._image_ids:
            return self._image_ids[tag]
        for host in usable:
            try:
                image_id = self._image_ids[tag] = host.provider.client.images.get(tag).id
                return image_id
            except host.client_errors:
                continue
        raise SandboxInfraError(f"no sandbox host that answers holds the image {tag}", reason="image_not_found")

    def _holding(self, image_id: str, usable: list[PlacedHost]) -> list[PlacedHost]:
        holding = []
        for host in usable:
            try:
                if image_id in host.images or image_exists(host.provider.client, image_id):
                    host.images.add(image_id)
                    holding.append(host)
            except host.client_errors as exc:
                host.classify(exc, during="look for the image")
        return holding

    def _ship(self, tag: str, image_id: str, source: PlacedHost, host: PlacedHost) -> None:
        key = (self.hosts.index(host), image_id)
        with self._lock:
            lock = self._shipping.setdefault(key, threading.Lock())
        with lock:  # one shipment per host and image; the others wait for it
            if image_id not in host.images:
                ship_image(tag, source=source.provider.client, target=host.provider.client)
                host.images.add(image_id)


def choose(hosts: list[PlacedHost], *, has_image: Callable[[PlacedHost], bool], room: int) -> PlacedHost:
    """The least loaded of: the hosts with the image and room, else those without it with room,
    else those with it, else any (ties: the first listed)."""
    with_image = [h for h in hosts if has_image(h)]
    without = [h for h in hosts if not has_image(h)]
    for candidates in ([h for h in with_image if h.load < room], [h for h in without if h.load < room],
                       with_image, hosts):
        if candidates:
            return min(candidates, key=lambda h: h.load)  # min keeps the first of equals
    raise ValueError("no hosts to choose from")


# what a sandbox may be provisioned on: one provider, or a placement over several hosts
SandboxTarget = Union[SandboxProvider, HostPlacement]


async def placed(target: SandboxTarget, spec: SandboxSpec) -> SandboxProvider:
    """The provider a new sandbox of ``spec`` is created and lives on."""
    return await target.place(spec) if isinstance(target, HostPlacement) else target
