"""The ``docker`` sandbox provider: one container per sandbox on a Docker daemon (the local one,
``DOCKER_HOST``, or the daemon ``client_for`` reaches).

The isolation policy and the container's lifecycle are ``deployment``'s; the stepping session is
``session.ShellSession`` on the socket attached to PID 1 (over TLS, the streams ``tls_attach``
opens; ``exec_runner`` with ``spec.session=False``); files go in through one exec's stdin
(``workspace.copy_in``). Invariants: those of ``provider``.
"""

from __future__ import annotations

import docker
import docker.errors
import requests.exceptions

from .blocking import run_blocking
from .deployment import StartedContainer, remove_container, start_container
from .errors import SandboxError, classify_docker_error
from .exec_runner import ExecRunner
from .limiter import DEFAULT_LIMITER, ProvisionLimiter
from .protocol import KILL_SIGNAL
from .provider import ListedSandbox, SandboxHandle, SandboxSession
from .session import ShellSession
from .spec import SandboxSpec
from .workspace import copy_in


HEALTH_TIMEOUT_S = 2.0


class DockerProvider:
    kind = "docker"
    # a daemon gone mid-episode raises requests' ConnectionError, which the SDK does not wrap
    client_errors: tuple[type[BaseException], ...] = (docker.errors.DockerException,
                                                      requests.exceptions.RequestException)

    def __init__(self, client: docker.DockerClient, limiter: ProvisionLimiter | None = None, *,
                 runtime: str = "runc"):
        self.client = client
        self.limiter = limiter or DEFAULT_LIMITER
        self.runtime = runtime  # the daemon's OCI runtime for sandboxes: runc, or runsc (gVisor)

    def __repr__(self) -> str:
        return f"DockerProvider({self.client.api.base_url}, runtime={self.runtime})"

    async def create(self, spec: SandboxSpec, limiter: ProvisionLimiter) -> StartedContainer:
        return await start_container(self.client.api, spec, limiter, runtime=self.runtime)

    async def open_session(self, spec: SandboxSpec, handle: SandboxHandle) -> SandboxSession:
        started = _started(handle)
        api = self.client.api
        if started.shell_socket is None:
            return ExecRunner(api, started.id, user=f"{started.uid}:{started.gid}", env=spec.env,
                              workdir=spec.workspace_dir,
                              kill_grace_s=spec.timeouts.kill_grace_s, flood_bytes=spec.output_flood_bytes)

        async def kill() -> None:
            await run_blocking(api.kill, started.id, KILL_SIGNAL)

        return await ShellSession.open(started.shell_socket, kill=kill, cwd=spec.workspace_dir,
                                       kill_grace_s=spec.timeouts.kill_grace_s, flood_bytes=spec.output_flood_bytes,
                                       ready_timeout_s=spec.timeouts.provision_s, uid=started.uid, gid=started.gid)

    async def copy_in(self, handle: SandboxHandle, archive: bytes, *, dest: str, user: str | None) -> None:
        await run_blocking(copy_in, self.client.api, handle.id, archive, dest=dest, user=user)

    async def remove(self, sandbox_id: str) -> None:
        await run_blocking(remove_container, self.client.api, sandbox_id)

    async def describe_exit(self, sandbox_id: str) -> str:
        try:
            state = (await run_blocking(self.client.api.inspect_container, sandbox_id))["State"]
        except Exception as exc:
            return f"container state unknown: {exc}"
        flags = ["OOMKilled"] if state.get("OOMKilled") else []
        return f"status={state.get('Status')} exit={state.get('ExitCode')} {' '.join(flags)}".strip()

    def classify(self, exc: BaseException, *, during: str) -> SandboxError:
        return classify_docker_error(exc, during=during)

    def list_sandboxes(self, labels: list[str]) -> list[ListedSandbox]:
        return [ListedSandbox(info["Id"], info.get("Labels") or {})
                for info in self.client.api.containers(all=True, filters={"label": labels})]

    def remove_now(self, sandbox_id: str) -> None:
        remove_container(self.client.api, sandbox_id)

    def health(self) -> None:
        """The daemon answers ``/_ping`` within ``HEALTH_TIMEOUT_S``: a host that stays silent (a
        stopped daemon, a lost route) fails it in seconds, not the client's ``TIMEOUT_S``."""
        api = self.client.api
        api.get(f"{api.base_url}/_ping", timeout=HEALTH_TIMEOUT_S).raise_for_status()


def _started(handle: SandboxHandle) -> StartedContainer:
    if not isinstance(handle, StartedContainer):
        raise TypeError(f"the docker provider was handed another provider's sandbox: {handle!r}")
    return handle
