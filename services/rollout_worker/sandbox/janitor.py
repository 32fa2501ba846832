"""The janitor: removes sandbox containers that outlived their owner, on one provider (``provider``:
its list-and-remove; a ``docker.DockerClient`` is the docker provider on that daemon).

Invariants:
- It only ever touches containers of its own stack: those carrying ``conveyor.trajectory_id``
  and ``conveyor.stack=<its stack id>`` (``shared.stack_id``). Another stack's sandboxes on the
  same daemon are never listed, so never removed, expired or not.
- Sandboxes with no ``conveyor.stack`` label, or an empty one (made before the label existed;
  a container can only blank a label its image gives it, not drop it), belong to no stack it
  can vouch for: they are left alone. ``legacy_sandboxes`` lists them so that the caller can
  say once how to remove them by hand.
- Of its own stack's, it removes one when it is past ``conveyor.created_at + conveyor.ttl``,
  when ``is_terminal(trajectory_id)`` says its trajectory is over, or when its time labels are
  unreadable (a sandbox nobody can account for).
Run it at worker start and periodically; it is idempotent and safe to run from several workers
at once (a container removed by someone else is simply skipped). Blocking: from async code,
call it through ``blocking.run_blocking``.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Callable, Mapping

import docker

from shared.stack_id import LABEL_STACK, stack_label

from .deployment import LABEL_CREATED_AT, LABEL_RUN_ID, LABEL_TRAJECTORY_ID, LABEL_TTL
from .docker_provider import DockerProvider
from .provider import SandboxProvider

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Reaped:
    container_id: str
    trajectory_id: str
    why: str  # "expired", "terminal" or "unlabelled"


def reap(where: SandboxProvider | docker.DockerClient, *, stack_id: str, is_terminal: Callable[[str], bool] | None = None,
         run_id: str | None = None, now: float | None = None) -> list[Reaped]:
    provider = _as_provider(where)
    now = time.time() if now is None else now
    label_filter = [LABEL_TRAJECTORY_ID, stack_label(stack_id)] + ([f"{LABEL_RUN_ID}={run_id}"] if run_id else [])
    reaped = []
    for listed in provider.list_sandboxes(label_filter):
        trajectory_id = listed.labels.get(LABEL_TRAJECTORY_ID, "")
        why = _why_reap(listed.labels, trajectory_id, now, is_terminal)
        if why is None:
            continue
        provider.remove_now(listed.id)
        log.info("janitor of stack %s removed %s (trajectory %s): %s", stack_id, listed.id[:12], trajectory_id, why)
        reaped.append(Reaped(listed.id, trajectory_id, why))
    return reaped


def legacy_sandboxes(where: SandboxProvider | docker.DockerClient) -> list[str]:
    """Ids of sandbox containers without a ``conveyor.stack`` label (or with an empty one), which
    no janitor removes."""
    return [listed.id for listed in _as_provider(where).list_sandboxes([LABEL_TRAJECTORY_ID])
            if not listed.labels.get(LABEL_STACK)]


def _as_provider(where: SandboxProvider | docker.DockerClient) -> SandboxProvider:
    return DockerProvider(where) if isinstance(where, docker.DockerClient) else where


def _why_reap(labels: Mapping[str, str], trajectory_id: str, now: float,
              is_terminal: Callable[[str], bool] | None) -> str | None:
    try:
        expires = float(labels[LABEL_CREATED_AT]) + float(labels[LABEL_TTL])
    except (KeyError, ValueError):
        return "unlabelled"
    if now >= expires:
        return "expired"
    if is_terminal is not None and is_terminal(trajectory_id):
        return "terminal"
    return None
