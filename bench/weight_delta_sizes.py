"""The delta path (``inference.weight_sync: delta``) at real model shapes: what a version costs.

Method. A Qwen2.5-shaped model (``CONFIGS`` of ``bench/weight_sync_sizes.py``: real layout, random
weights) takes real AdamW steps (one short random sequence, its language-model loss) at each
learning rate, in two regimes: ``fp32-master`` (fp32 parameters and optimizer, served in bf16)
and ``bf16`` (bf16 parameters and optimizer). After each step the served bf16 tensors are
encoded against the step before (``services.weights.delta.encode_version``) with every
encoding (``ENCODINGS``), and, beside them, layouts the codec does not have (``EXPERIMENTS``,
bytes and encode time only): ``varint``, the gaps as LEB128 varints then the changed elements'
XOR in byte planes; ``zigzag``, ``set-planes`` with each changed element's integer difference
of bits (zigzag) instead of its XOR; ``grouped-zigzag``, that with the elements of the whole
tensor taken in the order of the old value's exponent (stable), where the codec's ``grouped``
orders block by block (``services.weights.delta_order``): a small weight moves a bf16 step at a
small lr far more often than a large one. All zstd. The figures: the fraction of bf16 elements changed, the bytes of each encoding against
the full bf16 size (and against a zstd'd full version), each one's encode and decode
(``decode_frame`` of every frame) time, and, for the codec's default (``grouped``), the step
file's write (``delta_shadow.write_step``), its resolution against the old tensors
(``DeltaShadow.resolve``: what a replica's worker does before the pause) and the time to apply
and verify it on a shadow (``DeltaShadow.apply``: what the worker does while paused, before
vLLM's in-memory load).

    .venv/bin/python bench/weight_sync.py --delta-sizes 0.5B [--delta-lrs 1e-6 1e-5] [--delta-steps 3] \
        [--delta-regimes fp32-master bf16] [--delta-encodings set-planes grouped]
"""

from __future__ import annotations

import gc
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import zstandard

from bench.weight_sync_sizes import CONFIGS
from services.weights.delta import ZSTD_LEVEL, bits_of, byte_planes, decode_frame, encode_version, frame_of
from services.weights.delta_chain import ChainVersion
from services.weights.delta_shadow import DeltaShadow, read_step, write_step

REGIMES = ("fp32-master", "bf16")
ENCODINGS = ("set", "xor", "set-planes", "xor-planes", "grouped", "smallest")
ADOPTED = "grouped"  # the codec's default


def varint(values: np.ndarray) -> bytes:
    """``values`` (unsigned, < 2**35) as LEB128: seven bits a byte, low first, the top bit set on all but the last."""
    values = values.astype(np.uint64)
    width = np.ones(values.size, dtype=np.int64)
    for k in range(1, 5):
        width += values >= (1 << (7 * k))
    start = np.cumsum(width) - width
    out = np.zeros(int(width.sum()), dtype=np.uint8)
    for k in range(5):
        at = width > k
        more = np.where(width[at] > k + 1, 0x80, 0).astype(np.uint8)
        out[start[at] + k] = ((values[at] >> np.uint64(7 * k)) & np.uint64(0x7F)).astype(np.uint8) | more
    return out.tobytes()


def _zigzag(old: np.ndarray, new: np.ndarray) -> bytes:
    """The integer differences of the bits, zigzag-coded (small of either sign: small), in byte planes."""
    diff = new.astype(np.int64) - old.astype(np.int64)
    return byte_planes(((diff << 1) ^ (diff >> 63)).astype(np.uint32))


def _experiment(name: str, old: np.ndarray, new: np.ndarray) -> bytes:
    if name == "grouped-zigzag":
        order = np.argsort((old.view(np.uint16 if old.itemsize == 2 else np.uint32) >> 7) & 0xFF, kind="stable")
        old, new = old[order], new[order]
    flips = np.bitwise_xor(old, new)
    index = np.flatnonzero(flips)
    gaps = np.diff(index, prepend=-1)
    if name == "varint":
        return varint(gaps) + byte_planes(flips[index])
    values = _zigzag(old[index], new[index]) if name.endswith("zigzag") else byte_planes(flips[index])
    return byte_planes(gaps.astype(np.uint32)) + values


EXPERIMENTS = ("varint", "zigzag", "grouped-zigzag")


def experiment_payload(name: str, after: dict[str, torch.Tensor], before: dict[str, torch.Tensor]) -> int:
    compressor = zstandard.ZstdCompressor(level=ZSTD_LEVEL)
    return sum(len(compressor.compress(_experiment(name, bits_of(before[k]).numpy(), bits_of(after[k]).numpy())))
               for k in sorted(after))


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


def measure(size: str, regime: str, lr: float, steps: int, scratch: Path, encodings: tuple[str, ...] = ENCODINGS,
            experiments: tuple[str, ...] = EXPERIMENTS) -> list[dict]:
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
        for encoding in encodings:
            t = time.perf_counter()
            entries, payload = encode_version(after, before, encoding)
            row[f"{encoding}_encode_s"] = time.perf_counter() - t
            row[f"{encoding}_bytes"] = len(payload)
            row["changed_fraction"] = sum(e.changed for e in entries) / elements
            t = time.perf_counter()
            for entry in entries:
                decode_frame(entry, frame_of(entry, payload))
            row[f"{encoding}_decode_s"] = time.perf_counter() - t
            if encoding == ADOPTED:
                row["ops"] = ",".join(sorted({e.op for e in entries}))
                t = time.perf_counter()
                path = write_step(_version(entries, payload, step, step - 1), payload, scratch / f"{step}.pt", "bench")
                row["step_file_s"] = time.perf_counter() - t
                decoded = read_step(path)
                t = time.perf_counter()
                decoded = shadow.resolve([decoded])[0]
                row["resolve_s"] = time.perf_counter() - t
                timings = shadow.apply([decoded])
                row["apply_s"], row["verify_s"] = timings["apply_s"], timings["verify_s"]
                path.unlink()
                del decoded
            del entries, payload
        for name in experiments:
            t = time.perf_counter()
            row[f"{name}_bytes"] = experiment_payload(name, after, before)
            row[f"{name}_encode_s"] = time.perf_counter() - t
        rows.append(row)
        print(" ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()), flush=True)
        before = after
    del model, optimizer, shadow
    gc.collect()
    return rows


def run(sizes: list[str], lrs: list[float], steps: int, regimes: tuple[str, ...] = REGIMES,
        encodings: tuple[str, ...] = ENCODINGS, experiments: tuple[str, ...] = EXPERIMENTS) -> list[dict]:
    rows = []
    with tempfile.TemporaryDirectory(prefix="conveyor-bench-delta-") as tmp:
        for size in sizes:
            for regime in regimes:
                for lr in lrs:
                    rows += measure(size, regime, lr, steps, Path(tmp), encodings, experiments)
    return rows


def table(rows: list[dict]) -> str:
    """Means over each setting's steps: per encoding, MB (x fewer than the full bf16 bytes), encode / decode s."""
    names = [n for n in (*ENCODINGS, *EXPERIMENTS) if any(f"{n}_bytes" in r for r in rows)]
    lines = ["| size | regime | lr | changed (bf16 elements) | " + " | ".join(names)
             + " | resolve (before the pause) | apply + verify (paused) |", "|" + "---|" * (6 + len(names))]
    keys = sorted({(r["size"], r["regime"], r["lr"]) for r in rows}, key=lambda k: (k[0], k[1], k[2]))
    for key in keys:
        group = [r for r in rows if (r["size"], r["regime"], r["lr"]) == key]

        def mean(field: str, group: list[dict] = group) -> float:
            return sum(r.get(field, float("nan")) for r in group) / len(group)

        cells = []
        for name in names:
            size = mean(f"{name}_bytes")
            decode = f" / {mean(f'{name}_decode_s'):.1f}" if name in ENCODINGS else ""
            cells.append(f"{size / 1e6:.1f} MB ({mean('full_bytes') / max(size, 1):.0f}x), "
                         f"{mean(f'{name}_encode_s'):.1f}{decode} s")
        lines.append(f"| {key[0]} | {key[1]} | {key[2]:g} | {100 * mean('changed_fraction'):.3f}% | "
                     + " | ".join(cells) + f" | {mean('resolve_s'):.2f} s | {mean('apply_s'):.2f} + {mean('verify_s'):.2f} s |")
    return "\n".join(lines)
