"""The delta path (``inference.weight_sync: delta``) at real model shapes: what a version costs.

Method. A Qwen2.5-shaped model (``CONFIGS`` of ``bench/weight_sync_sizes.py``: real layout, random
weights) takes real AdamW steps (one short random sequence, its language-model loss) at each
learning rate, in two regimes: ``fp32-master`` (fp32 parameters and optimizer, served in bf16)
and ``bf16`` (bf16 parameters and optimizer). After each step the served bf16 tensors are
encoded against the step before (``services.weights.delta.encode_version``) with both
encodings, and the figures are: the fraction of bf16 elements changed, the bytes of each
encoding against the full bf16 size (and against a zstd'd full version), the encode time, the
decode time (``delta_shadow.write_step``) and the time to apply and verify it on a shadow
(``DeltaShadow.apply``: what a replica's worker does while paused, before vLLM's in-memory load).

    .venv/bin/python bench/weight_sync.py --delta-sizes 0.5B [--delta-lrs 1e-6 1e-5] [--delta-steps 3]
"""

from __future__ import annotations

import gc
import tempfile
import time
from pathlib import Path

import torch

from bench.weight_sync_sizes import CONFIGS
from services.weights.delta import encode_version
from services.weights.delta_chain import ChainVersion
from services.weights.delta_shadow import DeltaShadow, read_step, write_step

REGIMES = ("fp32-master", "bf16")


def _model(size: str, dtype: torch.dtype) -> torch.nn.Module:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(**{k: v for k, v in CONFIGS[size].hf_config().items() if k != "architectures"})
    model = Qwen2ForCausalLM(config).to(dtype)
    model.train()
    return model


def _served(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().to(torch.bfloat16, copy=True).contiguous() for k, v in model.state_dict().items()}


def _version(entries, payload: bytes, version: int, base: int | None) -> ChainVersion:
    return ChainVersion(version, "full" if base is None else "delta", base, entries[0].op if entries else "set",
                        len(payload), "", tuple(entries))


def measure(size: str, regime: str, lr: float, steps: int, scratch: Path) -> list[dict]:
    model = _model(size, torch.float32 if regime == "fp32-master" else torch.bfloat16)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    ids = torch.randint(0, model.config.vocab_size, (1, 32), generator=torch.Generator().manual_seed(1))
    before = _served(model)
    full_bytes = sum(t.numel() * 2 for t in before.values())
    elements = sum(t.numel() for t in before.values())
    t = time.perf_counter()
    full_entries, full_payload = encode_version(before, None)
    full_encode_s = time.perf_counter() - t
    shadow = DeltaShadow()
    step_file = write_step(_version(full_entries, full_payload, 0, None), full_payload, scratch / "full.pt", "bench")
    shadow.apply([read_step(step_file)])
    step_file.unlink()
    full_zstd_bytes = len(full_payload)
    del full_payload, full_entries
    rows = []
    for step in range(1, steps + 1):
        t = time.perf_counter()
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        train_s = time.perf_counter() - t
        after = _served(model)
        row = {"size": size, "regime": regime, "lr": lr, "step": step, "train_s": train_s, "full_bytes": full_bytes,
               "full_zstd_bytes": full_zstd_bytes, "full_encode_s": full_encode_s}
        for encoding in ("set", "xor"):
            t = time.perf_counter()
            entries, payload = encode_version(after, before, encoding)
            row[f"{encoding}_encode_s"] = time.perf_counter() - t
            row[f"{encoding}_bytes"] = len(payload)
            row["changed_fraction"] = sum(e.changed for e in entries) / elements
            if encoding == "set":
                t = time.perf_counter()
                path = write_step(_version(entries, payload, step, step - 1), payload, scratch / f"{step}.pt", "bench")
                row["decode_s"] = time.perf_counter() - t
                decoded = read_step(path)
                timings = shadow.apply([decoded])
                row["apply_s"], row["verify_s"] = timings["apply_s"], timings["verify_s"]
                path.unlink()
        rows.append(row)
        print(" ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()), flush=True)
        before = after
    del model, optimizer, shadow
    gc.collect()
    return rows


def run(sizes: list[str], lrs: list[float], steps: int) -> list[dict]:
    rows = []
    with tempfile.TemporaryDirectory(prefix="conveyor-bench-delta-") as tmp:
        for size in sizes:
            for regime in REGIMES:
                for lr in lrs:
                    rows += measure(size, regime, lr, steps, Path(tmp))
    return rows


def table(rows: list[dict]) -> str:
    """Means over each setting's steps."""
    lines = ["| size | regime | lr | changed (bf16 elements) | set bytes (x fewer than full) | xor bytes (x fewer) "
             "| encode set / xor | decode | apply + verify |", "|" + "---|" * 9]
    keys = sorted({(r["size"], r["regime"], r["lr"]) for r in rows}, key=lambda k: (k[0], k[1], k[2]))
    for key in keys:
        group = [r for r in rows if (r["size"], r["regime"], r["lr"]) == key]

        def mean(field: str, group: list[dict] = group) -> float:
            return sum(r[field] for r in group) / len(group)

        full = mean("full_bytes")
        lines.append(
            f"| {key[0]} | {key[1]} | {key[2]:g} | {100 * mean('changed_fraction'):.3f}% "
            f"| {mean('set_bytes') / 1e6:.2f} MB ({full / max(mean('set_bytes'), 1):.0f}x) "
            f"| {mean('xor_bytes') / 1e6:.2f} MB ({full / max(mean('xor_bytes'), 1):.0f}x) "
            f"| {mean('set_encode_s'):.2f} s / {mean('xor_encode_s'):.2f} s | {mean('decode_s'):.2f} s "
            f"| {mean('apply_s'):.2f} + {mean('verify_s'):.2f} s |")
    return "\n".join(lines)
