"""Sandboxed containers for agent trajectories: one container per trajectory, on a provider.

Layout (in the spirit of SWE-ReX's Deployment/Runtime split):

- ``spec``        what a sandbox is (image, user, limits, timeouts, network, labels); pydantic.
- ``deployment``  the container's lifecycle on the daemon and the isolation policy.
- ``protocol``    the shell line protocol (pure); ``session`` runs it over the attached socket;
                  ``exec_runner`` is the one-exec-per-command fallback.
- ``sandbox``     ``Sandbox``: provision, exec, read/write/list files, diff, teardown.
- ``provider``    the interface to where sandboxes run; ``docker_provider`` the Docker one;
                  ``providers`` which provider each environment uses (``sandbox.provider``);
                  ``placement`` the choice of a host among several (``docker_hosts``).
- ``limiter``     provisioning rate limit; ``retry`` bounded retries of infra errors;
  ``janitor``     removal of its own stack's leaked or expired containers;
  ``images``      offline base images;
  ``pool``        a warm pool of pre-started sandboxes per spec.
- ``errors``      the failure taxonomy; ``results`` plain result types; ``blocking`` the thread
                  pool every docker SDK call runs on.

Typical use::

    spec = SandboxSpec(image=tag, labels=SandboxLabels(run_id=..., group_id=..., trajectory_id=...))
    async with await provision_with_retry(spec, workspace=repo_dir) as sandbox:
        result = await sandbox.exec("pytest -q", timeout_s=60)
"""

from .errors import (
    EpisodeTimeout,
    SandboxClosed,
    SandboxConfigError,
    SandboxError,
    SandboxFileError,
    SandboxInfraError,
    SandboxLost,
)
from .janitor import Reaped, reap
from .limiter import DEFAULT_LIMITER, ProvisionLimiter
from .results import ExecResult, WorkspaceDiff
from .pool import WarmPool
from .provider import SandboxProvider
from .retry import provision_with_retry
from .sandbox import Sandbox
from .spec import Limits, NetworkPolicy, SandboxLabels, SandboxSpec, Timeouts

__all__ = [
    "DEFAULT_LIMITER",
    "EpisodeTimeout",
    "ExecResult",
    "Limits",
    "NetworkPolicy",
    "ProvisionLimiter",
    "Reaped",
    "Sandbox",
    "SandboxClosed",
    "SandboxConfigError",
    "SandboxError",
    "SandboxFileError",
    "SandboxInfraError",
    "SandboxLabels",
    "SandboxLost",
    "SandboxProvider",
    "SandboxSpec",
    "Timeouts",
    "WarmPool",
    "WorkspaceDiff",
    "provision_with_retry",
    "reap",
]
