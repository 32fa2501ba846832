"""``trainer.compile_layers`` (services/trainer/compile.py) on CPU: every decoder layer is
compiled, and the compiled step equals the eager one. The speed-up is a GPU figure
(``bench/gpu_check.py --compile-layers``, docs/gpu.md)."""

from __future__ import annotations

import copy

import pytest
import torch

from services.trainer.compile import compile_decoder_layers
from services.trainer.sharding import decoder_layers
from services.trainer.step import PolicyTrainer, build_optimizer
from shared.settings import OptimSettings, load_settings
from synthetic_logprobs import SYNTHETIC_LOGPROBS



def grads(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])


def one_step(model, tok, batches):  # noqa: ANN001, ANN201
    trainer = PolicyTrainer(model, tok.pad_token_id, alarm=SYNTHETIC_LOGPROBS, optim=OptimSettings(lr=1e-3, max_grad_norm=None))
    return trainer, trainer.train_step(batches)


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_a_step_with_compiled_layers_equals_the_eager_step(tiny_policy, make_batch, backend):
    torch._dynamo.reset()
    model, tok = tiny_policy
    batches = [make_batch(seed, n=4, model=model, group_id=seed) for seed in range(2)]
    eager, eager_metrics = one_step(copy.deepcopy(model), tok, batches)
    compiled_model = compile_decoder_layers(copy.deepcopy(model), backend=backend)
    layers = decoder_layers(compiled_model)
    assert layers and all(layer._compiled_call_impl is not None for layer in layers)
    compiled, compiled_metrics = one_step(compiled_model, tok, batches)
    assert compiled_metrics["loss"] == pytest.approx(eager_metrics["loss"], rel=1e-5, abs=1e-6)
    # gradients, not weights: AdamW's first step moves a weight by about lr whatever its
    # gradient's size, so rounding that flips a near-0 gradient's sign moves it by 2 lr
    torch.testing.assert_close(grads(compiled.model), grads(eager.model), atol=1e-6, rtol=1e-4)


def test_compile_layers_is_off_by_default_and_adamw_is_fused_only_on_a_gpu(tiny_policy):
    assert load_settings().trainer.compile_layers is False
    assert load_settings(trainer={"compile_layers": True}).trainer.compile_layers is True
    model, _ = tiny_policy
    assert not build_optimizer(model, OptimSettings()).defaults.get("fused")  # parameters on the CPU
