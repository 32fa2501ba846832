"""A replica brought to a version of the delta chain (``inference.weight_sync: delta``): download
and decode while it serves, pause only to apply.

    ask each replica which version its worker's shadow holds (``conveyor_delta_version``)
    -> plan (``delta_chain.ChainReader.plan``: from what it holds, or newest full + deltas)
    -> fetch each step's payload (checked against its manifest) and decode it to a step file
       (``delta_shadow.write_step``), all while the replica serves
    -> ask each replica's workers to read the step files and resolve them against their shadow
       (``conveyor_prepare_delta``: a ``grouped`` frame's positions need the old tensor), and,
       for one delta on the held version, apply them to the shadow, check it and pack the new
       version's linear layers (``services.inference.packed_swap``), still serving, and wait until
       they have (``conveyor_delta_prepared``)
    -> sync_weights: pause(keep) -> conveyor_apply_delta(step files: swap the packed layers in, or
       apply and reload) -> reset prefix cache
       -> [resume -> probe] -> label -> on_served -> resume

Invariants (besides ``sync_weights``'):
- A plan from the held version that cannot be fetched (a missing or corrupted object) or
  that the worker refuses (a checksum mismatch: the worker left its weights and shadow as they
  were) falls back, with an ERROR log, to a plan from the newest full version, its step files
  decoded again from the store (a refused plan's are removed first). If that fails
  too, the sync fails (``WeightSyncError``) and the version does not move: the replica goes on
  serving the version its label names.
- A replica whose worker's shadow already holds the target (its follower died after the apply,
  before the label: a shadow names a version only once it is checked and loaded, a failed load clears it) is
  not applied to again; it is labelled and probed like the others.
- A prepare only moves work out of the pause: one that fails or does not finish in time is
  logged, and the apply reads and resolves the step files itself.
- The probe is the one in the target version's manifest (the trainer's logprobs of it); the
  label and ``on_served`` come only after every replica applied and passed it.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import httpx

from services.weights import sync as ws
from services.weights.delta_chain import ChainBroken, ChainReader, ChainVersion
from services.weights.delta_shadow import write_step
from services.weights.probe import SyncProbe
from services.policy.probe import LogprobProbe

log = logging.getLogger(__name__)

APPLY_DELTA = "conveyor_apply_delta"
DELTA_VERSION = "conveyor_delta_version"
PREPARE_DELTA = "conveyor_prepare_delta"
DELTA_PREPARED = "conveyor_delta_prepared"
APPLY_TIMEOUT_S = 600.0
PREPARE_TIMEOUT_S = 300.0


def worker_calls(http: httpx.Client, url: str, method: str, kwargs: dict[str, Any], timeout_s: float) -> list[Any]:
    """Each worker's answer to ``method`` (a ``collective_rpc``)."""
    return list(ws.collective_rpc(http, url, method, kwargs, timeout_s).get("results", []))


def held_version(http: httpx.Client, url: str, chain: str) -> int | None:
    """The version of ``chain`` every worker of the replica holds in its shadow (None: none, another
    chain's, or they differ)."""
    held = {(r.get("chain"), r.get("version")) if isinstance(r, dict) else (None, None)
            for r in worker_calls(http, url, DELTA_VERSION, {}, 30.0)}
    if len(held) != 1:
        return None
    [(held_chain, version)] = held
    return int(version) if held_chain == chain and version is not None else None


def prepare_on_workers(http: httpx.Client, files: dict[str, list[Path]], timeout_s: float = PREPARE_TIMEOUT_S,
                       prebuild: bool = True) -> float:
    """Ask each replica (url: its step files) to prepare them while it serves (``prebuild``: and to
    pack the new version's layers for the swap), and wait until every one has or ``timeout_s``
    passed; returns the seconds waited (see the invariants)."""
    t0 = time.perf_counter()
    started = []
    for url, paths in files.items():
        try:
            worker_calls(http, url, PREPARE_DELTA, {"paths": [str(p) for p in paths], "prebuild": prebuild}, 30.0)
            started.append(url)
        except (ws.AdminCallError, httpx.HTTPError) as exc:
            log.warning("replica %s did not start preparing its delta step files (%s): the apply reads them itself",
                        url, exc)
    deadline = time.monotonic() + timeout_s
    for url in started:
        while True:
            try:
                if all(r.get("done") for r in worker_calls(http, url, DELTA_PREPARED, {}, 30.0)):
                    break
            except (ws.AdminCallError, httpx.HTTPError) as exc:
                log.warning("replica %s: cannot tell whether its delta prepare is done (%s)", url, exc)
                break
            if time.monotonic() > deadline:
                log.warning("replica %s is still preparing its delta step files after %.0fs: the apply waits for it",
                            url, timeout_s)
                break
            time.sleep(0.05)
    return time.perf_counter() - t0


@dataclass
class Prepared:
    """Step files for one plan, and what getting them cost."""

    steps: list[ChainVersion]
    files: list[Path]
    bytes: int = 0
    download_s: float = 0.0
    decode_s: float = 0.0
    notes: list[str] = field(default_factory=list)


class DeltaCatchUp:
    """Plans, fetches and decodes chain versions into ``work_dir`` (each version decoded once)."""

    def __init__(self, reader: ChainReader, work_dir: Path):
        self.reader, self.work_dir = reader, Path(work_dir)

    def step_file(self, version: int) -> Path:
        return self.work_dir / "steps" / f"{version:06d}.pt"

    def prepare(self, target: int, have: int | None) -> Prepared:
        """Step files from ``have`` to ``target``; from the newest full version when that plan is broken.
        Raises ``ChainBroken`` when no plan can be fetched."""
        try:
            return self._prepare(target, have)
        except ChainBroken as exc:
            if have is None:
                raise
            log.error("delta chain from version %d to %d is broken (%s); falling back to the newest full version",
                      have, target, exc)
            prepared = self._prepare(target, None)
            prepared.notes.append(f"fallback from {have}: {exc}")
            return prepared

    def _prepare(self, target: int, have: int | None) -> Prepared:
        steps = self.reader.plan(target, have)
        prepared = Prepared(steps, [])
        for step in steps:
            path = self.step_file(step.version)
            if not path.is_file():
                t0 = time.perf_counter()
                payload = self.reader.fetch(step)
                t1 = time.perf_counter()
                write_step(step, payload, path, self.reader.run_id)
                prepared.download_s += t1 - t0
                prepared.decode_s += time.perf_counter() - t1
                prepared.bytes += len(payload)
            prepared.files.append(path)
        return prepared

    def prune(self, keep_from: int) -> None:
        """Remove the step files of versions below ``keep_from``."""
        for path in (self.work_dir / "steps").glob("*.pt") if (self.work_dir / "steps").is_dir() else []:
            if path.stem.isdigit() and int(path.stem) < keep_from:
                path.unlink(missing_ok=True)


def sync_delta(urls: list[str], catch_up: DeltaCatchUp, version: int, *, http: httpx.Client,
               probe_model: str | None, probe_tolerance: float, on_served: Callable[[], None] | None = None,
               apply_timeout_s: float = APPLY_TIMEOUT_S, prebuild: bool = True) -> ws.SyncReport:
    """Serve chain version ``version`` on every replica; see the module invariants. ``prebuild``: the
    workers pack the new version's layers before the pause and only swap them in while paused
    (``services.inference.packed_swap``); otherwise they load through vLLM's in-memory reload."""
    t0 = time.perf_counter()
    held = {url: held_version(http, url, catch_up.reader.run_id) for url in urls}
    prepared: dict[int | None, Prepared] = {}
    try:
        for have in set(held.values()):
            prepared[have] = catch_up.prepare(version, have)
        # every replica already holds it: a follower killed after the apply, before the label
        target = next((p.steps[-1] for p in prepared.values() if p.steps), None) or catch_up.reader.manifest(version)
    except ChainBroken as exc:
        raise ws.WeightSyncError(f"weight sync to version {version}: the delta chain cannot be read ({exc}); the "
                                 "served version does not move", version, {u: str(exc) for u in urls},
                                 "download") from None
    probe = None
    if probe_model is not None and target.probe:
        probe = SyncProbe(LogprobProbe.from_json(target.probe.encode()), probe_model, probe_tolerance)
    worker: dict[str, Any] = {}

    def apply_one(url: str) -> None:
        plan = prepared[held[url]]
        if not plan.files:
            log.warning("replica %s already holds delta-chain version %d (its last sync died after the apply): "
                        "labelled and probed without applying it again", url, version)
            worker[url] = [{"version": version, "held": True}]
            ws.reset_prefix_cache(http, url)
            return
        try:
            worker[url] = worker_calls(http, url, APPLY_DELTA, {"paths": [str(p) for p in plan.files]}, apply_timeout_s)
        except ws.AdminCallError as exc:
            if plan.steps[0].kind == "full":
                raise
            log.error("replica %s refused delta version %d (%s); falling back to the newest full version", url,
                      version, exc.detail[:300])
            for refused in plan.files:  # decoded again from the store, not trusted as they are
                refused.unlink(missing_ok=True)
            full = catch_up.prepare(version, None)
            full.notes.append(f"fallback on {url}: {exc.detail[:300]}")
            prepared[None] = full
            worker[url] = worker_calls(http, url, APPLY_DELTA, {"paths": [str(p) for p in full.files]}, apply_timeout_s)
        ws.reset_prefix_cache(http, url)

    fetched = time.perf_counter() - t0
    worker_prepare_s = prepare_on_workers(http, {u: prepared[held[u]].files for u in urls if prepared[held[u]].files},
                                          prebuild=prebuild)
    report = ws.sync_weights(urls, None, version, load_all=lambda _http, targets: ws.on_all(targets, apply_one),
                             source=f"delta chain version {version}", probe=probe, on_served=on_served, client=http)
    extra = report.extra
    extra["prepare_s"] = fetched
    extra["worker_prepare_s"] = worker_prepare_s
    extra["download_s"] = sum(p.download_s for p in prepared.values())
    extra["decode_s"] = sum(p.decode_s for p in prepared.values())
    extra["download_bytes"] = sum(p.bytes for p in prepared.values())
    extra["plans"] = {str(have): [s.version for s in p.steps] for have, p in prepared.items()}
    extra["fallbacks"] = [note for p in prepared.values() for note in p.notes]
    extra["worker"] = worker
    catch_up.prune(keep_from=version)
    return report
