"""Two MFU levers of issue 25 (item 3) measured as far as a CPU takes them; the logprob levers
are measured by ``bench/gpu_check.py --checks levers``.

- Padding: the share of the forwarded tokens that are padding when the trainer packs (longest
  first, rows padded to the longest in a micro-batch: ``batching.plan_micro_batches``) 64
  sequences of uniformly drawn lengths, over 20 seeds. That share is the most that packing
  without padding (variable-length rows, not built) could save; it depends only on the lengths
  and the budget, so the CPU figure is the GPU figure.
- ``torch.compile`` of ``policy_loss``: forward and backward of the loss on ``[rows, 1024]``
  tensors, eager against compiled (inductor), median of 20 after the compile, with the two
  losses and gradients compared. A CPU says nothing of GPU kernel times; it does say whether
  the loss compiles in one graph and how its cost compares with a step.

    .venv/bin/python bench/mfu_levers_cpu.py [--no-compile] [--threads 1]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from services.trainer.batching import PreparedSample, plan_micro_batches  # noqa: E402
from services.trainer.loss import policy_loss  # noqa: E402


def padding_share(min_len: int, max_len: int, budget: int, sequences: int = 64, seeds: int = 20) -> dict[str, float]:
    shares = []
    for seed in range(seeds):
        rng = random.Random(seed)
        samples = [PreparedSample(f"t{i}", [1] * rng.randint(min_len, max_len), [1], [0.0], 0.0)
                   for i in range(sequences)]
        plan = plan_micro_batches(samples, budget)
        real = sum(len(s.token_ids) for s in samples)
        padded = sum(len(rows) * len(rows[0].token_ids) for rows in plan)
        shares.append(1 - real / padded)
    return {"min_len": min_len, "max_len": max_len, "micro_batch_tokens": budget,
            "padding_share_mean": statistics.mean(shares), "padding_share_max": max(shares)}


def loss_timing(rows: int, length: int = 1024, repeats: int = 20) -> dict[str, float]:
    g = torch.Generator().manual_seed(0)
    logprobs = (-5 * torch.rand(rows, length, generator=g)).requires_grad_()
    old = logprobs.detach() + 0.1 * torch.randn(rows, length, generator=g)
    advantages, mask = torch.randn(rows, generator=g), (torch.rand(rows, length, generator=g) > 0.25).float()

    def step(fn) -> tuple[float, torch.Tensor, float]:  # noqa: ANN001
        logprobs.grad = None
        started = time.perf_counter()
        loss, _ = fn(logprobs, old, advantages, mask, denominator=float(mask.sum()))
        loss.backward()
        return float(loss.detach()), logprobs.grad.clone(), time.perf_counter() - started

    started = time.perf_counter()
    compiled = torch.compile(policy_loss)
    compiled_loss, compiled_grad, _ = step(compiled)
    compile_s = time.perf_counter() - started
    eager_loss, eager_grad, _ = step(policy_loss)
    eager = statistics.median(step(policy_loss)[2] for _ in range(repeats))
    fast = statistics.median(step(compiled)[2] for _ in range(repeats))
    return {"rows": rows, "length": length, "eager_ms": eager * 1e3, "compiled_ms": fast * 1e3,
            "compile_s": compile_s, "loss_abs_diff": abs(compiled_loss - eager_loss),
            "grad_max_abs_diff": float((compiled_grad - eager_grad).abs().max())}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--no-compile", action="store_true", help="skip the torch.compile timing (~25 s to compile)")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    out = {"padding": [padding_share(lo, 1024, budget) for lo in (256, 512) for budget in (4096, 8192, 16384)]}
    if not args.no_compile:
        out["loss_compile"] = loss_timing(rows=16)
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
