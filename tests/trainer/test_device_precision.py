"""Device and precision from settings (issue 16, item 1), on CPU: device selection, bf16 mixed
precision against fp32 (loss and gradients within bf16's tolerance, float32 master weights
kept), activation checkpointing giving the same step, and the logprob alarm scaled to the
precision. The same step on a GPU is marked ``gpu`` and skipped without one."""

from __future__ import annotations

import copy

import pytest
import torch

from services.trainer.device import resolve_device
from services.trainer.step import PolicyTrainer
from shared.settings import OptimSettings, SettingsError, load_settings
from synthetic_logprobs import SYNTHETIC_LOGPROBS



def grads(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])


def one_step(model, tok, batches, **kwargs):  # noqa: ANN001, ANN201
    trainer = PolicyTrainer(model, tok.pad_token_id, alarm=SYNTHETIC_LOGPROBS, optim=OptimSettings(lr=1e-3, max_grad_norm=None),
                            **kwargs)
    metrics = trainer.train_step(batches)
    return trainer, metrics


def test_auto_is_the_cpu_here_and_cuda_without_a_gpu_is_refused():
    assert resolve_device("auto").type == ("cuda" if torch.cuda.is_available() else "cpu")
    assert resolve_device("cpu").type == "cpu"
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="trainer.device is cuda but torch sees no GPU"):
            resolve_device("cuda")


def test_bf16_step_matches_fp32_within_tolerance_and_keeps_fp32_master_weights(tiny_policy, make_batch):
    model, tok = tiny_policy
    batches = [make_batch(seed, n=4, model=model, group_id=seed) for seed in range(2)]
    fp32, m32 = one_step(copy.deepcopy(model), tok, batches)
    bf16, m16 = one_step(copy.deepcopy(model), tok, batches, dtype="bf16")
    assert m16["loss"] == pytest.approx(m32["loss"], rel=0.05, abs=1e-3)
    g32, g16 = grads(fp32.model), grads(bf16.model)
    cosine = float(torch.nn.functional.cosine_similarity(g32, g16, dim=0))
    assert cosine > 0.99, cosine
    assert float((g16.norm() / g32.norm() - 1).abs()) < 0.05
    assert all(p.dtype == torch.float32 for p in bf16.model.parameters())  # the master copy
    state = bf16.optimizer.state[next(iter(bf16.model.parameters()))]
    assert state["exp_avg"].dtype == torch.float32


def test_activation_checkpointing_gives_the_same_step(tiny_policy, make_batch):
    model, tok = tiny_policy
    batches = [make_batch(seed, n=4, model=model, group_id=seed) for seed in range(2)]
    plain, mp = one_step(copy.deepcopy(model), tok, batches)
    checkpointed_model = copy.deepcopy(model)
    checkpointed_model.gradient_checkpointing_enable()
    checkpointed, mc = one_step(checkpointed_model, tok, batches)
    assert checkpointed.model.is_gradient_checkpointing
    assert mc["loss"] == pytest.approx(mp["loss"], rel=1e-6)
    torch.testing.assert_close(grads(checkpointed.model), grads(plain.model), atol=1e-6, rtol=1e-5)


def test_the_logprob_alarm_is_scaled_to_the_precision_unless_set():
    assert load_settings().trainer.logprob_alarm.max_on_policy_mad == 1e-3
    assert load_settings(trainer={"dtype": "bf16"}).trainer.logprob_alarm.max_on_policy_mad == 5e-2
    explicit = load_settings(trainer={"dtype": "bf16", "logprob_alarm": {"max_on_policy_mad": 0.2}})
    assert explicit.trainer.logprob_alarm.max_on_policy_mad == 0.2
    with pytest.raises(SettingsError, match="trainer.dtype"):
        load_settings(trainer={"dtype": "fp8"})


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_a_bf16_step_on_the_gpu_matches_the_cpu_fp32_step(tiny_policy, make_batch):
    model, tok = tiny_policy
    batches = [make_batch(seed, n=4, model=model, group_id=seed) for seed in range(2)]
    cpu, mc = one_step(copy.deepcopy(model), tok, batches)
    gpu, mg = one_step(copy.deepcopy(model).to(resolve_device("cuda")), tok, batches, dtype="bf16")
    assert mg["loss"] == pytest.approx(mc["loss"], rel=0.05, abs=1e-3)
    cosine = torch.nn.functional.cosine_similarity(grads(cpu.model), grads(gpu.model).cpu(), dim=0)
    assert float(cosine) > 0.99
