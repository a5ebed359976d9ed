"""The FP8 oracle tests and scripts/bench_fp8.py check the sender's quantizer against: written here tile
by tile, independently of weightsync.runtime.transforms, and a bitwise comparison."""

from __future__ import annotations

import torch

FP8 = torch.float8_e4m3fn


def reference_fp8(full: torch.Tensor, bm: int = 128, bn: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """Tile by tile: scale = max(amax, 1e-4) / 448, value = x * (1 / scale) saturated to +-448 and cast
    to float8_e4m3fn (vLLM's per_block_cast_to_fp8 rule). On the CPU whatever the input's device (CUDA
    divides by a host scalar through its reciprocal)."""
    full = full.cpu()
    rows, cols = full.shape
    q = torch.empty(rows, cols, dtype=FP8)
    s = torch.empty(-(-rows // bm), -(-cols // bn), dtype=torch.float32)
    for i in range(s.shape[0]):
        for j in range(s.shape[1]):
            tile = full[i * bm:(i + 1) * bm, j * bn:(j + 1) * bn].to(torch.float32)
            amax = torch.clamp(tile.abs().max(), min=1e-4)
            scale = amax / 448.0
            s[i, j] = scale
            q[i * bm:(i + 1) * bm, j * bn:(j + 1) * bn] = torch.clamp(tile * (1.0 / scale), -448.0,
                                                                      448.0).to(FP8)
    return q, s


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(
        a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))
