"""Which provider a sandbox runs on: built from the settings (``shared.settings.sandbox``), one per
distinct setting, and chosen per environment.

Invariants:
- One provider (one client, one connection pool) per distinct provider setting in a process:
  two environments naming the same host share it.
- Until ``configure`` is called, every environment gets the local Docker daemon
  (``client.default_client``: its socket or ``DOCKER_HOST``), as before providers existed.
  The rollout worker calls ``configure(settings.sandbox)`` at start.
- ``configured()`` lists every provider this process may create sandboxes on, so the janitor
  sweeps each of them: each host of a ``docker_hosts`` setting is one, shared with a ``docker``
  setting that names the same host.
- A ``docker_hosts`` setting is a ``placement.HostPlacement`` over those hosts' providers.
"""

from __future__ import annotations

import functools
import threading

import docker
import requests.adapters
from docker.tls import TLSConfig

from pydantic import TypeAdapter

from shared.settings.sandbox import (DockerHostsSettings, DockerProviderSettings, SandboxProviderSettings,
                                     SandboxSettings)

from .client import POOL_SIZE, TIMEOUT_S, default_client
from .docker_provider import DockerProvider
from .limiter import DEFAULT_LIMITER, ProvisionLimiter
from .no_provider import NoSandboxProvider
from .placement import HostPlacement, SandboxTarget
from .provider import SandboxProvider

# Docker 20.10's API, which every daemon since accepts; what the isolation policy needs exists there
REMOTE_API_VERSION = "1.41"
_SETTINGS: TypeAdapter[SandboxProviderSettings] = TypeAdapter(SandboxProviderSettings)
_lock = threading.Lock()
_settings = SandboxSettings()


def configure(settings: SandboxSettings) -> None:
    global _settings
    with _lock:
        _settings = settings


def provider_for_environment(env_name: str) -> SandboxTarget:
    return provider_from(_settings.provider_for(env_name))


def default_provider() -> SandboxTarget:
    return provider_from(_settings.provider)


def configured() -> list[SandboxProvider]:
    """Every provider the settings name, each once (the stack's first; a placement's hosts in
    their order)."""
    listed: list[SandboxProvider] = []
    for settings in (_settings.provider, *_settings.environments.values()):
        named = settings.hosts if isinstance(settings, DockerHostsSettings) else [settings]
        listed += [p for p in map(provider_from, named) if not isinstance(p, HostPlacement) and p not in listed]
    return listed


def provider_from(settings: SandboxProviderSettings) -> SandboxTarget:
    return _cached(settings.model_dump_json())


@functools.lru_cache(maxsize=None)
def _cached(settings_json: str) -> SandboxTarget:
    settings = _SETTINGS.validate_json(settings_json)
    if isinstance(settings, DockerProviderSettings):
        return DockerProvider(docker_client(settings), _limiter(settings), runtime=settings.runtime)
    if isinstance(settings, DockerHostsSettings):
        return HostPlacement([docker_provider(host) for host in settings.hosts], recheck_s=settings.recheck_s,
                             max_sandboxes_per_host=settings.max_sandboxes_per_host)
    return NoSandboxProvider()


def docker_provider(settings: DockerProviderSettings) -> DockerProvider:
    """The one provider of this process for a Docker daemon's setting."""
    provider = provider_from(settings)
    assert isinstance(provider, DockerProvider)  # a docker setting makes a docker provider
    return provider


def _limiter(settings: DockerProviderSettings) -> ProvisionLimiter:
    """The host's own limit; the process-wide one for the local daemon at its defaults (as before
    there were providers, so benchmarks and other callers share it)."""
    defaults = DockerProviderSettings()
    if settings.host is None and (settings.max_concurrent_creates, settings.min_create_interval_s) == (
            defaults.max_concurrent_creates, defaults.min_create_interval_s):
        return DEFAULT_LIMITER
    return ProvisionLimiter(settings.max_concurrent_creates, settings.min_create_interval_s)


def docker_client(settings: DockerProviderSettings) -> docker.DockerClient:
    """The daemon a docker provider setting names (mutual TLS when ``tls`` is set)."""
    if settings.host is None:
        return default_client()
    tls = None
    if settings.tls is not None:
        tls = TLSConfig(client_cert=(str(settings.tls.client_cert), str(settings.tls.client_key)),
                        ca_cert=str(settings.tls.ca_cert), verify=True)
    # The API version is named, not asked for at construction: requests lets REQUESTS_CA_BUNDLE /
    # CURL_CA_BUNDLE replace a session's CA (psf/requests#3829), so the client must stop reading
    # the environment (trust_env) before its first request; the daemon's CA is the one to trust.
    client = docker.DockerClient(base_url=settings.host, tls=tls, version=REMOTE_API_VERSION,
                                 max_pool_size=POOL_SIZE, timeout=TIMEOUT_S)
    client.api.trust_env = False
    # over TLS the SDK keeps requests' own pool of 10 connections (max_pool_size is for sockets):
    # a burst would open and drop connections, a TLS handshake each
    client.api.mount("https://", requests.adapters.HTTPAdapter(pool_maxsize=POOL_SIZE))
    return client
