"""One trajectory's sandbox: provision, exec, files, workspace diff, teardown, on any provider
(``provider``; the local Docker daemon unless told).

Invariants:
- ``Sandbox.provision`` either returns a sandbox whose shell answers, or removes what it created
  and raises a ``SandboxError`` (infra errors are retryable: see ``retry.provision_with_retry``).
  It takes at most ``timeouts.provision_s``.
- Every coroutine leaves the event loop free: the provider's calls do (``provider``).
- After the episode deadline (``timeouts.episode_s`` from provisioning), commands raise
  ``EpisodeTimeout``; no command runs past it.
- A sandbox whose shell is lost while its provider does not answer (the host is gone), in an
  episode or during setup, raises ``SandboxInfraError`` (``daemon_unreachable``), retried as an
  infra error (on another host, with several: ``placement``), not ``SandboxLost``.
- ``teardown`` is idempotent and completes the removal even if its caller is cancelled. Use
  ``async with await Sandbox.provision(spec) as sandbox:`` so it runs in ``finally``.
"""

from __future__ import annotations

import asyncio
import logging
import time

import docker

from shared.prometheus import SANDBOX_PROVISION_SECONDS

from . import files
from .blocking import run_blocking
from .docker_provider import DockerProvider
from .errors import EpisodeTimeout, SandboxClosed, SandboxError, SandboxFileError, SandboxInfraError, SandboxLost
from .limiter import ProvisionLimiter
from .placement import SandboxTarget, placed
from .provider import SandboxHandle, SandboxProvider, SandboxSession
from .providers import default_provider
from .results import ExecResult, WorkspaceDiff
from .spec import SandboxSpec
from .workspace import WorkspaceSource, pack

log = logging.getLogger(__name__)


class Sandbox:
    def __init__(self, spec: SandboxSpec, provider: SandboxProvider, handle: SandboxHandle, runner: SandboxSession):
        self.spec = spec
        self.container_id = handle.id  # the provider's id of the sandbox (a container's, for docker)
        self.name = handle.name
        self.provider = provider
        self._runner = runner
        self._deadline = time.monotonic() + spec.timeouts.episode_s
        self.assigned_to: str | None = spec.labels.trajectory_id  # differs for pooled sandboxes (pool.py)
        self._baseline: dict[str, str] = {}
        self._closed = False
        self._lost: SandboxLost | None = None

    # -- lifecycle -----------------------------------------------------------------------------

    @classmethod
    async def provision(cls, spec: SandboxSpec, *, workspace: WorkspaceSource | None = None,
                        provider: SandboxTarget | None = None, client: docker.DockerClient | None = None,
                        limiter: ProvisionLimiter | None = None) -> Sandbox:
        """On ``provider`` (on the host it places the sandbox on, for a ``placement.HostPlacement``);
        else the docker provider on ``client``; else the process's default provider
        (``providers.default_provider``). Rate-limited by ``limiter``, else the provider's."""
        clock = time.perf_counter()
        deadline = asyncio.get_running_loop().time() + spec.timeouts.provision_s
        try:
            async with asyncio.timeout_at(deadline):
                provider = await placed(provider or _provider_for(client), spec)
        except TimeoutError as exc:
            raise SandboxInfraError(f"placing the sandbox took longer than {spec.timeouts.provision_s:.0f}s",
                                    reason="provision_timeout") from exc
        started: SandboxHandle | None = None
        runner: SandboxSession | None = None
        step = "create"
        try:
            async with asyncio.timeout_at(deadline):
                started = await provider.create(spec, limiter or provider.limiter)
                step = "open the shell"
                runner = await provider.open_session(spec, started)
                sandbox = cls(spec, provider, started, runner)
                if workspace is not None:
                    step = "copy the workspace in"
                    archive = await run_blocking(pack, workspace)
                    await provider.copy_in(started, archive, dest=spec.workspace_dir, user=spec.user)
                    sandbox._baseline = await sandbox._manifest()
                SANDBOX_PROVISION_SECONDS.observe(time.perf_counter() - clock)
                return sandbox
        except BaseException as exc:
            if started is not None:
                try:
                    await _discard(provider, started.id, runner)
                except Exception as cleanup_exc:  # the janitor removes it after its TTL
                    log.warning("could not remove %s after a failed provision: %s", started.name, cleanup_exc)
            if isinstance(exc, TimeoutError):
                raise SandboxInfraError(f"provisioning took longer than {spec.timeouts.provision_s:.0f}s (at: {step})",
                                        reason="provision_timeout") from exc
            if isinstance(exc, SandboxLost) and started is not None:
                if not await _answers(provider):  # the host is gone, not the sandbox
                    raise SandboxInfraError(f"{exc} during setup ({step}); its host does not answer",
                                            reason="daemon_unreachable") from exc
                state = await provider.describe_exit(started.id)
                reason = "oom_during_setup" if "OOMKilled" in state else "died_during_setup"
                raise SandboxInfraError(f"the sandbox died during setup ({step}): {state}", reason=reason) from exc
            if isinstance(exc, Exception):
                raise provider.classify(exc, during=step) from exc
            raise

    async def teardown(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            await _discard(self.provider, self.container_id, self._runner)
        except self.provider.client_errors as exc:
            during = f"teardown of {self.name} (the janitor removes it after its TTL)"
            raise self.provider.classify(exc, during=during) from exc

    async def __aenter__(self) -> Sandbox:
        return self

    async def __aexit__(self, *exc_info) -> None:
        await self.teardown()

    @property
    def alive(self) -> bool:
        return not self._closed and self._lost is None

    def restart_episode_clock(self) -> None:
        """Start the episode deadline now: a pre-started (pooled) sandbox gets its full episode
        time from when a trajectory takes it, not from when it was provisioned."""
        self._deadline = time.monotonic() + self.spec.timeouts.episode_s

    @property
    def remaining_s(self) -> float:
        return self._deadline - time.monotonic()

    # -- commands ------------------------------------------------------------------------------

    async def exec(self, command: str, *, timeout_s: float | None = None,
                   max_output_bytes: int | None = None) -> ExecResult:
        """Run ``command`` as the sandbox user (never root)."""
        return await self._exec(command, timeout_s, max_output_bytes, as_root=False)

    async def exec_trusted(self, command: str, *, timeout_s: float | None = None,
                           max_output_bytes: int | None = None) -> ExecResult:
        """Run ``command`` as root (CAP_SETUID/SETGID/KILL only). For commands the grader composes
        from its own text; never pass the agent's text, nor follow paths the agent controls."""
        return await self._exec(command, timeout_s, max_output_bytes, as_root=True)

    async def _exec(self, command: str, timeout_s: float | None, max_output_bytes: int | None, *,
                    as_root: bool) -> ExecResult:
        if self._closed:
            raise SandboxClosed(f"sandbox {self.name} was torn down")
        if self._lost is not None:
            raise self._lost
        remaining = self.remaining_s
        if remaining <= 0:
            raise EpisodeTimeout(f"the episode's {self.spec.timeouts.episode_s:.0f}s are over")
        timeout = min(timeout_s if timeout_s is not None else self.spec.timeouts.command_s, remaining)
        try:
            return await self._runner.run(command, timeout_s=timeout, as_root=as_root,
                                          max_output_bytes=max_output_bytes or self.spec.max_output_bytes)
        except SandboxLost as exc:
            if not await _answers(self.provider):  # the host is gone, not the sandbox: retry elsewhere
                raise SandboxInfraError(f"{exc}; its host does not answer", reason="daemon_unreachable") from exc
            state = await self.provider.describe_exit(self.container_id)
            reason = ("oom" if "OOMKilled" in state else
                      "pids_exhausted" if "can't fork" in str(exc) or "Cannot fork" in str(exc) else exc.reason)
            self._lost = SandboxLost(f"{exc} ({state})", reason=reason)
            raise self._lost from exc
        except self.provider.client_errors as exc:
            raise self.provider.classify(exc, during="exec") from exc

    # -- files ---------------------------------------------------------------------------------

    async def read_file(self, path: str, *, max_bytes: int = 1 << 20) -> bytes:
        path = files.resolve(path, self.spec.workspace_dir)
        result = await self.exec(files.read_command(path, max_bytes), max_output_bytes=files.read_output_cap(max_bytes))
        return files.decode_read(path, result.exit_code, result.raw)

    async def write_file(self, path: str, data: bytes | str) -> None:
        path = files.resolve(path, self.spec.workspace_dir)
        payload = data.encode() if isinstance(data, str) else data
        for command in files.write_commands(path, payload):
            result = await self.exec(command)
            if result.exit_code != 0:
                raise _file_error("write_file", path, result)

    async def list_files(self, path: str = ".", *, recursive: bool = False) -> list[str]:
        """Paths under ``path`` relative to it, sorted; directories end with ``/``."""
        path = files.resolve(path, self.spec.workspace_dir)
        result = await self.exec(files.list_command(path, recursive=recursive), max_output_bytes=8 << 20)
        if result.exit_code != 0 or result.truncated:
            raise _file_error("list_files", path, result)
        return files.parse_list(result.output)

    async def diff(self) -> WorkspaceDiff:
        """What changed in the workspace since provisioning (by content hash, regular files)."""
        now = await self._manifest()
        before = self._baseline
        return WorkspaceDiff(
            added=tuple(sorted(now.keys() - before.keys())),
            modified=tuple(sorted(p for p in now.keys() & before.keys() if now[p] != before[p])),
            deleted=tuple(sorted(before.keys() - now.keys())),
        )

    async def _manifest(self) -> dict[str, str]:
        result = await self.exec(files.manifest_command(self.spec.workspace_dir), max_output_bytes=64 << 20)
        if result.exit_code != 0 or result.truncated:
            raise _file_error("manifest", self.spec.workspace_dir, result)
        return files.parse_manifest(result.output)


def _provider_for(client: docker.DockerClient | None) -> SandboxTarget:
    if client is not None:
        return DockerProvider(client)
    return default_provider()


async def _answers(provider: SandboxProvider) -> bool:
    try:
        await run_blocking(provider.health)
        return True
    except Exception:
        return False


async def _discard(provider: SandboxProvider, sandbox_id: str, runner: SandboxSession | None) -> None:
    """Remove the sandbox; the removal finishes even if the awaiting task is cancelled."""
    removal = asyncio.ensure_future(provider.remove(sandbox_id))
    try:
        await asyncio.shield(removal)
    finally:
        if runner is not None:
            await runner.close()


def _file_error(op: str, path: str, result: ExecResult) -> SandboxError:
    detail = result.output.strip()[:500] or f"exit {result.exit_code}"
    return SandboxFileError(f"{op}({path!r}) failed: {detail}")
