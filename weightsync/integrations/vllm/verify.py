"""Per-tensor checksums for the backend's verification mode: a wrong mapping (a layout that validated
but puts bytes in the wrong place) is caught after a push instead of serving a scrambled model.

The checksum of a box of logical tensor ``T`` is ``sum(w(i) * bits(x_i)) mod 2**64`` over the box's
elements, where ``i`` is an element's flat index in ``T`` (row-major), ``w`` a fixed pseudo-random weight
of the index and ``bits`` the element's bit pattern in ``T``'s checkpoint dtype. A sum is blind to how
the elements are split, so the trainer ranks' sums over the shards they hold add up to the sum over any
box cover of the whole tensor, in particular the destination's pieces; a byte in the wrong place (a
swapped q/k, a shifted shard) changes it, since every index has its own weight.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Any

MASK64 = (1 << 64) - 1
_INT_OF_SIZE = {1: "uint8", 2: "int16", 4: "int32", 8: "int64"}
# The index weight: a multiplicative hash of the flat index, kept under 2**30 so that its product with
# a 32-bit pattern stays below 2**62 (sums then wrap modulo 2**64 the same way on every device).
_MUL, _ADD, _WMASK = 0x9E3779B1, 0x7F4A7C15, (1 << 30) - 1


def box_checksum(values: Any, global_shape: Sequence[int], offsets: Sequence[int]) -> int:
    """Checksum of ``values`` (a torch tensor: the box ``offsets + values.shape`` of a logical tensor of
    ``global_shape``, in the checkpoint's dtype)."""
    import torch

    shape = tuple(int(x) for x in values.shape)
    if math.prod(shape) == 0:
        return 0
    device = values.device
    strides = [1] * len(global_shape)
    for d in range(len(global_shape) - 2, -1, -1):
        strides[d] = strides[d + 1] * int(global_shape[d + 1])
    index = torch.zeros((), dtype=torch.int64, device=device)
    for d, n in enumerate(shape):
        axis = (torch.arange(n, dtype=torch.int64, device=device) + int(offsets[d])) * strides[d]
        index = index.unsqueeze(-1) + axis if d else axis
    index = index.reshape(shape)
    weight = (index * _MUL + _ADD) & _WMASK
    bits = values.contiguous().view(getattr(torch, _INT_OF_SIZE[values.element_size()])).to(torch.int64)
    if values.element_size() < 8:
        bits &= (1 << (8 * values.element_size())) - 1  # the pattern as an unsigned number
    return int((weight * bits).sum()) & MASK64


def add(sums: Iterable[int]) -> int:
    total = 0
    for s in sums:
        total = (total + int(s)) & MASK64
    return total


def to_signed(x: int) -> int:
    """An unsigned 64-bit sum as the int64 that has its bits (for all-reduce as int64)."""
    x &= MASK64
    return x - (1 << 64) if x >= 1 << 63 else x


__all__ = ["MASK64", "add", "box_checksum", "to_signed"]
