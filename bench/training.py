"""Training benchmark, in one run (issue 4):

1. weight-sync latency, from checkpoint written to new version served (``bench/weight_sync.py``);
2. trainer tokens/s against a bare torch loop on the same batches (``bench/training_step.py``);
3. wall time for N steps, asynchronous (``max_off_policy_steps = 2``) against synchronous (0),
   through the whole distributed system. The environment's step takes about as long as a
   training step plus its checkpoint and weight sync (``--env-latency``, default 1.5 s).
   That is the regime where overlapping rollouts with training pays.

    .venv/bin/python bench/training.py [--steps 8] [--env-latency 1.5] [--skip-components]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from services.cli.learning_demo import run_learning  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--env-latency", type=float, default=1.5)
    parser.add_argument("--skip-components", action="store_true", help="only the async vs sync comparison")
    args = parser.parse_args()

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
