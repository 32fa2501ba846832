"""Training benchmark, in one run (issue 4):

1. weight-sync latency, from checkpoint written to new version served (``bench/weight_sync.py``);
2. trainer tokens/s against a bare torch loop on the same batches (``bench/training_step.py``);
3. wall time for N steps, asynchronous (``max_off_policy_steps = 2``) against synchronous (0),
   through the whole distributed system. The environment's step takes about as long as a
   training step plus its checkpoint and weight sync (``--env-latency``, default 1.5 s).
   That is the regime where overlapping rollouts with training pays.

With ``--vs-trl`` it measures instead, per layout, Conveyor against TRL's GRPOTrainer (issue 7):
seconds per optimizer step of each, in one invocation (Conveyor first, then TRL), the ratio
Conveyor / TRL, Conveyor's breakdown per step (trainer forward/backward, checkpoint, weight
sync, and the rest of the wall time between two steps: waiting for rollouts), and both reward
curves (steps to reach mean reward 0.5 and 0.9, a PNG). Same tiny model (seed 0), prompts,
reward, batch shape and GRPO settings on both sides (``TRL_MATCHED``, ``bench/trl_grpo_digits.py``).
TRL is installed for the benchmark only, with ``--no-deps`` into ``~/.cache/conveyor-bench``.

    .venv/bin/python bench/training.py [--steps 8] [--env-latency 1.5] [--skip-components]
    .venv/bin/python bench/training.py --vs-trl [--steps 60] [--layouts llama,llama-tied] [--out DIR]
        [--max-off-policy-steps 0] [--env OMP_NUM_THREADS=1] [--trl-threads N]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from services.cli.learning_demo import run_learning  # noqa: E402

TRL_VERSION, ACCELERATE_VERSION = "1.16.0", "1.15.0"  # trl 1.16 runs on transformers 5.19
# Conveyor's knobs set as TRL's GRPOTrainer does it: Bessel std + 1e-4, zero-variance groups kept
# with advantage 0, each step trains on exactly the groups generated for it, every prompt once
# per epoch in shuffled order, truncated completions not masked, fully on-policy (k = 0)
TRL_MATCHED = {
    "CONVEYOR_TRAINER__ADVANTAGE_STD": "bessel",
    "CONVEYOR_TRAINER__ADVANTAGE_EPS": "1e-4",
    "CONVEYOR_TRAINER__ZERO_VARIANCE_GROUPS": "keep",
    "CONVEYOR_TRAINER__MAX_EXTRA_GROUPS_PER_STEP": "0",
    "CONVEYOR_INTAKE__SAMPLE_ORDER": "shuffled_epochs",
    "CONVEYOR_TRAINER__BATCHING__MASK_OVERLONG": "false",
}


def ensure_trl() -> Path:
    """TRL and accelerate in a cache directory, without their dependencies: the project's pinned
    transformers and torch stay the ones imported."""
    target = Path.home() / ".cache" / "conveyor-bench" / f"trl-{TRL_VERSION}"
    if not (target / "trl").is_dir():
        subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--target", str(target),
                        f"trl=={TRL_VERSION}", f"accelerate=={ACCELERATE_VERSION}"], check=True)
    return target


def run_trl(workdir: Path, steps: int, layout: str, threads: int = 0) -> list[dict]:
    out, log = workdir / "trl_steps.jsonl", workdir / "trl.log"
    env = {**os.environ, "PYTHONPATH": f"{ensure_trl()}{os.pathsep}{ROOT}", "PYTHONWARNINGS": "ignore"}
    with log.open("w") as fh:
        done = subprocess.run([sys.executable, str(ROOT / "bench" / "trl_grpo_digits.py"), "--steps", str(steps),
                               "--layout", layout, "--threads", str(threads), "--out", str(out)], env=env, stdout=fh, stderr=subprocess.STDOUT)
    if done.returncode != 0:
        raise RuntimeError(f"TRL run failed, see {log}:\n{log.read_text()[-3000:]}")
    return [json.loads(line) for line in out.read_text().splitlines() if line.strip()]


def first_reaching(rewards: list[float], level: float, window: int = 1) -> int | None:
    """First step (1-based) whose reward, averaged over the last ``window`` steps, is >= level."""
    for i in range(window - 1, len(rewards)):
        if statistics.fmean(rewards[i - window + 1:i + 1]) >= level:
            return i + 1
    return None


def conveyor_breakdown(steps: list[dict], groups: list[dict], k: int = 0) -> dict[str, list[float]]:
    """Per step after the first: the wall time since the previous step and its parts. The wait
    for rollouts is split with the groups completed in between (``stack/metrics.jsonl``): from
    the previous step's end to the first dispatch (weight sync excluded), dispatch to the last
    group scored and assembled, and from there to this step's start (the trainer picking it up)."""
    names = ("wall", "forward/backward", "checkpoint", "weight sync", "waiting for rollouts",
             "  admission", "  rollouts (dispatch to last group scored)", "  trainer pickup")
    parts: dict[str, list[float]] = {name: [] for name in names}
    for prev, cur in zip(steps, steps[1:]):
        wall = cur["time"] - prev["time"]
        fb, ckpt, sync = cur["step_time_s"], cur.get("checkpoint_s", 0.0), cur.get("weight_sync_s", 0.0)
        # nan before the first sync; by broadcast the sync is in the trainer's publish (checkpoint_s)
        sync = 0.0 if sync is None or sync != sync or "broadcast_sync_s" in cur else sync
        values = [wall, fb, ckpt, sync, wall - fb - ckpt - sync]
        done = [g for g in groups if g["status"] == "accepted" and prev["time"] < g["time"] <= cur["time"]]
        if done and k == 0:  # with k > 0 the next step's rollouts start before this one ends
            first_dispatch = min(g["time"] - g["group_latency_s"] for g in done)
            last_done = max(g["time"] for g in done)
            values += [max(first_dispatch - prev["time"], 0.0) - sync, last_done - max(first_dispatch, prev["time"]),
                       cur["time"] - fb - ckpt - last_done]
        for name, value in zip(names, values):
            parts[name].append(value)
    return {name: values for name, values in parts.items() if values}


def plot_curves(path: Path, curves: dict[str, list[float]], title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 3.5), dpi=120)
    for label, rewards in curves.items():
        ax.plot(range(1, len(rewards) + 1), rewards, label=label, linewidth=1.2)
    ax.axhline(0.5, color="grey", linewidth=0.6, linestyle=":")
    ax.axhline(0.9, color="grey", linewidth=0.6, linestyle=":")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("mean reward of the step's 32 completions")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def vs_trl(steps: int, layouts: list[str], out: Path, k: int, extra_env: dict[str, str] | None = None,
           trl_threads: int = 0) -> None:
    out.mkdir(parents=True, exist_ok=True)
    print(f"## Conveyor (max_off_policy_steps={k}) against TRL {TRL_VERSION} GRPOTrainer: {steps} steps, "
          f"4 prompts x 8 completions per step, at most 24 tokens, lr 5e-3, loss token mean (TRL loss_type=dapo); "
          f"Conveyor's extra env {extra_env or {}}, TRL threads {trl_threads or 'default'}",
          flush=True)
    for layout in layouts:
        load = [os.getloadavg()[0]]
        run = run_learning(out / layout, steps, k, overrides={**TRL_MATCHED, **(extra_env or {})}, layout=layout)
        conveyor = run.steps
        groups = [json.loads(line) for line in (run.workdir / "stack" / "metrics.jsonl").read_text().splitlines() if line]
        load.append(os.getloadavg()[0])
        trl = run_trl(out / layout, steps, layout, trl_threads)
        load.append(os.getloadavg()[0])
        parts = conveyor_breakdown(conveyor, groups, k)
        trl_s = [s["step_wall_s"] for s in trl]
        conv_mean, trl_mean = statistics.fmean(parts["wall"]), statistics.fmean(trl_s[1:])
        conv_med, trl_med = statistics.median(parts["wall"]), statistics.median(trl_s[1:])
        print(f"### layout {layout} (1-minute load average before/between/after: {', '.join(f'{x:.2f}' for x in load)})")
        print("  seconds per step, steps 2..N   mean    median")
        print(f"  Conveyor                     {conv_mean:6.3f}  {conv_med:6.3f}")
        print(f"  TRL GRPOTrainer              {trl_mean:6.3f}  {trl_med:6.3f}")
        print(f"  ratio Conveyor / TRL         {conv_mean / trl_mean:6.2f}x {conv_med / trl_med:6.2f}x  (target <= 3x)")
        print(f"  reply tokens, mean over steps: Conveyor {statistics.fmean(s['response_tokens_mean'] for s in conveyor):.1f},"
              f" TRL {statistics.fmean(s['completion_length'] for s in trl):.1f}")
        print(f"  Conveyor per step {'':24s} mean    median   share of the mean wall time"
              + ("" if k == 0 else f"  (k={k}: sync and rollouts overlap training, parts not additive)"))
        for name, values in parts.items():
            mean = statistics.fmean(values)
            print(f"    {name:42s} {mean:6.3f}  {statistics.median(values):6.3f}   {mean / conv_mean:6.1%}")
        curves = {"Conveyor": [s["reward_mean"] for s in conveyor], f"TRL {TRL_VERSION}": [s["reward_mean"] for s in trl]}
        for label, rewards in curves.items():
            reach = ", ".join(f"{lvl}: step {first_reaching(rewards, lvl)} (5-step mean: {first_reaching(rewards, lvl, 5)})"
                              for lvl in (0.5, 0.9))
            print(f"  {label:10s} reward first 3 {statistics.fmean(rewards[:3]):.3f}, last 3 {statistics.fmean(rewards[-3:]):.3f};"
                  f" reaches {reach}")
            print(f"    curve: {' '.join(f'{r:.2f}' for r in rewards)}")
        plot = out / f"vs_trl_{layout}.png"
        plot_curves(plot, curves, f"digit task, tiny {layout} model: Conveyor vs TRL GRPOTrainer")
        print(f"  curves: {plot}; steps: {out / layout}/{{train_steps,trl_steps}}.jsonl", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--env-latency", type=float, default=1.5)
    parser.add_argument("--skip-components", action="store_true", help="only the async vs sync comparison")
    parser.add_argument("--vs-trl", action="store_true", help="Conveyor against TRL's GRPOTrainer instead")
    parser.add_argument("--layouts", default="llama,llama-tied", help="--vs-trl: tiny-model layouts, comma-separated")
    parser.add_argument("--max-off-policy-steps", type=int, default=0, help="--vs-trl: Conveyor's staleness bound")
    parser.add_argument("--out", type=Path, help="--vs-trl: where step logs and plots go (default: a temp dir)")
    parser.add_argument("--env", action="append", default=[], metavar="KEY=VALUE",
                        help="--vs-trl: extra environment of Conveyor's processes (e.g. OMP_NUM_THREADS=1)")
    parser.add_argument("--trl-threads", type=int, default=0, help="--vs-trl: TRL's torch threads (0: torch's default)")
    args = parser.parse_args()

    if args.vs_trl:
        out = args.out or Path(tempfile.mkdtemp(prefix="conveyor-bench-vs-trl-"))
        vs_trl(args.steps, args.layouts.split(","), out.resolve(), args.max_off_policy_steps,
               dict(kv.split("=", 1) for kv in args.env), args.trl_threads)
        return

    if not args.skip_components:
        for script in ("weight_sync.py", "training_step.py"):
            print(f"## {script}", flush=True)
            subprocess.run([sys.executable, str(ROOT / "bench" / script)], check=True)

    print(f"## asynchronous vs synchronous: {args.steps} steps, env step {args.env_latency}s", flush=True)
    root = Path(tempfile.mkdtemp(prefix="conveyor-bench-training-"))
    results = {}
    for k in (0, 2):
        run = run_learning(root / f"k{k}", args.steps, k, task_config={"step_latency_s": args.env_latency})
        step_times = [s["step_time_s"] for s in run.steps]
        results[k] = run.wall_s
        print(
            f"max_off_policy_steps={k}: wall {run.wall_s:.1f}s for {len(run.steps)} steps "
            f"({run.wall_s / len(run.steps):.2f}s/step; train step p50 {statistics.median(step_times):.2f}s; "
            f"final reward {run.rewards[-1]:.3f})",
            flush=True,
        )
    print(f"async speed-up (sync wall / async wall): {results[0] / results[2]:.2f}x")


if __name__ == "__main__":
    main()
