"""Sharding Redis (issue 15, item 4): what one Redis costs per trajectory, at what rate one core of
it saturates, and whether runs split over shards by their ``{run_id}`` hash tag keep that cost.

A simulation of the ledger alone: no Celery, S3 or policy. Client processes drive many runs, each
through the real lifecycle, with the real ``Ledger`` (its Lua scripts), ``LeaseKeeper`` and
``LeaseReaper`` classes, per group:
- intake: the group's registration, ``register``, published mark;
- rollout worker: ``claim`` per member, ``mark_uploaded`` with its scoring task, ``scoring_sent``
  for the group (one scoring message per batch);
- scorer: ``claim`` (scoring stage) per member, ``mark_scored`` (the event goes on the stream);
- trainer: ``XREADGROUP`` of the run's stream, ``mark_consumed_many`` (one pipelined call per
  member), and the group's watched transaction (done, counted, queued, acked);
- and, in threads, heartbeats of both lease stages every ``ledger.heartbeat_s`` and both reapers'
  sweeps every ``ledger.reaper_interval_s``, the defaults of ``shared.settings``.

Per layout it reports, from each redis-server's ``INFO`` (before and after): its CPU seconds per
trajectory, the commands per trajectory (``commandstats``: commands run by Lua count), the Lua
script calls per trajectory, and the clients' own CPU per trajectory.

Layouts:
- ``1 shard``: one redis-server, the ledger as it is.
- ``N shards``: N redis-servers; a run lives on the shard that owns its hash slot, the slot Redis
  Cluster gives every ``{run_id}`` key (CRC16 mod 16384, slots split in equal ranges). The global
  key (``runs``, the run registry) exists once per shard, holding that shard's runs.
- ``cluster``: one redis-server in cluster mode owning every slot. Cluster mode refuses a command
  or script whose keys hash to different slots (``CROSSSLOT``). ``--crossslot`` calls each step of
  the lifecycle there as the ledger is, and lists those refused (none, since the lease zsets
  became per run: ``conveyor:{run}:leases``). The layout then runs the lifecycle there.

    .venv/bin/python bench/sharding.py [--clients 4] [--runs 32] [--groups 40] [--group-size 16] [--shards 1 2 3]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import resource
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import redis  # noqa: E402
from redis.crc import REDIS_CLUSTER_HASH_SLOTS, key_slot  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from services.cli.local_stack import _wait_for_port, free_port  # noqa: E402
from shared import ids  # noqa: E402
from shared.state.group_registry import GroupRegistry  # noqa: E402
from shared.state.leases import LeaseKeeper, LeaseReaper  # noqa: E402
from shared.state.ledger import LEASE_STAGES, ROLLOUT, SCORING, Ledger  # noqa: E402
from shared.names import RedisKeys  # noqa: E402
from shared.redis_clients import redis_for  # noqa: E402
from shared.schemas import GroupRegistration, RolloutRequest, ScoredEvent, ScoringTask, TaskProfile  # noqa: E402
from shared.settings import LedgerSettings  # noqa: E402
from shared.state.trainer_counters import TrainerCounter, TrainerCounters  # noqa: E402
from shared.state.trainer_reads import TRAINER_CONSUMER_GROUP as STREAM_READERS  # noqa: E402

TASK = TaskProfile(task_id="t", env_name="single_turn", task_data={"prompt": "What is 6 x 7?", "answer": "42"})


# --- the shards -------------------------------------------------------------------------------
@dataclass
class RedisServer:
    proc: subprocess.Popen
    url: str

    @classmethod
    def start(cls, root: Path, cluster: bool = False) -> "RedisServer":
        """As ``LocalStack.start_redis`` runs it: append-only file, fsync every second."""
        port = free_port()
        while cluster and port + 10000 > 65535:  # a cluster node also listens on its bus port, port + 10000
            port = free_port()
        data = root / f"redis-{port}"
        data.mkdir(parents=True)
        args = [shutil.which("redis-server") or "redis-server", "--port", str(port), "--bind", "127.0.0.1",
                "--dir", str(data), "--save", "", "--appendonly", "yes", "--appendfsync", "everysec"]
        if cluster:
            args += ["--cluster-enabled", "yes", "--cluster-config-file", str(data / "nodes.conf")]
        log = open(data / "log", "w")
        proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT)
        _wait_for_port(port, 10, proc, data / "log")
        server = cls(proc, f"redis://127.0.0.1:{port}/0")
        if cluster:
            client = server.client()
            client.execute_command("CLUSTER", "ADDSLOTSRANGE", 0, REDIS_CLUSTER_HASH_SLOTS - 1)
            while client.cluster("info")["cluster_state"] != "ok":
                time.sleep(0.1)
        return server

    def client(self) -> redis.Redis:
        return redis.Redis.from_url(self.url, decode_responses=True)

    def usage(self) -> tuple[float, int, int]:
        """(CPU seconds, commands including those Lua ran, Lua script calls) so far."""
        client = self.client()
        cpu = client.info("cpu")
        stats = client.info("commandstats")
        commands = sum(int(s["calls"]) for s in stats.values())
        scripts = sum(int(stats.get(f"cmdstat_{name}", {}).get("calls", 0)) for name in ("evalsha", "eval"))
        return float(cpu["used_cpu_user"]) + float(cpu["used_cpu_sys"]), commands, scripts

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(10)


def shard_of(run_id: str, shards: int) -> int:
    """The shard owning the run's hash slot, with the slots split in equal ranges (as a cluster of
    ``shards`` masters made by ``redis-cli --cluster create`` splits them)."""
    return key_slot(RedisKeys.states(run_id).encode()) * shards // REDIS_CLUSTER_HASH_SLOTS


# --- per-run lease keys ------------------------------------------------------------------------
def per_run_ledger(client: redis.Redis) -> Ledger:
    """The ledger: its lease keys are per run now (``conveyor:{run}:leases``, ``shared.names``), so
    the prototype this bench once wrapped around the scripts is the ledger itself."""
    return Ledger(client)


# --- one client process -----------------------------------------------------------------------
@dataclass
class Shard:
    """A client process's view of one shard: its ledger, lease keepers and reapers."""

    ledger: Ledger
    keepers: dict[str, LeaseKeeper]
    reapers: list[LeaseReaper]

    @classmethod
    def connect(cls, url: str, per_run: bool, settings: LedgerSettings) -> "Shard":
        client = redis_for(url)  # a standalone server, or a cluster (bench/sharding_cluster.py)
        ledger = per_run_ledger(client) if per_run else Ledger(client)
        keepers = {s.name: LeaseKeeper(ledger, settings.lease_ttl_s, settings.heartbeat_s, s) for s in LEASE_STAGES}
        reapers = [LeaseReaper(ledger, s, settings.max_attempts, settings.reaper_interval_s, lambda items: None)
                   for s in LEASE_STAGES]
        return cls(ledger, keepers, reapers)


def drive(urls: list[str], runs: list[str], groups: int, group_size: int, per_run: bool, out: mp.Queue) -> None:
    """Every group of these runs through the lifecycle; puts (trajectories, CPU seconds, seconds)."""
    settings = LedgerSettings()
    shards = [Shard.connect(url, per_run, settings) for url in urls]
    shard_by_run = {run: shards[shard_of(run, len(shards))] for run in runs}
    stop = threading.Event()
    for shard in shards:
        for keeper in shard.keepers.values():
            keeper.start()
        threading.Thread(target=_sweep, args=(shard, runs, per_run, settings.reaper_interval_s, stop), daemon=True).start()
    for run in runs:
        shard_by_run[run].ledger.redis.xgroup_create(RedisKeys.trainer_stream(run), STREAM_READERS, id="0", mkstream=True)
    started, cpu0 = time.perf_counter(), _cpu()
    done = 0
    for group_id in range(groups):
        for run in runs:
            done += _group_lifecycle(shard_by_run[run], run, group_id, group_size)
    out.put((done, _cpu() - cpu0, time.perf_counter() - started))
    stop.set()


def _sweep(shard: Shard, runs: list[str], per_run: bool, interval_s: float, stop: threading.Event) -> None:
    """Both reapers' sweeps at their interval; with per-run leases, the sweep reads each run's zset."""
    while not stop.wait(interval_s):
        for reaper in shard.reapers:
            reaper.sweep()  # reads each run's lease zset (the run registry's runs)


def _group_lifecycle(shard: Shard, run: str, group_id: int, size: int) -> int:
    ledger, r = shard.ledger, shard.ledger.redis
    now = time.time()
    requests = [RolloutRequest(run_id=run, group_id=group_id, episode_index=i, episode_seed=i,
                               trajectory_id=ids.trajectory_id(run, group_id, i, i), group_size=size,
                               task=TASK, dispatched_at=now) for i in range(size)]
    registry = GroupRegistry(r, run)  # intake
    registry.register(GroupRegistration(run_id=run, group_id=group_id, expected_size=size, task_id=TASK.task_id,
                                        policy_version=0, dispatched_at=now))
    ledger.register(requests)
    registry.mark_published(group_id)
    rollout, scoring = shard.keepers[ROLLOUT.name], shard.keepers[SCORING.name]
    tasks = []
    for request in requests:  # rollout worker
        tid = request.trajectory_id
        token, _ = rollout.claim(tid)
        task = ScoringTask(trajectory_id=tid, trajectory_key=f"trajectories/{run}/{group_id:06d}/{tid}.json.gz")
        ledger.mark_uploaded(tid, token, task.model_dump_json(), send_within_s=35.0)
        rollout.release(tid)
        tasks.append(task)
    ledger.scoring_sent([t.trajectory_id for t in tasks])
    for task in tasks:  # scorer
        tid = task.trajectory_id
        token, _ = scoring.claim(tid, task.model_dump_json())
        event = ScoredEvent(trajectory_id=tid, run_id=run, group_id=group_id, reward=1.0,
                            scored_key=f"scored/{run}/{group_id:06d}/{tid}.json.gz", at=time.time())
        ledger.mark_scored(tid, event, token=token)
        scoring.release(tid)
    stream = RedisKeys.trainer_stream(run)  # trainer
    entries = r.xreadgroup(STREAM_READERS, "sim", {stream: ">"}, count=256)[0][1]
    ledger.mark_consumed_many([ScoredEvent.model_validate_json(fields["event"]).trajectory_id for _, fields in entries])
    with r.pipeline(transaction=True) as tx:
        tx.watch(RedisKeys.run_marker(run), registry.done_key)
        tx.exists(RedisKeys.run_marker(run))
        tx.sismember(registry.done_key, group_id)
        tx.multi()
        registry.mark_done(group_id, tx)
        TrainerCounters(r, run).add(TrainerCounter.for_group_status("accepted"), transaction=tx)
        tx.rpush(RedisKeys.train_queue(run), f'{{"group_id": {group_id}}}')
        tx.xack(stream, STREAM_READERS, *(entry_id for entry_id, _ in entries))
        tx.execute()
    return len(entries)


def _cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


# --- which steps a cluster refuses ------------------------------------------------------------
def crossslot_check(client: redis.Redis, per_run: bool) -> dict[str, str]:
    """Each ledger step once, on one fresh group, against a cluster-mode Redis: step -> "ok" or
    the error (``CROSSSLOT``: the step's keys are in more than one slot)."""
    ledger = per_run_ledger(client) if per_run else Ledger(client)
    run = f"x{uuid.uuid4().hex[:8]}"
    tids = [ids.trajectory_id(run, 0, i, i) for i in range(3)]
    requests = [RolloutRequest(run_id=run, group_id=0, episode_index=i, episode_seed=i, trajectory_id=tid, members_dispatched=3,
                               task=TASK, dispatched_at=time.time()) for i, tid in enumerate(tids)]
    event = ScoredEvent(trajectory_id=tids[0], run_id=run, group_id=0, reward=1.0, scored_key="k", at=time.time())
    steps = {
        "register (REGISTER)": lambda: ledger.register(requests),
        "claim, rollout (CLAIM)": lambda: ledger.claim(tids[0], "t0", 30) and ledger.claim(tids[1], "t1", 30),
        "heartbeat (HEARTBEAT)": lambda: ledger.renew({tids[0]: "t0"}, 30),
        "hand_back (HAND_BACK)": lambda: ledger.hand_back(tids[1], "t1"),
        "mark_uploaded (TRANSITION)": lambda: ledger.mark_uploaded(tids[0], "t0", "{}", 35.0),
        "scoring_sent (SENT)": lambda: ledger.scoring_sent([tids[0]]),
        "claim, scoring (CLAIM)": lambda: ledger.claim(tids[0], "s0", 30, SCORING, "{}"),
        "mark_scored (TRANSITION)": lambda: ledger.mark_scored(tids[0], event, token="s0"),
        "mark_consumed (TRANSITION)": lambda: ledger.mark_consumed(tids[0]),
        "fail (TRANSITION)": lambda: ledger.fail(tids[1], "x"),
        "expire (EXPIRE)": lambda: ledger.expire(tids[2], 3),
        "reaper: expired_leases (ZRANGEBYSCORE)": lambda: ledger.expired_leases(stage=SCORING),
        "trainer: XREADGROUP + group transaction": lambda: _trainer_steps(client, run),
    }
    outcomes = {}
    for step, call in steps.items():
        try:
            call()
            outcomes[step] = "ok"
        except redis.ResponseError as exc:
            outcomes[step] = "CROSSSLOT" if "hash to the same slot" in str(exc) else f"error: {exc}"
    return outcomes


def _trainer_steps(client: redis.Redis, run: str) -> None:
    stream = RedisKeys.trainer_stream(run)
    client.xgroup_create(stream, STREAM_READERS, id="0", mkstream=True)
    entries = client.xreadgroup(STREAM_READERS, "sim", {stream: ">"}, count=256)
    with client.pipeline(transaction=True) as tx:
        tx.watch(RedisKeys.run_marker(run), RedisKeys.groups_done(run))
        tx.multi()
        tx.sadd(RedisKeys.groups_done(run), 0)
        tx.hincrby(RedisKeys.trainer_counters(run), "groups_accepted", 1)
        tx.rpush(RedisKeys.train_queue(run), "{}")
        tx.xack(stream, STREAM_READERS, *(e for e, _ in (entries[0][1] if entries else [])), "0-1")
        tx.execute()


# --- one layout -------------------------------------------------------------------------------
@dataclass
class ShardLoad:
    runs: int
    trajectories: int
    cpu_s: float
    commands: int
    script_calls: int

    @classmethod
    def total(cls, loads: list["ShardLoad"]) -> "ShardLoad":
        return cls(*(sum(getattr(load, field) for load in loads) for field in cls.__dataclass_fields__))

    def saturation(self) -> float:
        """Trajectories/s at which this load keeps one Redis core busy."""
        return self.trajectories / self.cpu_s if self.cpu_s else 0.0


@dataclass
class LayoutResult:
    name: str
    shards: list[ShardLoad]
    seconds: float
    client_cpu_s: float

    @property
    def trajectories(self) -> int:
        return sum(s.trajectories for s in self.shards)


def drive_in_processes(target: Callable[..., None], urls: list[str], runs: list[str], clients: int, groups: int,
                       group_size: int, per_run: bool) -> list[tuple[int, float, float]]:
    """``target`` (``drive`` or one like it) in ``clients`` processes, each with its share of the
    runs; their (trajectories, CPU seconds, seconds)."""
    out: mp.Queue = mp.Queue()
    procs = [mp.Process(target=target, args=(urls, runs[i::clients], groups, group_size, per_run, out))
             for i in range(clients)]
    for proc in procs:
        proc.start()
    reports = [out.get(timeout=900) for _ in procs]
    for proc in procs:
        proc.join(30)
    return reports


def run_layout(name: str, servers: list[RedisServer], runs: list[str], clients: int, groups: int, group_size: int,
               per_run: bool) -> LayoutResult:
    urls = [s.url for s in servers]
    before = [s.usage() for s in servers]
    reports = drive_in_processes(drive, urls, runs, clients, groups, group_size, per_run)
    after = [s.usage() for s in servers]
    loads = []
    for index, (b, a) in enumerate(zip(before, after)):
        owned = sum(1 for run in runs if shard_of(run, len(servers)) == index)
        loads.append(ShardLoad(owned, owned * groups * group_size, a[0] - b[0], a[1] - b[1], a[2] - b[2]))
    done = sum(r[0] for r in reports)
    if done != sum(s.trajectories for s in loads):
        raise RuntimeError(f"{name}: {done} trajectories consumed, {sum(s.trajectories for s in loads)} expected")
    return LayoutResult(name, loads, max(r[2] for r in reports), sum(r[1] for r in reports))


def per_traj(value: float, trajectories: int, scale: float = 1.0) -> str:
    return f"{value * scale / trajectories:,.1f}" if trajectories else "-"


def report(results: list[LayoutResult], console: Console) -> None:
    table = Table(title="Redis per trajectory, by layout (trajectories/s here are the clients' own limit)")
    for column in ("layout", "shard", "runs", "trajectories", "traj/s", "Redis CPU µs/traj", "commands/traj",
                   "Lua calls/traj", "one Redis core saturates at traj/s", "client CPU µs/traj"):
        table.add_column(column, justify="left" if column in ("layout", "shard") else "right")
    for result in results:
        n = len(result.shards)
        total = ShardLoad.total(result.shards)
        rows = [("all", total)] + ([(str(i), s) for i, s in enumerate(result.shards)] if n > 1 else [])
        for shard, load in rows:
            saturation = f"{load.saturation():,.0f}"
            if shard == "all" and n > 1:
                saturation += f" (x{n} shards: {load.saturation() * n:,.0f})"
            table.add_row(
                result.name, shard, str(load.runs), f"{load.trajectories:,}",
                f"{load.trajectories / result.seconds:,.0f}", per_traj(load.cpu_s, load.trajectories, 1e6),
                per_traj(load.commands, load.trajectories), per_traj(load.script_calls, load.trajectories),
                saturation,
                per_traj(result.client_cpu_s, result.trajectories, 1e6) if shard == "all" else "",
            )
    console.print(table)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, default=4, help="client processes, each driving its share of the runs")
    parser.add_argument("--runs", type=int, default=32)
    parser.add_argument("--groups", type=int, default=16, help="groups per run")
    parser.add_argument("--group-size", type=int, default=16)
    parser.add_argument("--shards", type=int, nargs="+", default=[1, 2, 3], help="layouts of N standalone shards")
    parser.add_argument("--no-cluster", action="store_true", help="skip the cluster-mode check and layout")
    args = parser.parse_args()
    console = Console(width=220)
    runs = [f"sim{i:03d}" for i in range(args.runs)]
    results: list[LayoutResult] = []
    with tempfile.TemporaryDirectory(prefix="sharding-") as tmp:
        for shards in args.shards:
            servers = [RedisServer.start(Path(tmp)) for _ in range(shards)]
            try:
                name = f"{shards} shard{'s' if shards > 1 else ''}"
                results.append(run_layout(name, servers, runs, args.clients, args.groups, args.group_size, per_run=False))
            finally:
                for server in servers:
                    server.stop()
        if not args.no_cluster:
            server = RedisServer.start(Path(tmp), cluster=True)
            try:
                table = Table(title="Each ledger step in cluster mode: as it is, and with per-run lease keys")
                for column in ("step", "as it is", "per-run lease keys"):
                    table.add_column(column)
                as_is, per_run = crossslot_check(server.client(), False), crossslot_check(server.client(), True)
                for step in as_is:
                    table.add_row(step, as_is[step], per_run[step])
                console.print(table)
                results.append(run_layout("cluster mode, per-run leases", [server], runs, args.clients, args.groups,
                                          args.group_size, per_run=True))
            finally:
                server.stop()
    report(results, console)


if __name__ == "__main__":
    main()
