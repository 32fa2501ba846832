"""The delta codec of ``inference.weight_sync: delta``: a policy version as only the elements that
changed since the version before it, in the served dtype, bit for bit.

One version is one payload (the per-tensor zstd frames, concatenated) and a list of
``TensorEntry`` that says where each tensor's frame is and what it holds:

- ``full``: the tensor's raw bits;
- ``set`` (index+value): the flat indices of the changed elements as gaps (uint32, the first
  gap from -1), then their new bits;
- ``xor``: the XOR of old and new bits over the whole tensor (mostly zero bytes, which zstd
  folds away);
- ``xor-planes``: that XOR with its bytes regrouped by significance (every element's low byte,
  then every high byte, ...): a small change flips only low mantissa bits, so the high planes are
  almost all zero and each plane compresses on its own statistics;
- ``set-planes``: the gaps (uint32) then the XOR of the changed elements' bits, each regrouped
  by byte planes the same way;
- ``grouped``: like ``set-planes``, with the elements taken in an order the old tensor decides
  (block by block, by the old value's exponent) and zigzag differences instead of XORs
  (``services.weights.delta_order``): its positions mean something only against the old tensor;
  for tensors on a GPU its comparison and order run on the device and only the changed set is
  copied to the host (``delta_order_device``; the checksum still reads the whole new tensor).

``FORMAT`` is the chain format these frames belong to (3: all six ops; 2: all but ``grouped``;
1, a manifest without a format: ``full``, ``set`` and ``xor`` only); ``encoding="smallest"``
writes each tensor as the smaller of its ``set-planes`` and ``xor-planes`` frames.

Decoding a frame gives a ``Change`` (indices and bits, or the whole tensor; for ``grouped``,
positions in the old tensor's order: a ``ranked`` change, which ``resolve_change`` turns into a
``set`` one with the old tensor); ``apply_change`` writes it into the tensor of the version
before, in place, and ``tensor_checksum`` (xxh3-64 of the tensor's bytes) of the result must
equal the entry's checksum: that is the check that the applied tensor is exactly the trainer's.

Invariants:
- Bits, not values: an element is changed when its bit pattern is (``-0.0`` vs ``0.0``, NaN
  payloads), and what is written is the new bit pattern, so decode(encode(old, new)) applied to
  old equals new byte for byte.
- Every entry carries the checksum of the tensor it produces, whatever its encoding.
- ``apply_change`` returns what it overwrote (``undo_change`` puts it back), so a tensor whose
  checksum fails is restored to the version before, not left half way.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import Literal

import numpy as np
import torch
import xxhash
import zstandard

from services.weights import delta_order_device
from services.weights.delta_order import OrderError, frame_of_changes, grouped_frame, resolve_ranked, supports

Encoding = Literal["set", "xor", "set-planes", "xor-planes", "grouped", "smallest"]
Op = Literal["full", "set", "xor", "set-planes", "xor-planes", "grouped"]
FORMAT = 3
OPS_OF_FORMAT = {1: ("full", "set", "xor"), 2: ("full", "set", "xor", "set-planes", "xor-planes"),
                 3: ("full", "set", "xor", "set-planes", "xor-planes", "grouped")}
ZSTD_LEVEL = 3
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_NP_BITS = {1: np.uint8, 2: np.int16, 4: np.int32, 8: np.int64}


class DeltaError(RuntimeError):
    """A delta that cannot be decoded or applied (a bad frame, a shape or dtype that does not fit)."""


@dataclass(frozen=True)
class TensorEntry:
    """One tensor of a version: its frame in the payload, and the checksum of the tensor it produces."""

    name: str
    dtype: str  # torch dtype name without the "torch." prefix
    shape: tuple[int, ...]
    op: Op
    changed: int  # elements whose bits changed (every element for "full")
    offset: int
    length: int
    checksum: str  # xxh3-64 hex of the resulting tensor's bytes

    def as_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict) -> TensorEntry:
        return cls(**{**data, "shape": tuple(data["shape"])})


@dataclass(frozen=True)
class Change:
    """A decoded frame: the whole tensor's bits (``op == "full"``), or flat indices and their bits
    (``"set"``: new bits, ``"xor"``: old XOR new), or positions in the old tensor's grouped order
    and zigzag differences (``"ranked"``, see ``resolve_change``)."""

    op: str  # "full" | "set" | "xor" | "ranked"
    bits: torch.Tensor
    index: torch.Tensor | None = None  # int64, for "set", "xor" and "ranked"


def bits_of(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's elements as same-width integers, flat (a view: no copy of contiguous tensors)."""
    flat = tensor.detach().contiguous().reshape(-1)
    return flat.view(_BITS[flat.element_size()])


def tensor_checksum(tensor: torch.Tensor) -> str:
    return xxhash.xxh3_64_hexdigest(bits_of(tensor.cpu()).numpy().view(np.uint8).data)


def _dtype_name(tensor: torch.Tensor) -> str:
    return str(tensor.dtype).removeprefix("torch.")


def byte_planes(values: np.ndarray) -> bytes:
    """The bytes of ``values`` regrouped by significance: every element's byte 0, then every byte 1, ..."""
    return values.view(np.uint8).reshape(-1, values.itemsize).T.tobytes()


def from_byte_planes(raw: bytes | memoryview, dtype: type, count: int) -> np.ndarray:
    """The inverse of ``byte_planes`` for ``count`` elements of ``dtype``: a flat, writable array."""
    width = np.dtype(dtype).itemsize
    planes = np.frombuffer(raw, dtype=np.uint8, count=count * width).reshape(width, count)
    return planes.T.copy().view(dtype).reshape(-1)


def _gaps(index: np.ndarray, name: str) -> np.ndarray:
    """Flat sorted indices as uint32 gaps, the first from -1."""
    gaps = np.diff(index, prepend=-1)
    if gaps.size and int(gaps.max()) >= 2**32:
        raise DeltaError(f"{name}: a gap of {int(gaps.max())} elements does not fit uint32")
    return gaps.astype(np.uint32)


def _delta_frame(name: str, old_bits: np.ndarray, new_bits: np.ndarray, op: Op,
                 compressor: zstandard.ZstdCompressor) -> tuple[int, bytes]:
    """The changed-element count and the frame of one delta op."""
    if op == "grouped":
        return grouped_frame(old_bits, new_bits, compressor)
    flips = np.bitwise_xor(old_bits, new_bits)
    if op == "xor":
        return int(np.count_nonzero(flips)), compressor.compress(flips.tobytes())
    if op == "xor-planes":
        return int(np.count_nonzero(flips)), compressor.compress(byte_planes(flips))
    index = np.flatnonzero(flips)
    if op == "set":
        return index.size, compressor.compress(_gaps(index, name).tobytes() + new_bits[index].tobytes())
    return index.size, compressor.compress(byte_planes(_gaps(index, name)) + byte_planes(flips[index]))


def encode_tensor(name: str, new: torch.Tensor, old: torch.Tensor | None, encoding: Encoding,
                  compressor: zstandard.ZstdCompressor) -> tuple[TensorEntry, bytes]:
    """The entry (offset 0) and frame of ``new`` against ``old`` (None: a full frame)."""
    new_bits = bits_of(new.cpu())
    checksum = xxhash.xxh3_64_hexdigest(new_bits.numpy().view(np.uint8).data)

    def entry(op: Op, changed: int, frame: bytes) -> tuple[TensorEntry, bytes]:
        return TensorEntry(name, _dtype_name(new), tuple(new.shape), op, changed, 0, len(frame), checksum), frame

    if old is None:
        return entry("full", new_bits.numel(), compressor.compress(new_bits.numpy().tobytes()))
    if old.shape != new.shape or old.dtype != new.dtype:
        raise DeltaError(f"{name}: {tuple(old.shape)} {old.dtype} before, {tuple(new.shape)} {new.dtype} now")
    if encoding == "grouped" and supports(new.element_size()) and new.device.type != "cpu" and old.device == new.device:
        # the comparison and the order on the device; only the changed set comes to the host
        count, frame = frame_of_changes(*delta_order_device.grouped_changes(bits_of(old), bits_of(new)), compressor)
        return entry("grouped", count, frame)
    new_np = new_bits.numpy()
    old_np = bits_of(old.cpu()).numpy()
    ops: tuple[Op, ...] = ("set-planes", "xor-planes") if encoding == "smallest" else (encoding,)
    if encoding == "grouped" and not supports(old_np.itemsize):
        ops = ("set-planes",)  # no exponent byte to order by
    best = min((_delta_frame(name, old_np, new_np, op, compressor) + (op,) for op in ops),
               key=lambda f: len(f[1]))
    return entry(best[2], best[0], best[1])


def decode_frame(entry: TensorEntry, frame: bytes) -> Change:
    """Decompress and parse one tensor's frame; raises ``DeltaError`` when it does not fit its entry."""
    dtype = getattr(torch, entry.dtype)
    itemsize = torch.empty(0, dtype=dtype).element_size()
    numel = int(np.prod(entry.shape, dtype=np.int64))
    try:
        raw = zstandard.ZstdDecompressor().decompress(frame, max_output_size=numel * (itemsize + 4) + 8)
    except zstandard.ZstdError as exc:
        raise DeltaError(f"{entry.name}: its frame does not decompress ({exc})") from None
    int_type = _BITS[itemsize]
    np_type = _NP_BITS[itemsize]
    if entry.op in ("full", "xor", "xor-planes"):
        if len(raw) != numel * itemsize:
            raise DeltaError(f"{entry.name}: {len(raw)} bytes decoded, {numel * itemsize} expected")
        if entry.op == "xor-planes":
            bits = torch.from_numpy(from_byte_planes(raw, np_type, numel))
        else:
            bits = torch.frombuffer(bytearray(raw), dtype=int_type) if raw else torch.empty(0, dtype=int_type)
        if entry.op == "full":
            return Change("full", bits)
        index = torch.nonzero(bits).reshape(-1)
        return Change("xor", bits[index], index)
    if entry.op not in ("set", "set-planes", "grouped"):
        raise DeltaError(f"{entry.name}: unknown frame op {entry.op!r} (this reader knows {OPS_OF_FORMAT[FORMAT]})")
    count = entry.changed
    if len(raw) != count * (4 + itemsize):
        raise DeltaError(f"{entry.name}: {len(raw)} bytes decoded for {count} changed elements")
    planes = entry.op in ("set-planes", "grouped")
    gaps = from_byte_planes(raw, np.uint32, count) if planes else np.frombuffer(raw, dtype=np.uint32, count=count)
    index = torch.from_numpy(np.cumsum(gaps.astype(np.int64)) - 1)
    if count and (int(index[-1]) >= numel):
        raise DeltaError(f"{entry.name}: index {int(index[-1])} beyond its {numel} elements")
    values = memoryview(raw)[count * 4:]
    if entry.op == "grouped":
        return Change("ranked", torch.from_numpy(from_byte_planes(values, np_type, count)), index)
    if planes:
        return Change("xor", torch.from_numpy(from_byte_planes(values, np_type, count)), index)
    bits = torch.frombuffer(bytearray(values), dtype=int_type) if count else torch.empty(0, dtype=int_type)
    return Change("set", bits, index)


def resolve_change(tensor: torch.Tensor, change: Change) -> Change:
    """``change`` with a ``ranked`` one made a ``set`` one against ``tensor`` (the old tensor it
    was encoded against; CPU, contiguous); any other as it is."""
    if change.op != "ranked":
        return change
    assert change.index is not None
    try:
        index, new = resolve_ranked(bits_of(tensor).numpy(), change.index.numpy(), change.bits.numpy())
    except OrderError as exc:
        raise DeltaError(str(exc)) from None
    return Change("set", torch.from_numpy(new), torch.from_numpy(index))


def apply_change(tensor: torch.Tensor, change: Change) -> Change:
    """Write ``change`` into ``tensor`` (contiguous, in place); returns the undo of what it overwrote.
    A ``ranked`` change is resolved against ``tensor`` first (``resolve_change``)."""
    flat = bits_of(tensor)
    if flat.data_ptr() != tensor.data_ptr() or not tensor.is_contiguous():
        raise DeltaError("apply_change needs a contiguous tensor")
    if change.op == "ranked":
        change = resolve_change(tensor, change)
    if change.op == "full":
        if change.bits.numel() != flat.numel():
            raise DeltaError(f"a full frame of {change.bits.numel()} elements for a tensor of {flat.numel()}")
        before = flat.clone()
        flat.copy_(change.bits.to(flat.device))
        return Change("full", before)
    assert change.index is not None
    index = change.index.to(flat.device)
    before = flat[index].clone()
    if change.op == "xor":
        flat[index] = torch.bitwise_xor(before, change.bits.to(flat.device))
    else:
        flat[index] = change.bits.to(flat.device)
    return Change("set", before, change.index)


def undo_change(tensor: torch.Tensor, undo: Change) -> None:
    apply_change(tensor, undo)


def encode_version(tensors: dict[str, torch.Tensor], previous: dict[str, torch.Tensor] | None,
                   encoding: Encoding = "grouped", level: int = ZSTD_LEVEL) -> tuple[list[TensorEntry], bytes]:
    """Every tensor of a version against ``previous`` (None: a full version): entries and payload.
    A tensor with no counterpart in ``previous`` is written full."""
    compressor = zstandard.ZstdCompressor(level=level)
    entries, frames, offset = [], [], 0
    for name in sorted(tensors):
        old = None if previous is None else previous.get(name)
        entry, frame = encode_tensor(name, tensors[name], old, encoding, compressor)
        entries.append(replace(entry, offset=offset))
        frames.append(frame)
        offset += len(frame)
    return entries, b"".join(frames)


def frame_of(entry: TensorEntry, payload: bytes | memoryview) -> bytes:
    if entry.offset < 0 or entry.offset + entry.length > len(payload):
        raise DeltaError(f"{entry.name}: frame {entry.offset}+{entry.length} beyond the payload's {len(payload)} bytes")
    return bytes(payload[entry.offset:entry.offset + entry.length])
