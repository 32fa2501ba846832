"""Would a LoRA policy's versions gain from the delta chain (``inference.weight_sync: delta``)?

Method. A Qwen2.5-shaped model (``CONFIGS`` of ``bench/weight_sync_sizes.py``, random weights,
fp32) cut to ``--layers`` decoder layers and a ``--vocab`` vocabulary (the statistics of one
layer's matrices do not depend on how many there are), with the trainer's own adapters
(``services.trainer.lora.with_lora``: rank 8, alpha 16, q/k/v/o, as ``trainer.lora`` defaults),
takes real AdamW steps on the adapters at each learning rate. After each step, both things a
LoRA version can serve are encoded in bf16 against the step before with
``services.weights.delta.encode_version`` (XOR, zstd):
- ``adapter`` (``trainer.lora.sync: adapter``): the adapter's tensors;
- ``merged`` (``trainer.lora.sync: merged``): ``merged_state_dict``, base plus the adapters.
The merged delta's bytes are projected to the whole model (per layer, times the real layer count)
and set against the model's full bf16 size; the adapter's, against the adapter's full size.

    .venv/bin/python -m bench.weight_delta_lora --size 0.5B --lrs 1e-5 1e-4 --steps 20
"""

from __future__ import annotations

import argparse
import dataclasses

import torch

from bench.weight_sync_sizes import CONFIGS
from services.trainer.lora import merged_state_dict, with_lora
from services.weights.delta import encode_version
from shared.settings.trainer import LoraSettings


def _bf16(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.detach().to(torch.bfloat16, copy=True).contiguous() for k, v in tensors.items()}


def measure(size: str, layers: int, vocab: int, lr: float, steps: int) -> list[dict]:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    real = CONFIGS[size]
    cut = dataclasses.replace(real, layers=layers, vocab=vocab)
    torch.manual_seed(0)
    base = Qwen2ForCausalLM(Qwen2Config(**{k: v for k, v in cut.hf_config().items() if k != "architectures"}))
    model = with_lora(base.float(), LoraSettings(enabled=True))
    model.train()
    trainable = {n: p for n, p in model.named_parameters() if p.requires_grad}
    optimizer = torch.optim.AdamW(trainable.values(), lr=lr)
    ids = torch.randint(0, vocab, (1, 32), generator=torch.Generator().manual_seed(1))
    adapter, merged = _bf16(trainable), _bf16(merged_state_dict(model))
    adapter_elements = sum(t.numel() for t in adapter.values())
    targeted = [n for n in merged if any(f"{m}.weight" in n for m in LoraSettings().target_modules)]
    rows = []
    for step in range(1, steps + 1):
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        adapter_after, merged_after = _bf16(trainable), _bf16(merged_state_dict(model))
        a_entries, a_payload = encode_version(adapter_after, adapter, "xor")
        m_entries, m_payload = encode_version(merged_after, merged, "xor")
        changed_targeted = sum(e.changed for e in m_entries if e.name in targeted)
        rows.append({
            "lr": lr, "step": step,
            "adapter_changed": sum(e.changed for e in a_entries) / adapter_elements,
            "adapter_full_mb": adapter_elements * 2 * real.layers / layers / 1e6,
            "adapter_delta_mb": len(a_payload) * real.layers / layers / 1e6,
            "merged_changed_in_targeted": changed_targeted / sum(merged[n].numel() for n in targeted),
            "merged_changed_untargeted": sum(e.changed for e in m_entries if e.name not in targeted),
            "merged_delta_mb": len(m_payload) * real.layers / layers / 1e6,
            "model_full_mb": real.params * 2 / 1e6,
        })
        print(" ".join(f"{k}={v:.4g}" for k, v in rows[-1].items()), flush=True)
        adapter, merged = adapter_after, merged_after
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", choices=sorted(CONFIGS), default="0.5B")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--lrs", type=float, nargs="+", default=[1e-5, 1e-4])
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    torch.set_num_threads(1)
    for lr in args.lrs:
        measure(args.size, args.layers, args.vocab, lr, args.steps)


if __name__ == "__main__":
    main()
