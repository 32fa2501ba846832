"""Capacity of the ledger on a real Redis Cluster (issue 30, item 2), in one run: one standalone
Redis, a cluster of one master, and a cluster of three masters, each master with one replica
(``tests/redis_cluster.py``), reached through ``redis+cluster://`` (``shared.redis_clients``).

The same simulated lifecycle as ``bench/sharding.py`` (``drive``: the real ``Ledger``, lease
keepers and reapers, the trainer's reads and transaction), many runs spread over the slots by
their ``{run_id}`` hash tag. On a cluster every critical ledger write waits for its replica
(``shared.state.replica_ack``: ``WAIT 1``); each cluster runs again without it ("no WAIT"), which
prices the wait. Per layout: trajectories/s as driven (on a small
machine the clients' own limit), each master's CPU seconds (``INFO``), and the rate at which the
busiest master's one core saturates (trajectories / its CPU seconds): the layout's capacity when
the clients are not the limit. Ratios are to the standalone Redis.

    .venv/bin/python bench/sharding_cluster.py [--clients 2] [--runs 24] [--groups 4] [--group-size 16]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import redis  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from bench.sharding import RedisServer, drive, drive_in_processes  # noqa: E402
from redis_cluster import running_cluster  # noqa: E402
from shared.state.replica_ack import ReplicaAck  # noqa: E402


@dataclass
class Layout:
    name: str
    url: str
    masters: list[int]  # ports
    replicas: list[int]
    replica_ack: bool = True  # False: the ledger's writes do not wait for the replica (the cost of WAIT)


def drive_without_replica_ack(*args: object) -> None:
    """``drive``, the ledger acknowledging a write as soon as its master answers."""
    ReplicaAck.write = lambda self, keys, write, merge: write()  # type: ignore[method-assign]  # this process only
    drive(*args)  # type: ignore[arg-type]


@dataclass
class Measured:
    layout: Layout
    trajectories: int
    seconds: float
    master_cpu_s: list[float]
    replica_cpu_s: float

    @property
    def saturates_at(self) -> float:
        return self.trajectories / max(self.master_cpu_s)


def _cpu(port: int) -> float:
    info = redis.Redis(port=port).info("cpu")
    return float(info["used_cpu_user"]) + float(info["used_cpu_sys"])


def _roles(ports: list[int]) -> tuple[list[int], list[int]]:
    roles = {port: redis.Redis(port=port, decode_responses=True).execute_command("ROLE")[0] for port in ports}
    return [p for p, r in roles.items() if r == "master"], [p for p, r in roles.items() if r != "master"]


def measure(layout: Layout, runs: list[str], clients: int, groups: int, group_size: int) -> Measured:
    before = {port: _cpu(port) for port in layout.masters + layout.replicas}
    target = drive if layout.replica_ack else drive_without_replica_ack
    reports = drive_in_processes(target, [layout.url], runs, clients, groups, group_size, True)
    used = {port: _cpu(port) - before[port] for port in before}
    done = sum(r[0] for r in reports)
    if done != len(runs) * groups * group_size:
        raise RuntimeError(f"{layout.name}: {done} trajectories consumed, {len(runs) * groups * group_size} expected")
    return Measured(layout, done, max(r[2] for r in reports), [used[p] for p in layout.masters],
                    sum(used[p] for p in layout.replicas))


def report(results: list[Measured], console: Console) -> None:
    base = results[0]
    table = Table(title="The ledger on a standalone Redis and on Redis Clusters (one replica per master)")
    for column in ("layout", "trajectories", "traj/s driven", "x standalone", "CPU s per master", "replicas' CPU s",
                   "busiest master saturates at traj/s", "x standalone "):
        table.add_column(column, justify="left" if column == "layout" else "right")
    for r in results:
        rate = r.trajectories / r.seconds
        table.add_row(r.layout.name, f"{r.trajectories:,}", f"{rate:,.0f}", f"{rate / (base.trajectories / base.seconds):.2f}",
                      " / ".join(f"{c:.1f}" for c in r.master_cpu_s), f"{r.replica_cpu_s:.1f}",
                      f"{r.saturates_at:,.0f}", f"{r.saturates_at / base.saturates_at:.2f}")
    console.print(table)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, default=2, help="client processes, each driving its share of the runs")
    parser.add_argument("--runs", type=int, default=24, help="runs, spread over the slots by their hash tags")
    parser.add_argument("--groups", type=int, default=4, help="groups per run")
    parser.add_argument("--group-size", type=int, default=16)
    args = parser.parse_args()
    runs = [f"cap{i:03d}" for i in range(args.runs)]
    results = []
    with tempfile.TemporaryDirectory(prefix="sharding-cluster-") as tmp, ExitStack() as stack:
        server = RedisServer.start(Path(tmp) / "standalone")
        stack.callback(server.stop)
        port = int(server.url.rsplit(":", 1)[1].split("/")[0])
        layouts = [Layout("standalone Redis", server.url, [port], [])]
        for masters in (1, 3):
            cluster = stack.enter_context(running_cluster(Path(tmp) / f"cluster-{masters}", masters=masters))
            master_ports, replica_ports = _roles(list(cluster.procs))
            name = f"cluster, {masters} master{'s' if masters > 1 else ''}"
            layouts.append(Layout(name, cluster.url, master_ports, replica_ports))
            layouts.append(Layout(f"{name}, no WAIT", cluster.url, master_ports, replica_ports, replica_ack=False))
        for index, layout in enumerate(layouts):  # runs of their own: a cluster serves two layouts
            results.append(measure(layout, [f"{run}l{index}" for run in runs], args.clients, args.groups, args.group_size))
    report(results, Console(width=200))


if __name__ == "__main__":
    main()
