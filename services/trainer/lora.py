"""LoRA: train low-rank adapters (``peft``) instead of every weight.

Invariants:
- Only the adapters' weights require gradients, so the optimizer (``step.build_optimizer``)
  holds only them; the base weights never change.
- What vLLM serves stays a plain Hugging Face checkpoint: ``merged_state_dict`` is the base
  weights with each adapter's ``B @ A * scale`` added, under the base model's own names, so the
  S3 weight path and the logprob probe work unchanged. (Not done yet: settings and the
  training loop's use of it, checkpoints of the adapter alone, and shipping only the adapter
  to vLLM's LoRA support.)
"""

from __future__ import annotations

import torch
from peft import LoraConfig, PeftModel, get_peft_model
from peft.tuners.lora import LoraLayer
from transformers import PreTrainedModel

ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")


def with_lora(model: PreTrainedModel, rank: int = 8, alpha: float = 16.0,
              target_modules: tuple[str, ...] = ATTENTION) -> PeftModel:
    config = LoraConfig(r=rank, lora_alpha=alpha, lora_dropout=0.0, target_modules=list(target_modules),
                        bias="none", task_type="CAUSAL_LM")
    return get_peft_model(model, config)


@torch.no_grad()
def merged_state_dict(model: PeftModel) -> dict[str, torch.Tensor]:
    """The base model's weights with the adapters' deltas added, under the base's names. The
    model is not touched (merging in place and back would drift the base weights by rounding)."""
    base = model.get_base_model()
    merged = {name.replace(".base_layer.", "."): tensor.detach().clone()
              for name, tensor in base.state_dict().items() if "lora_" not in name}
    for name, module in base.named_modules():
        if isinstance(module, LoraLayer):
            for adapter in module.active_adapters:
                merged[f"{name}.weight"] += module.get_delta_weight(adapter).to(merged[f"{name}.weight"].dtype)
    return merged
