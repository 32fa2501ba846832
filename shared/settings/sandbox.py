"""Settings of the sandbox providers: where sandboxes run, for the whole stack and per environment
(``services.rollout_worker.sandbox.providers`` turns them into providers; docs/sandboxes.md).

``sandbox.provider`` is a setting with modes, told apart by ``kind``: ``docker`` (one daemon),
``docker_hosts`` (several daemons, each new sandbox placed on one: ``sandbox.placement``), or
``none`` (no sandboxes at all); a hosted provider adds its own section to the union. ``sandbox.environments`` names, per
environment, a provider other than the stack's.

Part of ``shared.settings`` (its docstring states the invariants every section keeps).
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal, Union

from pydantic import Field, model_validator

from shared.settings.base import Float, Int, Section, read_mode


class DockerTLSSettings(Section):
    """Mutual TLS to a remote daemon: the daemon's CA, and this worker's certificate and key."""

    ca_cert: Path
    client_cert: Path
    client_key: Path


class DockerProviderSettings(Section):
    """A Docker daemon: the local one (``DOCKER_HOST`` or its socket) when ``host`` is unset."""

    kind: Literal["docker"] = "docker"
    host: str | None = None  # unix:///var/run/docker.sock, tcp://10.0.0.7:2376, ...
    tls: DockerTLSSettings | None = None
    # the OCI runtime the daemon runs sandboxes with: runc, or a name registered with the daemon
    # (runsc: gVisor, its own kernel in user space; docs/sandboxes.md)
    runtime: str = "runc"
    # this daemon's rate limit on container creation, per worker process (sandbox.limiter)
    max_concurrent_creates: Int = Field(8, gt=0)
    min_create_interval_s: Float = Field(0.01, ge=0)

    @model_validator(mode="after")
    def _tcp_needs_tls(self) -> DockerProviderSettings:
        if self.host is not None and self.host.startswith("tcp://") and self.tls is None:
            raise ValueError("a tcp:// Docker host needs tls (ca_cert, client_cert, client_key): a daemon on plain "
                             "TCP is root on its host for anyone who reaches the port")
        if self.tls is not None and self.host is None:
            raise ValueError("tls needs a host: the local daemon is reached through its socket")
        return self


class NoSandboxProviderSettings(Section):
    """No sandboxes: an environment that asks for one fails with a config error, and the janitor
    has nothing to sweep there (a worker pool for text-only environments, with no daemon)."""

    kind: Literal["none"] = "none"


class DockerHostsSettings(Section):
    """Several Docker daemons for the same sandboxes: each new one goes to the least loaded host
    that answers and holds its image (``services.rollout_worker.sandbox.placement``). Each host
    keeps its own settings (TLS, runtime, rate limit on creation)."""

    kind: Literal["docker_hosts"] = "docker_hosts"
    hosts: list[DockerProviderSettings] = Field(min_length=1)
    # sandboxes this worker keeps on one host before it prefers a host without the image
    max_sandboxes_per_host: Int = Field(32, gt=0)
    # a host that stopped answering is skipped this long before it is asked again
    recheck_s: Float = Field(5.0, gt=0)

    @model_validator(mode="after")
    def _each_host_once(self) -> DockerHostsSettings:
        named = [host.host or "the local daemon" for host in self.hosts]
        if twice := sorted({name for name in named if named.count(name) > 1}):
            raise ValueError(f"a sandbox host is listed twice: {', '.join(twice)} (each daemon once, or its "
                             "sandboxes would be counted apart)")
        return self


# kind names the variant, docker when it is left out (sandbox.provider: {host: ...} is a docker host)
SandboxProviderSettings = Annotated[Union[DockerProviderSettings, DockerHostsSettings, NoSandboxProviderSettings],
                                    Field(discriminator="kind"), read_mode("kind", "docker")]


class SandboxSettings(Section):
    provider: SandboxProviderSettings = DockerProviderSettings()
    # {environment name: provider}: that environment's sandboxes run there instead
    environments: dict[str, SandboxProviderSettings] = Field(default_factory=dict)

    def provider_for(self, env_name: str) -> DockerProviderSettings | DockerHostsSettings | NoSandboxProviderSettings:
        return self.environments.get(env_name, self.provider)
