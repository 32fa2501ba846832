"""On a Redis Cluster, a ledger write is acknowledged only once it cannot be lost in a failover.

A cluster replicates asynchronously: a master answers a write before its replica holds it, so
a master killed right after a write can be replaced by a replica that never saw it, and a write
the caller was told succeeded is gone (a consumed trajectory would be trained on again). The
ledger's critical writes (``shared.state.ledger``: registration and every guarded transition:
uploaded, scored, consumed, failed, requeued) therefore go through ``ReplicaAck.write``, which,
after the write, sends ``WAIT 1`` to the master that ran it and returns only when:

- its replica holds the write (``WAIT`` answers 1), or
- the master has no replica in the cluster's view at all (``CLUSTER REPLICAS``: after a failover,
  until the old master comes back as its replica): no failover can then lose the write; it
  lives on one node with its append-only file, as on a standalone Redis.

A master that died or lost its slot before confirming (the slot's node changed during the call,
or ``WAIT`` failed to connect) leaves the write unknown: it is run again on the slot's new master
(every guarded write is idempotent: a copy finds the trajectory already moved, a registration
leaves known ids alone), and the caller's ``merge`` keeps the first replies where the copy finds
the write had survived. A replica the cluster still lists but that does not confirm (stopped,
partitioned, or dead and not yet forgotten: it might still be promoted) is waited for up to
``limit_s``; then ``ReplicationUnconfirmed`` stops the caller loudly rather than acknowledge a
write that a failover could lose.

The other writes (claims, heartbeats, expiries, hand-backs, the scoring send-by moves) are not
waited for: losing one loses no acknowledged result. The leases and dispatch deadlines redo
their work (``shared.state.ledger``). A standalone Redis has no replica: ``write`` runs once.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TypeVar

import redis
from redis.cluster import RedisCluster

log = logging.getLogger(__name__)

T = TypeVar("T")

WAIT_MS = 1000  # one WAIT; a live replica answers in about a round trip
LIMIT_S = 30.0  # how long a listed replica may leave a write unconfirmed
ATTEMPTS = 5  # writes run again after a failover during the call


class ReplicationUnconfirmed(RuntimeError):
    """A write reached a master whose replica did not confirm it in time."""


class ReplicaAck:
    def __init__(self, client: redis.Redis, limit_s: float = LIMIT_S):
        self.cluster = client if isinstance(client, RedisCluster) else None
        self.limit_s = limit_s
        self.alone: set[str] = set()  # masters last seen with no replica: asked first, not waited on

    def write(self, slot_keys: list[str], write: Callable[[], list[T]],
              merge: Callable[[list[T], list[T]], list[T]]) -> list[T]:
        """``write()``'s replies, once every slot of ``slot_keys`` confirmed it (see above);
        ``merge(first, again)``: the replies to return when the write ran again."""
        if self.cluster is None:
            return write()
        replies: list[T] | None = None
        for _ in range(ATTEMPTS):
            before = self._masters(slot_keys)
            again = write()
            replies = again if replies is None else merge(replies, again)
            if self._masters(slot_keys) == before and all(self._confirmed(name) for name in set(before)):
                return replies
            log.warning("a Redis Cluster master failed over during a ledger write; running it again on the new master")
            for key in set(slot_keys):  # a command waits the failover out (``OutageCluster``); a pipeline would not
                self.cluster.type(key)  # a single-key command (a cluster client pipelines EXISTS)
        raise ReplicationUnconfirmed(f"a ledger write was not confirmed after {ATTEMPTS} failovers")

    def _masters(self, slot_keys: list[str]) -> list[str]:
        assert self.cluster is not None
        return [self.cluster.get_node_from_key(key).name for key in slot_keys]

    def _confirmed(self, node_name: str) -> bool:
        """True once the node's replica holds its writes, or the node has none; False if the
        node is gone (the write is unknown)."""
        assert self.cluster is not None
        node = self.cluster.get_node(node_name=node_name)
        connection = self.cluster.get_redis_connection(node)
        deadline = time.monotonic() + self.limit_s
        try:
            while True:
                if node_name in self.alone:
                    if not _replicas(connection):
                        return True
                    self.alone.discard(node_name)
                if int(connection.execute_command("WAIT", 1, WAIT_MS)) >= 1:
                    return True
                if not _replicas(connection):
                    self.alone.add(node_name)
                    return True
                if time.monotonic() > deadline:
                    raise ReplicationUnconfirmed(
                        f"the replica of Redis Cluster master {node_name} did not confirm a ledger write in "
                        f"{self.limit_s:.0f} s; a failover now could lose it, so the write is not acknowledged. "
                        f"Bring the replica back, or remove it (redis-cli --cluster del-node) if it is gone for good")
        except (redis.ConnectionError, redis.TimeoutError):
            return False


def _replicas(connection: redis.Redis) -> list[str]:
    """The replicas the cluster knows of this master, connected or not."""
    return connection.execute_command("CLUSTER", "REPLICAS", connection.execute_command("CLUSTER", "MYID"))
