"""What every ``conveyor`` command shares: the ``--config`` and ``--resume`` options, the settings
load that names a bad field, logging, the log-level check and the wait for Redis at start.

Invariants:
- ``command_settings`` records the loaded settings in ``errors.state``, so a known failure
  after it is reported with the run it concerns.
- A worker waits for Redis at start as through any outage (``shared.outage``), never longer
  than ``outage.limit_s``.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console

from services.cli import errors
from shared.settings import Settings, load_settings

console = Console(stderr=True, soft_wrap=True)

ConfigOption = typer.Option(None, "--config", "-c", help="YAML settings file (or set CONVEYOR_CONFIG)")
ResumeOption = typer.Option(False, "--resume", help="continue a run id that is already in Redis: its published groups are "
                            "skipped and reported (without it, a run id in use is an error)")


def log_level(name: str, source: str) -> str:
    if name.upper() not in logging.getLevelNamesMapping():
        raise errors.CommandError(f"{source}: unknown log level {name!r}; use DEBUG, INFO, WARNING, ERROR or CRITICAL")
    return name.upper()


def command_settings(config: Optional[Path]) -> Settings:
    errors.state.settings = load_settings(config)
    return errors.state.settings


def setup_logging() -> None:
    level = log_level(os.environ.get("CONVEYOR_LOG_LEVEL", "INFO"), "CONVEYOR_LOG_LEVEL")
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # minio's transport logs each of its retries; the storage layer reports the outcome
    # (a StorageError naming the endpoint), so an unreachable S3 server is one line, not six
    logging.getLogger("urllib3.connectionpool").setLevel(logging.ERROR)
    # httpx logs every request at INFO: a rollout worker would write a line per turn
    logging.getLogger("httpx").setLevel(logging.WARNING)


def wait_for_redis(settings: Settings) -> None:
    """A worker waits for Redis at start, as through any outage (``shared.outage``: logged,
    bounded by outage.limit_s, then one line and exit 2); a refused password stops it at once."""
    from shared.redis_clients import redis_for

    redis_for(settings.redis.url, settings.outage).ping()
