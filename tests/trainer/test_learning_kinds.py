"""Each loss kind of the registry (grpo, dr_grpo, dapo, gspo, cispo) learns the toy task
(issue 27, item 2): the learning test's digit task, tiny model and settings, trained by the
production step (``PolicyTrainer.train_step`` with ``trainer.loss.kind``), in one process.

Why not the whole distributed system, as tests/test_learning.py runs grpo (two layouts): each
of those runs starts its own vLLM and takes 90-105 s on CPU, and CI has no room for one more
per kind. What a kind changes is the loss and nothing else; sampling, batches and the weight
path are the same whatever the kind, and the distributed runs cover them. So here the replies
are sampled by transformers from the policy (temperature 1, top_p 1, as vLLM samples in the
learning runs), and everything after sampling is real: the toy task's reward function
(``digit_share``), group advantages (``services.trainer.advantages``; not divided by the std
for dr_grpo, as its settings require), ``TrainingBatch`` / ``TrainingSample``, batching, the
kind's loss and AdamW. Seeds are fixed: a run is deterministic on one machine.

The groups of each step are sampled before the previous step's update, so every trained
sample is one version behind, as with ``max_off_policy_steps: 1`` in the distributed runs.
That matters: exactly on policy, with one update per batch, the ratio is 1 and grpo, dapo and
cispo have the same gradient (their curves here were identical); one version behind, the
ratios differ from 1 and each kind's clip and weighting act. The behaviour logprobs are the
sampling policy's own, so the gap is staleness only (``correction: none``).

Settings as in ``services.cli.learning_demo``: 4 groups of 8 a step, 24 tokens a reply, lr
5e-3, replies cut at 24 tokens trained on (``mask_overlong: false``), zero-variance groups
dropped. The criterion is the distributed test's: within 20 steps the mean reward of the last
three steps is above the first three's by 0.2 and at least twice it. A run stops early once
that holds with 0.1 to spare.
"""

from __future__ import annotations

import json
import math
import statistics

import pytest
import torch

from services.cli.learning_demo import write_prompts
from services.policy.model import sequence_logprobs
from services.rollout_worker.environments.toy_rewards import digit_share
from services.trainer.advantages import group_advantages
from services.trainer.losses import KINDS
from services.trainer.step import PolicyTrainer
from shared.schemas import StopReason, TrainingBatch, TrainingSample
from shared.settings import BatchingSettings, LossSettings, OptimSettings

STEPS, GROUPS_PER_STEP, GROUP_SIZE, MAX_TOKENS = 20, 4, 8, 24


def sample_group(model, tokenizer, prompt: str, group_id: int, version: int, scale_by_std: bool = True) -> TrainingBatch:
    """One GRPO group of ``prompt``: 8 replies sampled from ``model``, scored by the toy reward
    (``scale_by_std``: the advantages divided by the group's std, ``trainer.scale_advantage_by_std``)."""
    text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=False)
    prompt_ids = tokenizer.encode(text, add_special_tokens=False)
    eos = model.generation_config.eos_token_id
    eos_ids = set(eos if isinstance(eos, list) else [eos])
    pad = tokenizer.pad_token_id or 0
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt_ids]), attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
                             do_sample=True, temperature=1.0, top_p=1.0, top_k=0, max_new_tokens=MAX_TOKENS,
                             num_return_sequences=GROUP_SIZE, pad_token_id=pad)
    replies = []
    for row in out[:, len(prompt_ids):].tolist():
        cut = next((i + 1 for i, token in enumerate(row) if token in eos_ids), len(row))  # the stop token is sampled too
        replies.append(row[:cut])
    rewards = [digit_share(tokenizer.decode(reply, skip_special_tokens=True), {}) for reply in replies]
    advantages = group_advantages(rewards, scale_by_std=scale_by_std).advantages
    width = len(prompt_ids) + max(len(r) for r in replies)
    ids = torch.tensor([prompt_ids + r + [pad] * (width - len(prompt_ids) - len(r)) for r in replies])
    attention = torch.tensor([[1] * (len(prompt_ids) + len(r)) + [0] * (width - len(prompt_ids) - len(r)) for r in replies])
    with torch.no_grad():  # the behaviour logprobs: the policy's own, before the step
        behaviour = sequence_logprobs(model, ids, attention).tolist()
    samples = []
    for i, (reply, reward, advantage) in enumerate(zip(replies, rewards, advantages)):
        n = len(prompt_ids) + len(reply)
        samples.append(TrainingSample(
            trajectory_id=f"g{group_id}-{i}", token_ids=prompt_ids + reply, loss_mask=[0] * len(prompt_ids) + [1] * len(reply),
            inference_logprobs=[0.0] * len(prompt_ids) + behaviour[i][len(prompt_ids):n], advantage=advantage,
            reward=reward, oldest_policy_version=version,
            stop_reason=StopReason.truncated if reply[-1] not in eos_ids else StopReason.done))
    return TrainingBatch(run_id="learn", group_id=group_id, samples=samples)


@pytest.fixture
def one_thread():
    """One torch thread, as the learning runs' trainer (``trainer.torch_threads: 1``): on a
    loaded 2-core host, two threads made each step 10 times slower."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.slow
@pytest.mark.parametrize("kind", sorted(KINDS))
def test_the_kind_learns_the_toy_task(tiny_policy, tmp_path, one_thread, kind) -> None:
    model, tokenizer = tiny_policy
    torch.manual_seed(0)
    texts = [json.loads(line)["prompt"] for line in write_prompts(tmp_path / "prompts.jsonl").read_text().splitlines()]
    trainer = PolicyTrainer(model, tokenizer.pad_token_id or 0, optim=OptimSettings(lr=5e-3), loss=LossSettings(kind=kind),
                            batching=BatchingSettings(mask_overlong=False))
    rewards: list[float] = []
    sampled: list[TrainingBatch] = []  # the next step's groups, sampled before this step's update
    for step in range(STEPS + 1):
        group_ids = range(step * GROUPS_PER_STEP, (step + 1) * GROUPS_PER_STEP)
        batches, sampled = sampled, [sample_group(model, tokenizer, texts[g % len(texts)], g, trainer.step,
                                                  scale_by_std=kind != "dr_grpo") for g in group_ids]
        rewards.append(statistics.fmean(s.reward for b in sampled for s in b.samples))
        trained = [b for b in batches if len({s.reward for s in b.samples}) > 1]  # zero-variance groups dropped
        if trained:
            stale = all(b.samples[0].oldest_policy_version < trainer.step for b in trained)  # after the first update
            metrics = trainer.train_step(trained)
            assert metrics["alarm"] == 0.0
            assert math.isnan(metrics["logprob_mad_on_policy"]) == stale  # NaN: no token of the step's own weights
        if step >= 5 and statistics.fmean(rewards[-3:]) > max(statistics.fmean(rewards[:3]) + 0.2,
                                                               2 * statistics.fmean(rewards[:3])) + 0.1:
            break
    start, end = statistics.fmean(rewards[:3]), statistics.fmean(rewards[-3:])
    print(f"{kind}: reward per step {[round(r, 3) for r in rewards]}")
    assert end > start + 0.2 and end > 2 * start, f"{kind} did not learn: {rewards}"
