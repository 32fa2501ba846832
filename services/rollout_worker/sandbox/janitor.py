"""The janitor: removes sandbox containers that outlived their owner.

Invariant: it only ever touches containers carrying ``conveyor.trajectory_id``, and removes one
when it is past ``conveyor.created_at + conveyor.ttl``, when ``is_terminal(trajectory_id)`` says
its trajectory is over, or when its labels are unreadable (a sandbox nobody can account for).
Run it at worker start and periodically; it is idempotent and safe to run from several workers
at once (a container removed by someone else is simply skipped). Blocking: from async code,
call it through ``blocking.run_blocking``.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Callable

import docker

from .deployment import LABEL_CREATED_AT, LABEL_RUN_ID, LABEL_TRAJECTORY_ID, LABEL_TTL, remove_container

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Reaped:
    container_id: str
    trajectory_id: str
    why: str  # "expired", "terminal" or "unlabelled"


def reap(client: docker.DockerClient, *, is_terminal: Callable[[str], bool] | None = None,
         run_id: str | None = None, now: float | None = None) -> list[Reaped]:
    now = time.time() if now is None else now
    label_filter = [LABEL_TRAJECTORY_ID] + ([f"{LABEL_RUN_ID}={run_id}"] if run_id else [])
    reaped = []
    for info in client.api.containers(all=True, filters={"label": label_filter}):
        labels = info.get("Labels") or {}
        trajectory_id = labels.get(LABEL_TRAJECTORY_ID, "")
        why = _why_reap(labels, trajectory_id, now, is_terminal)
        if why is None:
            continue
        remove_container(client.api, info["Id"])
        log.info("janitor removed %s (trajectory %s): %s", info["Id"][:12], trajectory_id, why)
        reaped.append(Reaped(info["Id"], trajectory_id, why))
    return reaped


def _why_reap(labels: dict[str, str], trajectory_id: str, now: float,
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
