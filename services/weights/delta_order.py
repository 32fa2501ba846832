"""The ``grouped`` frame of the delta codec (``services.weights.delta``): the changed elements
taken in an order the old tensor decides, so that a decoder holding the old tensor (a
replica's worker, with its shadow: ``services.weights.delta_shadow``) can recompute it.

Whether a small optimizer step moves a value's bf16 bits depends mostly on the value's
magnitude (a small weight's last mantissa bit is a small step), so the elements are taken
block by block (``BLOCK`` elements), and inside a block in the stable order of the old value's
exponent byte: the changed elements cluster, and their gaps shrink. Each changed element's
new bits are written as the zigzag-coded integer difference to its old bits (``+-1`` for a
value that moved one step: almost all of them), in the tensor's width.

Frame: ``byte_planes(gaps)`` (uint32, the first from -1, positions in that order), then
``byte_planes(zigzag(new - old))``. Decoding a frame needs nothing but the frame and gives
the positions in that order (``Change("ranked")``); ``resolve_ranked`` turns them into flat
indices and new bits with the old tensor (``Change("set")``).

Three implementations write the same frames bit for bit: the numpy code here (the reference,
and the fallback: ``NUMPY_ONLY``, or numba not installed), the compiled kernels of
``delta_order_jit`` (one pass per block, no sort: used on CPU tensors when numba is installed),
and ``delta_order_device`` (torch ops on the tensors' own device: ``delta.encode_tensor`` uses it
for tensors on a GPU).

Invariants:
- The order is a function of the old tensor's bits alone (its exponent bytes, block by
  block), so the encoder and a decoder holding the same old tensor compute the same one; a
  decoder holding another tensor resolves to wrong bits, which the entry's checksum of the
  result refuses (``DeltaShadow.apply``), never silently.
- Memory beyond the tensors: one chunk (``CHUNK`` elements) of order at a time.
"""

from __future__ import annotations

import numpy as np
import zstandard

from services.weights import delta_order_jit

BLOCK = 1 << 20
CHUNK = 4 * BLOCK
NUMPY_ONLY = False  # True: the numpy code even where the compiled kernels (``delta_order_jit``) can run
_UNSIGNED = {2: np.uint16, 4: np.uint32}
_EXPONENT_SHIFT = {2: 7, 4: 23}  # bf16, fp32 (a float16's key takes a mantissa bit: still a valid order)


class OrderError(ValueError):
    """Bits of a width the grouped frame does not have, or positions beyond the tensor."""


def _order(old: np.ndarray, lo: int, hi: int) -> np.ndarray:
    """Flat indices of ``old[lo:hi]`` (``lo`` a multiple of ``BLOCK``) block by block, stable by exponent."""
    width = old.itemsize
    keys = ((old[lo:hi].view(_UNSIGNED[width]) >> _EXPONENT_SHIFT[width]) & 0xFF).astype(np.uint8)
    out: np.ndarray = np.empty(hi - lo, dtype=np.int64)
    whole = (hi - lo) // BLOCK * BLOCK
    if whole:
        rows = np.argsort(keys[:whole].reshape(-1, BLOCK), axis=1, kind="stable")
        rows += (np.arange(rows.shape[0], dtype=np.int64) * BLOCK)[:, None]
        out[:whole] = rows.reshape(-1)
    if whole < hi - lo:
        out[whole:] = np.argsort(keys[whole:], kind="stable") + whole
    return out + lo


def _zigzag(old: np.ndarray, new: np.ndarray) -> np.ndarray:
    width = old.itemsize * 8
    diff = new - old  # wraps in the tensor's width
    return ((diff << 1) ^ (diff >> (width - 1))).view(_UNSIGNED[old.itemsize])


def _unzigzag(zigzag: np.ndarray, signed: type) -> np.ndarray:
    half = zigzag >> 1
    return (half ^ (np.zeros_like(zigzag) - (zigzag & 1))).view(signed)


def supports(itemsize: int) -> bool:
    return itemsize in _UNSIGNED


def grouped_frame(old: np.ndarray, new: np.ndarray, compressor: zstandard.ZstdCompressor) -> tuple[int, bytes]:
    """The changed-element count and the ``grouped`` frame of ``new`` against ``old`` (flat, same-width ints)."""
    if not supports(old.itemsize):
        raise OrderError(f"no grouped frame for {old.itemsize}-byte elements")
    if delta_order_jit.available() and not NUMPY_ONLY:
        unsigned = _UNSIGNED[old.itemsize]
        return frame_of_changes(*delta_order_jit.changes(old.view(unsigned), new.view(unsigned), BLOCK,
                                                         _EXPONENT_SHIFT[old.itemsize]), compressor)
    positions, diffs = [], []
    for lo in range(0, old.size, CHUNK):
        hi = min(old.size, lo + CHUNK)
        if np.array_equal(old[lo:hi], new[lo:hi]):
            continue
        order = _order(old, lo, hi)
        before, after = old[order], new[order]
        at = np.flatnonzero(before != after)
        positions.append(at + lo)
        diffs.append(_zigzag(before[at], after[at]))
    index = np.concatenate(positions) if positions else np.empty(0, dtype=np.int64)
    zigzag = np.concatenate(diffs) if diffs else np.empty(0, dtype=_UNSIGNED[old.itemsize])
    return frame_of_changes(index, zigzag, compressor)


def frame_of_changes(positions: np.ndarray, zigzag: np.ndarray,
                     compressor: zstandard.ZstdCompressor) -> tuple[int, bytes]:
    """The changed-element count and the ``grouped`` frame of ``positions`` (ascending, in the
    grouped order) and their zigzag differences."""
    from services.weights.delta import byte_planes

    if delta_order_jit.available() and not NUMPY_ONLY:
        return positions.size, compressor.compress(delta_order_jit.frame_body(positions, zigzag))
    gaps = np.diff(positions, prepend=-1).astype(np.uint32)  # a gap is at most one block: fits
    return positions.size, compressor.compress(byte_planes(gaps) + byte_planes(zigzag))


def resolve_ranked(old: np.ndarray, positions: np.ndarray, zigzag: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Flat indices (ascending) and new bits of the changed elements at ``positions`` (sorted, in
    the grouped order of ``old``) with differences ``zigzag`` (bits of ``old``'s width)."""
    if positions.size and (positions[0] < 0 or positions[-1] >= old.size):
        raise OrderError(f"a position beyond the tensor's {old.size} elements")
    if delta_order_jit.available() and not NUMPY_ONLY:
        unsigned = _UNSIGNED[old.itemsize]
        flat, bits, found = delta_order_jit.resolve(old.view(unsigned), positions, zigzag.view(unsigned), BLOCK,
                                                    _EXPONENT_SHIFT[old.itemsize])
        if found != positions.size:
            raise OrderError(f"{positions.size - found} of {positions.size} positions repeat one before them")
        return flat, bits.view(old.dtype)
    index: np.ndarray = np.empty(positions.size, dtype=np.int64)
    taken: np.ndarray = np.empty(positions.size, dtype=np.int64)  # which difference goes with each index
    bounds = np.asarray(np.searchsorted(positions, np.arange(0, old.size + CHUNK, CHUNK)))
    for chunk, (a, b) in enumerate(zip(bounds[:-1], bounds[1:])):
        if a < b:
            lo = chunk * CHUNK
            flat = _order(old, lo, min(old.size, lo + CHUNK))[positions[a:b] - lo]
            ascending = np.argsort(flat)  # sorted indices: the paused writes go through memory in order
            index[a:b], taken[a:b] = flat[ascending], ascending + a
    new = old[index] + _unzigzag(zigzag.view(_UNSIGNED[old.itemsize])[taken], old.dtype.type)
    return index, new
