"""What callers hand the engine, checked and turned into what the binding takes: a registered buffer's
pointer, size and memory kind, a write's offsets and sizes, a batch's columns, an immediate. A bad value is
a TransportError naming the argument (and the write of a batch), never the binding's bare TypeError or a
value numpy wrapped around."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from weightsync.errors import TransportError

# Memory kinds as the binding numbers them (MemKind in cpp/core/lane.hpp).
KIND_HOST = 0
KIND_CUDA = 1


@dataclass(frozen=True)
class BufferInfo:
    ptr: int
    nbytes: int
    kind: int
    device: int
    label: str


def buffer_info(buffer: Any, name: str | None) -> BufferInfo:
    """Pointer and size of a torch tensor, numpy array or writable buffer."""
    label = name or type(buffer).__name__
    try:
        import torch
    except ImportError:  # pragma: no cover - torch is a dependency; keep numpy usable without it
        torch = None
    if torch is not None and isinstance(buffer, torch.Tensor):
        if not buffer.is_contiguous():
            raise TransportError(f"cannot register tensor {label}: it is not contiguous (call .contiguous())")
        nbytes = buffer.numel() * buffer.element_size()
        if buffer.is_cuda:
            return BufferInfo(buffer.data_ptr(), nbytes, KIND_CUDA, buffer.device.index or 0, label)
        return BufferInfo(buffer.data_ptr(), nbytes, KIND_HOST, -1, label)
    if isinstance(buffer, np.ndarray):
        if not buffer.flags.c_contiguous:
            raise TransportError(f"cannot register array {label}: it is not C-contiguous")
        return BufferInfo(buffer.ctypes.data, buffer.nbytes, KIND_HOST, -1, label)
    try:
        view = memoryview(buffer)
    except TypeError:
        raise TransportError(
            f"cannot register {label}: expected a torch tensor, numpy array or writable buffer"
        ) from None
    if view.readonly:
        raise TransportError(f"cannot register {label}: the buffer is read-only")
    arr = np.frombuffer(view, dtype=np.uint8)
    return BufferInfo(arr.ctypes.data, arr.nbytes, KIND_HOST, -1, label)


def u64(value: Any, name: str, where: str) -> int:
    """``value`` as an unsigned 64-bit integer, or a TransportError naming the argument and the call
    (nanobind would raise a bare TypeError naming neither)."""
    try:
        v = int(value)
    except (TypeError, ValueError):
        raise TransportError(f"{where}: {name} {value!r} is not an integer") from None
    if v < 0:
        raise TransportError(f"{where}: {name} {v} must be >= 0")
    if v >= 1 << 64:
        raise TransportError(f"{where}: {name} {v} does not fit in 64 bits (0 <= {name} < 2**64)")
    return v


def column(values: Any, dtype: type[np.unsignedinteger], name: str) -> np.ndarray:
    """A batch column as a contiguous array of ``dtype``; a value out of its range is a TransportError
    naming the column and the first offending write (numpy would wrap negatives or raise OverflowError)."""
    arr = np.asarray(values)
    if arr.dtype == dtype:  # the plan's columns: every value of an unsigned type is in its range
        return np.ascontiguousarray(arr)
    limit = int(np.iinfo(dtype).max)
    if arr.dtype.kind in "ui":
        bad = np.flatnonzero((arr < 0) | (arr > limit)) if arr.size else np.empty(0, dtype=np.int64)
        if bad.size:
            k = int(bad[0])
            raise TransportError(
                f"write {k} of the batch: {name} {int(arr.reshape(-1)[k])} is outside 0..{limit}"
            )
        return np.ascontiguousarray(arr, dtype=dtype)
    flat = arr.reshape(-1)
    for k, v in enumerate(flat.tolist()):
        if not isinstance(v, int) or isinstance(v, bool):
            try:
                i = int(v)
            except (TypeError, ValueError, OverflowError):  # OverflowError: inf
                raise TransportError(f"write {k} of the batch: {name} {v!r} is not an integer") from None
            if i != v:  # a fraction (int() would cut it off: bytes at another offset)
                raise TransportError(f"write {k} of the batch: {name} {v!r} is not an integer")
            v = i
        if not 0 <= v <= limit:
            raise TransportError(f"write {k} of the batch: {name} {v} is outside 0..{limit}")
    return np.ascontiguousarray(flat.astype(dtype), dtype=dtype).reshape(arr.shape)


def used_entries(table: Sequence[Any], index: np.ndarray) -> tuple[Sequence[Any], np.ndarray]:
    """The entries of ``table`` that ``index`` (a uint32 batch column) names, in table order, and the
    column renumbered into them: the same writes from the same regions. The table as given where the
    batch names all of it, or an index out of range (the engine's error then names the write)."""
    n = len(table)
    if index.ndim != 1 or not index.size or n <= 1:
        return table, index
    if int(index.max()) >= n:
        return table, index
    named = np.zeros(n, dtype=bool)
    named[index] = True
    kept = np.flatnonzero(named)
    if len(kept) == n:
        return table, index
    renumber = np.cumsum(named, dtype=np.uint32) - np.uint32(1)
    return [table[i] for i in kept.tolist()], np.ascontiguousarray(renumber[index])


def immediate(imm: int | None) -> int | None:
    """``imm`` as the engine's 32-bit immediate (None: the write carries none)."""
    if imm is None:
        return None
    if not 0 <= int(imm) < 1 << 32:
        raise TransportError(f"immediate {imm} does not fit in 32 bits")
    return int(imm)
