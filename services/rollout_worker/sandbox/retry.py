"""Provisioning with bounded retries of infra errors, each attempt in a fresh container.

Invariant: only ``SandboxInfraError`` is retried, at most ``attempts`` times in total, with
jittered exponential backoff; every failed attempt has already removed its container
(``Sandbox.provision``). Config errors and anything else propagate at once. Each attempt is
placed anew: on several hosts (``placement``), one that failed as unreachable is skipped.
"""

from __future__ import annotations

import logging

import docker
from tenacity import AsyncRetrying, RetryCallState, retry_if_exception_type, stop_after_attempt, wait_exponential_jitter

from .errors import SandboxInfraError
from .limiter import ProvisionLimiter
from .placement import SandboxTarget
from .sandbox import Sandbox
from .spec import SandboxSpec
from .workspace import WorkspaceSource

log = logging.getLogger(__name__)


def _log_retry(state: RetryCallState) -> None:
    exc = state.outcome.exception() if state.outcome else None
    log.warning("provisioning attempt %d failed (%s); retrying in a fresh container", state.attempt_number, exc)


async def provision_with_retry(spec: SandboxSpec, *, workspace: WorkspaceSource | None = None,
                               provider: SandboxTarget | None = None, client: docker.DockerClient | None = None,
                               limiter: ProvisionLimiter | None = None,
                               attempts: int = 3, backoff_initial_s: float = 0.5,
                               backoff_max_s: float = 8.0) -> Sandbox:
    async for attempt in AsyncRetrying(
        retry=retry_if_exception_type(SandboxInfraError),
        stop=stop_after_attempt(attempts),
        wait=wait_exponential_jitter(multiplier=backoff_initial_s, max=backoff_max_s, jitter=backoff_initial_s),
        before_sleep=_log_retry,
        reraise=True,
    ):
        with attempt:
            return await Sandbox.provision(spec, workspace=workspace, provider=provider, client=client,
                                               limiter=limiter)
    raise AssertionError("unreachable: tenacity re-raises the last error")
