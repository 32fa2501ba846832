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

from services.cli.local_stack import LocalStack, free_port  # noqa: E402
from services.intake.publisher import build_group  # noqa: E402
from shared.celery_app import make_celery, publish_rollouts  # noqa: E402
from shared.ledger import Ledger  # noqa: E402
from shared.names import RedisKeys  # noqa: E402
from shared.schemas import GroupRecord, GroupRegistration, ScoredTrajectory, TaskProfile  # noqa: E402
from shared.settings import load_settings  # noqa: E402
from shared.storage import get_model, open_store  # noqa: E402

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
    env = {k: v for k, v in base.env.items() if k not in ("CONVEYOR_RUN_ID", "CONVEYOR_TRAINER__METRICS_PATH")}
    env.update({
        "CONVEYOR_ROLLOUT__GROUP_SIZE": str(group_size), "CONVEYOR_ROLLOUT__MAX_TURNS": str(max_turns),
        "CONVEYOR_ROLLOUT__MAX_TOKENS_PER_TURN": "24", "CONVEYOR_ROLLOUT__MAX_EPISODE_TOKENS": "400",
        "CONVEYOR_TRAINER__BLOCK_MS": "50",
    })
    stack = LocalStack(root / run_id, run_id=run_id, env=env)
    import os

    os.environ.update(stack.env)
    settings = load_settings()
    celery = make_celery(settings)
    ledger = Ledger.from_url(settings.redis.url)
    store = open_store(settings.storage)
    groups_per_wave = level // group_size
    waves_out = []
    with stack:
        stack.start_rollout_worker(concurrency=slots)
        stack.start_scoring_worker()
        stack.start_trainer()
        time.sleep(8)  # workers import torch/transformers and connect
        group_id = 0
        for wave in range(waves + 1):  # wave 0 warms up every process and is not counted
            wave_groups = []
            started = time.time()
            for _ in range(groups_per_wave):
                task = TaskProfile(task_id=f"b{group_id}", env_name="guess_number",
                                   task_data={"low": 1, "high": 50, "target": 1 + (group_id * 7) % 50},
                                   env_config={"step_latency_s": step_latency})
                requests = build_group(settings, group_id, task)
                registration = GroupRegistration(run_id=run_id, group_id=group_id, expected_size=group_size,
                                                 task_id=task.task_id, policy_version=0, dispatched_at=requests[0].dispatched_at)
                ledger.redis.hset(RedisKeys.groups(run_id), str(group_id), registration.model_dump_json())
                ledger.register(requests)
                for batch in ([r] for r in requests) if task_per_trajectory else [requests]:
                    publish_rollouts(celery, batch)
                wave_groups.append(group_id)
                group_id += 1
            target = group_id * group_size
            deadline = time.time() + 600
            while ledger.counts(run_id)["consumed"] + ledger.counts(run_id)["failed"] < target:
                if time.time() > deadline:
                    raise TimeoutError(f"wave {wave} of level {level} did not finish: {ledger.counts(run_id)}")
                time.sleep(0.05)
            if wave == 0:
                continue
            records = [get_model(store, f"groups/{run_id}/{g:06d}.json.gz", GroupRecord) for g in wave_groups]
            scored = [
                get_model(store, f"scored/{run_id}/{g:06d}/{m.trajectory_id}.json.gz", ScoredTrajectory)
                for r, g in zip(records, wave_groups) for m in r.members if m.reward is not None
            ]
            wall = max(r.completed_at for r in records) - started
            longest = max(s.timings["episode"] for s in scored)
            waves_out.append({"wall": wall, "longest_episode": longest, "scored": scored, "records": records, "episodes": len(scored)})
    metrics = [json.loads(line) for line in (root / run_id / "metrics.jsonl").read_text().splitlines()] if (root / run_id / "metrics.jsonl").exists() else []
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

    from services.inference.server import VllmServer
    from services.inference.tiny_model import generate_tiny_model

    root = Path(tempfile.mkdtemp(prefix="conveyor-bench-"))
    base = LocalStack(root / "base")
    vllm = None
    try:
        base.start_redis()
        if args.storage == "s3":
            base.start_s3()
        else:
            base.env.update({"CONVEYOR_STORAGE__BACKEND": "local", "CONVEYOR_STORAGE__LOCAL_ROOT": str(root / "objects")})
        model_dir = generate_tiny_model(root / "tiny", end_of_turn_bias=4.0)
        vllm = VllmServer(model_dir, "tiny", port=free_port(), log_path=root / "vllm.log")
        vllm.start()
        vllm.wait_ready(600)
        base.use_inference(vllm.base_url, model_dir, "tiny")
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
    finally:
        base.stop()
        if vllm:
            vllm.stop()


if __name__ == "__main__":
    main()
