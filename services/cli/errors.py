"""Known failures of a ``conveyor`` command: one line on stderr naming the cause, exit code 2.

Invariants:
- An exception of a type in ``KNOWN`` (or a subclass) ends the command with exactly one line,
  ``error: <cause>``, and exit code 2. Any other exception is a bug and keeps its traceback.
- ``conveyor --debug ...`` shows the traceback of a known failure too.
- A line never holds a password: Redis URLs are shown with ``***`` in its place.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Callable

import kombu.exceptions
import redis.exceptions

from services.intake.datasets import DatasetError
from shared.scoring.rewards import RewardError
from shared.environments import EnvironmentConfigError, EnvironmentUnavailable
from shared.model_source import ModelSourceError
from shared.outage import OutageTooLong, redact_url, say_back_now
from shared.state.run_marker import RedisDataLost
from shared.settings import Settings, SettingsError
from shared.storage import StorageError


class CommandError(Exception):
    """A failure a command found by its own check (a missing model, an unknown log level)."""


@dataclass
class CliState:
    debug: bool = False
    settings: Settings | None = None  # once a command has loaded them: the Redis URL to name


state = CliState()


def _redis_url() -> str:
    return redact_url(state.settings.redis.url) if state.settings else "redis.url"


def _as_is(exc: BaseException) -> str:
    return str(exc)


# First match wins: a subclass goes before its base class.
KNOWN: list[tuple[type[BaseException], Callable[[BaseException], str]]] = [
    (SettingsError, _as_is),  # names the field, the variable, or the file and line
    (CommandError, _as_is),
    (ModelSourceError, _as_is),  # names inference.model_path and why it is neither a directory nor a model name
    (DatasetError, _as_is),
    (StorageError, _as_is),  # names the S3 endpoint, or the key
    (RewardError, _as_is),
    (EnvironmentUnavailable, _as_is),  # names the environment and the registered ones
    (EnvironmentConfigError, _as_is),  # names the environment and the env_config field
    (OutageTooLong, _as_is),  # names the dependency, how long it was down and outage.limit_s
    (RedisDataLost, _as_is),  # names the run and says that Redis lost its data
    (redis.exceptions.AuthenticationError, lambda exc: f"Redis at {_redis_url()} refused the credentials: {exc}"),
    (redis.exceptions.ConnectionError, lambda exc: f"Redis unreachable at {_redis_url()}: {exc}"),
    (redis.exceptions.TimeoutError, lambda exc: f"Redis at {_redis_url()} timed out: {exc}"),
    (kombu.exceptions.OperationalError, lambda exc: f"the Celery broker (Redis at {_redis_url()}) is unreachable: {exc}"),
]


def explain(exc: BaseException) -> str | None:
    """The one line for a known failure; None for anything else."""
    for kind, message in KNOWN:
        if isinstance(exc, kind):
            return " ".join(message(exc).split())
    return None


def run(command: Callable[[], object]) -> None:
    """Run the CLI; a known failure becomes its line on stderr and exit code 2."""
    try:
        command()
    except Exception as exc:
        line = explain(exc)
        if line is None or state.debug:
            raise
        say_back_now()  # a pending "is back" line goes first: the error is the last line
        sys.stderr.write(f"error: {line}\n")
        sys.exit(2)
