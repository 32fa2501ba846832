"""What a sandbox provider is: the one interface ``Sandbox`` and the janitor use to reach a
place that runs sandboxes (a Docker daemon today: ``docker_provider``; docs/sandboxes.md says how
a hosted one would plug in).

A provider does five things, and nothing else:

- **create** a sandbox from a snapshot (``spec.image``), isolated and labelled as ``spec`` says;
- open its **session**: the stepping channel commands run on (``SandboxSession``);
- **transfer files** in (``copy_in``: a tar archive unpacked as the sandbox user);
- for the janitor, **list** the sandboxes carrying given labels and **remove** one;
- say whether it is **healthy** (reachable and able to create).

Invariants every provider keeps (``Sandbox`` and the janitor rely on them):
- ``create`` returns a started sandbox or raises; a failure or cancellation between the
  provider's create call and the return removes what it made. Every sandbox it creates carries
  ``spec``'s labels (``deployment.labels_for``) where ``list_sandboxes`` can filter on them, so its
  owner removes it in ``finally`` and, failing that, its own stack's janitor does.
- The isolation of ``spec`` is enforced, not requested: no network for ``network.mode='none'``,
  the memory/CPU/pid limits, a non-root command user. A spec the provider cannot enforce is a
  ``SandboxConfigError`` at create, never a sandbox with less isolation.
- Lifecycle methods are coroutines that leave the event loop free; the janitor's methods and
  ``health`` are blocking (the janitor runs in a thread).
- ``remove`` and ``remove_now`` are idempotent: a sandbox already gone is fine.
- Errors of the provider's own client leave through ``classify`` as ``SandboxError``s
  (``errors``: infra errors are retried in a fresh sandbox, config errors are not).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Protocol, runtime_checkable

from .errors import SandboxError
from .limiter import ProvisionLimiter
from .results import ExecResult
from .spec import SandboxSpec


class SandboxHandle(Protocol):
    """A created sandbox, as its provider knows it; handed back to the same provider only."""

    @property
    def id(self) -> str: ...
    @property
    def name(self) -> str: ...


class SandboxSession(Protocol):
    """The stepping channel: one command at a time, as the sandbox user (or as root for the
    grader's own commands), bounded in time and kept output (``session.ShellSession``)."""

    async def run(self, command: str, *, timeout_s: float, max_output_bytes: int,
                  as_root: bool = False) -> ExecResult: ...
    async def close(self) -> None: ...


@dataclass(frozen=True)
class ListedSandbox:
    id: str
    labels: Mapping[str, str]


@runtime_checkable
class SandboxProvider(Protocol):
    kind: str  # the settings' tag (shared.settings.sandbox): "docker", ...
    limiter: ProvisionLimiter  # its own rate limit on creation (per host), unless a caller brings one
    # the provider client's own exception types: what ``classify`` turns into SandboxErrors
    client_errors: tuple[type[BaseException], ...]

    async def create(self, spec: SandboxSpec, limiter: ProvisionLimiter) -> SandboxHandle: ...
    async def open_session(self, spec: SandboxSpec, handle: SandboxHandle) -> SandboxSession: ...
    async def copy_in(self, handle: SandboxHandle, archive: bytes, *, dest: str, user: str | None) -> None: ...
    async def remove(self, sandbox_id: str) -> None: ...
    async def describe_exit(self, sandbox_id: str) -> str:
        """How it stopped, as ``status=... exit=... [OOMKilled]`` (``OOMKilled`` when the memory
        limit killed it); never raises."""
        ...

    def classify(self, exc: BaseException, *, during: str) -> SandboxError: ...

    # -- the janitor's (blocking) ---------------------------------------------------------------
    def list_sandboxes(self, labels: list[str]) -> list[ListedSandbox]:
        """Sandboxes, running or stopped, carrying every one of ``labels`` (``key`` or ``key=value``)."""
        ...

    def remove_now(self, sandbox_id: str) -> None: ...

    def health(self) -> None:
        """Returns when the provider answers; raises its client's error otherwise."""
        ...
