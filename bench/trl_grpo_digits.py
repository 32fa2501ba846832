"""TRL's GRPOTrainer on Conveyor's digit task: the reference for ``bench/training.py --vs-trl``.

Measures, per optimizer step, TRL's in-process wall time (generation with transformers'
``generate`` on CPU, reward, forward/backward and AdamW, all in one process) and the mean
reward of the step's 32 completions. One JSON line per step goes to ``--out``.

It trains the same tiny model as Conveyor's learning run (``generate_tiny_model`` with seed 0,
end-of-turn bias 4, the given layout) on the same 16 prompts (``demo.write_prompts``)
with the same reward (``toy_rewards.digit_share`` of the reply) and the same batch shape: 4
prompts x 8 generations = 32 completions per step, at most 24 tokens, temperature 1, lr 5e-3
constant, AdamW, grad clip 1, beta 0 (no reference model), clip eps 0.2, one iteration per
generation, advantages scaled by the group's (Bessel) std, loss type ``dapo`` (a token mean
over the whole step's completion tokens, Conveyor's ``token_mean``).

TRL is not a project dependency: ``bench/training.py`` installs it into a cache directory with
``--no-deps`` and runs this script with that directory on PYTHONPATH, so the project's pinned
transformers and torch are the ones used.

    PYTHONPATH=<trl dir>:. .venv/bin/python bench/trl_grpo_digits.py --steps 60 --layout llama --out trl.jsonl
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

GROUP_SIZE, PROMPTS_PER_STEP, MAX_TOKENS, LR = 8, 4, 24, 0.005


def digit_reward(completions, **_: object) -> list[float]:
    from services.rollout_worker.environments.toy_rewards import digit_share

    return [digit_share(c[0]["content"] if isinstance(c, list) else c, {}) for c in completions]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--layout", default="llama")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--seed", type=int, default=0, help="TRL's sampling/shuffling seed")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = parser.parse_args()

    import torch
    import trl
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from services.cli.demo import write_prompts
    from services.inference.tiny_model import generate_tiny_model

    if args.threads:
        torch.set_num_threads(args.threads)
    work = Path(tempfile.mkdtemp(prefix="conveyor-trl-"))
    model_dir = generate_tiny_model(work / "tiny", seed=0, end_of_turn_bias=4.0, layout=args.layout)
    rows = [json.loads(line) for line in write_prompts(work / "prompts.jsonl").read_text().splitlines()]
    dataset = Dataset.from_list([{"prompt": [{"role": "user", "content": r["prompt"]}]} for r in rows])
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)

    config = GRPOConfig(
        output_dir=str(work / "out"), max_steps=args.steps, seed=args.seed, use_cpu=True, report_to="none",
        per_device_train_batch_size=GROUP_SIZE * PROMPTS_PER_STEP, gradient_accumulation_steps=1,
        num_generations=GROUP_SIZE, max_completion_length=MAX_TOKENS, temperature=1.0, top_p=1.0,
        learning_rate=LR, lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0, max_grad_norm=1.0,
        beta=0.0, epsilon=0.2, num_iterations=1, loss_type="dapo", scale_rewards="group",
        mask_truncated_completions=False, logging_steps=1, save_strategy="no", bf16=False,
        dataloader_num_workers=0, disable_tqdm=True,
    )
    out = args.out.open("w")

    class StepClock(TrainerCallback):
        """Wall time from one optimizer step's start to its end, and the step's logged reward."""

        def __init__(self) -> None:
            self.started = 0.0
            self.pending: dict = {}

        def on_step_begin(self, _args, state, control, **kw):
            self.started = time.perf_counter()

        def on_step_end(self, _args, state, control, **kw):
            self.pending = {"step": state.global_step, "step_wall_s": time.perf_counter() - self.started,
                            "time": time.time()}

        def on_log(self, _args, state, control, logs=None, **kw):
            if logs and "reward" in logs and self.pending:
                out.write(json.dumps({**self.pending, "reward_mean": logs["reward"],
                                      "reward_std": logs.get("reward_std", 0.0),
                                      "completion_length": logs.get("completions/mean_length", 0.0)}) + "\n")
                out.flush()
                self.pending = {}

    trainer = GRPOTrainer(model=model, reward_funcs=digit_reward, args=config, train_dataset=dataset,
                          processing_class=tokenizer, callbacks=[StepClock()])
    print(json.dumps({"trl": trl.__version__, "torch_threads": torch.get_num_threads(),
                      "pid": os.getpid()}), flush=True)
    trainer.train()
    out.close()


if __name__ == "__main__":
    main()
