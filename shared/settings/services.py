"""Settings of the shared services: Redis, the object store (an S3 server or a local directory,
by ``storage.backend``), the ledger's timings, and how an outage of either is waited out.

Part of ``shared.settings`` (its docstring states the invariants every section keeps).
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal, Union

from pydantic import Field, model_validator

from shared.settings.base import Float, Int, Section, read_mode


class RedisSettings(Section):
    """Where the ledger and the other state owners live (``url``), and the Celery broker
    (``broker_url``, the same Redis when left empty). ``url`` may name a Redis Cluster
    (``redis+cluster://host:port``, ``shared.redis_clients``); the broker then needs a
    standalone Redis of its own: kombu's Redis transport has no cluster support."""

    url: str = "redis://127.0.0.1:6379/0"
    broker_url: str = ""

    @property
    def broker(self) -> str:
        """The Celery broker's URL."""
        return self.broker_url or self.url

    @model_validator(mode="after")
    def _broker_is_standalone(self) -> "RedisSettings":
        if self.broker.startswith("redis+cluster://"):
            raise ValueError("redis.broker_url: the Celery broker needs a standalone Redis (kombu's Redis transport has "
                             "no cluster support); set redis.broker_url when redis.url names a cluster")
        return self


class S3StorageSettings(Section):
    """An S3 server (MinIO, or any S3 API) holds the objects (``shared.storage.S3Store``)."""

    backend: Literal["s3"] = "s3"
    endpoint: str = "127.0.0.1:9000"  # host:port of the S3 server
    access_key: str = "conveyor"
    secret_key: str = "conveyor-secret"
    bucket: str = "conveyor"
    secure: bool = False
    region: str = "us-east-1"


class LocalStorageSettings(Section):
    """A directory every process of the stack shares holds the objects (``shared.storage.LocalStore``)."""

    backend: Literal["local"] = "local"
    local_root: Path = Path(".conveyor/objects")


# backend names the variant, s3 when it is left out (CONVEYOR_STORAGE__ENDPOINT alone is an s3
# store); a field of the other backend is an error naming it (storage.local.endpoint: Extra inputs ...)
StorageSettings = Annotated[Union[S3StorageSettings, LocalStorageSettings], Field(discriminator="backend"),
                            read_mode("backend", "s3")]


class LedgerSettings(Section):
    lease_ttl_s: Float = Field(30.0, gt=0)  # a running trajectory whose lease is older is re-dispatched
    heartbeat_s: Float = Field(5.0, gt=0)
    reaper_interval_s: Float = Field(5.0, gt=0)
    max_attempts: Int = Field(3, gt=0)
    # Celery redelivers a message unacknowledged this long (a backstop for a worker that died before
    # its first claim; a copy of a task still running is a no-op at the claim). Above lease_ttl_s + reaper_interval_s.
    visibility_timeout_s: Int = Field(300, gt=0)
    # a trajectory waiting to be claimed (queued, or uploaded and sent to scoring) this long has its
    # message sent again (it was lost; a copy of one only waiting is a no-op at the claim); the wait
    # doubles after each re-send, up to 32x (shared.state.ledger)
    dispatch_ttl_s: Float = Field(120.0, gt=0)
    # a finished trajectory whose JSON is at most this many bytes is carried inline in the
    # ledger's Redis instead of an object (shared.inline_trajectories); 0 (the default): every one
    # is an object. Opt-in: its step-level gain is not yet shown (docs/performance/loop_speed.md,
    # lever 4); 16384 suits short trajectories such as the toy task's (1.5-2 KiB)
    inline_max_bytes: Int = Field(0, ge=0)


class OutageSettings(Section):
    """How a long-running service waits out an outage of Redis or the S3 server (shared.outage)."""

    limit_s: Float = Field(900.0, gt=0)  # down longer than this: the service exits with code 2
    backoff_max_s: Float = Field(2.0, gt=0)  # the longest wait between two tries
    log_every_s: Float = Field(30.0, gt=0)  # while it lasts, one "still waiting" line this often
