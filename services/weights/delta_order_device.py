"""The ``grouped`` frame's order on the tensors' own device (torch ops): for a trainer whose
weights are on a GPU, the comparison, the order and the changed set are computed there and only
the changed set (positions and zigzag differences: a few percent of the tensor) comes to the host.

The same code runs on a CPU tensor, which is how it is tested (``tests/test_weight_delta.py``
compares it with ``services.weights.delta_order``'s numpy code); on a CPU the numpy code or the
compiled kernels (``delta_order_jit``) are faster, so ``services.weights.delta`` uses this only
for tensors on another device.

Invariants:
- The positions and differences equal ``delta_order.grouped_frame``'s, bit for bit: the same
  blocks (``delta_order.BLOCK``), the same stable order by exponent byte, the same zigzag.
- Memory on the device beyond the two tensors: one span (``SPAN`` elements) of keys, order and
  gathered values at a time.
"""

from __future__ import annotations

import numpy as np
import torch

from services.weights import delta_order

SPAN = 64 << 20  # elements per span: a multiple of any BLOCK the codec uses
_SHIFT = {2: 7, 4: 23}


def _order(old: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
    """Flat indices of ``old[lo:hi]`` (``lo`` a multiple of ``BLOCK``) block by block, stable by exponent."""
    block = delta_order.BLOCK
    # the sign-extended int32 has the same bits 7..14 (bf16) or 23..30 (fp32) as the unsigned value
    keys = ((old[lo:hi].to(torch.int32) >> _SHIFT[old.element_size()]) & 0xFF).to(torch.uint8)
    whole = (hi - lo) // block * block
    parts = []
    if whole:
        rows = torch.sort(keys[:whole].view(-1, block), dim=1, stable=True).indices
        rows += torch.arange(0, whole, block, device=old.device).unsqueeze(1)
        parts.append(rows.view(-1))
    if whole < hi - lo:
        parts.append(torch.sort(keys[whole:], stable=True).indices + whole)
    return torch.cat(parts) + lo if len(parts) > 1 else parts[0] + lo


def _span(block: int) -> int:
    return max(block, SPAN // block * block)


def grouped_changes(old: torch.Tensor, new: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    """Positions (int64, ascending) and zigzag differences (numpy, unsigned of the width) of the
    changed elements of ``new`` against ``old`` (flat same-width integer tensors on one device)."""
    if not delta_order.supports(old.element_size()):
        raise delta_order.OrderError(f"no grouped frame for {old.element_size()}-byte elements")
    width = old.element_size() * 8
    positions, diffs = [], []
    span = _span(delta_order.BLOCK)
    for lo in range(0, old.numel(), span):
        hi = min(old.numel(), lo + span)
        if torch.equal(old[lo:hi], new[lo:hi]):
            continue
        order = _order(old, lo, hi)
        before, after = old[order], new[order]
        at = torch.nonzero(before != after).view(-1)
        diff = (after[at].to(torch.int64) - before[at].to(torch.int64)) & ((1 << width) - 1)
        diff = torch.where(diff >= 1 << (width - 1), diff - (1 << width), diff)
        diffs.append(torch.where(diff >= 0, 2 * diff, -2 * diff - 1).cpu())
        positions.append((at + lo).cpu())
    unsigned = np.uint16 if width == 16 else np.uint32
    if not positions:
        return np.empty(0, dtype=np.int64), np.empty(0, dtype=unsigned)
    return torch.cat(positions).numpy(), torch.cat(diffs).numpy().astype(unsigned)


def resolve(old: torch.Tensor, positions: torch.Tensor, zigzag: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Flat indices (ascending) and new bits, on ``old``'s device, of the changed elements at
    ``positions`` (int64, sorted, in range) with differences ``zigzag`` (``delta_order.resolve_ranked``
    on the device)."""
    width = old.element_size() * 8
    positions, zigzag = positions.to(old.device), zigzag.to(old.device).to(torch.int64) & ((1 << width) - 1)
    span = _span(delta_order.BLOCK)
    bounds = torch.searchsorted(positions, torch.arange(0, old.numel() + span, span, device=old.device)).tolist()
    index = torch.empty_like(positions)
    taken = torch.empty_like(positions)
    for part, (a, b) in enumerate(zip(bounds[:-1], bounds[1:])):
        if a < b:
            lo = part * span
            flat = _order(old, lo, min(old.numel(), lo + span))[positions[a:b] - lo]
            ascending = torch.argsort(flat)
            index[a:b], taken[a:b] = flat[ascending], ascending + a
    zz = zigzag[taken]
    diff = torch.where(zz & 1 == 0, zz >> 1, -(zz >> 1) - 1)
    new = (old[index].to(torch.int64) + diff) & ((1 << width) - 1)
    new = torch.where(new >= 1 << (width - 1), new - (1 << width), new)  # back to the signed width
    return index, new.to(old.dtype)
