"""Training-step benchmark: ``PolicyTrainer.train_step`` tokens/s against a bare torch loop.

Method. Both sides get the same tiny model (two copies of one checkpoint), the same GRPO
batches and the same micro-batches (the trainer's own token-budget plan). The bare loop is
what a hand-written training step would be: pre-collated tensors, forward, token logprobs,
the clipped loss, backward, grad clipping and AdamW, with no sample preparation, no
statistics and no metrics. The trainer's time includes everything ``train_step`` does,
turning ``TrainingSample`` lists into tensors included. Steps alternate between the two
sides, and which side goes first alternates too, so background load hits both alike. The
figure per side is the median wall time over steps; the best-of-steps ratio and the
CPU-time ratio are printed as cross-checks that load on a shared machine skews less.
Tokens are real (non-padding) tokens forwarded; both sides forward the same ones.

    .venv/bin/python bench/training_step.py [--steps 8] [--groups 8] [--group-size 4]
        [--micro-batch-tokens 2048] [--threads N] [--json]
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from services.inference.tiny_model import generate_tiny_model  # noqa: E402
from services.trainer.batching import micro_batches, prepare_samples  # noqa: E402
from services.policy.model import load_policy, sequence_logprobs  # noqa: E402
from services.trainer.step import PolicyTrainer, build_optimizer  # noqa: E402
from shared.settings import BatchingSettings, LossSettings, OptimSettings  # noqa: E402
from shared.schemas import StopReason, TrainingBatch, TrainingSample  # noqa: E402


def make_batches(model, groups: int, group_size: int, seed: int = 0) -> list[TrainingBatch]:
    """GRPO groups of multi-hundred-token trajectories, logprobs near the model's own."""
    rng = random.Random(seed)
    batches = []
    for g in range(groups):
        samples = []
        prompt = [rng.randrange(3, 512) for _ in range(rng.randint(30, 60))]
        for i in range(group_size):
            completion = [rng.randrange(3, 512) for _ in range(rng.randint(40, 250))]
            ids = prompt + completion
            t = torch.tensor([ids])
            with torch.no_grad():
                lp = sequence_logprobs(model, t, torch.ones_like(t))[0].tolist()
            mask = [0] * len(prompt) + [1] * len(completion)
            lp = [v + rng.gauss(0, 0.05) if m else 0.0 for v, m in zip(lp, mask)]
            samples.append(TrainingSample(
                trajectory_id=f"{g}-{i}", token_ids=ids, loss_mask=mask, inference_logprobs=lp,
                advantage=rng.uniform(-1, 1), reward=0.0, oldest_policy_version=0, stop_reason=StopReason.done,
            ))
        batches.append(TrainingBatch(run_id="bench", group_id=g, samples=samples))
    return batches


def bare_step(model, optimizer, mbs, clip_eps: float, max_norm: float) -> int:
    """A hand-written GRPO step over pre-collated micro-batches; returns tokens forwarded."""
    denominator = sum(float(mb.loss_mask.sum()) for mb in mbs)
    optimizer.zero_grad(set_to_none=True)
    tokens = 0
    for mb in mbs:
        logits = model(input_ids=mb.input_ids, attention_mask=mb.attention_mask, use_cache=False).logits[:, :-1]
        logp = torch.gather(logits, -1, mb.input_ids[:, 1:, None]).squeeze(-1) - torch.logsumexp(logits, -1)
        ratio = torch.exp(logp - mb.old_logprobs[:, 1:])
        adv = mb.advantages[:, None]
        loss = torch.maximum(-adv * ratio, -adv * ratio.clamp(1 - clip_eps, 1 + clip_eps))
        ((loss * mb.loss_mask[:, 1:]).sum() / denominator).backward()
        tokens += int(mb.attention_mask.sum())
    torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    optimizer.step()
    return tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=8, help="measured steps per side (after 2 warm-up steps)")
    parser.add_argument("--groups", type=int, default=8)
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--micro-batch-tokens", type=int, default=2048)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument("--json", action="store_true", help="print one JSON line instead of the table")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = generate_tiny_model(Path(tmp) / "tiny", seed=0, end_of_turn_bias=4.0)
        model, tok = load_policy(model_dir)
    batches = make_batches(model, args.groups, args.group_size)
    optim, loss = OptimSettings(lr=1e-5), LossSettings()
    batching = BatchingSettings(max_seq_len=512, micro_batch_tokens=args.micro_batch_tokens)

    trainer = PolicyTrainer(copy.deepcopy(model), tok.pad_token_id, optim=optim, loss=loss, batching=batching)
    bare_model = copy.deepcopy(model)
    bare_model.train()
    bare_opt = build_optimizer(bare_model, optim)
    samples = [s for b in batches for s in b.samples]
    mbs = micro_batches(prepare_samples(samples, batching).samples, batching.micro_batch_tokens, tok.pad_token_id)

    def run_trainer() -> int:
        return int(trainer.train_step(batches)["tokens"])

    def run_bare() -> int:
        return bare_step(bare_model, bare_opt, mbs, loss.clip_eps, optim.max_grad_norm)

    wall: dict[str, list[float]] = {"trainer": [], "bare": []}
    cpu: dict[str, list[float]] = {"trainer": [], "bare": []}
    sides = [("trainer", run_trainer), ("bare", run_bare)]
    forwarded: dict[str, int] = {}
    for step in range(args.steps + 2):
        for name, run in (sides if step % 2 == 0 else sides[::-1]):  # alternate who goes first
            w0, c0 = time.perf_counter(), time.process_time()
            forwarded[name] = tokens = run()
            w1, c1 = time.perf_counter(), time.process_time()
            if step >= 2:
                wall[name].append(w1 - w0)
                cpu[name].append(c1 - c0)

    assert forwarded["trainer"] == forwarded["bare"], forwarded  # the same work on both sides
    med = {k: statistics.median(v) for k, v in wall.items()}
    best = {k: min(v) for k, v in wall.items()}
    cpu_med = {k: statistics.median(v) for k, v in cpu.items()}
    result = {
        "sequences": len(samples), "tokens_per_step": tokens, "micro_batches": len(mbs),
        "micro_batch_tokens": args.micro_batch_tokens, "steps": args.steps,
        "trainer_tokens_per_s": tokens / med["trainer"], "bare_tokens_per_s": tokens / med["bare"],
        "trainer_step_s": med["trainer"], "bare_step_s": med["bare"],
        "ratio": med["bare"] / med["trainer"],
        "ratio_best_of": best["bare"] / best["trainer"],
        "ratio_cpu_time": cpu_med["bare"] / cpu_med["trainer"],
        "torch_threads": torch.get_num_threads(), "load_average_1m": os.getloadavg()[0],
    }
    if args.json:
        print(json.dumps(result))
        return
    print(f"{result['sequences']} sequences, {tokens} tokens per step in {len(mbs)} micro-batches "
          f"(budget {args.micro_batch_tokens}); {args.steps} steps per side, medians; "
          f"{result['torch_threads']} torch threads, load average {result['load_average_1m']:.1f}")
    print(f"  trainer train_step  {result['trainer_tokens_per_s']:9.0f} tokens/s  ({result['trainer_step_s']:.3f} s/step)")
    print(f"  bare torch loop     {result['bare_tokens_per_s']:9.0f} tokens/s  ({result['bare_step_s']:.3f} s/step)")
    print(f"  ratio               {result['ratio']:9.3f}  (target >= 0.9; best-of-steps {result['ratio_best_of']:.3f},"
          f" CPU time {result['ratio_cpu_time']:.3f})")


if __name__ == "__main__":
    main()
