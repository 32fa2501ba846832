"""Episodes in flight (issue 30): how many concurrent episodes one host's rollout workers hold,
and what each costs, as concurrency doubles from 1,024 to 16,384.

Everything is real but the policy: redis-server, ``--workers`` Celery rollout worker processes,
the ledger with its leases, heartbeats and reapers, S3 (the moto server, as the tests use), the
Celery scoring worker and the trainer's consumer (``trainer.mode: assemble``: it assembles every
group and writes its batch, no optimizer step). The replay policy of bench/capacity.py stands in
for vLLM: it answers every completion at once. Every environment step of the guess-the-number
episodes waits ``--step-latency`` seconds (an asyncio sleep: a tool call that costs no CPU), for
``--max-turns`` steps, so an episode lasts about their product and the episodes overlap.

Per level, a feeder keeps ``queued + running`` trajectories at the level (publishing whole GRPO
groups as intake does, as episodes finish), waits until ``running`` (the ledger's count: claimed,
leased, episode under way) reaches 95% of it, then holds ``--hold-s`` seconds and reports:
- episodes really in flight: the ledger's ``running``, sampled every second (min / mean);
- RSS per in-flight episode: the rollout workers' resident memory (every process) over ``running``;
- Redis operations/s and its CPU in cores (``INFO stats`` / ``INFO cpu`` over the hold);
- lease-renewal latency p99 (one heartbeat renewing all a worker's leases) against the lease, and
  the event-loop lag p99 of the workers, from their Prometheus histograms (bucket upper bounds);
- worker processes, and trajectories consumed per second during the hold.

With ``--kill``, one worker is killed with SIGKILL halfway through the last level's hold and a
new one started in its place; its episodes come back through the reaper. At the end, feeding
stops, every trajectory registered is waited for, and exactly-once is checked: each one is
consumed (or failed, and counted) and appears in exactly one of the trainer's group records, and
the trainer counted no duplicate event.

    .venv/bin/python bench/in_flight.py [--levels 1024,2048,4096,8192,16384] [--hold-s 300]
        [--workers 4] [--group-size 16] [--step-latency 20] [--max-turns 8] [--kill] [--json]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.in_flight_probe import LAG, RENEWAL, Histograms, RedisMeter  # noqa: E402
from bench.in_flight_run import InFlightRun, check_exactly_once, replay_stack  # noqa: E402
from bench.local_runs import rss_mb  # noqa: E402


def hold_level(run: InFlightRun, level: int, hold_s: float, kill_at_s: float | None) -> dict:
    """Ramp to ``level``, hold it ``hold_s`` seconds, and what it cost."""
    ramp_started = time.time()
    run.feed_until_running(level, timeout_s=max(120.0, level / 20))
    ramp_s = time.time() - ramp_started
    histograms, meter = Histograms(run.metrics_ports()), RedisMeter(run.bench.client)
    histograms.start()
    started = time.time()
    meter.start(started)
    consumed0 = run.finished()
    running: list[int] = []
    sampled_at: list[float] = []
    rss: list[float] = []
    killed: dict = {}
    while (now := time.time()) - started < hold_s:
        run.feed(level)
        counts = run.bench.ledger.counts(run.bench.run_id)
        running.append(counts["running"])
        sampled_at.append(now - started)
        rss.append(sum(rss_mb(p.proc.pid) for p in run.workers if p.alive()))
        if kill_at_s is not None and not killed and now - started >= kill_at_s:
            killed = {**run.kill_one_worker(), "at_hold_s": round(now - started, 1)}
        time.sleep(max(0.0, 1.0 - (time.time() - now)))
    wall = time.time() - started
    histograms.ports = run.metrics_ports()  # a replacement's counts start at 0: still a lower bound for it
    histograms.stop()
    ops, redis_cores = meter.rates(time.time())
    mean_running = sum(running) / len(running)
    lowest = running.index(min(running))
    return {
        "level": level, "ramp_s": round(ramp_s, 1), "hold_s": round(wall, 1),
        "running_min": min(running), "running_mean": round(mean_running),
        "running_min_at_hold_s": round(sampled_at[lowest], 1),
        "seconds_below_95pct": sum(1 for n in running if n < 0.95 * level),
        "rss_mb_per_episode": round(sum(rss) / len(rss) / max(mean_running, 1), 3),
        "workers_rss_mb": round(sum(rss) / len(rss)),
        "redis_ops_per_s": round(ops), "redis_cpu_cores": round(redis_cores, 3),
        "renewal_p99_s": histograms.quantile(RENEWAL, 0.99), "renewals": histograms.count(RENEWAL),
        "lease_ttl_s": run.bench.settings.ledger.lease_ttl_s,
        "loop_lag_p99_s": histograms.quantile(LAG, 0.99), "loop_lag_max_bucket_s": histograms.quantile(LAG, 1.0),
        "worker_processes": len(run.workers), "slots_per_worker": run.slots,
        "consumed_per_s": round((run.finished() - consumed0) / wall, 1), "load_1m": round(os.getloadavg()[0], 1),
        **({"killed": killed} if killed else {}),
    }


def print_table(results: list[dict], done: dict, args: argparse.Namespace) -> None:
    print(f"# in flight: {args.workers} rollout workers, group size {args.group_size}, {args.max_turns} steps of "
          f"{args.step_latency}s per episode, hold {args.hold_s}s per level; replay policy, S3 = moto, lease "
          f"{results[0]['lease_ttl_s']}s")
    print("| level | running min / mean | RSS MB per episode | workers RSS MB | Redis ops/s | Redis CPU | "
          "renewal p99 (lease) | loop lag p99 / max | worker processes | consumed/s | ramp s | load 1m |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in results:
        print(f"| {r['level']} | {r['running_min']} / {r['running_mean']} | {r['rss_mb_per_episode']:.2f} | "
              f"{r['workers_rss_mb']} | {r['redis_ops_per_s']} | {r['redis_cpu_cores']:.2f} | "
              f"≤{r['renewal_p99_s']}s ({r['lease_ttl_s']:.0f}s) | ≤{r['loop_lag_p99_s']}s / ≤{r['loop_lag_max_bucket_s']}s | "
              f"{r['worker_processes']} | {r['consumed_per_s']} | {r['ramp_s']} | {r['load_1m']} |")
    for r in results:
        if "killed" in r:
            print(f"kill -9 at level {r['level']}: {r['killed']}")
    for r in results:
        print(f"level {r['level']}: lowest running {r['running_min']} at {r['running_min_at_hold_s']} s into the hold; "
              f"{r['seconds_below_95pct']} of {r['hold_s']:.0f} s sampled below 95% of the level")
    print(f"end: {json.dumps(done)}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--levels", default="1024,2048,4096,8192,16384", help="episodes in flight, in run order")
    parser.add_argument("--hold-s", type=float, default=300.0, help="seconds each level is held")
    parser.add_argument("--workers", type=int, default=4, help="rollout worker processes")
    parser.add_argument("--group-size", type=int, default=16)
    parser.add_argument("--step-latency", type=float, default=20.0, help="seconds each environment step waits")
    parser.add_argument("--max-turns", type=int, default=8)
    parser.add_argument("--headroom", type=float, default=1.25,
                        help="slots over the peak's groups per worker (room for the re-dispatched after a kill)")
    parser.add_argument("--kill", action="store_true", help="kill -9 one worker halfway through the last level")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    levels = [int(x) for x in args.levels.split(",")]
    slots = math.ceil(max(levels) / args.group_size / args.workers * args.headroom)
    with tempfile.TemporaryDirectory(prefix="conveyor-in-flight-") as tmp:
        root = Path(tmp)
        with replay_stack(root) as base, InFlightRun.start(base, root, args.workers, slots, args.group_size,
                                                            args.max_turns, args.step_latency) as run:
            results = []
            for index, level in enumerate(levels):
                kill_at = args.hold_s / 2 if args.kill and index == len(levels) - 1 else None
                results.append(hold_level(run, level, args.hold_s, kill_at))
                print(json.dumps(results[-1]), file=sys.stderr, flush=True)
            done = check_exactly_once(run, timeout_s=args.step_latency * args.max_turns * 3 + 600)
    if args.json:
        print(json.dumps({"settings": vars(args), "results": results, "end": done}, indent=2))
    else:
        print_table(results, done, args)


if __name__ == "__main__":
    main()
