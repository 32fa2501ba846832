"""The delta codec of ``inference.weight_sync: delta``: a policy version as only the elements that
changed since the version before it, in the served dtype, bit for bit.

One version is one payload (the per-tensor zstd frames, concatenated) and a list of
``TensorEntry`` that says where each tensor's frame is and what it holds:

- ``full``: the tensor's raw bits;
- ``set`` (index+value): the flat indices of the changed elements as gaps (uint32, the first
  gap from -1), then their new bits;
- ``xor``: the XOR of old and new bits over the whole tensor (mostly zero bytes, which zstd
  folds away).

Decoding a frame gives a ``Change`` (indices and bits, or the whole tensor); ``apply_change``
writes it into the tensor of the version before, in place, and ``tensor_checksum`` (xxh3-64 of
the tensor's bytes) of the result must equal the entry's checksum: that is the check that the
applied tensor is exactly the trainer's.

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

Encoding = Literal["set", "xor"]
Op = Literal["full", "set", "xor"]
ZSTD_LEVEL = 3
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


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
    """A decoded frame: the whole tensor's bits (``op == "full"``), or flat indices and their bits."""

    op: Op
    bits: torch.Tensor
    index: torch.Tensor | None = None  # int64, for "set" and "xor"


def bits_of(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's elements as same-width integers, flat (a view: no copy of contiguous tensors)."""
    flat = tensor.detach().contiguous().reshape(-1)
    return flat.view(_BITS[flat.element_size()])


def tensor_checksum(tensor: torch.Tensor) -> str:
    return xxhash.xxh3_64_hexdigest(bits_of(tensor.cpu()).numpy().view(np.uint8).data)


def _dtype_name(tensor: torch.Tensor) -> str:
    return str(tensor.dtype).removeprefix("torch.")


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
    old_bits = bits_of(old.cpu())
    if encoding == "xor":
        flips = torch.bitwise_xor(old_bits, new_bits)
        return entry("xor", int(torch.count_nonzero(flips)), compressor.compress(flips.numpy().tobytes()))
    index = torch.nonzero(old_bits != new_bits).reshape(-1)
    gaps = torch.diff(index, prepend=torch.tensor([-1])).to(torch.int64)
    if index.numel() and int(gaps.max()) >= 2**32:
        raise DeltaError(f"{name}: a gap of {int(gaps.max())} elements does not fit uint32")
    raw = gaps.numpy().astype(np.uint32).tobytes() + new_bits[index].numpy().tobytes()
    return entry("set", index.numel(), compressor.compress(raw))


def decode_frame(entry: TensorEntry, frame: bytes) -> Change:
    """Decompress and parse one tensor's frame; raises ``DeltaError`` when it does not fit its entry."""
    dtype = getattr(torch, entry.dtype)
    itemsize = torch.empty(0, dtype=dtype).element_size()
    numel = int(np.prod(entry.shape, dtype=np.int64))
    try:
        raw = zstandard.ZstdDecompressor().decompress(frame, max_output_size=max(numel * max(itemsize, 4) + 8, 1))
    except zstandard.ZstdError as exc:
        raise DeltaError(f"{entry.name}: its frame does not decompress ({exc})") from None
    int_type = _BITS[itemsize]
    if entry.op in ("full", "xor"):
        if len(raw) != numel * itemsize:
            raise DeltaError(f"{entry.name}: {len(raw)} bytes decoded, {numel * itemsize} expected")
        bits = torch.frombuffer(bytearray(raw), dtype=int_type) if raw else torch.empty(0, dtype=int_type)
        if entry.op == "full":
            return Change("full", bits)
        index = torch.nonzero(bits).reshape(-1)
        return Change("xor", bits[index], index)
    count = entry.changed
    if len(raw) != count * (4 + itemsize):
        raise DeltaError(f"{entry.name}: {len(raw)} bytes decoded for {count} changed elements")
    gaps = np.frombuffer(raw, dtype=np.uint32, count=count).astype(np.int64)
    index = torch.from_numpy(np.cumsum(gaps) - 1)
    if count and (int(index[-1]) >= numel):
        raise DeltaError(f"{entry.name}: index {int(index[-1])} beyond its {numel} elements")
    bits = torch.frombuffer(bytearray(raw[count * 4:]), dtype=int_type) if count else torch.empty(0, dtype=int_type)
    return Change("set", bits, index)


def apply_change(tensor: torch.Tensor, change: Change) -> Change:
    """Write ``change`` into ``tensor`` (contiguous, in place); returns the undo of what it overwrote."""
    flat = bits_of(tensor)
    if flat.data_ptr() != tensor.data_ptr() or not tensor.is_contiguous():
        raise DeltaError("apply_change needs a contiguous tensor")
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
                   encoding: Encoding = "set", level: int = ZSTD_LEVEL) -> tuple[list[TensorEntry], bytes]:
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
