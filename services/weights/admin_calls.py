"""The admin calls of one weight sync, one per replica and step, each over ``admin_http``'s
bounded retries: pause, resume, is_paused, the reload, the prefix-cache reset and the weight label.

Invariants:
- Transport errors and 502/503/504 are retried; other 5xx answers are retried only for the
  idempotent control calls (pause, resume, label, reads), never for a reload that the server
  rejected.
- The reload is the worker extension's ``conveyor_reload_weights`` (vLLM's reload, then the
  re-processing of tied layers: ``services.inference.vllm_worker``). A replica launched without
  the extension falls back to vLLM's plain ``reload_weights``, with one warning per replica;
  one launched without Conveyor's admin routes is paused through vLLM's ``/pause``, likewise.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import httpx

from services.inference.vllm_admin import PAUSE_PATH as KEEP_PAUSE_ROUTE  # the route vLLM answers with our middleware
from services.weights.admin_http import AdminCallError, admin_request

log = logging.getLogger(__name__)

RELOAD_TIMEOUT_S = 600.0  # a real model's safetensors can take minutes to read
# Conveyor's worker extension (services.inference.vllm_worker); vLLM's own method otherwise
EXTENSION_RELOAD = "conveyor_reload_weights"
PLAIN_RELOAD = "reload_weights"
_WITHOUT_EXTENSION: set[str] = set()  # replicas seen to lack the extension: warned once, then plain reloads
_WITHOUT_ADMIN_ROUTES: set[str] = set()  # replicas seen to lack Conveyor's admin routes: vLLM's /pause


def pause(client: httpx.Client, base_url: str, mode: str = "keep") -> None:
    """``POST /pause?mode=keep``: stop scheduling; in-flight requests are frozen, not aborted.
    A keep-mode pause goes to Conveyor's own route (``services.inference.vllm_admin``: the same
    pause without vLLM's 20 ms sleep); a replica launched without it gets vLLM's, warned once."""
    if mode == "keep" and base_url not in _WITHOUT_ADMIN_ROUTES:
        try:
            admin_request(client, "POST", base_url, KEEP_PAUSE_ROUTE, call="pause", retry_5xx=True)
            return
        except AdminCallError as exc:
            if exc.status != 404:
                raise
        log.warning("%s was launched without Conveyor's admin routes (--middleware "
                    "services.inference.vllm_admin.ConveyorAdminRoutes): pausing through vLLM's /pause", base_url)
        _WITHOUT_ADMIN_ROUTES.add(base_url)
    admin_request(client, "POST", base_url, "/pause", call="pause", retry_5xx=True, params={"mode": mode})


def resume(client: httpx.Client, base_url: str) -> None:
    """``POST /resume`` (a no-op on a replica that is not paused)."""
    admin_request(client, "POST", base_url, "/resume", call="resume", retry_5xx=True)


def is_paused(client: httpx.Client, base_url: str) -> bool:
    """``GET /is_paused`` -> ``{"is_paused": bool}``."""
    r = admin_request(client, "GET", base_url, "/is_paused", call="is_paused", retry_5xx=True)
    return bool(r.json()["is_paused"])


def reload_weights(client: httpx.Client, base_url: str, weights_path: str | Path,
                   timeout_s: float = RELOAD_TIMEOUT_S, method: str = EXTENSION_RELOAD) -> None:
    """``POST /collective_rpc`` ``<method>(weights_path=...)``: load a checkpoint dir in place.

    ``conveyor_reload_weights`` (the worker extension) is vLLM's reload plus the re-processing
    of tied layers; a replica launched without the extension gets vLLM's plain
    ``reload_weights`` (the sync probe then tells whether that was enough).
    """
    if method == EXTENSION_RELOAD and base_url in _WITHOUT_EXTENSION:
        method = PLAIN_RELOAD
    body = {"method": method, "kwargs": {"weights_path": str(weights_path)}, "timeout": timeout_s}
    try:
        admin_request(client, "POST", base_url, "/collective_rpc", call=method, retry_5xx=False,
                      json=body, timeout=httpx.Timeout(timeout_s + 10.0, connect=5.0))
    except AdminCallError as exc:
        if method != EXTENSION_RELOAD or not _lacks_extension(exc):
            raise
        log.warning("%s was launched without Conveyor's worker extension (--worker-extension-cls "
                    "services.inference.vllm_worker.ConveyorWorkerExtension): using vLLM's plain reload_weights, "
                    "which leaves tied output heads stale on some backends", base_url)
        _WITHOUT_EXTENSION.add(base_url)
        reload_weights(client, base_url, weights_path, timeout_s, method=PLAIN_RELOAD)


def collective_rpc(client: httpx.Client, base_url: str, method: str, kwargs: dict[str, Any], timeout_s: float) -> Any:
    """``POST /collective_rpc`` ``<method>(**kwargs)`` on every worker of the replica, never retried
    on a 5xx (the method may have acted); vLLM's answer, ``{"results": [one per worker]}``."""
    body = {"method": method, "kwargs": kwargs, "timeout": timeout_s}
    r = admin_request(client, "POST", base_url, "/collective_rpc", call=method, retry_5xx=False, json=body,
                      timeout=httpx.Timeout(timeout_s + 10.0, connect=5.0))
    return r.json()


def _lacks_extension(exc: AdminCallError) -> bool:
    return exc.status is not None and EXTENSION_RELOAD in exc.detail and (
        "attribute" in exc.detail or "not found" in exc.detail.lower() or "not implemented" in exc.detail.lower())


def reset_prefix_cache(client: httpx.Client, base_url: str) -> None:
    """``POST /reset_prefix_cache?reset_running_requests=true``: drop KV computed by old weights."""
    r = admin_request(client, "POST", base_url, "/reset_prefix_cache", call="reset_prefix_cache", retry_5xx=True,
                 params={"reset_running_requests": "true"})
    if not r.json().get("success", False):
        raise AdminCallError(base_url, "reset_prefix_cache", f"answered {r.text[:200]}")


def set_weight_version(client: httpx.Client, base_url: str, version: str) -> None:
    """``POST /update_weight_version`` with ``{"new_version": "<str>"}`` (a JSON int is a 400)."""
    admin_request(client, "POST", base_url, "/update_weight_version", call="update_weight_version", retry_5xx=True,
             json={"new_version": str(version)})


def weight_version(client: httpx.Client, base_url: str, timeout_s: float | None = None) -> str:
    """``GET /weight_info`` -> ``{"weight_version": str}`` ("default" until first labelled)."""
    extra: dict[str, Any] = {} if timeout_s is None else {"timeout": httpx.Timeout(timeout_s, connect=min(timeout_s, 5.0))}
    r = admin_request(client, "GET", base_url, "/weight_info", call="weight_info", retry_5xx=True, **extra)
    return str(r.json()["weight_version"])
