"""Orchestration capacity (issue 15): how many trajectories per second Conveyor itself moves when
the policy costs nothing.

A replay policy stands in for vLLM (benchmarks only; tests use real vLLM): an aiohttp server
that answers ``/v1/completions`` at once with recorded token ids and logprobs. Episodes are
single-turn tasks with a trivial reward. Everything else is real: redis-server, Celery rollout
and scoring workers, S3 writes (the moto server, or local files with ``--storage local``), the
ledger, the scorer and the trainer consumer (assembling groups and writing their batches, no
training: every group has zero variance and is kept, ``trainer.zero_variance_groups: keep``).

It reports, per configuration (rollout worker processes x group size):
- end-to-end trajectories/s, intake start to the last trajectory consumed;
- group latency p50/p99 (dispatch to the trainer's decision), from the trainer's own metrics lines;
- trainer-side latency p50/p99: the group's last upload done, and its last scoring done, to the
  trainer's decision, from the trajectories' stage timings and the group records;
- Redis commands per trajectory (``INFO stats`` total_commands_processed, before and after);
- object-store bytes per trajectory (every object the run wrote);
- S3 requests per trajectory, by method (the moto server's request log, before the benchmark
  reads the run's objects back; 0 with ``--storage local``);
- worker RSS per concurrent episode (the rollout workers' resident memory over slots x group size),
  and per worker process, idle (started, tokenizer loaded, no task yet) and while running;
- where the CPU went: the machine's busy share of all cores (other sessions' too), and in cores the
  rollout workers', redis-server's and each other process's (the benchmark's own process runs the
  replay policy and the dispatcher).

Every group is published at once (a capacity run), so that the trainer-side latency from upload
includes the wait behind the whole backlog. With ``--offered-load 0.25 0.5 0.8``, each
configuration's capacity run is followed by runs in which intake publishes one group every
group_size / rate seconds, at that fraction of the capacity just measured (or ``--offered-rate``,
absolute): the trainer-side latency below saturation, and where it starts to queue. A table of
these runs is printed at the end. Measuring starts once every worker answers a Celery ping.

With ``--atropos``, once Conveyor's stack is down, each configuration's trajectories (read back
from the object store: the same token ids, masks, logprobs, rewards and group size) go through
Atropos 0.4's API server, with as many producer processes as the configuration had rollout
workers (``bench/atropos_side_by_side.py``), and a table gives the ratio Conveyor / Atropos.

    .venv/bin/python bench/capacity.py [--trajectories 2000] [--workers 1 4] [--group-sizes 4 16 64]
                                       [--scoring-batch-max 1 64] [--bundle-max 1 16] [--offered-load 0.25 0.5 0.8]
                                       [--offered-rate 50] [--storage local] [--atropos]   # --atropos after bench/atropos_venv.sh
"""

from __future__ import annotations

import argparse
import asyncio
import gzip
import itertools
import json
import os
import re
import statistics
import sys
import tempfile
import threading
import time
from collections import Counter, defaultdict
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from aiohttp import web  # noqa: E402

from bench.atropos_side_by_side import DEFAULT_PYTHON, GUARANTEES, ScoredGroup, run_atropos  # noqa: E402
from bench.local_runs import (BenchRun, machine_cpu_s, mem_available_mb, pct, process_cpu_s, redis_cpu_s,  # noqa: E402
                              rss_mb, wait_for_workers)
from services.cli.local_stack import LocalStack, free_port  # noqa: E402
from services.inference.tiny_model import generate_tiny_model  # noqa: E402
from services.intake.publisher import build_group  # noqa: E402
from shared.celery_app import publish_rollouts  # noqa: E402
from shared.state.group_registry import GroupRegistry  # noqa: E402
from shared.object_bundles import decode_bundle, is_bundle_key  # noqa: E402
from shared.rates import per_second  # noqa: E402
from shared.schemas import FlatSequence, GroupRecord, GroupRegistration, ScoredTrajectory, TaskProfile, Trajectory  # noqa: E402

REWARD_FN = "services.rollout_worker.environments.toy_rewards:digit_share"


class ReplayPolicy:
    """Answers every completion at once with the tokens of "42" and the end of turn, fixed logprobs."""

    def __init__(self, model_dir: Path) -> None:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
        self.reply_ids = tokenizer.encode("42", add_special_tokens=False) + [tokenizer.convert_tokens_to_ids("<|im_end|>")]
        self.port = free_port()
        self.requests = 0
        self._ready = threading.Event()
        threading.Thread(target=self._serve, daemon=True, name="replay-policy").start()
        self._ready.wait(10)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _serve(self) -> None:
        async def completions(request: web.Request) -> web.Response:
            body = await request.json()
            self.requests += 1
            ids = self.reply_ids[: body.get("max_tokens", len(self.reply_ids))]
            return web.json_response({"choices": [{"token_ids": ids, "logprobs": {"token_logprobs": [-0.1] * len(ids)},
                                                   "finish_reason": "stop", "text": "42"}]})

        async def models(_: web.Request) -> web.Response:
            return web.json_response({"data": [{"id": "tiny"}]})

        async def health(_: web.Request) -> web.Response:
            return web.Response(text="ok")

        app = web.Application()
        app.add_routes([web.post("/v1/completions", completions), web.get("/v1/models", models), web.get("/health", health)])
        loop = asyncio.new_event_loop()
        runner = web.AppRunner(app, access_log=None)
        loop.run_until_complete(runner.setup())
        loop.run_until_complete(web.TCPSite(runner, "127.0.0.1", self.port).start())
        self._ready.set()
        loop.run_forever()


def command_calls(client) -> dict[str, int]:
    """Calls per Redis command so far (``INFO commandstats``; commands run by Lua scripts count too)."""
    return {name.removeprefix("cmdstat_"): int(stats["calls"]) for name, stats in client.info("commandstats").items()}


S3_REQUEST = re.compile(r'"(GET|PUT|HEAD|POST|DELETE) /')


def s3_requests(log_path: Path) -> Counter:
    """Requests the moto server logged so far, by method (none with local files)."""
    if not log_path.exists():
        return Counter()
    return Counter(m.group(1) for m in S3_REQUEST.finditer(log_path.read_text(errors="replace")))


def publish_group(run: BenchRun, group_id: int) -> None:
    """Register one single-turn group the way intake does and publish it as one rollout task."""
    task = TaskProfile(task_id=f"c{group_id}", env_name="single_turn",
                       task_data={"prompt": "Say a number.", "row": {"id": group_id}}, env_config={"reward_fn": REWARD_FN})
    requests = build_group(run.settings, group_id, task)
    GroupRegistry(run.client, run.run_id).register(GroupRegistration(
        run_id=run.run_id, group_id=group_id, expected_size=len(requests), task_id=task.task_id,
        policy_version=0, dispatched_at=requests[0].dispatched_at, env_name="single_turn"))
    run.ledger.register(requests)
    publish_rollouts(run.celery, requests)


def run_config(base: LocalStack, root: Path, workers: int, group_size: int, trajectories: int,
               slots: int, scoring_batch_max: int = 64, bundle_max: int = 64,
               offered_rate: float | None = None) -> tuple[dict, list[ScoredGroup]]:
    """One configuration. ``offered_rate`` (trajectories/s): intake publishes a group every
    group_size / offered_rate seconds; None: every group at once (the capacity run)."""
    run_id = f"cap-w{workers}-g{group_size}-b{scoring_batch_max}-u{bundle_max}" + (f"-r{offered_rate:.0f}" if offered_rate else "")
    run = BenchRun.open(base, root, run_id, {
        "CONVEYOR_ROLLOUT__GROUP_SIZE": str(group_size), "CONVEYOR_ROLLOUT__MAX_TURNS": "1",
        "CONVEYOR_ROLLOUT__MAX_TOKENS_PER_TURN": "4", "CONVEYOR_TRAINER__BLOCK_MS": "20",
        "CONVEYOR_REWARDS__WEIGHTS": json.dumps({"verifier": 1.0}),
        "CONVEYOR_ROLLOUT__SCORING_BATCH_MAX": str(scoring_batch_max),
        "CONVEYOR_ROLLOUT__UPLOAD_BUNDLE_MAX": str(bundle_max),
        # every reply is the same, so every group has zero variance: kept, the trainer still
        # reads its trajectories and writes its batch, as it does for a group it trains on
        "CONVEYOR_TRAINER__ZERO_VARIANCE_GROUPS": "keep",
    })
    groups = max(1, trajectories // group_size)
    with run.stack:
        procs = [run.stack.start_rollout_worker(name=f"rollout{i}", concurrency=slots) for i in range(workers)]
        run.stack.start_scoring_worker()
        run.stack.start_trainer()
        startup_s = wait_for_workers(run.celery, workers + 1, timeout_s=600)  # each has loaded its tokenizer
        time.sleep(2)  # the trainer joins its stream
        idle_rss_mb = [rss_mb(p.proc.pid) for p in procs]
        client = run.client
        commands0 = int(client.info("stats")["total_commands_processed"])
        s3_log = base.root / "logs" / "s3.log"
        s3_before = s3_requests(s3_log)
        by_command0 = command_calls(client)
        redis_cpu0, (busy0, total0) = redis_cpu_s(client), machine_cpu_s()
        by_process = {p.name: p.proc.pid for p in run.stack.processes + base.processes} | {"benchmark": os.getpid()}
        process_cpu0 = {name: process_cpu_s(pid) for name, pid in by_process.items()}
        started, load_before = time.time(), os.getloadavg()[0]
        for group_id in range(groups):
            if offered_rate and (wait := started + group_id * group_size / offered_rate - time.time()) > 0:
                time.sleep(wait)
            publish_group(run, group_id)
        published_s = time.time() - started
        total = groups * group_size
        rss_samples: list[float] = []
        run.wait_until_consumed(total, timeout_s=3600, what=run_id,
                                each_poll=lambda: rss_samples.append(sum(rss_mb(p.proc.pid) for p in procs)))
        wall, load_after = time.time() - started, os.getloadavg()[0]
        (busy1, total1), redis_cpu = machine_cpu_s(), redis_cpu_s(client) - redis_cpu0
        process_cpu = {name: process_cpu_s(pid) - process_cpu0[name] for name, pid in by_process.items()}
        commands = int(client.info("stats")["total_commands_processed"]) - commands0
        s3_calls = s3_requests(s3_log) - s3_before
        by_command = {name: calls - by_command0.get(name, 0) for name, calls in command_calls(client).items()}
        counts = run.ledger.counts(run.run_id)
        latencies = [m["group_latency_s"] for m in run.trainer_metrics()]
        objects = {k: run.store.get_bytes(k) for prefix in ("trajectories", "scored", "groups", "batches")
                   for k in run.store.list_keys(f"{prefix}/{run.run_id}/")}
    written = WrittenRun.parse(objects)
    from_upload, from_scoring = written.trainer_side_latencies()
    result = {
        "workers": workers, "group_size": group_size, "scoring_batch_max": scoring_batch_max, "bundle_max": bundle_max,
        "offered_traj_per_s": offered_rate, "published_traj_per_s": per_second(total, published_s),
        "trajectories": total, "failed": counts["failed"], "load_1m_before_after": [load_before, load_after],
        "traj_per_s": total / wall, "group_latency_p50_ms": 1000 * pct(latencies, 0.5),
        "group_latency_p99_ms": 1000 * pct(latencies, 0.99), "trainer_side_p50_ms": 1000 * pct(from_upload, 0.5),
        "trainer_side_p99_ms": 1000 * pct(from_upload, 0.99), "scored_to_decided_p50_ms": 1000 * pct(from_scoring, 0.5),
        "scored_to_decided_p99_ms": 1000 * pct(from_scoring, 0.99), "redis_commands_per_traj": commands / total,
        "stored_bytes_per_traj": sum(len(b) for b in objects.values()) / total,
        "s3_requests_per_traj": sum(s3_calls.values()) / total,
        "s3_requests_per_traj_by_method": {method: round(calls / total, 2) for method, calls in sorted(s3_calls.items())},
        "top_redis_commands_per_traj": {name: round(calls / total, 2) for name, calls in
                                        sorted(by_command.items(), key=lambda kv: -kv[1])[:12]},
        # a slot runs one rollout task: a whole group's episodes at once
        "rss_mb_per_concurrent_episode": (statistics.fmean(rss_samples) / (workers * slots * group_size)
                                          if rss_samples else float("nan")),
        "worker_rss_idle_mb": statistics.fmean(idle_rss_mb),  # per rollout worker process, before any task
        "worker_rss_mb": statistics.fmean(rss_samples) / workers if rss_samples else float("nan"),
        "workers_start_s": startup_s,
        # where the machine's 2 cores went: all of it, and Redis' part (in cores)
        "machine_cpu_busy": (busy1 - busy0) / (total1 - total0), "redis_cpu_cores": redis_cpu / wall,
        "rollout_workers_cpu_cores": sum(cpu for name, cpu in process_cpu.items() if name.startswith("worker-rollout")) / wall,
        "cpu_cores_by_process": {name: round(cpu / wall, 3) for name, cpu in process_cpu.items()
                                 if not name.startswith("worker-rollout")},  # the benchmark runs the replay policy
        "mem_available_mb": mem_available_mb(), "load_1m": os.getloadavg()[0],
    }
    return result, written.atropos_groups()


@dataclass
class WrittenRun:
    """What a run left in the object store: its trajectories, their scorings and the group records."""

    trajectories: list[Trajectory]
    scored: dict[str, ScoredTrajectory]  # by trajectory id
    records: list[GroupRecord]

    @classmethod
    def parse(cls, objects: dict[str, bytes]) -> "WrittenRun":
        def models(prefix: str, model_type: type) -> list:  # a bundle's members each
            return [model_type.model_validate_json(member) for k, b in objects.items() if k.startswith(prefix)
                    for member in (decode_bundle(b) if is_bundle_key(k) else [gzip.decompress(b)])]

        scored = {s.trajectory_id: s for s in models("scored/", ScoredTrajectory)}
        return cls(models("trajectories/", Trajectory), scored, models("groups/", GroupRecord))

    def trainer_side_latencies(self) -> tuple[list[float], list[float]]:
        """Per group, from the last member's upload done, and from its last scoring, to the
        trainer's decision. The upload's end is dispatch + queue wait + episode + upload, so the
        worker's time between the episode and the upload counts on the trainer's side."""
        uploaded: dict[int, float] = defaultdict(float)
        scored: dict[int, float] = defaultdict(float)
        for t in self.trajectories:
            s = self.scored[t.trajectory_id]
            done = t.request.dispatched_at + s.timings["queue_wait"] + s.timings["episode"] + s.timings["upload"]
            uploaded[s.group_id] = max(done, uploaded[s.group_id])
            scored[s.group_id] = max(s.scored_at, scored[s.group_id])
        return ([r.completed_at - uploaded[r.group_id] for r in self.records],
                [r.completed_at - scored[r.group_id] for r in self.records])

    def atropos_groups(self) -> list[ScoredGroup]:
        """The same trajectories as Atropos groups: each as the trainer flattens it, with its reward."""
        members: dict[int, list[tuple[FlatSequence, float]]] = defaultdict(list)
        for t in self.trajectories:
            members[t.request.group_id].append((t.flatten(), self.scored[t.trajectory_id].reward))
        return [ScoredGroup(tokens=[f.token_ids for f, _ in group],
                            masks=[[tok if m else -100 for tok, m in zip(f.token_ids, f.loss_mask)] for f, _ in group],
                            scores=[r for _, r in group], inference_logprobs=[f.inference_logprobs for f, _ in group])
                for _, group in sorted(members.items())]


def compare(conveyor: list[dict], atropos: list[dict]) -> None:
    """Each configuration's figures side by side, and the ratio Conveyor / Atropos."""
    from rich.console import Console
    from rich.table import Table

    table = Table(title="Conveyor / Atropos, same trajectories (ratio > 1: Conveyor's figure is higher)")
    for column in ("workers = producers", "group size", "traj/s C | A", "ratio", "p50 ms: C upload | A push", "ratio",
                   "p50 ms: C scored | A push", "ratio", "p99 ms: C scored | A push", "ratio"):
        table.add_column(column, justify="right")
    for c, a in zip(conveyor, atropos):
        row = [str(c["workers"]), str(c["group_size"])]
        for ck, ak in (("traj_per_s", "traj_per_s"), ("trainer_side_p50_ms", "latency_p50_ms"),
                       ("scored_to_decided_p50_ms", "latency_p50_ms"), ("scored_to_decided_p99_ms", "latency_p99_ms")):
            row += [f"{c[ck]:.1f} | {a[ak]:.1f}", f"{c[ck] / a[ak]:.2f}x"]
        table.add_row(*row)
    console = Console(width=160)
    console.print(table)
    console.print("Latency: Conveyor from the group's last upload (or last scoring) to the trainer's decision; "
                  "Atropos from the push of the scored group to its delivery by /batch.")
    console.print(GUARANTEES)


def print_offered_load(results: list[dict]) -> None:
    """Latency against offered load: each configuration's capacity run (all at once) and its steady runs."""
    from rich.console import Console
    from rich.table import Table

    table = Table(title="Steady offered load: trainer-side latency below and at saturation")
    for column in ("workers", "group size", "offered traj/s", "achieved traj/s", "from upload p50 / p99 ms",
                   "from scoring p50 / p99 ms", "dispatch to decision p50 ms", "machine CPU busy", "load 1m"):
        table.add_column(column, justify="right")
    for r in results:
        offered = f"{r['offered_traj_per_s']:.0f}" if r["offered_traj_per_s"] else "all at once"
        table.add_row(str(r["workers"]), str(r["group_size"]), offered, f"{r['traj_per_s']:.1f}",
                      f"{r['trainer_side_p50_ms']:.0f} / {r['trainer_side_p99_ms']:.0f}",
                      f"{r['scored_to_decided_p50_ms']:.0f} / {r['scored_to_decided_p99_ms']:.0f}",
                      f"{r['group_latency_p50_ms']:.0f}", f"{r['machine_cpu_busy']:.0%}", f"{r['load_1m']:.1f}")
    Console(width=160).print(table)


def rounded(result: dict) -> str:
    return json.dumps({k: round(v, 2) if isinstance(v, float) else v for k, v in result.items()})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trajectories", type=int, default=2000)
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--group-sizes", type=int, nargs="+", default=[4, 16, 64])
    parser.add_argument("--slots", type=int, default=16, help="Celery thread slots per rollout worker")
    parser.add_argument("--storage", choices=["s3", "local"], default="s3")
    parser.add_argument("--scoring-batch-max", type=int, nargs="+", default=[64],
                        help="rollout.scoring_batch_max per configuration; 1 sends one scoring message per trajectory")
    parser.add_argument("--bundle-max", type=int, nargs="+", default=[64],
                        help="rollout.upload_bundle_max per configuration; 1 uploads one object per trajectory")
    parser.add_argument("--offered-load", type=float, nargs="*", default=[], metavar="FRACTION",
                        help="after each configuration's capacity run, runs whose intake publishes groups at this "
                             "fraction of the capacity just measured, at a steady rate (e.g. 0.25 0.5 0.8)")
    parser.add_argument("--offered-rate", type=float, nargs="*", default=[], metavar="TRAJ_PER_S",
                        help="the same at these absolute rates (trajectories/s)")
    parser.add_argument("--atropos", action="store_true",
                        help="then feed each configuration's trajectories to Atropos' API server (bench/atropos_side_by_side.py)")
    parser.add_argument("--atropos-python", type=Path, default=DEFAULT_PYTHON)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="conveyor-capacity-") as tmp:
        root = Path(tmp)
        model_dir = generate_tiny_model(root / "tiny")  # the workers' tokenizer; the replay policy speaks it
        policy = ReplayPolicy(model_dir)
        base = LocalStack(root / "base")
        results, written, offered = [], [], []
        try:
            base.start_redis()
            if args.storage == "s3":
                base.start_s3()
            else:
                base.env.update({"CONVEYOR_STORAGE__BACKEND": "local", "CONVEYOR_STORAGE__LOCAL_ROOT": str(root / "objects")})
            base.use_inference(policy.base_url, model_dir, "tiny")
            for workers in args.workers:
                for group_size in args.group_sizes:
                    for batch_max, bundle_max in itertools.product(args.scoring_batch_max, args.bundle_max):
                        result, groups = run_config(base, root, workers, group_size, args.trajectories, args.slots,
                                                    batch_max, bundle_max)
                        results.append(result)
                        written.append(groups)
                        print(rounded(result), flush=True)
                        rates = [f * result["traj_per_s"] for f in args.offered_load] + args.offered_rate
                        steady = []
                        for rate in rates:
                            steady.append(run_config(base, root, workers, group_size, args.trajectories, args.slots,
                                                     batch_max, bundle_max, offered_rate=rate)[0])
                            print(rounded(steady[-1]), flush=True)
                        offered += [result, *steady] if steady else []
        finally:
            base.stop()
        if offered:
            print_offered_load(offered)
        print(f"replay policy answered {policy.requests} completions")
        if args.atropos:  # after Conveyor's stack is down: the server has the machine to itself
            atropos = []
            for result, groups in zip(results, written):
                atropos.append(run_atropos(groups, producers=result["workers"], concurrency=args.slots,
                                           python=args.atropos_python, log_dir=root))
                print(rounded(atropos[-1]), flush=True)
            compare(results, atropos)


if __name__ == "__main__":
    main()
