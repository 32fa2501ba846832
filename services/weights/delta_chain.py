"""The delta weight chain in object storage: every policy version of a run, full or as a delta on
the version before, each one self-describing (``inference.weight_sync: delta``).

Layout, one prefix per version: ``weight_chain/{run}/{version:06d}/`` holds ``payload.bin``
(the version's frames, ``services.weights.delta``) and then ``COMMITTED``, the version's
manifest: ``{"format", "version", "kind": "full" | "delta", "base": <version or null>, "encoding",
"payload": {"size", "xxh3"}, "tensors": [TensorEntry...], "probe": <the trainer's logprob probe
or null>, "saved_at"}``. ``format`` is ``services.weights.delta.FORMAT`` when written (a manifest
without it is format 1, from before the field).

Invariants:
- ``COMMITTED`` is written last: a version without it does not exist for any reader, and a
  committed version is never overwritten (``ChainWriter.publish`` raises). The trainer deletes
  the versions no replica can still need, after each full version (``delta_prune``).
- A delta's ``base`` is the version its writer published before it, in the same process; a
  full version has none. A writer that starts (or restarts) with no previous tensors writes a
  full version first, and one every ``full_every`` versions, and whenever the delta would be
  larger than ``max_fraction`` of the full version: so a chain is always newest full + deltas.
- ``plan(target, have)`` walks back from ``target`` by ``base`` links only: it returns the
  steps that take a replica at ``have`` (None: nothing known) to ``target``, oldest first,
  starting at a full version unless it reaches ``have``. A missing manifest or payload is a
  ``ChainBroken`` naming the version, never a shorter plan.
- A manifest of a format this reader does not know, or with a frame op its format does not
  have, is refused (``ChainBroken`` naming both), never guessed at.
- ``fetch`` checks a payload against its manifest's size and xxh3 before anything is decoded
  (``ChainBroken`` on a mismatch): a corrupted object is refused before any replica sees it.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

import torch
import xxhash

from services.weights.delta import FORMAT, OPS_OF_FORMAT, Encoding, TensorEntry, encode_version
from shared.names import CHECKPOINT_COMMITTED, weight_chain_prefix
from shared.storage import ObjectStore, StorageError

PAYLOAD = "payload.bin"
FULL_EVERY = 20
MAX_FRACTION = 0.25


class ChainBroken(RuntimeError):
    """A version the plan needs is missing or does not match its manifest."""


@dataclass(frozen=True)
class ChainVersion:
    """One committed version's manifest."""

    version: int
    kind: str  # "full" | "delta"
    base: int | None
    encoding: str
    payload_size: int
    payload_xxh3: str
    tensors: tuple[TensorEntry, ...]
    probe: str | None = None  # LogprobProbe JSON
    extra: dict[str, Any] = field(default_factory=dict)
    format: int = FORMAT

    def as_json(self) -> dict[str, Any]:
        return {"format": self.format, "version": self.version, "kind": self.kind, "base": self.base, "encoding": self.encoding,
                "payload": {"size": self.payload_size, "xxh3": self.payload_xxh3},
                "tensors": [t.as_json() for t in self.tensors], "probe": self.probe, **self.extra}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> ChainVersion:
        """Raises ``ChainBroken`` for a format this reader does not know (see the invariants)."""
        fmt = data.get("format", 1)
        if fmt not in OPS_OF_FORMAT:
            raise ChainBroken(f"chain version {data.get('version')} is in format {fmt!r}; this reader knows formats "
                              f"{sorted(OPS_OF_FORMAT)}: refused, not guessed at")
        unknown = {t.get("op") for t in data["tensors"]} - set(OPS_OF_FORMAT[fmt])
        if unknown:
            raise ChainBroken(f"chain version {data.get('version')} (format {fmt}) has frame ops {sorted(map(str, unknown))} "
                              f"that format does not have")
        return cls(int(data["version"]), data["kind"], data["base"], data["encoding"], int(data["payload"]["size"]),
                   data["payload"]["xxh3"], tuple(TensorEntry.from_json(t) for t in data["tensors"]),
                   data.get("probe"), {k: data[k] for k in ("saved_at", "encode_s", "full_size") if k in data}, fmt)


@dataclass(frozen=True)
class Published:
    version: ChainVersion
    encode_s: float
    upload_s: float
    full_size: int  # the bytes of the version's tensors in the served dtype, uncompressed


class ChainWriter:
    """The trainer's end: publishes each version of served-dtype tensors as a delta on the last one
    it published, or full (see the invariants). Holds a copy of the last published tensors: on the
    host, or with ``keep_on_device`` on the device they came on (the encode then runs there)."""

    def __init__(self, store: ObjectStore, run_id: str, *, full_every: int = FULL_EVERY,
                 max_fraction: float = MAX_FRACTION, encoding: Encoding = "grouped", keep_on_device: bool = False):
        if full_every < 1 or not 0 < max_fraction <= 1:
            raise ValueError(f"full_every {full_every} must be >= 1 and max_fraction {max_fraction} in (0, 1]")
        self.store, self.run_id = store, run_id
        self.full_every, self.max_fraction, self.encoding = full_every, max_fraction, encoding
        self.keep_on_device = keep_on_device  # the last version on the tensors' own device, not the host
        self.last: dict[str, torch.Tensor] | None = None
        self.last_version: int | None = None
        self.last_full: int | None = None

    def publish(self, version: int, tensors: dict[str, torch.Tensor], probe: str | None = None) -> Published:
        """Write ``version`` (payload, then its manifest) and remember its tensors as the next base."""
        prefix = weight_chain_prefix(self.run_id, version)
        if prefix + CHECKPOINT_COMMITTED in self.store.list_keys(prefix):
            raise ChainBroken(f"chain version {prefix} is already committed; versions are never overwritten")
        if self.last_version is not None and version <= self.last_version:
            raise ValueError(f"version {version} published after {self.last_version}: versions only go up")
        held = {name: (t.detach().clone() if self.keep_on_device else t.detach().to("cpu", copy=True)).contiguous()
               for name, t in tensors.items()}
        full_size = sum(t.numel() * t.element_size() for t in held.values())
        t0 = time.perf_counter()
        due_full = self.last is None or self.last_full is None or version - self.last_full >= self.full_every
        entries, payload = encode_version(held, None if due_full else self.last, self.encoding)
        kind = "full" if due_full else "delta"
        if not due_full and len(payload) > self.max_fraction * full_size:
            entries, payload, kind = *encode_version(held, None, self.encoding), "full"
        encode_s = time.perf_counter() - t0
        t1 = time.perf_counter()
        self.store.put_bytes(prefix + PAYLOAD, payload, content_type="application/octet-stream")
        manifest = ChainVersion(version, kind, None if kind == "full" else self.last_version, self.encoding,
                                len(payload), xxhash.xxh3_64_hexdigest(payload), tuple(entries), probe,
                                {"saved_at": time.time(), "encode_s": encode_s, "full_size": full_size})
        self.store.put_bytes(prefix + CHECKPOINT_COMMITTED, json.dumps(manifest.as_json()).encode(),
                             content_type="application/json")
        self.last, self.last_version = held, version
        if kind == "full":
            self.last_full = version
        return Published(manifest, encode_s, time.perf_counter() - t1, full_size)


class ChainReader:
    """The replicas' end: reads manifests, plans a catch-up, fetches checked payloads."""

    def __init__(self, store: ObjectStore, run_id: str):
        self.store, self.run_id = store, run_id

    def manifest(self, version: int) -> ChainVersion:
        key = weight_chain_prefix(self.run_id, version) + CHECKPOINT_COMMITTED
        try:
            data = self.store.get_bytes(key)
        except StorageError as exc:
            raise ChainBroken(f"chain version {version} of run {self.run_id} is missing ({key}: {exc})") from None
        try:
            return ChainVersion.from_json(json.loads(data))
        except (ValueError, KeyError, TypeError) as exc:
            raise ChainBroken(f"chain version {version} of run {self.run_id}: unreadable manifest {key} ({exc})") from None

    def plan(self, target: int, have: int | None = None) -> list[ChainVersion]:
        """The versions to apply, oldest first, to go from ``have`` to ``target`` (see the invariants)."""
        steps: list[ChainVersion] = []
        version: int | None = target
        while version is not None and version != have:
            step = self.manifest(version)
            steps.append(step)
            if step.kind == "full":
                break
            if step.base is None or step.base >= version:
                raise ChainBroken(f"chain version {version} of run {self.run_id} is a delta on {step.base}")
            version = step.base
        return steps[::-1]

    def fetch(self, step: ChainVersion) -> bytes:
        """The payload of ``step``, checked against its manifest."""
        key = weight_chain_prefix(self.run_id, step.version) + PAYLOAD
        try:
            data = self.store.get_bytes(key)
        except StorageError as exc:
            raise ChainBroken(f"chain version {step.version} of run {self.run_id}: payload {key} is missing "
                              f"({exc})") from None
        if len(data) != step.payload_size or xxhash.xxh3_64_hexdigest(data) != step.payload_xxh3:
            raise ChainBroken(f"chain version {step.version} of run {self.run_id}: payload {key} does not match its "
                              f"manifest ({len(data)} bytes, manifest {step.payload_size}, or its xxh3)")
        return data
