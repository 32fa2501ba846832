"""The staleness sweep (issue 27, item 6): learning on the toy digit task through the whole
distributed system at staleness bounds k (``trainer.max_off_policy_steps``), each without and with
an off-policy correction (``trainer.loss.correction``), in one run.

On CPU in fp32 vLLM and the trainer agree to about 1e-7, so nothing would show what a
correction is for. The sweep therefore serves the policy from vLLM in bfloat16 against a trainer
in float32 (``--mismatch bf16``, the default; ``--mismatch none`` keeps both in fp32): the
behaviour logprobs then differ from the trainer's by about 1e-2 a token, as on GPUs. The
logprob alarm's bounds and the weight-sync probe's are raised for the sweep (``ALARM_BOUND``, ``ALARM_KL_BOUND``,
``PROBE_BOUND``), since that gap is the point.

Per run it reports steps to mean reward 0.5 and 0.9 (the first step at or above it, and of the
5-step mean), the mean reward of the last 3 steps, the wall time, the staleness of the trained
samples (the share of samples 0, 1, 2+ versions behind), and the step means of ``mismatch_kl``
and ``correction_masked_frac``. It writes ``sweep.json`` (after every run, so a cut sweep keeps
what it did) and ``sweep.png`` under ``--out``.

    .venv/bin/python bench/staleness_sweep.py [--steps 20] [--ks 0,2,4,8] [--corrections none,tis,icepop]
        [--mismatch bf16|none] [--eager] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(1, str(ROOT / "bench"))

from services.cli.learning_demo import run_learning  # noqa: E402
from training import first_reaching, plot_curves  # noqa: E402

ALARM_BOUND = "0.5"  # bf16 behaviour against an fp32 trainer differs by ~1e-2 a token: not an alarm here
ALARM_KL_BOUND = "0.5"  # and its mismatch KL (2.3e-5 at k = 0 in the sweep) is over the fp32 default of 1e-6
# the follower's probe compares vLLM's bf16 logprobs with the trainer's fp32 ones: up to 0.07 apart
# on the tiny model after some steps (seen), over the bf16 default of 0.05
PROBE_BOUND = "0.3"
MISMATCH = {"bf16": {"CONVEYOR_INFERENCE__DTYPE": "bfloat16",
                     "CONVEYOR_TRAINER__LOGPROB_ALARM__MAX_ON_POLICY_MAD": ALARM_BOUND,
                     "CONVEYOR_TRAINER__LOGPROB_ALARM__MAX_ON_POLICY_MISMATCH_KL": ALARM_KL_BOUND,
                     "CONVEYOR_INFERENCE__SYNC_PROBE_TOLERANCE": PROBE_BOUND},
            "none": {}}


def staleness_shares(steps: list[dict]) -> dict[str, float]:
    """The share of trained samples 0, 1 and 2+ versions behind their step (``staleness_<lag>``)."""
    lags: Counter[int] = Counter()
    for step in steps:
        for key, value in step.items():
            if key.startswith("staleness_"):
                lags[int(key.split("_")[1])] += int(value)
    total = sum(lags.values()) or 1
    return {"0": lags[0] / total, "1": lags[1] / total, "2+": sum(v for k, v in lags.items() if k >= 2) / total}


def mean_of(steps: list[dict], key: str) -> float | None:
    values = [s[key] for s in steps if isinstance(s.get(key), (int, float))]
    return statistics.fmean(values) if values else None


def one_run(out: Path, steps: int, k: int, correction: str, mismatch: str, eager: bool) -> dict:
    label = f"k{k}-{correction}"
    overrides = {**MISMATCH[mismatch], "CONVEYOR_TRAINER__LOSS__CORRECTION": correction,
                 **({"CONVEYOR_INFERENCE__EAGER": "true"} if eager else {})}
    started = time.time()
    load_before = os.getloadavg()[0]
    run = run_learning(out / label, steps, k, overrides=overrides)
    rewards = run.rewards
    return {
        "label": label, "k": k, "correction": correction, "mismatch": mismatch, "steps": len(rewards),
        "rewards": rewards, "to_0.5": first_reaching(rewards, 0.5), "to_0.9": first_reaching(rewards, 0.9),
        "to_0.5_5step": first_reaching(rewards, 0.5, 5), "to_0.9_5step": first_reaching(rewards, 0.9, 5),
        "final_reward": statistics.fmean(rewards[-3:]) if rewards else None,
        "wall_s": run.wall_s, "run_s": time.time() - started, "load_before": load_before,
        "staleness": staleness_shares(run.steps),
        "mismatch_kl": mean_of(run.steps, "mismatch_kl"),
        "correction_masked_frac": mean_of(run.steps, "correction_masked_frac"),
        "logprob_mad_on_policy": mean_of(run.steps, "logprob_mad_on_policy"),
    }


def table(results: list[dict]) -> str:
    rows = ["| k | correction | steps to 0.5 (5-step mean) | steps to 0.9 (5-step mean) | final reward | wall s | "
            "samples 0 / 1 / 2+ behind | mismatch KL | masked share |", "|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        s = r["staleness"]
        kl = "-" if r["mismatch_kl"] is None else f"{r['mismatch_kl']:.2e}"
        masked = "-" if r["correction_masked_frac"] is None else f"{r['correction_masked_frac']:.3f}"
        rows.append(f"| {r['k']} | {r['correction']} | {r['to_0.5']} ({r['to_0.5_5step']}) | {r['to_0.9']} "
                    f"({r['to_0.9_5step']}) | {r['final_reward']:.3f} | {r['wall_s']:.0f} | "
                    f"{s['0']:.2f} / {s['1']:.2f} / {s['2+']:.2f} | {kl} | {masked} |")
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--ks", default="0,2,4,8")
    parser.add_argument("--corrections", default="none,tis,icepop")
    parser.add_argument("--mismatch", choices=sorted(MISMATCH), default="bf16")
    parser.add_argument("--out", type=Path, default=Path("/tmp/conveyor-staleness-sweep"))
    parser.add_argument("--eager", action="store_true", help="vLLM eager: starts in about a third of the time")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    results: list[dict] = []
    print(f"## staleness sweep: {args.steps} steps, k in {args.ks}, corrections {args.corrections}, "
          f"mismatch {args.mismatch}; {os.cpu_count()} CPUs", flush=True)
    for k in (int(x) for x in args.ks.split(",")):
        for correction in args.corrections.split(","):
            try:
                result = one_run(args.out, args.steps, k, correction, args.mismatch, args.eager)
            except (RuntimeError, TimeoutError) as exc:  # one failed run is reported, the sweep goes on
                print(f"k{k}-{correction}: FAILED: {str(exc)[:600]}", flush=True)
                continue
            results.append(result)
            (args.out / "sweep.json").write_text(json.dumps(results, indent=1))
            print(f"{result['label']}: to 0.5 {result['to_0.5']}, to 0.9 {result['to_0.9']}, final "
                  f"{result['final_reward']:.3f}, wall {result['wall_s']:.0f}s, staleness {result['staleness']}, "
                  f"mismatch KL {result['mismatch_kl']}, masked {result['correction_masked_frac']}; "
                  f"curve {' '.join(f'{x:.2f}' for x in result['rewards'])}", flush=True)
    print(table(results))
    plot_curves(args.out / "sweep.png", {r["label"]: r["rewards"] for r in results},
                f"digit task, tiny model, vLLM {args.mismatch} vs fp32 trainer: staleness k x correction")
    print(f"curves: {args.out / 'sweep.png'}; figures: {args.out / 'sweep.json'}")


if __name__ == "__main__":
    main()
