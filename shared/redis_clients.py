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
- A standalone client with ``outage`` waits out an outage of Redis (``shared.outage``). A cluster
  client rides a failover with redis-py's own retries (it re-reads the slots and tries again);
  it does not wait out a longer outage: a call then fails.
"""

from __future__ import annotations

import redis
from redis.cluster import RedisCluster

from shared.outage import redis_client
from shared.settings import OutageSettings, RedisSettings

CLUSTER_SCHEME = "redis+cluster://"


def is_cluster_url(url: str) -> bool:
    return url.startswith(CLUSTER_SCHEME)


def redis_for(url: str, outage: OutageSettings | None = None) -> redis.Redis:
    """A client for the ledger and the other owners of Redis state. With ``outage`` (a
    long-running service), every call to a standalone Redis waits out its outage
    (``shared.outage``); without, a call fails at once (a one-shot command). A
    ``redis+cluster://`` URL gives a cluster client (it speaks the same commands)."""
    if is_cluster_url(url):
        cluster = RedisCluster.from_url("redis://" + url[len(CLUSTER_SCHEME):], decode_responses=True)
        return cluster  # type: ignore[return-value]  # RedisCluster serves the commands the owners use
    return redis_client(url, outage) if outage is not None else redis.Redis.from_url(url, decode_responses=True)


def broker_client(redis_settings: RedisSettings, outage: OutageSettings | None = None) -> redis.Redis | None:
    """A client of the broker's Redis, for reading its queues' lengths (the reapers), when the
    broker has a Redis of its own (``redis.broker_url``); None when it is the ledger's."""
    if not redis_settings.broker_url or redis_settings.broker_url == redis_settings.url:
        return None
    return redis_for(redis_settings.broker_url, outage)
