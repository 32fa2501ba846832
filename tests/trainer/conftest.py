"""Fixtures for the training-step tests: the tiny checkpoint and synthetic GRPO batches."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Callable

import pytest
import torch

from services.inference.tiny_model import generate_tiny_model
from services.policy.model import load_policy, sequence_logprobs
from shared.schemas import StopReason, TrainingBatch, TrainingSample


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return generate_tiny_model(tmp_path_factory.mktemp("trainer-tiny") / "model", seed=0, end_of_turn_bias=4.0)


@pytest.fixture
def tiny_policy(tiny_dir: Path):
    """A fresh (model, tokenizer) per test: tests update weights."""
    return load_policy(tiny_dir)


MakeBatch = Callable[..., TrainingBatch]


@pytest.fixture
def make_batch() -> MakeBatch:
    """``make_batch(seed, n, model=None, ...)``: one group of n samples with random ids.

    Inference logprobs are the model's own logprobs plus noise (so some ratios clip and some
    do not), or random negatives without a model. Lengths vary, so padding is exercised.
    """

    def make(
        seed: int,
        n: int = 4,
        model: torch.nn.Module | None = None,
        prompt_len: tuple[int, int] = (3, 8),
        completion_len: tuple[int, int] = (2, 12),
        noise: float = 0.15,
        stop_reasons: list[StopReason] | None = None,
        group_id: int = 0,
    ) -> TrainingBatch:
        rng = random.Random(seed)
        samples = []
        for i in range(n):
            p, c = rng.randint(*prompt_len), rng.randint(*completion_len)
            ids = [rng.randrange(3, 512) for _ in range(p + c)]
            mask = [0] * p + [1] * c
            if model is not None:
                t = torch.tensor([ids])
                with torch.no_grad():
                    lp = sequence_logprobs(model, t, torch.ones_like(t))[0].tolist()
                lp = [v + rng.gauss(0.0, noise) for v in lp]
            else:
                lp = [-rng.uniform(0.5, 6.0) for _ in ids]
            lp = [v if m else 0.0 for v, m in zip(lp, mask)]
            samples.append(TrainingSample(
                trajectory_id=f"g{group_id}-{seed}-{i}", token_ids=ids, loss_mask=mask, inference_logprobs=lp,
                advantage=rng.uniform(-1.5, 1.5), reward=0.0, oldest_policy_version=0,
                stop_reason=(stop_reasons[i] if stop_reasons else StopReason.done),
            ))
        return TrainingBatch(run_id="run", group_id=group_id, samples=samples)

    return make
