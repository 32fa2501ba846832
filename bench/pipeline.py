"""Pipeline benchmark: end-to-end trajectories/s and per-stage latency at 1, 8 and 32
concurrent episodes, with every process real (Redis, Celery workers, vLLM on CPU, trainer).

Method. For each concurrency level L, the rollout worker gets exactly L episode slots
(thread slots x group size), and work arrives in waves of L episodes: a wave is dispatched
at once, and the next starts when the trainer has consumed the last group of the previous one.
So no episode waits for a free slot, and what a wave costs beyond its longest episode is the
orchestration: queueing, claiming, upload, the scoring hop, and group assembly.
    overhead = (wave wall time - longest episode in the wave) / longest episode
The wave's end is the trainer's own completion timestamp, not a poll.

Episodes are guess-the-number games against the tiny random model. Each environment step
takes `--step-latency` seconds, standing in for tool execution. Run it twice, with 0 and with
a realistic latency, to see both the raw cost and its share of an agentic episode.

    .venv/bin/python bench/pipeline.py [--step-latency 0.5] [--waves 3] [--storage local|s3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.local_runs import BenchRun, episode_settings, inference_stack  # noqa: E402
from services.cli.local_stack import LocalStack  # noqa: E402

LEVELS = {1: (1, 1), 8: (2, 4), 32: (8, 4)}  # concurrent episodes -> (thread slots, group size)


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


def run_level(base: LocalStack, root: Path, level: int, waves: int, step_latency: float, max_turns: int,
              task_per_trajectory: bool = False) -> dict:
    slots, group_size = LEVELS[level]
    if task_per_trajectory:
        slots = level  # one episode per task: as many slots as concurrent episodes
    run_id = f"bench-c{level}" + ("-split" if task_per_trajectory else "")
    run = BenchRun.open(base, root, run_id, episode_settings(group_size, max_turns))
    groups_per_wave = level // group_size
    waves_out = []
    with run.stack:
        run.stack.start_rollout_worker(concurrency=slots)
        run.stack.start_scoring_worker()
        run.stack.start_trainer()
        time.sleep(8)  # workers import torch/transformers and connect
        group_id = 0
        for wave in range(waves + 1):  # wave 0 warms up every process and is not counted
            wave_groups = list(range(group_id, group_id + groups_per_wave))
            started = time.time()
            for g in wave_groups:
                run.publish_guess_group(g, step_latency, task_per_trajectory)
            group_id += groups_per_wave
            run.wait_until_consumed(group_id * group_size, 600, f"wave {wave} of level {level}")
            if wave == 0:
                continue
            records, scored = run.read_groups(wave_groups)
            wall = max(r.completed_at for r in records) - started
            longest = max(s.timings["episode"] for s in scored)
            waves_out.append({"wall": wall, "longest_episode": longest, "scored": scored, "records": records, "episodes": len(scored)})
    metrics = run.trainer_metrics()
    stages = {name: [s.timings[name] for w in waves_out for s in w["scored"]] for name in ("queue_wait", "episode", "inference", "env", "upload", "scoring")}
    stages["group_assembly"] = [m["assembly_s"] for m in metrics]
    overheads = [(w["wall"] - w["longest_episode"]) / w["longest_episode"] for w in waves_out]
    return {
        "level": level,
        "trajectories_per_s": statistics.median(w["episodes"] / w["wall"] for w in waves_out),
        "wave_wall_s": statistics.median(w["wall"] for w in waves_out),
        "longest_episode_s": statistics.median(w["longest_episode"] for w in waves_out),
        "overhead": statistics.median(overheads),
        "overhead_abs_s": statistics.median(w["wall"] - w["longest_episode"] for w in waves_out),
        "stages_p50_ms": {k: 1000 * pct(v, 0.5) for k, v in stages.items()},
        "stages_p95_ms": {k: 1000 * pct(v, 0.95) for k, v in stages.items()},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--step-latency", type=float, default=0.0)
    parser.add_argument("--max-turns", type=int, default=4)
    parser.add_argument("--waves", type=int, default=3)
    parser.add_argument("--levels", default="1,8,32")
    parser.add_argument("--storage", choices=["local", "s3"], default="local")
    parser.add_argument("--compare-task-shapes", action="store_true",
                        help="at each level, also run one Celery task per trajectory (vs one per group)")
    args = parser.parse_args()

    root = Path(tempfile.mkdtemp(prefix="conveyor-bench-"))
    with inference_stack(root, args.storage) as base:
        print(f"# pipeline benchmark: storage={args.storage} step_latency={args.step_latency}s max_turns={args.max_turns} waves={args.waves}")
        print("| episodes | traj/s | wave wall s | longest episode s | overhead | overhead ms | queue wait p50 | inference p50 | upload p50 | scoring p50 | assembly p50 |")
        print("|---|---|---|---|---|---|---|---|---|---|---|")
        shapes = [False, True] if args.compare_task_shapes else [False]
        for level, split in ((int(x), s) for x in args.levels.split(",") for s in shapes):
            r = run_level(base, root, level, args.waves, args.step_latency, args.max_turns, split)
            p50 = r["stages_p50_ms"]
            label = f"{level}{' (task per trajectory)' if split else ''}"
            print(
                f"| {label} | {r['trajectories_per_s']:.2f} | {r['wave_wall_s']:.3f} | {r['longest_episode_s']:.3f} | "
                f"{100 * r['overhead']:.1f}% | {1000 * r['overhead_abs_s']:.0f} | {p50['queue_wait']:.1f} ms | {p50['inference']:.1f} ms | "
                f"{p50['upload']:.1f} ms | {p50['scoring']:.1f} ms | {p50['group_assembly']:.1f} ms |",
                flush=True,
            )
            print(f"  p95 ms: {json.dumps({k: round(v, 1) for k, v in r['stages_p95_ms'].items()})}", flush=True)


if __name__ == "__main__":
    main()
