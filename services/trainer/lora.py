"""LoRA: train low-rank adapters (``peft``) instead of every weight (``trainer.lora``).

Invariants:
- The adapters' initial weights are a function of ``trainer.lora`` alone (``with_lora`` draws
  them from its own seeded generator), so every rank of a sharded trainer, a one-process
  trainer and the leader's unsharded copy start from the same adapters.
- Only the adapters' weights require gradients, so the optimizer (``step.build_optimizer``)
  holds only them; the base weights are the served base checkpoint (``inference.model_path``)
  and never change.
- ``merged_state_dict`` is the base weights with each adapter's ``B @ A * alpha / rank`` added,
  under the base model's own names, each tensor once (a tied output head is not written
  twice). The model is not touched. ``save_served(..., "merged")`` writes it as a plain Hugging
  Face checkpoint, so the S3 weight path and the logprob probe work as without LoRA.
- ``save_served(..., "adapter")`` writes only the adapter, in peft's ``save_pretrained`` layout
  (``adapter_config.json``, ``adapter_model.safetensors``), which vLLM's LoRA support loads;
  the adapter config (``shared.names.CHECKPOINT_ADAPTER_CONFIG``) tells the two layouts apart.
- A trainer checkpoint of a LoRA run carries the adapter's weights and its shape
  (``lora_shape``: rank, alpha, target modules) in its trainer state; ``load_adapter_state``
  refuses a state of another shape, naming both, and loads every adapter weight or none.
- A target module that names no layer of the model is refused at wrapping, naming it and the
  layers there are, and peft's default for the architecture. Left at its default (the
  attention projections ``q_proj``...``o_proj``), on an architecture that names them otherwise
  (GPT-2's fused ``c_attn``, GPT-NeoX's ``query_key_value``), the targets are peft's default
  for that architecture, and the log says so. GPT-2's ``Conv1D`` layers count as linear (peft
  adapts them with their transposed weight, and ``merged_state_dict`` merges them so).
- Under FSDP (``services.trainer.distributed``) the leader writes the served checkpoint from an
  unsharded CPU copy of the policy (the served base again, which never trains) into which
  ``load_trainable_weights`` loads the adapters gathered from every rank; so a sharded run
  writes with the same functions, and the same files, as one process.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch
from peft import LoraConfig, PeftModel, get_peft_model, get_peft_model_state_dict, set_peft_model_state_dict
from peft.tuners.lora import LoraLayer
from peft.utils.constants import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING as PEFT_DEFAULT_TARGETS
from transformers import PreTrainedModel
from transformers.pytorch_utils import Conv1D

from shared.settings import LORA_ATTENTION, LoraSettings

log = logging.getLogger(__name__)

ADAPTER_INIT_SEED = 0  # the adapters' initial weights are drawn with this seed, on every process


class LoraShapeError(ValueError):
    """A saved adapter does not fit the model's adapters (other rank, alpha or target modules)."""


def target_modules(model: PreTrainedModel, lora: LoraSettings) -> list[str]:
    """The names of the layers that get an adapter: ``trainer.lora.target_modules``, or, left at
    its default on an architecture without those names, peft's default for the architecture."""
    linear = sorted({name.rsplit(".", 1)[-1] for name, module in model.named_modules()
                     if isinstance(module, (torch.nn.Linear, Conv1D))})
    wanted = list(lora.target_modules)
    architecture_default = PEFT_DEFAULT_TARGETS.get(getattr(model.config, "model_type", ""))
    missing = [t for t in wanted if t not in linear]
    if not missing:
        return wanted
    if wanted == LORA_ATTENTION and len(missing) == len(wanted) and architecture_default \
            and set(architecture_default) <= set(linear):
        log.info("LoRA adapts %s, peft's default for %s: the model has no %s", architecture_default,
                 model.config.model_type, ", ".join(LORA_ATTENTION))
        return list(architecture_default)
    hint = f"; peft's default for {model.config.model_type} is {architecture_default}" if architecture_default else ""
    raise ValueError(f"trainer.lora.target_modules {missing} name no linear layer of the model; it has {linear}{hint}")


def with_lora(model: PreTrainedModel, lora: LoraSettings) -> PeftModel:
    targets = target_modules(model, lora)
    targeted = [m for name, m in model.named_modules() if name.rsplit(".", 1)[-1] in targets]
    # Conv1D keeps its weight transposed; peft adapts such layers per module either way
    config = LoraConfig(r=lora.rank, lora_alpha=lora.alpha, lora_dropout=0.0, target_modules=targets,
                        bias="none", task_type="CAUSAL_LM", fan_in_fan_out=all(isinstance(m, Conv1D) for m in targeted))
    device = next(model.parameters()).device
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else [], device_type=device.type):
        torch.manual_seed(ADAPTER_INIT_SEED)  # seeds the device's generator too; fork_rng restores both
        return get_peft_model(model, config)


def lora_shape(model: PeftModel) -> dict[str, Any]:
    config = model.peft_config[model.active_adapter]
    return {"rank": config.r, "alpha": float(config.lora_alpha), "target_modules": sorted(config.target_modules)}


def adapter_state(model: PeftModel) -> dict[str, Any]:
    """What a trainer checkpoint keeps of the adapter: its weights (peft's names) and shape."""
    weights = {name: tensor.detach().cpu().clone() for name, tensor in get_peft_model_state_dict(model).items()}
    return {"shape": lora_shape(model), "weights": weights}


def check_adapter_shape(shape: dict[str, Any], model: PeftModel) -> None:
    """Refuse a saved adapter ``shape`` (``lora_shape``) other than the model's, naming both."""
    if shape != lora_shape(model):
        raise LoraShapeError(f"the checkpoint's adapter is {shape}, the trainer's is {lora_shape(model)} "
                             "(trainer.lora must match the run's)")


@torch.no_grad()
def load_adapter_state(model: PeftModel, state: dict[str, Any]) -> None:
    check_adapter_shape(state["shape"], model)
    expected = set(get_peft_model_state_dict(model))
    if set(state["weights"]) != expected:
        raise LoraShapeError(f"the checkpoint's adapter weights {sorted(set(state['weights']) ^ expected)} "
                             "are not the model's")
    set_peft_model_state_dict(model, state["weights"])


@torch.no_grad()
def load_trainable_weights(model: PeftModel, weights: dict[str, torch.Tensor]) -> None:
    """Load every adapter weight, named as the whole model's state dict names it (what
    ``sharding.full_state_dict(trainable_only=True)`` gathers), or none."""
    trainable = {name for name, p in model.named_parameters() if p.requires_grad}
    if set(weights) != trainable:
        raise LoraShapeError(f"the gathered adapter weights {sorted(set(weights) ^ trainable)} are not the model's")
    model.load_state_dict(weights, strict=False)


@torch.no_grad()
def merged_state_dict(model: PeftModel) -> dict[str, torch.Tensor]:
    """The base model's weights with the adapters' deltas added, under the base's names. The
    model is not touched (merging in place and back would drift the base weights by rounding)."""
    base = model.get_base_model()
    merged: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for name, tensor in base.state_dict().items():
        if "lora_" in name or tensor.data_ptr() in seen:  # a tied weight is written once, as save_pretrained does
            continue
        seen.add(tensor.data_ptr())
        merged[name.replace(".base_layer.", ".")] = tensor.detach().clone()
    for name, module in base.named_modules():
        if isinstance(module, LoraLayer):
            if f"{name}.weight" not in merged:
                raise ValueError(f"{name} is tied to another weight; LoRA on a tied layer cannot be merged")
            for adapter in module.active_adapters:
                merged[f"{name}.weight"] += module.get_delta_weight(adapter).to(merged[f"{name}.weight"].dtype)
    return merged


def save_served(model: PeftModel, out_dir: Path, sync: str, *, max_shard_size: str | int) -> None:
    """Write what vLLM will load: the merged full checkpoint (in weight files of at most
    ``max_shard_size``), or the adapter alone."""
    if sync == "merged":
        model.get_base_model().save_pretrained(out_dir, state_dict=merged_state_dict(model), safe_serialization=True,
                                               max_shard_size=max_shard_size)
    elif sync == "adapter":
        model.save_pretrained(out_dir, safe_serialization=True)
        (out_dir / "README.md").unlink(missing_ok=True)  # peft's model card: nothing a reader needs
    else:
        raise ValueError(f"trainer.lora.sync is merged or adapter, got {sync!r}")
