"""What the delta codec and every backend's kernels share: the ENC_IDX16 block (from block.h, which the
C++ and CUDA kernels include), the payload's alignment, words of a tensor, and the first room a compare
makes for its changes."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import numpy as np

from weightsync.errors import WeightSyncError


def _block_words() -> int:
    """The ENC_IDX16 block's words, from block.h (the one definition the C++ and CUDA kernels share)."""
    text = (Path(__file__).resolve().parent / "block.h").read_text()
    found = re.search(r"#define WS_DELTA_BLOCK_BITS (\d+)", text)
    if found is None:
        raise WeightSyncError("weightsync/delta/block.h defines no WS_DELTA_BLOCK_BITS")
    return 1 << int(found.group(1))


BLOCK = _block_words()  # words per ENC_IDX16 block (indices inside it fit 16 bits)
ALIGN = 16  # every section of a payload starts at a multiple of this (word views need it)


def first_room(hint: int, total: int) -> int:
    """Changes a compare of ``total`` words makes room for before it knows how many there are: ``hint``
    (the last push's count and a margin), or with none (the first compare) 1/64 of the words (RL steps
    change 1-5% of BF16 values); at least 1024, at most every word."""
    return min(max(hint or total // 64, 1024), max(total, 1))


def _align(n: int) -> int:
    return -(-int(n) // ALIGN) * ALIGN


def word_dtype(w: int) -> Any:
    """The integer torch dtype of ``w`` bytes: compares and copies of it are bitwise."""
    import torch

    return {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[w]


def words(t: Any, w: int) -> Any:
    """A contiguous tensor's bytes as a flat tensor of ``w``-byte integers (trailing bytes left out)."""
    import torch

    b = t.detach().reshape(-1).view(torch.uint8)
    return b[: b.numel() // w * w].view(word_dtype(w))


def _narrow(idx: Any, n: int) -> Any:
    """Changed-word indices as int32 where they fit (they are kept through a push: half the memory)."""
    import torch

    return idx.to(torch.int32) if n < 1 << 31 else idx


def _to_device(a: np.ndarray, device: Any) -> Any:
    """A small host table as a tensor on ``device`` without waiting for the device: a GPU copy from
    pageable memory synchronizes the stream, one from pinned memory with ``non_blocking`` does not (torch's
    host allocator keeps the pinned block until the copy is done)."""
    import torch

    t = torch.from_numpy(np.array(a))  # its own copy: the caller may change ``a``
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t
