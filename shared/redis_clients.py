"""The one way a process gets a client of the ledger's Redis: a standalone server, or a Redis
Cluster, chosen by the URL's scheme (``redis.url``, docs/configuration.md).

- ``redis://host:port/db`` (or ``rediss://``, ``unix://``): one Redis server, ``redis.Redis``.
- ``redis+cluster://host:port``: a Redis Cluster, ``redis.cluster.RedisCluster``; the node named
  is where the client first asks for the cluster's slots (any node of it will do). Database 0
  only: a cluster has no other.

Invariants:
- Every key of a run carries the run's hash tag (``conveyor:{run_id}:...``, ``shared.names``), so
  a cluster keeps a run on one slot, and every Lua script and MULTI transaction of the state
  owners (``shared.state``) touches the keys of one run only. The keys that span runs (the run
  registry, the replica holders, the dead letters) are each one key, touched by single-key
  commands or single-key scripts only (docs/compose.md says why each is safe).
- The Celery broker never runs on a cluster: kombu's Redis transport has no cluster support
  (``redis.broker_url`` names its own standalone Redis; ``shared.celery_app``).
- A client with ``outage`` waits out an outage of Redis (``shared.outage``): of a standalone
  server, or of a cluster (a master failing over to its replica), command by command
  (``OutageCluster``; a cluster's pipelines ride a failover with redis-py's own retries only).
"""

from __future__ import annotations

from typing import Any

import redis
from redis.cluster import RedisCluster
from redis.exceptions import ClusterDownError, MasterDownError, TryAgainError

from shared.outage import Dependency, OutageRetry, redact_url, redis_client, redis_transient
from shared.settings import OutageSettings, RedisSettings

CLUSTER_SCHEME = "redis+cluster://"


def is_cluster_url(url: str) -> bool:
    return url.startswith(CLUSTER_SCHEME)


class OutageCluster(RedisCluster):
    """A cluster client whose every command waits out an outage of the cluster as
    ``shared.outage`` waits one out: a failover (a master gone until its replica takes over:
    connection refused, ``CLUSTERDOWN``, ``TRYAGAIN``) longer than redis-py's own retries.
    A pipeline is left to redis-py's retries."""

    def __init__(self, *args: Any, dependency: Dependency, **kwargs: Any):
        self.dependency = dependency  # before the base class's own first commands (COMMAND, the slots)
        super().__init__(*args, **kwargs)

    def execute_command(self, *args: Any, **kwargs: Any) -> Any:
        return self.dependency.call(lambda: super(OutageCluster, self).execute_command(*args, **kwargs), cluster_transient)

    def get_retry(self) -> OutageRetry:
        """What ``shared.outage`` reads a client's outage from (``seconds_since_recovery``)."""
        return OutageRetry(self.dependency)


def cluster_transient(exc: BaseException) -> bool:
    """A failover in progress, or any transient error of a standalone Redis."""
    return redis_transient(exc) or isinstance(exc, (ClusterDownError, TryAgainError, MasterDownError))


def redis_for(url: str, outage: OutageSettings | None = None) -> redis.Redis:
    """A client for the ledger and the other owners of Redis state. With ``outage`` (a
    long-running service), every call waits out an outage of Redis, a cluster's failover
    included (``shared.outage``); without, a call fails at once (a one-shot command). A
    ``redis+cluster://`` URL gives a cluster client (it speaks the same commands)."""
    if is_cluster_url(url):
        node_url = "redis://" + url[len(CLUSTER_SCHEME):]
        if outage is None:
            return RedisCluster.from_url(node_url, decode_responses=True)  # type: ignore[return-value]  # same commands
        dependency = Dependency.named(f"Redis Cluster at {redact_url(node_url)}", outage)
        return OutageCluster.from_url(node_url, dependency=dependency, decode_responses=True)  # type: ignore[return-value]
    return redis_client(url, outage) if outage is not None else redis.Redis.from_url(url, decode_responses=True)


def broker_client(redis_settings: RedisSettings, outage: OutageSettings | None = None) -> redis.Redis | None:
    """A client of the broker's Redis, for reading its queues' lengths (the reapers), when the
    broker has a Redis of its own (``redis.broker_url``); None when it is the ledger's."""
    if not redis_settings.broker_url or redis_settings.broker_url == redis_settings.url:
        return None
    return redis_for(redis_settings.broker_url, outage)
