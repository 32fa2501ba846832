"""The ``none`` sandbox provider: this environment (or stack) runs no sandboxes. Creating one is a
``SandboxConfigError`` naming the setting; the janitor finds nothing to remove; it is always
healthy. For worker pools that serve text-only environments and reach no daemon."""

from __future__ import annotations

from .errors import SandboxConfigError, SandboxError
from .limiter import DEFAULT_LIMITER, ProvisionLimiter
from .provider import ListedSandbox, SandboxHandle, SandboxSession
from .spec import SandboxSpec


class NoSandboxProvider:
    kind = "none"
    client_errors: tuple[type[BaseException], ...] = ()
    limiter = DEFAULT_LIMITER  # never used: nothing is created

    def __repr__(self) -> str:
        return "NoSandboxProvider()"

    async def create(self, spec: SandboxSpec, limiter: ProvisionLimiter) -> SandboxHandle:
        raise SandboxConfigError(f"no sandbox for {spec.labels.trajectory_id}: its environment's sandbox provider "
                                 "is 'none' (settings: sandbox.provider, sandbox.environments)", reason="no_provider")

    async def open_session(self, spec: SandboxSpec, handle: SandboxHandle) -> SandboxSession:
        raise _never_created()

    async def copy_in(self, handle: SandboxHandle, archive: bytes, *, dest: str, user: str | None) -> None:
        raise _never_created()

    async def remove(self, sandbox_id: str) -> None:
        return None

    async def describe_exit(self, sandbox_id: str) -> str:
        return "never created"

    def classify(self, exc: BaseException, *, during: str) -> SandboxError:
        return exc if isinstance(exc, SandboxError) else SandboxConfigError(f"{during}: {exc}", reason="no_provider")

    def list_sandboxes(self, labels: list[str]) -> list[ListedSandbox]:
        return []

    def remove_now(self, sandbox_id: str) -> None:
        return None

    def health(self) -> None:
        return None


def _never_created() -> SandboxConfigError:
    return SandboxConfigError("the 'none' sandbox provider creates no sandboxes", reason="no_provider")
