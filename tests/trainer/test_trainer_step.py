"""The optimizer step: accumulation equivalence, metrics, skipping, and the learning direction."""

from __future__ import annotations

import copy

import pytest
import torch

from model_layouts import policy_dir

from services.policy.model import load_policy, sequence_logprobs
from services.trainer.step import PolicyTrainer
from shared.settings import BatchingSettings, LossSettings, OptimSettings
from shared.schemas import StopReason, TrainingBatch, TrainingSample
from synthetic_logprobs import SYNTHETIC_LOGPROBS

# make_batch's inference logprobs are deliberately not the model's own (noise, or random
# values), so the on-policy logprob alarm would fire on them: these tests turn it off.

METRICS = {"loss", "grad_norm", "tokens", "tokens_per_s", "step_time_s", "clip_frac", "kl",
           "logprob_mad_vs_inference", "overlong_masked", "truncated", "mismatch_kl", "mismatch_ratio_p05",
           "mismatch_ratio_p50", "mismatch_ratio_p95", "correction_masked_frac"}


def test_logprobs_do_not_depend_on_padding(tiny_policy) -> None:
    model, _ = tiny_policy
    a, b = [1, 50, 60, 70, 80, 90, 100], [1, 200, 210]
    ids = torch.tensor([a, b + [0] * 4])
    mask = torch.tensor([[1] * 7, [1] * 3 + [0] * 4])
    with torch.no_grad():
        batched = sequence_logprobs(model, ids, mask)
        alone = sequence_logprobs(model, torch.tensor([b]), torch.ones(1, 3, dtype=torch.long))
        logits = model(torch.tensor([a])).logits[0].log_softmax(-1)
    torch.testing.assert_close(batched[1, :3], alone[0], atol=1e-5, rtol=0)
    assert batched[0, 0] == 0 and (batched[1, 3:] == 0).all()
    manual = torch.stack([logits[t - 1, a[t]] for t in range(1, 7)])
    torch.testing.assert_close(batched[0, 1:], manual, atol=1e-5, rtol=0)


def test_logprobs_use_the_sampling_temperature(tiny_policy) -> None:
    model, _ = tiny_policy
    ids = torch.tensor([[1, 50, 60, 70]])
    with torch.no_grad():
        got = sequence_logprobs(model, ids, torch.ones_like(ids), temperature=0.7)
        logits = (model(ids).logits[0] / 0.7).log_softmax(-1)
    torch.testing.assert_close(got[0, 1:], torch.stack([logits[t - 1, ids[0, t]] for t in range(1, 4)]), atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match="temperature"):
        PolicyTrainer(model, 0, temperature=0.0)


@pytest.mark.parametrize("aggregation", ["token_mean", "seq_mean"])
def test_micro_batched_update_equals_full_batch_update(tiny_policy, make_batch, aggregation: str) -> None:
    model, tok = tiny_policy
    model.double()  # float64, so the comparison sees the accumulation, not rounding
    batches = [make_batch(seed, n=4, model=model, group_id=seed) for seed in range(3)]
    settings = dict(
        optim=OptimSettings(lr=1e-3, max_grad_norm=0.05, weight_decay=0.01),
        loss=LossSettings(aggregation=aggregation, kl_coef=0.05, clip_eps_high=0.28),
    )
    full = PolicyTrainer(copy.deepcopy(model), tok.pad_token_id, alarm=SYNTHETIC_LOGPROBS,
                         batching=BatchingSettings(max_seq_len=32, micro_batch_tokens=4096), **settings)
    micro = PolicyTrainer(copy.deepcopy(model), tok.pad_token_id, alarm=SYNTHETIC_LOGPROBS,
                          batching=BatchingSettings(max_seq_len=32, micro_batch_tokens=40), **settings)
    mf, mm = full.train_step(batches), micro.train_step(batches)

    assert mf["micro_batches"] == 1 and mm["micro_batches"] >= 4
    assert mf["grad_norm"] > 0.05, "the test should exercise clipping"
    assert 0 < mf["clip_frac"] < 1, "the test should exercise both clipped and unclipped tokens"
    for key in ("loss", "grad_norm", "clip_frac", "kl", "logprob_mad_vs_inference", "tokens"):
        assert mm[key] == pytest.approx(mf[key], rel=1e-9, abs=1e-12), key
    for (name, pf), pm in zip(full.model.named_parameters(), micro.model.parameters()):
        torch.testing.assert_close(pm.grad, pf.grad, atol=1e-9, rtol=0, msg=name)
        torch.testing.assert_close(pm, pf, atol=1e-6, rtol=0, msg=name)
    assert not torch.equal(next(full.model.parameters()), next(model.parameters())), "an update happened"


def test_metrics_and_step_counter(tiny_policy, make_batch) -> None:
    model, tok = tiny_policy
    stops = [StopReason.truncated, StopReason.done, StopReason.done, StopReason.done]
    batch = make_batch(1, n=4, model=model, completion_len=(20, 30), stop_reasons=stops)
    trainer = PolicyTrainer(model, tok.pad_token_id, alarm=SYNTHETIC_LOGPROBS, optim=OptimSettings(lr=1e-4),
                            batching=BatchingSettings(max_seq_len=24, micro_batch_tokens=48))
    metrics = trainer.train_step([batch])
    assert METRICS <= metrics.keys()
    assert trainer.step == 1 and metrics["step"] == 1 and metrics["skipped"] == 0
    assert metrics["overlong_masked"] == 1 and metrics["truncated"] == 4  # every sample is > 24 tokens
    assert metrics["tokens"] == 3 * 24 and metrics["micro_batches"] == 2  # the masked one is not forwarded
    assert metrics["tokens_per_s"] > 0 and metrics["step_time_s"] > 0
    assert 0 < metrics["logprob_mad_vs_inference"] < 0.5  # noise of 0.15 around the model's logprobs


def test_a_step_with_nothing_to_train_on_is_skipped(tiny_policy, make_batch) -> None:
    model, tok = tiny_policy
    before = [p.detach().clone() for p in model.parameters()]
    batch = make_batch(2, n=2, model=model, stop_reasons=[StopReason.truncated] * 2)
    trainer = PolicyTrainer(model, tok.pad_token_id, alarm=SYNTHETIC_LOGPROBS)
    metrics = trainer.train_step([batch])
    assert METRICS <= metrics.keys()
    assert metrics["skipped"] == 1 and metrics["overlong_masked"] == 2 and trainer.step == 0
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_positive_advantage_raises_the_token_probability(tiny_policy) -> None:
    """On-policy GRPO steps: the token with A > 0 gains probability, the one with A < 0 loses it."""
    model, tok = tiny_policy
    prompt, good, bad = [1, 40, 41, 42, 43], 300, 301
    trainer = PolicyTrainer(model, tok.pad_token_id, alarm=SYNTHETIC_LOGPROBS, optim=OptimSettings(lr=3e-3))

    def logprob(token: int) -> float:
        ids = torch.tensor([prompt + [token]])
        with torch.no_grad():
            return sequence_logprobs(model, ids, torch.ones_like(ids))[0, -1].item()

    start_good, start_bad = logprob(good), logprob(bad)
    for step in range(5):
        samples = [
            TrainingSample(trajectory_id=f"{step}-{tok_id}", token_ids=prompt + [tok_id], loss_mask=[0] * 5 + [1],
                           inference_logprobs=[0.0] * 5 + [logprob(tok_id)], advantage=adv, reward=adv,
                           oldest_policy_version=step, stop_reason=StopReason.done)
            for tok_id, adv in ((good, 1.0), (bad, -1.0))
        ]
        metrics = trainer.train_step([TrainingBatch(run_id="r", group_id=step, samples=samples)])
        # on-policy: the trainer's logprobs are the "inference" ones, up to float32 rounding
        assert metrics["logprob_mad_vs_inference"] < 1e-5 and metrics["clip_frac"] == 0
        assert metrics["ratio_mean"] == pytest.approx(1.0, abs=1e-5)
    assert logprob(good) > start_good + 1.0, (start_good, logprob(good))
    assert logprob(bad) < start_bad - 1.0, (start_bad, logprob(bad))


def test_per_token_advantages_steer_each_token_by_its_own_sign(tiny_policy) -> None:
    """One sequence, two sampled tokens, per-token advantages +1 and -1 (trainer.token_rewards):
    the first token gains probability and the second loses it in the same sample."""
    model, tok = tiny_policy
    prompt, first, second = [1, 40, 41, 42, 43], 310, 311
    trainer = PolicyTrainer(model, tok.pad_token_id, alarm=SYNTHETIC_LOGPROBS, optim=OptimSettings(lr=3e-3))

    def logprobs() -> tuple[float, float]:
        ids = torch.tensor([prompt + [first, second]])
        with torch.no_grad():
            row = sequence_logprobs(model, ids, torch.ones_like(ids))[0]
        return row[-2].item(), row[-1].item()

    start = logprobs()
    for step in range(5):
        now = logprobs()
        sample = TrainingSample(trajectory_id=f"{step}", token_ids=prompt + [first, second], loss_mask=[0] * 5 + [1, 1],
                                inference_logprobs=[0.0] * 5 + list(now), advantage=0.0, reward=0.0,
                                oldest_policy_version=step, stop_reason=StopReason.done,
                                token_advantages=[0.0] * 5 + [1.0, -1.0])
        trainer.train_step([TrainingBatch(run_id="r", group_id=step, samples=[sample])])
    end = logprobs()
    assert end[0] > start[0] + 0.5 and end[1] < start[1] - 0.5, (start, end)


def test_a_policy_whose_config_asks_for_dropout_trains_without_it(make_batch, tmp_path):
    """GPT-2's config asks for dropout 0.1; vLLM samples without it, so the trainer must too:
    in training mode, the same sequence gets the same logprobs twice, and on-policy samples
    give a ratio of exactly 1 (nothing clipped, no gap to the inference logprobs)."""
    model, tok = load_policy(policy_dir(tmp_path / "gpt2", "gpt2"))
    assert model.training and model.config.resid_pdrop == 0.1  # the checkpoint's config is kept
    ids = torch.tensor([[5, 6, 7, 8, 9, 10, 11, 12]])
    first, second = (sequence_logprobs(model, ids, torch.ones_like(ids)) for _ in range(2))
    assert torch.equal(first, second)
    on_policy = make_batch(0, n=4, model=model, noise=0.0)
    metrics = PolicyTrainer(model, tok.pad_token_id).train_step([on_policy])
    assert metrics["clip_frac"] == 0.0 and metrics["logprob_mad_vs_inference"] < 1e-5
