"""What a replica's worker keeps for ``inference.weight_sync: delta``: the served-dtype tensors of
the version it serves, by checkpoint name (the shadow), to apply the next delta to.

vLLM's own parameters are not the checkpoint's tensors (q, k and v fused into one, weights
repacked for the CPU kernels), so a delta is applied to the shadow, the shadow is checked
tensor by tensor against the trainer's checksums, and only then are the shadow's tensors loaded
into vLLM (``services.inference.vllm_worker``'s ``conveyor_apply_delta``).

A step file (``write_step``, by the follower, while the replica serves) is one chain version
decoded: ``torch.save`` of ``{"chain", "version", "base", "kind", "tensors": [{"name", "op",
"bits", "index", "dtype", "shape", "checksum"}]}``; ``chain`` names the chain (its run).

Invariants:
- ``DeltaShadow.apply`` either moves the shadow to the last step's version with every tensor's
  checksum equal to that step's manifest, or raises and leaves the shadow as it was (a delta's
  changes are undone; a full version is built aside). A checksum mismatch raises
  ``DeltaChecksumMismatch`` naming the tensors.
- A plan that starts with a delta applies only to a shadow of the same chain at that delta's
  base; one that starts with a full version applies to any shadow.
- ``stage`` is ``apply`` without moving ``version``: the tensors hold the new version, checked,
  until ``commit`` (then ``version`` moves) or ``rollback`` (a delta's changes undone); nothing
  else may change the shadow in between.
- ``resolve`` changes nothing: it returns a plan of one delta on the held version with its
  ``ranked`` changes (``grouped`` frames) resolved against the shadow into ``set`` ones, so
  the worker can do that before the pause; ``apply`` resolves any left while it applies.
- A worker whose weights were loaded another way (a reload from disk, a broadcast) holds no
  shadow (``clear``): its next delta sync starts from a full version.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from services.weights.delta import (
    Change,
    DeltaError,
    apply_change,
    decode_frame,
    frame_of,
    resolve_change,
    tensor_checksum,
    undo_change,
)
from services.weights.delta_chain import ChainVersion


class DeltaChecksumMismatch(DeltaError):
    """The tensors a delta produced are not the trainer's (by their checksums)."""


def write_step(step: ChainVersion, payload: bytes, dest: Path, chain: str) -> Path:
    """Decode every frame of ``step`` and save the step file at ``dest`` (written whole, then renamed)."""
    tensors = []
    for entry in step.tensors:
        change = decode_frame(entry, frame_of(entry, payload))
        tensors.append({"name": entry.name, "op": change.op, "bits": change.bits,
                        "index": change.index if change.index is not None else torch.empty(0, dtype=torch.int64),
                        "dtype": entry.dtype, "shape": list(entry.shape), "checksum": entry.checksum})
    dest.parent.mkdir(parents=True, exist_ok=True)
    partial = dest.with_name(dest.name + ".partial")
    torch.save({"chain": chain, "version": step.version, "base": -1 if step.base is None else step.base, "kind": step.kind,
                "tensors": tensors}, partial)
    partial.rename(dest)
    return dest


def read_step(path: str | Path) -> dict[str, Any]:
    return torch.load(path, map_location="cpu", weights_only=True)


@dataclass
class Staged:
    """A version applied to the shadow's tensors (``work``) and checked, not yet committed."""

    work: dict[str, torch.Tensor]
    undo: list[tuple[str, Change]]  # what the writes into the shadow's own tensors overwrote
    version: int
    chain: str
    checksums: dict[str, str]  # the trainer's, by name
    changed: set[str]  # the tensors with any element written
    timings: dict[str, float]


class DeltaShadow:
    """The served version's tensors by checkpoint name, that version (None: none held) and its chain."""

    def __init__(self) -> None:
        self.tensors: dict[str, torch.Tensor] = {}
        self.version: int | None = None
        self.chain: str | None = None

    def clear(self) -> None:
        self.tensors, self.version, self.chain = {}, None, None

    def resolve(self, steps: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """``steps`` with their ``ranked`` changes resolved against the shadow when they are one delta
        on the version it holds; otherwise as they are (see the invariants)."""
        if len(steps) != 1 or steps[0]["kind"] == "full" or (steps[0]["base"], steps[0]["chain"]) != (
                self.version, self.chain):
            return steps
        tensors = []
        for t in steps[0]["tensors"]:
            if t["op"] == "ranked" and t["name"] in self.tensors:
                change = resolve_change(self.tensors[t["name"]], Change("ranked", t["bits"], t["index"]))
                t = {**t, "op": change.op, "bits": change.bits, "index": change.index}
            tensors.append(t)
        return [{**steps[0], "tensors": tensors}]

    def apply(self, steps: list[dict[str, Any]]) -> dict[str, float]:
        """Apply decoded steps (oldest first); see the invariants. Returns seconds and counts."""
        staged = self.stage(steps)
        self.commit(staged)
        return staged.timings

    def stage(self, steps: list[dict[str, Any]]) -> Staged:
        """Apply decoded steps (oldest first) and check every tensor, without moving ``version``: the
        shadow's tensors are the new version's until ``commit`` or ``rollback`` (a delta's changes
        are written in place; a full version is built aside). Raises as ``apply`` does, leaving the
        shadow as it was."""
        if not steps:
            raise DeltaError("no steps to apply")
        first = steps[0]
        if first["kind"] != "full" and (first["base"], first["chain"]) != (self.version, self.chain):
            raise DeltaError(f"version {first['version']} of chain {first['chain']} is a delta on {first['base']}, "
                             f"but this worker holds version {self.version} of chain {self.chain}")
        if any(s["kind"] == "full" for s in steps[1:]):
            raise DeltaError("a full version only starts a plan")
        t0 = time.perf_counter()
        work = {} if first["kind"] == "full" else self.tensors
        undo: list[tuple[str, Change]] = []
        changed = 0
        touched: set[str] = set()
        try:
            for step in steps:
                for t in step["tensors"]:
                    change = Change(t["op"], t["bits"], t["index"] if t["op"] != "full" else None)
                    if t["op"] == "full":
                        work[t["name"]] = torch.empty(t["shape"], dtype=getattr(torch, t["dtype"]))
                    elif t["name"] not in work:
                        raise DeltaError(f"{t['name']}: a delta for a tensor this worker does not hold")
                    undone = apply_change(work[t["name"]], change)
                    if work is self.tensors:
                        undo.append((t["name"], undone))
                    changed += change.bits.numel()
                    if change.bits.numel():
                        touched.add(t["name"])
            applied = time.perf_counter()
            last = steps[-1]["tensors"]
            if set(work) != {t["name"] for t in last}:
                raise DeltaChecksumMismatch(f"version {steps[-1]['version']} names {len(last)} tensors, this worker "
                                            f"holds {len(work)}")
            checksums = {t["name"]: t["checksum"] for t in last}
            wrong = [name for name, checksum in checksums.items() if tensor_checksum(work[name]) != checksum]
            if wrong:
                raise DeltaChecksumMismatch(f"version {steps[-1]['version']}: {len(wrong)} tensor(s) differ from the "
                                            f"trainer's checksums: {', '.join(wrong[:5])}")
        except BaseException:
            for name, undone in reversed(undo):
                undo_change(work[name], undone)
            raise
        timings = {"apply_s": applied - t0, "verify_s": time.perf_counter() - applied, "changed": float(changed)}
        return Staged(work, undo, int(steps[-1]["version"]), str(steps[-1]["chain"]), checksums, touched, timings)

    def commit(self, staged: Staged) -> None:
        """The shadow holds ``staged``'s version (its tensors checked by ``stage``)."""
        self.tensors, self.version, self.chain = staged.work, staged.version, staged.chain

    def rollback(self, staged: Staged) -> None:
        """The shadow as it was before ``stage`` (a delta's changes undone)."""
        if staged.work is self.tensors:
            for name, undone in reversed(staged.undo):
                undo_change(self.tensors[name], undone)
