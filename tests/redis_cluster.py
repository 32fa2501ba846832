"""A real Redis Cluster on localhost for tests: three masters and three replicas of
``redis-server``, each in its own directory, durable as the standalone one (``appendonly yes``,
``appendfsync everysec``), created with ``redis-cli --cluster create ... --cluster-replicas 1``, and ready once every master has its
replica connected (``shared.state.replica_ack`` waits for it).
A master that dies is replaced by its replica after ``NODE_TIMEOUT_MS`` (about 3 to 5 s in all)."""

from __future__ import annotations

import random
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest
import redis

NODES = 6  # three masters, each with one replica
NODE_TIMEOUT_MS = 2000
SLOTS = 16384


@dataclass
class Cluster:
    url: str  # redis+cluster://host:port of its first node
    procs: dict[int, subprocess.Popen]  # port -> its redis-server

    def kill(self, port: int) -> None:
        """SIGKILL the node on ``port``."""
        self.procs[port].send_signal(signal.SIGKILL)
        self.procs[port].wait(10)


@contextmanager
def running_cluster(root: Path, masters: int = NODES // 2) -> Iterator[Cluster]:
    """``masters`` masters, each with one replica. ``redis-cli --cluster create`` needs three
    masters at least; fewer (bench/sharding_cluster.py) are joined by hand, as it would."""
    binary, cli = shutil.which("redis-server"), shutil.which("redis-cli")
    if binary is None or cli is None:
        pytest.fail("redis-server and redis-cli are not installed (apt-get install -y redis-server)")
    ports = _cluster_ports(2 * masters)
    procs: dict[int, subprocess.Popen] = {}
    try:
        for port in ports:
            workdir = root / str(port)
            workdir.mkdir(parents=True)
            procs[port] = subprocess.Popen(
                [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "yes",
                 "--appendfsync", "everysec", "--repl-diskless-sync-delay", "0", "--dir", str(workdir), "--cluster-enabled", "yes",
                 "--cluster-config-file", "nodes.conf", "--cluster-node-timeout", str(NODE_TIMEOUT_MS)],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            )
        clients = [redis.Redis(port=port, decode_responses=True, socket_timeout=5) for port in ports]
        for client in clients:
            wait_for_ping(client)
        if masters >= 3:
            subprocess.run([cli, "--cluster", "create", *(f"127.0.0.1:{port}" for port in ports), "--cluster-replicas", "1",
                            "--cluster-yes"], check=True, stdout=subprocess.DEVNULL, timeout=60)
        else:
            _join_by_hand(clients, ports, masters)
        deadline = time.monotonic() + 30
        while not all(client.cluster("info")["cluster_state"] == "ok" and _replicated(client) for client in clients):
            if time.monotonic() > deadline:
                pytest.fail("the Redis Cluster did not reach cluster_state:ok, each master with its replica, in 30 s")
            time.sleep(0.05)
        yield Cluster(f"redis+cluster://127.0.0.1:{ports[0]}", procs)
    finally:
        for proc in procs.values():
            proc.terminate()
        for proc in procs.values():
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:  # a node slow to stop (a loaded machine) is not kept waiting for
                proc.kill()
                proc.wait(10)


def _join_by_hand(clients: list[redis.Redis], ports: list[int], masters: int) -> None:
    """The first ``masters`` nodes share the slots in equal ranges; node ``masters + i``
    replicates master ``i``."""
    for index in range(masters):
        first, last = index * SLOTS // masters, (index + 1) * SLOTS // masters - 1
        clients[index].execute_command("CLUSTER", "ADDSLOTSRANGE", first, last)
    for port in ports[1:]:
        clients[0].execute_command("CLUSTER", "MEET", "127.0.0.1", port)
    for index in range(masters):
        master_id = clients[index].execute_command("CLUSTER", "MYID")
        deadline = time.monotonic() + 30
        while True:  # the replica must know the master first (gossip)
            try:
                clients[masters + index].execute_command("CLUSTER", "REPLICATE", master_id)
                break
            except redis.ResponseError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)


def _replicated(client: redis.Redis) -> bool:
    """A replica, or a master whose replica is connected and known to the cluster as its own."""
    role = client.execute_command("ROLE")
    if role[0] != "master":
        return True
    return len(role[2]) == 1 and bool(client.execute_command("CLUSTER", "REPLICAS", client.execute_command("CLUSTER", "MYID")))


def wait_for_ping(client: redis.Redis) -> None:
    for _ in range(100):
        try:
            client.ping()
            return
        except redis.ConnectionError:
            time.sleep(0.05)


def _cluster_ports(count: int) -> list[int]:
    """Distinct free ports whose cluster bus ports (port + 10000) are free too, and none the bus
    port of another: a client of a bus port would wait for an answer that never comes."""
    ports: list[int] = []
    while len(ports) < count:
        port = random.randint(20000, 50000)
        taken = {p for q in ports for p in (q, q + 10000, q - 10000)}
        if port not in taken and _free(port) and _free(port + 10000):
            ports.append(port)
    return ports


def _free(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True
