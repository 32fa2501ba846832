"""The logprob levers of issue 25, item 3, on CPU: logits only from the first needed position on
(``logits_to_keep``), and the float32 log-softmax in chunks recomputed in backward. Each gives
the same logprobs, gradients and training step as computing every position at once."""

from __future__ import annotations

import copy

import pytest
import torch

from services.policy.model import sequence_logprobs
from services.trainer.step import PolicyTrainer, trainer_from_settings
from shared.settings import BatchingSettings, OptimSettings, SettingsError, load_settings
from synthetic_logprobs import SYNTHETIC_LOGPROBS



def padded_batch() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Two right-padded rows whose completions start at 4 and 6: ids, attention, loss mask."""
    ids = torch.tensor([[1, 50, 60, 70, 80, 90, 100, 110], [1, 200, 210, 220, 230, 240, 250, 0]])
    attention = torch.tensor([[1] * 8, [1] * 7 + [0]])
    loss_mask = torch.tensor([[0, 0, 0, 0, 1, 1, 1, 1], [0, 0, 0, 0, 0, 0, 1, 0]], dtype=torch.float32)
    return ids, attention, loss_mask


@pytest.mark.parametrize("chunk_tokens", [None, 1, 3, 64])
def test_needed_positions_and_chunks_give_the_same_logprobs_and_gradients(tiny_policy, chunk_tokens):
    model, _ = tiny_policy
    ids, attention, loss_mask = padded_batch()
    full = sequence_logprobs(model, ids, attention, temperature=0.7)
    (full * loss_mask).sum().backward()
    full_grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    lever = sequence_logprobs(model, ids, attention, temperature=0.7, needed=loss_mask, chunk_tokens=chunk_tokens)
    (lever * loss_mask).sum().backward()
    assert lever.shape == full.shape and (lever[:, :4] == 0).all()  # before the first needed position
    torch.testing.assert_close(lever[:, 4:], full[:, 4:], atol=1e-6, rtol=0)
    assert lever[1, 7] == 0  # padding stays 0
    for grad, expected in zip((p.grad for p in model.parameters()), full_grads):
        torch.testing.assert_close(grad, expected, atol=1e-6, rtol=1e-5)


def test_nothing_needed_computes_nothing_but_zeros(tiny_policy):
    model, _ = tiny_policy
    ids, attention, loss_mask = padded_batch()
    with torch.no_grad():
        out = sequence_logprobs(model, ids, attention, needed=torch.zeros_like(loss_mask), chunk_tokens=2)
    assert out.shape == ids.shape and (out == 0).all()


def test_the_step_with_the_levers_equals_the_step_over_every_position(tiny_policy, make_batch):
    model, tok = tiny_policy
    batches = [make_batch(seed, n=4, model=model, group_id=seed) for seed in range(3)]
    trained = {}
    for name, kwargs in {"every position": {"trim_prompt_logits": False},
                         "levers": {"trim_prompt_logits": True, "logprob_chunk_tokens": 5}}.items():
        policy = copy.deepcopy(model)
        trainer = PolicyTrainer(policy, tok.pad_token_id, alarm=SYNTHETIC_LOGPROBS, optim=OptimSettings(lr=1e-3),
                                batching=BatchingSettings(max_seq_len=32, micro_batch_tokens=40), **kwargs)
        trained[name] = (trainer.train_step(batches), policy)
    (every, every_model), (levers, levers_model) = trained["every position"], trained["levers"]
    for key in ("loss", "grad_norm", "clip_frac", "ratio_mean", "logprob_mad_vs_inference", "logprob_mad_on_policy"):
        assert levers[key] == pytest.approx(every[key], rel=1e-5, abs=1e-7), key
    for a, b in zip(levers_model.parameters(), every_model.parameters()):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)


def test_the_chunk_size_is_a_trainer_setting(tiny_dir):
    assert load_settings().trainer.logprob_chunk_tokens is None
    with pytest.raises(SettingsError, match="logprob_chunk_tokens"):
        load_settings(trainer={"logprob_chunk_tokens": 0})
    settings = load_settings(trainer={"logprob_chunk_tokens": 512, "device": "cpu"},
                             inference={"model_path": str(tiny_dir)})
    trainer, _ = trainer_from_settings(settings)
    assert trainer.logprob_chunk_tokens == 512 and trainer.trim_prompt_logits
