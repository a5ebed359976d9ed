"""The delta push's compare and scatter for tensors in host memory, in C++ (cpp/delta/): what
:mod:`weightsync.delta.cuda`'s kernels do on a GPU, for a source or destination on CPU.

Why not the torch ops (:meth:`weightsync.delta.sender.DeltaSender._changed_words` and the per-key gathers, the
reference's indexed update in ``finish``, the receiver's decode and indexed copies): they pass over the data
several times (a byte mask, ``nonzero`` over it, the gathers, the update), many times what reading the tensors
and the reference once costs. The C++ compare reads each current word and its reference word once, writes the
changed words' sorted positions and values, and updates the reference in the same pass (so the sender's
``finish`` has nothing left to copy: ``ref_done``), on up to :func:`threads` threads without the GIL; its
inner loop has no branch per change (cpp/delta/host_delta.cpp says why that matters). The scatter puts an
ENC_IDX16 stream's contiguous runs into their keys without decoding the positions into int64 first, checking
every entry against its run and key (the stream came over the wire).

Both are used where :func:`wanted`: a CPU device, the compiled engine has them, and
``WEIGHTSYNC_DELTA_KERNELS`` is not ``0`` (the torch ops) nor ``1`` under Triton's interpreter
(``TRITON_INTERPRET=1``: the tests run the Triton kernels on CPU that way).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import numpy as np

ENV = "WEIGHTSYNC_DELTA_KERNELS"
THREADS_ENV = "WEIGHTSYNC_DELTA_THREADS"
MAX_THREADS = 16


def available() -> bool:
    """Whether the compiled engine has the host kernels."""
    from weightsync._ext import _core

    return hasattr(_core, "delta_compare") and hasattr(_core, "delta_scatter_idx16")


def wanted(device: Any) -> bool:
    """Whether delta work on ``device`` goes to the host kernels (see the module docstring)."""
    if device.type != "cpu":
        return False
    flag = os.environ.get(ENV, "")
    if flag == "0" or (flag == "1" and os.environ.get("TRITON_INTERPRET", "") == "1"):
        return False
    return available()


def threads() -> int:
    """Threads the host kernels may use: ``WEIGHTSYNC_DELTA_THREADS`` where set, else every CPU this
    process may run on (its affinity), :data:`MAX_THREADS` at most. The compare and the scatter are on
    the push's critical path, which the trainer and the inference engine wait for; torch's intra-op
    thread count is not taken because launchers set ``OMP_NUM_THREADS=1`` for reasons of their own (Ray
    does for every actor without CPUs of its own, which would leave the compare on one thread)."""
    env = os.environ.get(THREADS_ENV, "")
    if env:
        if not env.isdigit() or int(env) < 1:
            raise ValueError(f"{THREADS_ENV}={env!r}: a number of threads of at least 1")
        return int(env)
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # no affinity on this platform
        cpus = os.cpu_count() or 1
    # at most MAX_THREADS by default: a pass over memory stops gaining from threads long before a large
    # host's core count, and each thread costs a start and a scratch
    return max(1, min(cpus, MAX_THREADS))


def _check_words(t: Any, what: str, dtype: Any | None = None) -> None:
    if t.device.type != "cpu":
        raise ValueError(f"{what} is on {t.device}, not the CPU")
    if not t.is_contiguous():
        raise ValueError(f"{what} is not contiguous")
    if dtype is not None and t.dtype != dtype:
        raise ValueError(f"{what} is {t.dtype}, not {dtype}")


class SpaceCompare:
    """One word space's compare on the host, with its buffers kept from one push to the next: the outputs
    (positions, values) and the threads' scratch. Fresh memory costs a page fault per 4 KB page as it is
    first written, a large share of a compare's time; these are reused while
    big enough and not twice too big (about 20 bytes a changed word of the last push held: 42 MB for
    0.225 GB of BF16 at 1.9% changed). What :meth:`compare` returns are views of them: valid until
    this space's next compare (the sender is done with them at ``finish``)."""

    def __init__(self) -> None:
        self.out_idx: Any = None
        self.out_val: Any = None
        self.scratch: Any = None
        self.poison: int | None = None  # tests: fill the outputs with this byte first
        self.ref_updated = True  # the compare puts the changes into the reference (delta_cuda's may not)

    @property
    def scratch_bytes(self) -> int:
        """Bytes held between pushes (outputs and scratch; not the reference)."""
        return sum(int(t.numel()) * t.element_size() for t in (self.out_idx, self.out_val, self.scratch)
                   if t is not None)

    @staticmethod
    def _fit(held: Any, n: int, dtype: Any) -> Any:
        import torch

        if held is None or held.dtype != dtype or not n <= held.numel() <= 2 * max(n, 1024):
            return torch.empty(max(n, 1), dtype=dtype)
        return held

    def compare(self, views: Sequence[Any], ref: Any, hint: int,
                nthreads: int | None = None) -> tuple[Any, Any]:
        """A word space's changed words as (sorted int64 positions, values), bitwise, the reference
        updated: ``views`` its keys' flat integer word views in order (end to end in ``ref``, one flat
        tensor of the same integer dtype). Room for ``hint`` changes first (none: 1/64 of the words);
        where more changed, a second run finds exactly the rest (the first run's are in the reference by
        then), and the two outputs are concatenated."""
        import torch

        from weightsync._ext import _core
        from weightsync.delta.units import first_room

        _check_words(ref, "the reference")
        total = int(ref.numel())
        for i, v in enumerate(views):
            _check_words(v, f"key {i}", ref.dtype)
        held = sum(int(v.numel()) for v in views)
        if held != total:
            raise ValueError(f"the keys hold {held} words, the reference {total}")
        word = int(ref.element_size())
        addrs = np.array([int(v.data_ptr()) for v in views], np.uint64)
        sizes = np.array([int(v.numel()) for v in views], np.int64)
        n = nthreads or threads()
        cap = first_room(hint, total)
        outs: list[tuple[Any, Any]] = []
        first = True
        while True:
            if first:  # the held buffers; a second run's (rare) are its own
                self.out_idx = out_idx = self._fit(self.out_idx, cap, torch.int64)
                self.out_val = out_val = self._fit(self.out_val, cap, ref.dtype)
            else:
                out_idx, out_val = torch.empty(cap, dtype=torch.int64), torch.empty(cap, dtype=ref.dtype)
            scratch_bytes = 0
            if n > 1:  # threads after the first: a share of the changes each, a quarter more for the spread
                share = cap // n + cap // (4 * n) + 4096
                scratch_bytes = (n - 1) * (share * (8 + 2 * word) + 8)
                if first:
                    self.scratch = scratch = self._fit(self.scratch, scratch_bytes, torch.uint8)
                else:
                    scratch = torch.empty(scratch_bytes, dtype=torch.uint8)
            if self.poison is not None:
                out_idx.view(torch.uint8).fill_(self.poison)
                out_val.view(torch.uint8).fill_(self.poison)
            k = int(_core.delta_compare(word, int(ref.data_ptr()), total, addrs, sizes,
                                        int(out_idx.data_ptr()), int(out_val.data_ptr()), cap, n,
                                        int(scratch.data_ptr()) if scratch_bytes else 0, scratch_bytes))
            first = False
            if k <= cap:
                outs.append((out_idx[:k], out_val[:k]))
                break
            # the first cap changes are out and in the reference; the rest are found by a second run
            outs.append((out_idx[:cap], out_val[:cap]))
            cap = k - cap
        if len(outs) == 1:
            return outs[0]
        return torch.cat([o[0] for o in outs]), torch.cat([o[1] for o in outs])


def compare(views: Sequence[Any], ref: Any, hint: int, poison: int | None = None,
            nthreads: int | None = None) -> tuple[Any, Any]:
    """:meth:`SpaceCompare.compare` with buffers of its own (none kept); ``poison``: fill the outputs
    with this byte first (tests: an entry left unwritten shows)."""
    held = SpaceCompare()
    held.poison = poison
    return held.compare(views, ref, hint, nthreads)


def _scatter_table(runs: Sequence[Sequence[int]], key_bytes: Sequence[int], w: int) -> np.ndarray:
    """The C++ scatter's run table: the rows of ``runs`` with each key's size in words beside its
    address."""
    if len(key_bytes) != len(runs):
        raise ValueError(f"{len(runs)} runs but {len(key_bytes)} key sizes")
    table = np.zeros((len(runs), 7), np.int64)
    if len(runs):
        r = np.asarray(runs, np.int64).reshape(-1, 6)
        table[:, 0] = r[:, 0]
        table[:, 1] = np.asarray(key_bytes, np.int64) // w
        table[:, 2:] = r[:, 1:]
    return table


def scatter_idx16(payload: Any, n: int, k: int, w: int, vals_at: int, runs: Sequence[Sequence[int]],
                  key_bytes: Sequence[int], nthreads: int | None = None) -> str:
    """Scatters the contiguous runs of an ENC_IDX16 stream (``payload``: uint8 on the CPU from the
    stream's start, ``n`` words of which ``k`` changed, ``w`` bytes a word, values at byte ``vals_at``)
    into their keys: ``runs`` rows as :func:`weightsync.delta.triton_kernels.scatter_idx16` takes them
    (the key's address, shift from stream positions to its words, first and last+1 changed index, first
    and last+1 stream position), ``key_bytes`` each run's key's size (every store is checked to lie in
    it). Returns ``"host"`` (which kernels scattered)."""
    import torch

    from weightsync._ext import _core
    from weightsync.delta.units import BLOCK, _align

    _check_words(payload, "the payload", torch.uint8)
    nb = -(-n // BLOCK)
    if int(payload.numel()) < vals_at + w * k or vals_at < _align(4 * nb) + 2 * k:
        raise ValueError(f"an ENC_IDX16 stream of {k} changed {w}-byte words out of {n} does not fit "
                         f"{int(payload.numel())} bytes with its values at {vals_at}")
    table = _scatter_table(runs, key_bytes, w)
    base = int(payload.data_ptr())
    _core.delta_scatter_idx16(w, n, k, base, base + _align(4 * nb), base + vals_at, table,
                              nthreads or threads())
    return "host"


def scatter_bitmap(payload: Any, n: int, k: int, w: int, vals_at: int, runs: Sequence[Sequence[int]],
                   key_bytes: Sequence[int], nthreads: int | None = None) -> str:
    """:func:`scatter_idx16` for an ENC_BITMAP stream (bit ``i % 8`` of byte ``i // 8`` set for each
    changed word ``i``, then the values at byte ``vals_at``): its set bits read into what an ENC_IDX16
    stream holds (each position's low 16 bits, the count per 65536-word block) by C++, then the same
    C++ scatter, which checks every store. The torch ops before (every bit unpacked, ``nonzero``, an
    indexed copy per run) pass over every bit several times. Raises ValueError
    where the bitmap does not set exactly ``k`` bits below ``n`` (no key is touched then)."""
    import torch

    from weightsync._ext import _core
    from weightsync.delta.units import BLOCK

    _check_words(payload, "the payload", torch.uint8)
    if int(payload.numel()) < vals_at + w * k or vals_at < -(-n // 8):
        raise ValueError(f"an ENC_BITMAP stream of {k} changed {w}-byte words out of {n} does not fit "
                         f"{int(payload.numel())} bytes with its values at {vals_at}")
    table = _scatter_table(runs, key_bytes, w)
    counts = np.empty(-(-n // BLOCK), np.int32)
    low = np.empty(k, np.uint16)
    base = int(payload.data_ptr())
    n_threads = nthreads or threads()
    _core.delta_bitmap_to_idx16(base, n, k, int(counts.ctypes.data), int(low.ctypes.data), n_threads)
    _core.delta_scatter_idx16(w, n, k, int(counts.ctypes.data), int(low.ctypes.data), base + vals_at, table,
                              n_threads)
    return "host"
