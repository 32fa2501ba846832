"""The replicas of one weight sync and its phases (``ReplicaSet``), for ``sync_weights``
(``services.weights.sync``, whose invariants these phases serve).

Invariants:
- A phase runs on every replica in parallel (``on_all``) and returns only once each is done;
  a phase that failed anywhere raises ``WeightSyncError`` naming the phase and, for each
  failed replica, why.
- Every replica a pause was sent to is recorded (``sent_pause``) before the call, so
  ``resume_all`` resumes it even when the pause timed out; a resume failure never hides the
  error already on its way out (it becomes a note on it).
- A failed load or probe reloads every replica from ``restore_dir`` when one is given, and
  the error says whether that worked; without one it names the replicas to restart.
- The probe resumes every replica first (it is a real request); a mismatch pauses them again
  before the restore. A passed probe leaves nothing to resume: ``resume_all`` then calls no
  replica.
- The seconds of each phase and the probe's largest difference are kept for the report
  (``SyncReport``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

from services.weights.admin_calls import (EXTENSION_RELOAD, RELOAD_TIMEOUT_S, pause, reload_weights,
                                          reset_prefix_cache, resume, set_weight_version)
from services.weights.admin_http import AdminCallError
from services.weights.probe import ProbeMismatch, SyncProbe, verify_replica

log = logging.getLogger(__name__)


class WeightSyncError(RuntimeError):
    """A sync did not complete; ``failed`` maps each failing replica to why, and ``phase``
    names the step that failed (pause, reload, probe, label, on_served, resume)."""

    def __init__(self, message: str, version: int, failed: dict[str, str], phase: str = "sync"):
        super().__init__(message)
        self.version, self.failed, self.phase = version, failed, phase


@dataclass(frozen=True)
class SyncReport:
    """Seconds per phase (each phase covers all replicas in parallel) and in total."""

    version: int
    replicas: tuple[str, ...]
    pause_s: float
    reload_s: float
    version_s: float
    resume_s: float
    total_s: float
    extra: dict[str, Any] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def on_all(urls: Iterable[str], fn: Callable[[str], None]) -> dict[str, BaseException]:
    """Run ``fn(url)`` for every replica in parallel; return the failures by replica."""
    urls = list(urls)
    if len(urls) == 1:
        try:
            fn(urls[0])
        except Exception as exc:  # noqa: BLE001 - returned, reported by replica
            return {urls[0]: exc}
        return {}
    with ThreadPoolExecutor(max_workers=len(urls), thread_name_prefix="weight-sync") as pool:
        futures = {url: pool.submit(fn, url) for url in urls}
    return {url: failure for url, f in futures.items() if (failure := f.exception()) is not None}


def _why(exc: BaseException) -> str:
    if isinstance(exc, AdminCallError):
        return f"{exc.call}: {exc.detail}"
    return f"{type(exc).__name__}: {exc}"


def describe_failures(failures: dict[str, BaseException]) -> dict[str, str]:
    return {url: _why(exc) for url, exc in failures.items()}


def failure_listing(failures: dict[str, BaseException]) -> str:
    return "; ".join(f"{url} ({_why(exc)})" for url, exc in failures.items())


class ReplicaSet:
    """The replicas of one sync and what it did to them so far: the phases (``pause``, ``load``,
    ``probe``, ``label``, ``served``, then ``resume_all`` in a ``finally``) each run on every
    replica in parallel and raise ``WeightSyncError`` naming that phase. Records which replicas
    were sent a pause (each gets a resume), seconds per phase, and the probe's numbers."""

    def __init__(self, urls: list[str], version: int, http: httpx.Client, *, restore_dir: Path | None = None,
                 reload_timeout_s: float = RELOAD_TIMEOUT_S):
        self.urls, self.version, self.http = urls, version, http
        self.restore_dir, self.reload_timeout_s = restore_dir, reload_timeout_s
        self.sent_pause: list[str] = []
        self.timings = {"pause_s": 0.0, "reload_s": 0.0, "version_s": 0.0, "resume_s": 0.0}
        self.extra: dict[str, Any] = {}

    @contextmanager
    def _timed(self, seconds: dict[str, Any], key: str) -> Iterator[None]:
        started = time.perf_counter()
        try:
            yield
        finally:
            seconds[key] = time.perf_counter() - started

    def _error(self, what: str, failed: dict[str, BaseException], phase: str) -> WeightSyncError:
        return WeightSyncError(f"weight sync to version {self.version}: {what} " + failure_listing(failed),
                               self.version, describe_failures(failed), phase)

    def _pause_one(self, url: str) -> None:
        self.sent_pause.append(url)  # list.append is atomic; a sent pause may act even if it times out
        pause(self.http, url)

    def pause(self) -> None:
        with self._timed(self.timings, "pause_s"):
            failed = on_all(self.urls, self._pause_one)
        if failed:
            raise self._error("pause failed on", failed, "pause")

    def load(self, load_all: Callable[[httpx.Client, list[str]], dict[str, BaseException]], source: str) -> None:
        """Load the new weights into every paused replica; on failure restore ``restore_dir``
        everywhere (when given) and raise."""
        with self._timed(self.timings, "reload_s"):
            failed = load_all(self.http, self.urls)
        if failed:
            raise _reload_failure(self.http, self.urls, failed, self.version, source, self.restore_dir,
                                  self.reload_timeout_s)

    def probe(self, probe: SyncProbe) -> None:
        with self._timed(self.extra, "probe_s"):
            _verify_served(self.http, self.urls, probe, self.version, self.restore_dir, self.reload_timeout_s,
                           self._pause_one, self.extra)
        self.sent_pause.clear()  # passed: every replica was resumed for it and none paused since

    def label(self, label: str) -> None:
        with self._timed(self.timings, "version_s"):
            failed = on_all(self.urls, lambda url: set_weight_version(self.http, url, label))
        if failed:
            raise self._error("weights reloaded everywhere, but setting the version label failed on", failed, "label")

    def served(self, on_served: Callable[[], None]) -> None:
        with self._timed(self.extra, "on_served_s"):
            on_served()

    def resume_all(self, error: BaseException | None) -> None:
        """Resume every replica a pause was sent to. A resume failure becomes a note on
        ``error`` (the error already on its way out wins) or, with none, the error."""
        with self._timed(self.timings, "resume_s"):
            failed = on_all(list(self.sent_pause), lambda url: resume(self.http, url)) if self.sent_pause else {}
        if not failed:
            return
        msg = f"weight sync to version {self.version}: resume failed on {failure_listing(failed)}; they stay paused"
        log.error(msg)
        if error is not None:
            error.add_note(msg)
        else:
            raise WeightSyncError(msg, self.version, describe_failures(failed), "resume")

    def report(self, total_s: float) -> SyncReport:
        return SyncReport(version=self.version, replicas=tuple(self.urls), total_s=total_s, extra=self.extra,
                          **self.timings)


def reload_from(weights_dir: Path, reload_timeout_s: float = RELOAD_TIMEOUT_S, method: str = EXTENSION_RELOAD,
                ) -> Callable[[httpx.Client, list[str]], dict[str, BaseException]]:
    """The default load phase: every replica reloads ``weights_dir`` and resets its prefix cache."""
    return lambda http, urls: on_all(urls, lambda url: _reload_and_reset(http, url, weights_dir, reload_timeout_s,
                                                                         method))


def _verify_served(http: httpx.Client, urls: list[str], probe: SyncProbe, version: int, restore_dir: Path | None,
                   reload_timeout_s: float, pause_one: Callable[[str], None], extra: dict[str, Any]) -> None:
    """Resume every replica (the probe is a real request) and check it serves the trainer's
    logprobs; on any mismatch, put every replica back on ``restore_dir`` and raise."""
    failed = on_all(urls, lambda url: resume(http, url))
    if failed:
        raise WeightSyncError(f"weight sync to version {version}: resume before the probe failed on "
                              + failure_listing(failed), version, describe_failures(failed), "resume")
    results = {}

    def verify(url: str) -> None:
        results[url] = verify_replica(http, url, probe)

    failed = on_all(urls, verify)
    if results:
        extra["probe_max_abs_diff"] = max(r.max_abs_diff for r in results.values())
    if not failed:
        return
    mismatches = [exc for exc in failed.values() if isinstance(exc, ProbeMismatch)]
    if mismatches:
        extra["probe_max_abs_diff"] = max(exc.result.max_abs_diff for exc in mismatches)
    message = (f"weight sync to version {version} did not take: {failure_listing(failed)}. The served version does not "
               "move. A layer that the reload did not update (a tied output head, a renamed or missing tensor) "
               "shows this way.")
    if restore_dir is not None:
        on_all(urls, pause_one)
        restore_failed = on_all(urls, lambda url: _reload_and_reset(http, url, restore_dir, reload_timeout_s))
        message += (f" Restoring {restore_dir} failed on {failure_listing(restore_failed)}: restart those replicas."
                    if restore_failed else f" Every replica was reloaded from {restore_dir}.")
    raise WeightSyncError(message, version, describe_failures(failed), "probe")


def _reload_and_reset(http: httpx.Client, url: str, weights_dir: Path, reload_timeout_s: float,
                      method: str = EXTENSION_RELOAD) -> None:
    reload_weights(http, url, weights_dir, reload_timeout_s, method)
    reset_prefix_cache(http, url)


def _reload_failure(http: httpx.Client, urls: list[str], failed: dict[str, BaseException], version: int,
                    source: str, restore_dir: Path | None, reload_timeout_s: float) -> WeightSyncError:
    """Build the error for failed reloads, after reloading every replica from ``restore_dir`` if given."""
    message = f"weight sync to version {version}: reload of {source} failed on {failure_listing(failed)}."
    if restore_dir is None:
        message += (" vLLM leaves a replica whose reload failed half-loaded: restart "
                    + ", ".join(failed) + " (no restore_dir was given).")
        reloaded = [u for u in urls if u not in failed]
        if reloaded:
            message += f" {', '.join(reloaded)} hold the new weights under their old version label."
    else:
        restore_failed = on_all(urls, lambda url: _reload_and_reset(http, url, restore_dir, reload_timeout_s))
        if restore_failed:
            message += f" Restoring {restore_dir} failed on {failure_listing(restore_failed)}: restart those replicas."
        else:
            message += f" Every replica was reloaded from {restore_dir} and serves it again under its old label."
    return WeightSyncError(message, version, describe_failures(failed), "reload")
