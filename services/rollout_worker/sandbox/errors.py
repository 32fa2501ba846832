"""Sandbox failures, classified by who is at fault and whether a fresh container can help.

Invariant: every exception that leaves this package for a sandbox reason is a ``SandboxError``
with a short machine-readable ``reason``:

- ``SandboxInfraError``: the daemon, the image store or the host failed (daemon unreachable,
  5xx, missing image, OOM-killed or vanished during setup, provisioning too slow). Retry the
  trajectory in a fresh container, up to a bound (``provision_with_retry``).
- ``SandboxConfigError``: the spec cannot work on this daemon (bad parameter, unsupported
  limit or network mode). Retrying does not help.
- ``SandboxLost``, ``EpisodeTimeout``, ``SandboxClosed``: the episode cannot go on (the agent
  killed or exhausted its container, or ran out of time). End the trajectory with the reason.

A command that fails, times out or prints too much is not an exception: it is an ``ExecResult``.
"""

from __future__ import annotations

import docker.errors
import requests.exceptions


class SandboxError(Exception):
    reason = "sandbox_error"

    def __init__(self, message: str, *, reason: str | None = None):
        super().__init__(message)
        if reason is not None:
            self.reason = reason


class SandboxInfraError(SandboxError):
    reason = "infra"


class SandboxConfigError(SandboxError):
    reason = "config"


class SandboxLost(SandboxError):
    """The container or its shell stopped answering in the middle of an episode."""

    reason = "sandbox_lost"


class EpisodeTimeout(SandboxError):
    reason = "episode_timeout"


class SandboxClosed(SandboxError):
    reason = "closed"


class SandboxFileError(SandboxError):
    """A file operation failed inside a healthy sandbox (missing file, too large, permission)."""

    reason = "file"


def classify_docker_error(exc: BaseException, *, during: str) -> SandboxError:
    """Map an exception raised by the docker SDK (or the socket under it) to a SandboxError."""
    if isinstance(exc, SandboxError):
        return exc
    where = f"{during}: {type(exc).__name__}: {exc}"
    if isinstance(exc, docker.errors.ImageNotFound):
        return SandboxInfraError(where, reason="image_not_found")
    if isinstance(exc, docker.errors.NotFound):
        return SandboxInfraError(where, reason="container_vanished")
    if isinstance(exc, docker.errors.APIError):
        status = exc.status_code or 500
        if 400 <= status < 500 and status not in (404, 408, 409, 429):
            return SandboxConfigError(where, reason="daemon_rejected")
        return SandboxInfraError(where, reason="daemon_error")
    if isinstance(exc, (docker.errors.DockerException, requests.exceptions.RequestException, OSError)):
        return SandboxInfraError(where, reason="daemon_unreachable")
    return SandboxInfraError(where, reason="unexpected")
