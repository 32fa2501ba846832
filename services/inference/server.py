"""Launches vLLM's OpenAI-compatible server as a subprocess and checks its health.

Invariants:
- The command line is ``services.inference.vllm_command.build_command``'s (GPU or CPU host,
  dev mode and worker extension, LoRA), built from the same options as every other launch.
- The server runs in its own process group (its engine-core child included) with stdout
  and stderr appended to one log file; ``stop()`` sends SIGTERM to the whole group, then
  SIGKILL after a grace period, so no process outlives the ``VllmServer``. If the process
  that started it dies first, even by SIGKILL, the same happens to the group
  (``shared.processes.start_group_leader``: the kernel's SIGTERM, then the process-group guard's).
- ``wait_ready()`` returns only once ``/health`` answers 200 and ``/v1/models`` lists the
  served name; it raises ``InferenceServerError`` carrying the log's tail if the process
  exits first or the timeout passes (and stops the process in both cases).
- ``check_inference()`` / ``health()`` never raise: they return
  ``{"ok": bool, "model": str | None, "detail": str}``.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
from tenacity import Retrying, retry_if_exception_type, stop_after_delay, wait_fixed

from services.inference.vllm_command import (  # noqa: F401 (callers import the launcher's names from here)
    InferenceServerError,
    build_command,
    has_nvidia_gpu,
    settings_options,
)
from shared.processes import release_group, start_group_leader
from shared.required import required

log = logging.getLogger(__name__)


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
        log_path: str | Path | None = None,
        startup_timeout: float = 300.0,
        **command_options: Any,
    ) -> None:
        """``command_options``: the rest of ``build_command``'s options (dtype, gpu, lora_rank, ...)."""
        self.served_model_name = served_model_name
        local = "127.0.0.1" if host in ("0.0.0.0", "::", "") else host  # where this process reaches it
        self.base_url = f"http://{local}:{port}"
        self.log_path = Path(log_path) if log_path else Path(tempfile.gettempdir()) / f"vllm-{port}.log"
        self.startup_timeout = startup_timeout
        self.argv, self.env_overrides = build_command(model_path, served_model_name, host=host, port=port, **command_options)
        self.process: subprocess.Popen[bytes] | None = None

    @classmethod
    def from_settings(cls, inference: Any, log_path: str | Path | None = None, lora_rank: int | None = None) -> VllmServer:
        """Build from ``shared.settings.InferenceSettings`` (listening on ``inference.host``; the
        model is ``inference.model_path``, a local directory or a Hugging Face model name);
        ``lora_rank``: serve adapters of that rank (``LoraSettings.served_rank``)."""
        return cls(**settings_options(inference, lora_rank), log_path=log_path, startup_timeout=inference.startup_timeout_s)

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
            code = required(self.process, "the vLLM server's process (start sets it)").poll()
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
