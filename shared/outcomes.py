"""What became of a trajectory a worker took, and why one failed: enums instead of strings.

Invariants:
- A failure reason in the ledger (``failures`` hash, the trainer's ``failed`` event) starts with
  a ``FailureKind`` value, then ``: `` and the detail (``reason``). ``kind_of`` reads it back,
  so ``conveyor status --failures`` and ``conveyor retry --reason`` group by the same word.
  Reasons written before the kinds existed (``lease_expired after 3 attempts``) parse too.
- A ``bug`` reason carries the traceback after its first line; the first line alone
  (``headline``) is what a table shows.
"""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass


class RolloutOutcome(str, enum.Enum):
    """What a rollout worker did with one request of a task."""

    uploaded = "uploaded"  # the trajectory is in storage, and scored in the worker or its scoring task published
    requeued = "requeued"  # a known infra error with attempts left: queued again after a backoff
    handed_back = "handed_back"  # the worker is shutting down: queued again, no attempt spent
    failed = "failed"  # the ledger holds it as failed, with a reason
    skipped = "skipped"  # the claim or a hand-off found it elsewhere (another copy, another attempt)
    refused = "refused"  # its run's data is gone from Redis (shared.state.run_marker): nothing recreated


class FailureKind(str, enum.Enum):
    """The first word of every failure reason."""

    env_error = "env_error"  # the environment raised: the task's fault, not retried
    infra_error = "infra_error"  # a known infra error (sandbox daemon, storage, inference 5xx) after max_attempts
    inference_outage = "inference_outage"  # inference unreachable for longer than outage.limit_s
    inference_rejected = "inference_rejected"  # inference answered 4xx: this request cannot succeed
    config_error = "config_error"  # the task names an environment or env_config this worker cannot use: not retried
    bug = "bug"  # an unexpected exception: failed at once, the traceback kept in the reason
    lease_expired = "lease_expired"  # the rollout worker died max_attempts times (shared.state.ledger)
    scoring_lease_expired = "scoring_lease_expired"
    scoring_error = "scoring_error"  # the reward function or the trajectory object failed
    run_stopped = "run_stopped"  # `conveyor run stop`: its run ended before it did (shared.state.run_stop)
    superseded = "superseded"  # group redundancy: the group had kept its first members; this one was cancelled


def reason(kind: FailureKind, detail: str) -> str:
    return f"{kind.value}: {detail}"


_KIND = re.compile(r"[a-z_]+")


def kind_of(failure_reason: str) -> str:
    """The reason's first word (a ``FailureKind`` value for every reason Conveyor writes)."""
    match = _KIND.match(failure_reason)
    return match.group(0) if match else "unknown"


def headline(failure_reason: str) -> str:
    """The first line: a bug's reason carries its traceback below it."""
    return failure_reason.split("\n", 1)[0]


@dataclass(frozen=True)
class RolloutResult:
    outcome: RolloutOutcome
    detail: str = ""  # the failure kind, or the state a skip found

    def __str__(self) -> str:
        return f"{self.outcome.value}:{self.detail}" if self.detail else self.outcome.value
