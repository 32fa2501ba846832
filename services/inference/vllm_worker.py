"""Conveyor's extension of vLLM's GPU/CPU worker, loaded with ``--worker-extension-cls``.

vLLM resolves ``POST /collective_rpc {"method": name}`` to a method of its worker; this
class adds Conveyor's own, so a weight sync needs no patch of vLLM.

``conveyor_reload_weights(weights_path)`` is vLLM's in-place ``reload_weights`` made right for
every layout the trainer can load. vLLM's layerwise reload processes a layer (for example,
repacks its weight for the CPU GEMM kernels) only when the checkpoint loads that layer. A
layer whose parameter is shared with another one (an output head tied to the input
embedding) is never loaded from the checkpoint, so the processed copy its kernel computes
with stays at the launch values while its parameter holds the new ones. That was the
silent "tied embeddings stop learning" bug.

The broadcast path (``inference.weight_sync: nccl``, ``services.weights.broadcast``):
``conveyor_join_weight_group`` makes each worker a rank of the trainer's process group
(``services.weights.process_group``), and ``conveyor_receive_weights(names, dtypes, shapes, buckets)``
receives the trainer's tensors, one flat broadcast per bucket (``services.weights.broadcast.bucket_layout``)
cut into the named tensors, in that order, straight into vLLM's in-place reload (the same
lifecycle as a reload from disk: ``reload_weights(weights_iterator=...)``).

Invariants:
- After ``conveyor_reload_weights`` or ``conveyor_receive_weights`` returns, every layer that
  owns a parameter shared with another layer has been processed again from the parameter's
  current values, so what a layer computes with is what its parameters hold. Whether the
  served model is the trainer's is checked from outside by the sync probe
  (``services.weights.probe``).
- ``conveyor_receive_weights`` takes part in exactly one broadcast per bucket, in the order
  given, whatever the model's loader does with its tensors (a tied head it skips is still
  received), so the trainer and every worker stay in step.
- At most one weight group per worker: joining again closes the previous one first.
- The delta path (``inference.weight_sync: delta``, ``services.weights.delta_sync``):
  ``conveyor_apply_delta(paths)`` applies decoded chain versions to the worker's shadow
  (``services.weights.delta_shadow``), checks every tensor's checksum there, and only then loads
  the shadow's tensors into vLLM; a mismatch raises before vLLM's weights are touched. Any other
  load (``conveyor_reload_weights``, ``conveyor_receive_weights``) drops the shadow first.
  ``conveyor_prepare_delta(paths, prebuild)``, called while the replica serves, reads the same step
  files and resolves them against the shadow (``DeltaShadow.resolve``) in a background thread; the
  apply of the same paths on the same shadow version takes that result (waiting for it), any
  other apply reads its files itself. A prepare changes nothing the worker serves.
- With ``prebuild`` and one delta on the held version, the prepare also stages it on the shadow
  (``DeltaShadow.stage``: applied and every tensor checked, the version not moved) and packs the
  new version's changed linear layers aside (``services.inference.packed_swap``); the apply then
  only swaps them in, copies the changed plain parameters and checks those, and commits the
  shadow. A prepare that is not applied (other paths, another prepare, a reload) rolls the
  shadow back. A checksum mismatch found while preparing makes the apply raise
  (``DeltaChecksumMismatch``) before anything served changes; a failure during the swap clears
  the shadow and raises, so the follower loads a full version. A model the swap cannot map
  (``SwapUnavailable``) is loaded through vLLM's reload, as without ``prebuild``.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import defaultdict
from typing import TYPE_CHECKING, NamedTuple

import torch

if TYPE_CHECKING:
    from services.weights.delta_shadow import DeltaShadow
    from services.weights.process_group import Backend, WeightProcessGroup

log = logging.getLogger(__name__)


def _modules_sharing_parameters(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """Every (name, module) that directly owns a parameter also owned by another module."""
    owners: dict[int, list[tuple[str, torch.nn.Module]]] = defaultdict(list)
    for name, module in model.named_modules():
        for param in module.parameters(recurse=False):
            owners[id(param)].append((name, module))
    shared: dict[str, torch.nn.Module] = {}
    for modules in owners.values():
        if len(modules) > 1:
            shared.update(modules)
    return sorted(shared.items())


def _resident_gb() -> float:
    """This process's resident memory (GB), from ``/proc/self/status``."""
    with open("/proc/self/status") as status:
        lines = status.read().splitlines()
    for line in lines:
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1e6
    return 0.0


class _Prepared(NamedTuple):
    """A ``conveyor_prepare_delta`` under way or done: for which step files, on which shadow."""

    paths: tuple[str, ...]
    base: tuple[str | None, int | None]  # the shadow's (chain, version) it resolves against
    thread: threading.Thread
    result: dict  # "steps", or "error"; and "prepare_s"


class ConveyorWorkerExtension:
    """Mixed into vLLM's worker class (``--worker-extension-cls``); methods run on every worker."""

    _conveyor_weight_group: WeightProcessGroup | None  # set while this worker is in the trainer's weight group
    _conveyor_shadow: DeltaShadow | None  # the delta path's tensors of the served version
    _conveyor_prepared: _Prepared | None
    _conveyor_layout: dict[tuple, bool] | None  # packed_swap.check_plan's orientations by layer kind

    def _conveyor_drop_shadow(self) -> None:
        self._conveyor_take_prepared(None)
        shadow = getattr(self, "_conveyor_shadow", None)
        if shadow is not None:
            shadow.clear()

    def conveyor_delta_version(self, checksums: bool = False) -> dict:
        """``{"chain", "version"}``: the chain and version the shadow holds (None: none), with
        ``checksums`` every shadow tensor's xxh3 by name."""
        shadow = getattr(self, "_conveyor_shadow", None)
        answer: dict = {"chain": None if shadow is None else shadow.chain,
                        "version": None if shadow is None else shadow.version}
        if checksums and shadow is not None:
            from services.weights.delta import tensor_checksum

            answer["checksums"] = {name: tensor_checksum(t) for name, t in shadow.tensors.items()}
        return answer

    def _conveyor_the_shadow(self) -> DeltaShadow:
        from services.weights.delta_shadow import DeltaShadow

        if getattr(self, "_conveyor_shadow", None) is None:
            self._conveyor_shadow = DeltaShadow()
        assert self._conveyor_shadow is not None
        return self._conveyor_shadow

    def conveyor_prepare_delta(self, paths: list[str], prebuild: bool = False) -> dict:
        """Start reading and resolving the step files ``paths`` against the shadow in a background
        thread (the replica keeps serving); with ``prebuild``, a single delta on the held version is
        also applied to the shadow, checked, and its changed layers packed for the swap
        (``services.inference.packed_swap``). ``conveyor_delta_prepared`` says when it is done."""
        from services.weights.delta_shadow import read_step

        self._conveyor_take_prepared(None)
        shadow = self._conveyor_the_shadow()
        result: dict = {}

        def work() -> None:
            t0 = time.perf_counter()
            try:
                result["steps"] = shadow.resolve([read_step(path) for path in paths])
                result["resolve_s"] = time.perf_counter() - t0
                if prebuild:
                    self._conveyor_prebuild(shadow, result)
            except Exception as exc:  # the apply reads the files itself and raises what is wrong
                result["error"] = repr(exc)
            result["prepare_s"] = time.perf_counter() - t0

        thread = threading.Thread(target=work, name="conveyor-delta-prepare", daemon=True)
        thread.start()
        self._conveyor_prepared = _Prepared(tuple(paths), (shadow.chain, shadow.version), thread, result)
        return {"started": True}

    def _conveyor_prebuild(self, shadow: DeltaShadow, result: dict) -> None:
        """Stage ``result["steps"]`` on the shadow and pack their layers into ``result["prebuilt"]``; a
        refusal (a checksum) is ``result["refused"]``, a model the swap cannot map
        ``result["prebuild_skipped"]``. Once staged, the resolved steps are dropped before the packing
        (the apply reads the files again if the packing fails): the packed copy does not sit beside
        them (1.4 GB at Qwen2.5-1.5B, lr 1e-6, fp32 master)."""
        from services.inference.packed_swap import SwapUnavailable, build, check_plan, swap_plan
        from services.weights.delta_shadow import DeltaChecksumMismatch

        steps = result["steps"]
        if len(steps) != 1 or steps[0]["kind"] == "full":
            result["prebuild_skipped"] = "not a single delta on the held version"
            return
        try:
            plan = swap_plan(self.model_runner.get_model(), shadow.tensors)  # type: ignore[attr-defined]  # vLLM's worker's
            if getattr(self, "_conveyor_layout", None) is None:
                self._conveyor_layout = {}  # the live model's orientations, once checked (check_plan)
            result.update(check_plan(plan, shadow.tensors, self._conveyor_layout))  # the shadow: the served version
        except SwapUnavailable as exc:
            log.warning("conveyor delta: the prebuilt swap cannot map this model (%s); vLLM's reload loads it", exc)
            result["prebuild_skipped"] = str(exc)
            return
        rss_before = _resident_gb()
        t0 = time.perf_counter()
        try:
            staged = shadow.stage(steps)
        except DeltaChecksumMismatch as exc:
            result["refused"] = str(exc)
            return
        result["steps"] = None  # staged: the resolved changes are not needed again
        del steps
        t1 = time.perf_counter()
        try:
            swap = build(plan, staged.work, staged.checksums, staged.changed)
        except BaseException as exc:
            shadow.rollback(staged)
            if not isinstance(exc, DeltaChecksumMismatch):
                raise
            result["refused"] = str(exc)
            return
        result["prebuilt"] = (staged, swap)
        result.update({f"stage_{k}": v for k, v in staged.timings.items()})
        result.update({"stage_s": t1 - t0, "build_s": swap.build_s, **swap.timings,
                       "build_rss_gb": _resident_gb() - rss_before})

    def conveyor_delta_prepared(self) -> dict:
        """``{"done"}``: whether the last ``conveyor_prepare_delta`` finished (True when there is none)."""
        prepared = getattr(self, "_conveyor_prepared", None)
        return {"done": prepared is None or not prepared.thread.is_alive()}

    def _conveyor_take_prepared(self, paths: list[str] | None) -> tuple[list | None, dict, tuple | None]:
        """The prepared steps for ``paths`` on the shadow as it is now (None: none), waiting for them,
        what preparing cost, and the prebuilt ``(staged, swap)`` (None: none); forgets any prepare, and
        rolls back a staged one it does not hand out."""
        prepared = getattr(self, "_conveyor_prepared", None)
        self._conveyor_prepared = None
        if prepared is None:
            return None, {}, None
        prepared.thread.join()
        result = prepared.result
        prebuilt = result.pop("prebuilt", None)
        shadow = getattr(self, "_conveyor_shadow", None)
        if (paths is None or prepared.paths != tuple(paths) or shadow is None
                or prepared.base != (shadow.chain, shadow.version)):
            if prebuilt is not None and shadow is not None:
                shadow.rollback(prebuilt[0])
            return None, {}, None
        timings = {k: v for k, v in result.items() if isinstance(v, float)}
        return result.get("steps"), {**timings, "prepare_error": result.get("error"),
                                     "prebuild_skipped": result.get("prebuild_skipped"),
                                     "refused": result.get("refused")}, prebuilt

    def conveyor_apply_delta(self, paths: list[str]) -> dict:
        """Apply the step files ``paths`` (oldest first): swap in the layers prebuilt for them, or
        apply them to the shadow, check it, and load it into vLLM."""
        from services.inference.packed_swap import drop_in_background
        from services.weights.delta_shadow import DeltaChecksumMismatch, read_step

        t0 = time.perf_counter()
        steps, prepared, prebuilt = self._conveyor_take_prepared(paths)
        prepared["prepared_wait_s"] = time.perf_counter() - t0
        if prepared.get("refused"):
            raise DeltaChecksumMismatch(f"refused while preparing: {prepared['refused']}")
        shadow = self._conveyor_the_shadow()
        if prebuilt is not None:
            staged, swap = prebuilt
            try:
                timings = swap.swap(staged.work)
            except BaseException:
                shadow.clear()  # vLLM may hold part of the new version: the shadow no longer says what it serves
                raise
            finally:
                retired = [swap.retired, staged.undo]
                swap.retired, staged.undo = [], []
                drop_in_background(retired)
            shadow.commit(staged)
            return {**timings, **prepared, "path": "prebuilt", "prepared": True, "version": shadow.version}
        timings = shadow.apply(steps if steps is not None else [read_step(path) for path in paths])
        t0 = time.perf_counter()
        try:
            self.reload_weights(weights_iterator=iter(list(shadow.tensors.items())))  # type: ignore[attr-defined]
            reprocessed = self._conveyor_reprocess_tied()
        except BaseException:
            shadow.clear()  # vLLM may hold part of the new version: the shadow no longer says what it serves
            raise
        return {**timings, **prepared, "path": "reload", "prepared": steps is not None,
                "load_s": time.perf_counter() - t0, "version": shadow.version, "reprocessed": reprocessed}

    def conveyor_reload_weights(self, weights_path: str) -> list[str]:
        """Reload ``weights_path`` in place, then reprocess layers with shared (tied) parameters.

        Returns the names of the reprocessed layers (``[]`` for an untied model).
        """
        self._conveyor_drop_shadow()
        self.reload_weights(weights_path=weights_path)  # type: ignore[attr-defined]  # vLLM's own reload (its worker's)
        return self._conveyor_reprocess_tied()

    def conveyor_join_weight_group(self, backend: Backend, host: str, port: int, rank_offset: int, world_size: int,
                                   timeout_s: float = 300.0) -> int:
        """Join the trainer's weight group as rank ``rank_offset + <this worker's rank>``; returns it."""
        from services.weights.process_group import WeightProcessGroup

        self.conveyor_leave_weight_group()
        rank = rank_offset + int(getattr(self, "rank", 0))
        device = self.device if backend == "nccl" else torch.device("cpu")  # type: ignore[attr-defined]  # vLLM's worker's
        self._conveyor_weight_group = WeightProcessGroup(backend, host, port, rank, world_size, device=device,
                                                  timeout_s=timeout_s)
        log.info("conveyor: joined the %s weight group at %s:%d as rank %d of %d", backend, host, port, rank,
                 world_size)
        return rank

    def conveyor_leave_weight_group(self) -> None:
        group = getattr(self, "_conveyor_weight_group", None)
        self._conveyor_weight_group = None
        if group is not None:
            group.close()

    def conveyor_receive_weights(self, names: list[str], dtypes: list[str], shapes: list[list[int]],
                                 buckets: list[list[int]] | None = None) -> list[str]:
        """Receive each named tensor from the trainer's broadcast into vLLM's in-place reload,
        then reprocess tied layers; returns the reprocessed layers' names. ``buckets``: the
        ``[start, end)`` runs of tensors sent as one flat broadcast each (one dtype per run);
        none: one broadcast per tensor."""
        group = getattr(self, "_conveyor_weight_group", None)
        if group is None:
            raise RuntimeError("conveyor_receive_weights before conveyor_join_weight_group: this worker is in no "
                               "weight group")
        if not len(names) == len(dtypes) == len(shapes):
            raise ValueError(f"{len(names)} names, {len(dtypes)} dtypes and {len(shapes)} shapes: they must match")

        runs = buckets if buckets is not None else [[i, i + 1] for i in range(len(names))]
        if [i for start, end in runs for i in range(start, end)] != list(range(len(names))) or any(
                len({dtypes[i] for i in range(start, end)}) != 1 for start, end in runs):
            raise ValueError(f"buckets {runs} do not cover the {len(names)} tensors in order, one dtype each")

        def received():
            for start, end in runs:
                sizes = [math.prod(shape) for shape in shapes[start:end]]
                flat = group.broadcast(torch.empty(sum(sizes), dtype=getattr(torch, dtypes[start]), device=group.device))
                for name, part, shape in zip(names[start:end], flat.split(sizes), shapes[start:end]):
                    yield name, part.view(shape)

        stream = received()
        self._conveyor_drop_shadow()
        try:
            self.reload_weights(weights_iterator=stream)  # type: ignore[attr-defined]  # vLLM's worker's
        finally:
            # tensors the loader did not take (or did not get to, when it failed) are still
            # received: the trainer's broadcast never waits on this worker until its timeout
            for _ in stream:
                pass
        return self._conveyor_reprocess_tied()

    def _conveyor_reprocess_tied(self) -> list[str]:
        from vllm.config import set_current_vllm_config

        model = self.model_runner.get_model()  # type: ignore[attr-defined]  # vLLM's worker's
        reprocessed = []
        with torch.no_grad(), set_current_vllm_config(self.vllm_config):  # type: ignore[attr-defined]  # vLLM's worker's
            for name, module in _modules_sharing_parameters(model):
                method = getattr(module, "quant_method", None)
                if method is None or not hasattr(method, "process_weights_after_loading"):
                    continue
                method.process_weights_after_loading(module)
                reprocessed.append(name)
        if reprocessed:
            log.info("conveyor reload: reprocessed tied layers %s", reprocessed)
        return reprocessed
