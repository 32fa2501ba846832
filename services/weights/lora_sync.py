"""Weight sync by LoRA adapter (``trainer.lora.sync: adapter``): each version is a new adapter
that every replica loads beside the ones it serves, through vLLM's runtime LoRA API.

One sync, for all replicas together (each phase on every replica, in parallel):

    load_lora_adapter(<served>-v<version>, adapter_dir) -> [probe through it]
        -> update_weight_version -> [on_served()] -> unload the adapters before ``keep_from``

Invariants:
- Replicas are launched with LoRA on (``server.build_command(lora_rank=...)``: ``--enable-lora``,
  ``--max-lora-rank`` at least the adapter's rank, ``VLLM_ALLOW_RUNTIME_LORA_UPDATING``).
- Version ``v`` is served under ``shared.names.lora_adapter_name(served, v)``; version 0 is
  the base model under its own name. The base and the adapters already loaded are not
  touched: nothing is paused, and a request naming an earlier version keeps being answered by
  that version's adapter until it is unloaded.
- The discipline of the full-weights sync (``weight_sync``) holds: with a ``probe``, every
  replica must reproduce the trainer's logprobs *through the new adapter* before any label is
  set or ``on_served`` runs. A failed load, probe or label raises ``WeightSyncError`` and the
  served version does not move; after a failed load or probe the new adapter is unloaded
  again wherever it was loaded, so no replica serves an adapter that did not pass.
- The replica's weight label (``/weight_info``) is ``str(version)``, as in the full-weights sync.
- After ``on_served``, this run's adapters of versions below ``keep_from`` are unloaded (turns
  started under the previous version may still be running, so the caller keeps it); a failed
  unload is logged and never fails the sync.
- A load is idempotent (``load_inplace``): a version's adapter never changes, so syncing a
  replica that holds it already (a lagging replica re-synced) is harmless.
- ``adapter_dir`` is read by the replica, not by this process: a path the replica sees. It
  must stay there while the adapter is loaded (vLLM may evict it from its cache and read it
  again).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from pathlib import Path

import httpx

from services.weights.admin_http import admin_client, admin_request
from services.weights.probe import ProbeMismatch, SyncProbe, verify_replica
from services.weights.admin_calls import set_weight_version
from services.weights.replica_set import SyncReport, WeightSyncError, describe_failures, failure_listing, on_all
from shared.names import CHECKPOINT_ADAPTER_CONFIG, lora_adapter_name, lora_adapter_version

log = logging.getLogger(__name__)

LOAD_TIMEOUT_S = 120.0


def load_adapter(client: httpx.Client, base_url: str, name: str, path: Path) -> None:
    """``POST /v1/load_lora_adapter`` (in place: loading a name again replaces it)."""
    admin_request(client, "POST", base_url, "/v1/load_lora_adapter", call="load_lora_adapter", retry_5xx=False,
                  json={"lora_name": name, "lora_path": str(path), "load_inplace": True},
                  timeout=httpx.Timeout(LOAD_TIMEOUT_S, connect=5.0))


def unload_adapter(client: httpx.Client, base_url: str, name: str) -> None:
    admin_request(client, "POST", base_url, "/v1/unload_lora_adapter", call="unload_lora_adapter", retry_5xx=True,
                  json={"lora_name": name})


def loaded_versions(client: httpx.Client, base_url: str, served_model: str) -> list[int]:
    """The versions whose adapters of ``served_model`` the replica lists in ``/v1/models``."""
    r = admin_request(client, "GET", base_url, "/v1/models", call="models", retry_5xx=True)
    versions = (lora_adapter_version(served_model, m["id"]) for m in r.json().get("data", [])
                if m.get("parent") == served_model)
    return sorted(v for v in versions if v is not None)


def sync_adapter(
    base_urls: list[str],
    adapter_dir: Path,
    version: int,
    served_model: str,
    *,
    keep_from: int,
    on_served: Callable[[], None] | None = None,
    client: httpx.Client | None = None,
    probe: SyncProbe | None = None,
) -> SyncReport:
    """Serve the adapter in ``adapter_dir`` as ``version`` on every replica; see the module invariants."""
    urls = [u.rstrip("/") for u in base_urls]
    adapter_dir = Path(adapter_dir).resolve()
    if not (adapter_dir / CHECKPOINT_ADAPTER_CONFIG).is_file():
        raise FileNotFoundError(f"{adapter_dir} holds no LoRA adapter ({CHECKPOINT_ADAPTER_CONFIG})")
    name = lora_adapter_name(served_model, version)
    http = admin_client() if client is None else client
    t0 = time.perf_counter()
    extra: dict[str, float] = {}
    try:
        t = time.perf_counter()
        failed = on_all(urls, lambda url: load_adapter(http, url, name, adapter_dir))
        load_s = time.perf_counter() - t
        if failed:
            _unload_everywhere(http, urls, name)
            raise WeightSyncError(f"adapter sync to version {version}: loading {adapter_dir} as {name} failed on "
                                  + failure_listing(failed) + ". The served version does not move.",
                                  version, describe_failures(failed), "reload")
        if probe is not None:
            t = time.perf_counter()
            _verify(http, urls, dataclasses.replace(probe, model=name), version, name, extra)
            extra["probe_s"] = time.perf_counter() - t
        t = time.perf_counter()
        failed = on_all(urls, lambda url: set_weight_version(http, url, str(version)))
        version_s = time.perf_counter() - t
        if failed:
            raise WeightSyncError(f"adapter sync to version {version}: {name} loaded everywhere, but setting the "
                                  "version label failed on " + failure_listing(failed), version, describe_failures(failed), "label")
        if on_served is not None:
            on_served()
        _unload_before(http, urls, served_model, keep_from)
    finally:
        if client is None:
            http.close()
    report = SyncReport(version=version, replicas=tuple(urls), pause_s=0.0, reload_s=load_s, version_s=version_s,
                        resume_s=0.0, total_s=time.perf_counter() - t0, extra=extra)
    log.info("adapter sync to version %d (%s) on %d replica(s): %.3fs (load %.3f)%s", version, name, len(urls),
             report.total_s, load_s,
             f"; probe max |dlogprob| {extra['probe_max_abs_diff']:.2g}" if "probe_max_abs_diff" in extra else "")
    return report


def _verify(http: httpx.Client, urls: list[str], probe: SyncProbe, version: int, name: str,
            extra: dict[str, float]) -> None:
    results = {}

    def verify(url: str) -> None:
        results[url] = verify_replica(http, url, probe)

    failed = on_all(urls, verify)
    diffs = [r.max_abs_diff for r in results.values()] + [
        exc.result.max_abs_diff for exc in failed.values() if isinstance(exc, ProbeMismatch)]
    if diffs:
        extra["probe_max_abs_diff"] = max(diffs)
    if failed:
        _unload_everywhere(http, urls, name)
        raise WeightSyncError(f"adapter sync to version {version} did not take: {failure_listing(failed)}. The served "
                              f"version does not move; {name} was unloaded again.", version, describe_failures(failed), "probe")


def _unload_everywhere(http: httpx.Client, urls: list[str], name: str) -> None:
    failed = on_all(urls, lambda url: unload_adapter(http, url, name))
    for url, exc in failed.items():  # a replica where the load never took has nothing to unload
        log.info("unloading %s from %s: %s", name, url, exc)


def _unload_before(http: httpx.Client, urls: list[str], served_model: str, keep_from: int) -> None:
    def unload_old(url: str) -> None:
        for old in loaded_versions(http, url, served_model):
            if old < keep_from:
                unload_adapter(http, url, lora_adapter_name(served_model, old))

    for url, exc in on_all(urls, unload_old).items():
        log.warning("unloading old adapters from %s failed (they stay loaded): %s", url, exc)
