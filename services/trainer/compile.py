"""``torch.compile`` of the policy's decoder layers (``trainer.compile_layers``): regional
compilation, one compiled graph that every decoder layer reuses.

Invariants:
- Only the repeated blocks (``sharding.decoder_layers``) are compiled, each in place with
  ``Module.compile``; the embedding, the output head and the loss stay eager. The layers share
  one class and one code path, so the graph is traced once and reused by every layer, and the
  step's first call pays the compilation (seconds to a minute), not every layer.
- Compilation changes how a step is computed, never what: the same weights give the same loss
  and gradients up to kernel rounding (``tests/trainer/test_compile_layers.py``).
- It runs after LoRA adapters are attached and before FSDP2 shards the layers (the order
  torch's regional compilation recipes use), so the compiled graph holds the adapters.
"""

from __future__ import annotations

import torch

from services.trainer.sharding import decoder_layers


def compile_decoder_layers(model: torch.nn.Module, backend: str = "inductor") -> torch.nn.Module:
    """Compile every decoder layer of ``model`` (or of a peft model's base) in place; returns it."""
    for layer in decoder_layers(model):
        layer.compile(backend=backend)
    return model
