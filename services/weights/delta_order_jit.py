"""Compiled kernels (numba) for the ``grouped`` frame of ``services.weights.delta_order``: the same
positions and bits as its numpy code, in one pass over the tensor instead of a sort.

The grouped order takes a block's elements in the stable order of their exponent byte (the
key). An element's position in it is ``less[key] + seen[key]``: the block's elements with a
smaller key, plus those with its key before it. So a counting pass (the block's key
histogram) and one pass in natural order, counting as it goes, give every changed element's
position without sorting the block or writing its order (the numpy code's stable ``argsort``
writes an int64 per element, then gathers the old and new tensors through it):

- ``changes``: per block, the histogram, then the changed elements' positions and zigzag
  differences, put in ascending position by a counting sort of the (few) changed ones by key;
- ``frame_body``: the gaps and differences in byte planes, in one pass (no int64 gaps, no
  transposed copies);
- ``resolve``: per block, the histogram, then a pass that recomputes each element's position
  and takes the element when it is the next wanted position of its key's bucket: flat indices
  come out ascending, with no sort.

Invariants:
- The output equals the numpy code's bit for bit (``tests/test_weight_delta.py`` compares the
  two on random tensors and small blocks): this is a faster path, not another format.
- ``available()`` is False when numba is not installed; the numpy code is then used.
- Kernels are compiled on first use (about a second; cached on disk where numba finds a
  writable folder, else compiled in each process) and release the GIL.
"""

from __future__ import annotations

from typing import Any

import numpy as np

try:
    from numba import njit
except ImportError:  # pragma: no cover - the numpy code is used instead
    njit = None


def available() -> bool:
    return njit is not None


def _kernels(cache: bool) -> tuple[Any, Any, Any, Any]:
    assert njit is not None

    @njit(cache=cache, nogil=True)
    def count_changes(old, new, block):  # noqa: ANN001, ANN202 - numba-typed
        blocks = (old.size + block - 1) // block
        counts = np.zeros(blocks + 1, dtype=np.int64)
        for b in range(blocks):
            lo, hi = b * block, min(old.size, (b + 1) * block)
            c = 0
            for i in range(lo, hi):
                c += old[i] != new[i]
            counts[b + 1] = counts[b] + c
        return counts

    @njit(cache=cache, nogil=True)
    def changes(old, new, block, shift, offsets, positions, zigzag, width_bits):  # noqa: ANN001, ANN202
        mask = (1 << width_bits) - 1
        half = 1 << (width_bits - 1)
        seen = np.empty(256, dtype=np.int64)
        less = np.empty(256, dtype=np.int64)
        start = np.empty(257, dtype=np.int64)
        placed = np.empty(256, dtype=np.int64)
        keys = np.empty(block, dtype=np.uint8)  # the block's changed elements, in natural order
        ranks = np.empty(block, dtype=np.int64)
        diffs = np.empty(block, dtype=np.int64)
        for b in range(offsets.size - 1):
            first, last = offsets[b], offsets[b + 1]
            if first == last:
                continue
            lo, hi = b * block, min(old.size, (b + 1) * block)
            seen[:] = 0
            start[:] = 0
            m = 0
            for i in range(lo, hi):  # one pass: each changed element's rank among its key's elements
                k = (old[i] >> shift) & 0xFF
                r = seen[k]
                if old[i] != new[i]:
                    d = (np.int64(new[i]) - np.int64(old[i])) & mask
                    if d >= half:
                        d -= mask + 1
                    keys[m], ranks[m], diffs[m] = k, r, 2 * d if d >= 0 else -2 * d - 1
                    start[k + 1] += 1
                    m += 1
                seen[k] = r + 1
            total = 0
            for k in range(256):  # the block's histogram is now ``seen``
                less[k] = total
                total += seen[k]
                start[k + 1] += start[k]
            placed[:] = 0
            for j in range(m):  # a counting sort of the changed ones by key: ascending positions
                k = keys[j]
                at = first + start[k] + placed[k]
                placed[k] += 1
                positions[at] = lo + less[k] + ranks[j]
                zigzag[at] = diffs[j]

    @njit(cache=cache, nogil=True)
    def resolve(old, positions, zigzag, block, shift, bounds, index, new, width_bits):  # noqa: ANN001, ANN202
        mask = (1 << width_bits) - 1
        less = np.empty(257, dtype=np.int64)
        seen = np.empty(256, dtype=np.int64)
        want = np.empty(257, dtype=np.int64)
        ends = np.empty(257, dtype=np.int64)
        rank = np.empty(256, dtype=np.int64)  # the rank among its key's elements of the next wanted one
        taken = 0
        for b in range(bounds.size - 1):
            a, z = bounds[b], bounds[b + 1]
            if a == z:
                continue
            lo, hi = b * block, min(old.size, (b + 1) * block)
            less[:] = 0
            for i in range(lo, hi):
                less[((old[i] >> shift) & 0xFF) + 1] += 1
            for k in range(256):
                less[k + 1] += less[k]
            j = a  # want[k]: the first wanted position in key k's bucket, then the next one
            for k in range(256):
                while j < z and positions[j] - lo < less[k]:
                    j += 1
                want[k] = j
            want[256] = z
            ends[:] = want
            for k in range(256):
                rank[k] = positions[want[k]] - lo - less[k] if want[k] < ends[k + 1] else -1
            seen[:] = 0
            for i in range(lo, hi):
                k = (old[i] >> shift) & 0xFF
                s = seen[k]
                if s == rank[k]:
                    w = want[k]
                    zz = np.int64(zigzag[w])
                    d = (zz >> 1) if (zz & 1) == 0 else -(zz >> 1) - 1
                    index[taken] = i
                    new[taken] = (np.int64(old[i]) + d) & mask
                    taken += 1
                    want[k] = w + 1
                    rank[k] = positions[w + 1] - lo - less[k] if w + 1 < ends[k + 1] else -1
                seen[k] = s + 1
        return taken

    @njit(cache=cache, nogil=True)
    def planes(positions, zigzag, out):  # noqa: ANN001, ANN202
        count, width = positions.size, zigzag.itemsize
        before = -1
        for j in range(count):
            gap = positions[j] - before
            before = positions[j]
            for p in range(4):
                out[p * count + j] = (gap >> (8 * p)) & 0xFF
            z = np.int64(zigzag[j])
            for p in range(width):
                out[(4 + p) * count + j] = (z >> (8 * p)) & 0xFF

    return count_changes, changes, resolve, planes


_compiled: tuple[Any, Any, Any, Any] | None = None


def _get() -> tuple[Any, Any, Any, Any]:
    global _compiled
    if _compiled is None:
        try:
            _compiled = _kernels(cache=True)
        except RuntimeError:  # numba finds no writable cache folder (a read-only install): compile each time
            _compiled = _kernels(cache=False)
    return _compiled


def changes(old: np.ndarray, new: np.ndarray, block: int, shift: int) -> tuple[np.ndarray, np.ndarray]:
    """Positions (int64, ascending, in the grouped order) and zigzag differences of the elements whose
    bits differ; ``old`` and ``new`` flat unsigned ints of one width."""
    count_changes, kernel, _, _ = _get()
    offsets = count_changes(old, new, block)
    positions: np.ndarray = np.empty(int(offsets[-1]), dtype=np.int64)
    zigzag: np.ndarray = np.empty(positions.size, dtype=old.dtype)
    kernel(old, new, block, shift, offsets, positions, zigzag, old.itemsize * 8)
    return positions, zigzag


def resolve(old: np.ndarray, positions: np.ndarray, zigzag: np.ndarray, block: int,
            shift: int) -> tuple[np.ndarray, np.ndarray, int]:
    """Flat indices (ascending) and new bits (``old``'s unsigned width) of the elements at
    ``positions`` (sorted, in range) and how many of them were found (fewer: duplicate positions)."""
    _, _, kernel, _ = _get()
    bounds: np.ndarray = np.asarray(np.searchsorted(positions, np.arange(0, old.size + block, block, dtype=np.int64)))
    bounds[-1] = positions.size
    index: np.ndarray = np.empty(positions.size, dtype=np.int64)
    new: np.ndarray = np.empty(positions.size, dtype=old.dtype)
    taken = kernel(old, positions, zigzag, block, shift, bounds.astype(np.int64), index, new, old.itemsize * 8)
    return index, new, int(taken)


def frame_body(positions: np.ndarray, zigzag: np.ndarray) -> bytes:
    """``byte_planes`` of the gaps (uint32, the first from -1) then of ``zigzag``, in one pass:
    the bytes ``delta_order.frame_of_changes`` compresses."""
    out: np.ndarray = np.empty(positions.size * (4 + zigzag.itemsize), dtype=np.uint8)
    _get()[3](positions, zigzag, out)
    return out.tobytes()
