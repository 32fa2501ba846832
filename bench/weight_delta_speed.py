"""The delta codec's encode (trainer) and resolve (replica's worker) speed, stage by stage, with
the compiled ``grouped`` kernels (``services.weights.delta_order_jit``) against the numpy code
they replace, in one run (``inference.weight_sync: delta``).

Method. Qwen2.5-shaped served tensors (``CONFIGS``: real layout) and the next version after one
step: ``--step adamw`` a real AdamW step of an fp32 model (``bench.weight_delta_sizes``: one
random 32-token sequence) served in bf16, ``--step synthetic`` the synthetic fp32-master step of
``bench.weight_delta_pause`` (random bf16 weights; what fits at 1.5B). Then ``--rounds`` rounds,
each timing the numpy path (``delta_order.NUMPY_ONLY``) and the compiled one, alternating:
``encode_version`` of every tensor (``grouped``, zstd level 3), ``decode_frame`` of every frame,
``resolve_change`` of every tensor against the old one, ``apply_change`` and the checksum; the
two paths' payloads and resolved tensors must be equal (the run stops otherwise). Before the
rounds, one pass of each path split by stage (the numpy stages as ``grouped_frame`` and
``resolve_ranked`` do them, timed here; the kernel's compile left out). MB/s is of the served
version's bf16 bytes. Medians over the rounds; the 1-minute load average at start and end.

    .venv/bin/python -m bench.weight_delta_speed --size 0.5B [--step adamw] [--rounds 3] [--lr 1e-6]
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import numpy as np
import torch
import xxhash
import zstandard

from bench.weight_delta_pause import fp32_master_step
from bench.weight_delta_sizes import _model, _served
from bench.weight_sync_sizes import CONFIGS, random_tensor
from services.weights import delta_order, delta_order_jit
from services.weights.delta import (ZSTD_LEVEL, apply_change, bits_of, byte_planes, decode_frame, encode_version,
                                    frame_of, resolve_change, tensor_checksum)


def loadavg() -> float:
    return float(Path("/proc/loadavg").read_text().split()[0])


def versions(size: str, step: str, lr: float) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """The served bf16 tensors before and after one step."""
    if step == "adamw":
        model = _model(size, torch.float32)
        optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
        ids = torch.randint(0, model.config.vocab_size, (1, 32), generator=torch.Generator().manual_seed(1))
        before = _served(model)
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        after = _served(model)
        del model, optimizer
        return before, after
    g, g2 = torch.Generator().manual_seed(0), torch.Generator().manual_seed(2)
    before = {name: random_tensor(name, shape, g) for name, shape in CONFIGS[size].tensor_shapes()}
    return before, {name: fp32_master_step(t, lr, g2) for name, t in before.items()}


class Stages:
    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self.t = time.perf_counter()

    def __call__(self, stage: str) -> None:
        now = time.perf_counter()
        self.seconds[stage] = self.seconds.get(stage, 0.0) + now - self.t
        self.t = now


def numpy_stages(before: dict[str, torch.Tensor], after: dict[str, torch.Tensor]) -> dict[str, float]:
    """The numpy ``grouped`` encode and resolve of every tensor, split by stage (the steps of
    ``delta_order.grouped_frame`` and ``resolve_ranked``, timed one by one)."""
    compressor, s = zstandard.ZstdCompressor(level=ZSTD_LEVEL), Stages()
    for name in sorted(after):
        old, new = bits_of(before[name]).numpy(), bits_of(after[name]).numpy()
        s.t = time.perf_counter()
        xxhash.xxh3_64_hexdigest(new.view(np.uint8).data)
        s("encode: checksum (xxh3)")
        positions, diffs = [], []
        for lo in range(0, old.size, delta_order.CHUNK):
            hi = min(old.size, lo + delta_order.CHUNK)
            same = np.array_equal(old[lo:hi], new[lo:hi])
            s("encode: compare the chunk (array_equal)")
            if same:
                continue
            order = delta_order._order(old, lo, hi)
            s("encode: exponent keys + stable argsort")
            a, b = old[order], new[order]
            s("encode: gather old, new in that order")
            at = np.flatnonzero(a != b)
            s("encode: compare + flatnonzero")
            positions.append(at + lo)
            diffs.append(delta_order._zigzag(a[at], b[at]))
            s("encode: zigzag differences")
        if not positions:
            continue
        index, zigzag = np.concatenate(positions), np.concatenate(diffs)
        planes = byte_planes(np.diff(index, prepend=-1).astype(np.uint32)) + byte_planes(zigzag)
        s("encode: gaps + byte planes")
        compressor.compress(planes)
        s("encode: zstd")
        bounds = np.asarray(np.searchsorted(index, np.arange(0, old.size + delta_order.CHUNK, delta_order.CHUNK)))
        flat_all, taken_all = [], []
        for chunk, (a_, b_) in enumerate(zip(bounds[:-1], bounds[1:])):
            if a_ < b_:
                lo = chunk * delta_order.CHUNK
                order = delta_order._order(old, lo, min(old.size, lo + delta_order.CHUNK))
                s("resolve: exponent keys + stable argsort")
                flat = order[index[a_:b_] - lo]
                ascending = np.argsort(flat)
                flat_all.append(flat[ascending])
                taken_all.append(ascending + a_)
                s("resolve: take positions + sort them ascending")
        resolved = np.concatenate(flat_all)
        old[resolved] + delta_order._unzigzag(zigzag[np.concatenate(taken_all)], old.dtype.type)
        s("resolve: new bits (unzigzag)")
    return s.seconds


def jit_stages(before: dict[str, torch.Tensor], after: dict[str, torch.Tensor]) -> dict[str, float]:
    """The compiled path's encode and resolve of every tensor, split by stage."""
    compressor, s = zstandard.ZstdCompressor(level=ZSTD_LEVEL), Stages()
    for name in sorted(after):
        old, new = bits_of(before[name]).numpy(), bits_of(after[name]).numpy()
        unsigned, shift = delta_order._UNSIGNED[old.itemsize], delta_order._EXPONENT_SHIFT[old.itemsize]
        s.t = time.perf_counter()
        xxhash.xxh3_64_hexdigest(new.view(np.uint8).data)
        s("encode: checksum (xxh3)")
        index, zigzag = delta_order_jit.changes(old.view(unsigned), new.view(unsigned), delta_order.BLOCK, shift)
        s("encode: kernel (count, positions, zigzag)")
        planes = delta_order_jit.frame_body(index, zigzag)
        s("encode: gaps + byte planes (kernel)")
        compressor.compress(planes)
        s("encode: zstd")
        delta_order_jit.resolve(old.view(unsigned), index, zigzag, delta_order.BLOCK, shift)
        s("resolve: kernel (positions to ascending indices, new bits)")
    return s.seconds


def one_round(before: dict[str, torch.Tensor], after: dict[str, torch.Tensor], numpy_only: bool) -> dict:
    delta_order.NUMPY_ONLY = numpy_only
    try:
        t = time.perf_counter()
        entries, payload = encode_version(after, before, "grouped")
        encode_s = time.perf_counter() - t
        t = time.perf_counter()
        changes = {e.name: decode_frame(e, frame_of(e, payload)) for e in entries}
        decode_s = time.perf_counter() - t
        t = time.perf_counter()
        resolved = {name: resolve_change(before[name], c) for name, c in changes.items()}
        resolve_s = time.perf_counter() - t
        del changes
        held = {name: t.clone() for name, t in before.items()}
        t = time.perf_counter()
        for name, change in resolved.items():
            apply_change(held[name], change)
        apply_s = time.perf_counter() - t
        t = time.perf_counter()
        ok = all(tensor_checksum(held[e.name]) == e.checksum for e in entries)
        verify_s = time.perf_counter() - t
    finally:
        delta_order.NUMPY_ONLY = False
    if not ok:
        raise SystemExit("a resolved tensor's checksum failed")
    return {"encode_s": encode_s, "decode_s": decode_s, "resolve_s": resolve_s, "apply_s": apply_s,
            "verify_s": verify_s, "bytes": len(payload), "changed": sum(e.changed for e in entries),
            "digest": xxhash.xxh3_64_hexdigest(payload)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", choices=list(CONFIGS), default="0.5B")
    parser.add_argument("--step", choices=["adamw", "synthetic"], default="adamw")
    parser.add_argument("--lr", type=float, default=1e-6)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    if not delta_order_jit.available():
        raise SystemExit("numba is not installed: no compiled path to compare")
    load_start = loadavg()
    t = time.perf_counter()
    before, after = versions(args.size, args.step, args.lr)
    mb = sum(t.numel() * t.element_size() for t in after.values()) / 1e6
    elements = sum(t.numel() for t in after.values())
    print(f"{args.size} {args.step} step lr {args.lr}: {mb:.0f} MB bf16, made in {time.perf_counter() - t:.1f} s, "
          f"load {load_start}", flush=True)
    warm = {name: t[:4096].contiguous() for name, t in before.items() if t.numel() >= 4096}
    one_round(warm, {name: after[name][:4096].contiguous() for name in warm}, numpy_only=False)  # compile
    for label, stages in (("numpy", numpy_stages(before, after)), ("compiled", jit_stages(before, after))):
        print(f"\n{label} path, by stage:")
        for stage, seconds in stages.items():
            print(f"  {stage:60s} {seconds:7.3f} s  {mb / seconds:9.0f} MB/s")
    rows: dict[str, list[dict]] = {"numpy": [], "compiled": []}
    for r in range(args.rounds):
        for label in ("numpy", "compiled"):
            rows[label].append(one_round(before, after, numpy_only=label == "numpy"))
            print(f"round {r + 1} {label}: " + " ".join(
                f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}" for k, v in rows[label][-1].items()), flush=True)
    if len({row["digest"] for label in rows for row in rows[label]}) != 1:
        raise SystemExit("the two paths wrote different payloads")
    changed = rows["numpy"][0]["changed"]
    print(f"\n{changed / elements:.2%} of bf16 elements changed; {rows['numpy'][0]['bytes'] / 1e6:.1f} MB per version "
          f"(the same from both paths); load {load_start} at start, {loadavg()} at end")
    print("| stage | numpy | compiled | ratio |\n|---|---|---|---|")
    for key in ("encode_s", "decode_s", "resolve_s", "apply_s", "verify_s"):
        a, b = (statistics.median(row[key] for row in rows[label]) for label in ("numpy", "compiled"))
        print(f"| {key[:-2]} | {a:.2f} s ({mb / a:.0f} MB/s) | {b:.2f} s ({mb / b:.0f} MB/s) | {a / b:.1f}x |")


if __name__ == "__main__":
    main()
