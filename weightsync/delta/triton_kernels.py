"""The delta sender's compare and the receiver's scatter on a GPU as Triton kernels: what
:meth:`weightsync.delta.sender.DeltaSender._changed_words` and the per-key value gathers produce (the
sorted int64 positions of a space's changed words and their new values), reading each current tensor and
the reference once, and updating the reference in the same pass.

A space's keys are cut into tiles of :data:`TILE` words (a key's last tile may be short; a tile never
spans two keys), in the order of the keys in the space, so the tiles' changes come out sorted.

* ``_compact``, one program per tile: loads the tile's current and reference words (integer views: the
  compare is bitwise), counts the changed ones and, when at most :data:`SLOT` changed, writes their
  in-tile indices (int16) and values into the tile's slot of a scratch area and stores them into the
  reference. A tile with more changes (*overflowed*) only writes its count and leaves its reference
  words as they were.
* a ``cumsum`` of the counts (torch), whose last element is read by the host: the slice's changed words
  (the one host synchronization per slice, as the torch path's ``nonzero``);
* ``_place``, one program per tile: copies the slot's entries to their final place (position = tile
  start + in-tile index, value); an overflowed tile compares its words again (its reference is as it
  was), writes its positions and values directly and updates its reference.

The kernels find a key's words from the reference's pointer plus the key's distance from it in words
(a table per space, rebuilt when a tensor's storage moves), so that where every key and the reference
are 16-byte aligned (``Compactor.vec``) the compiler may load whole tiles in 16-byte vectors; a space
whose keys are not a whole number of words from its reference is compared by the torch ops.

Tiles go in slices of at most :data:`COMPARE_SLICE` words and :data:`SCRATCH_BYTES` of slot scratch (the
slots: ``SLOT * (2 + w)`` bytes a tile, ``w`` the word size; plus 12 bytes a tile of counts). The scratch
is allocated per slice from torch's caching allocator on the trainer's device and freed after the push's
compare (:attr:`Compactor.scratch_bytes`: the largest of the last compare; it is not part of
``PushStats.delta_ref_bytes``, which counts the reference only).

The receiver's side (:func:`scatter_idx16`): an ENC_IDX16 stream's contiguous runs (entries of one key
whose stream and key positions differ by one shift) scattered by one kernel per stream, without
decoding the positions into int64 first: per (run, 65536-word block) pair, the block's base from the
cumsum of the block counts, each changed word stored at ``block * 65536 + low16 + shift`` of its key.
Strided runs and bitmap streams keep the torch ops.

The sender's compare runs here only where the CUDA C++ kernel (:mod:`weightsync.delta.cuda`,
faster) cannot be compiled, or with ``WEIGHTSYNC_DELTA_KERNELS=triton``; the receiver's scatter runs
here where ``triton`` imports. Both only on CUDA, unless ``WEIGHTSYNC_DELTA_KERNELS=0``. With Triton's
interpreter (``TRITON_INTERPRET=1`` before triton is imported) and ``WEIGHTSYNC_DELTA_KERNELS=1`` the
kernels also run on CPU tensors (the tests do that); without the interpreter they never run on CPU.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

TILE = 4096  # words per tile (in-tile indices fit int16)
SLOT = 512  # changed words a tile's slot holds (12.5%: more is an overflowed tile, compared twice)
COMPARE_SLICE = 1 << 29  # words per slice at most (the delta module's slice)
SCRATCH_BYTES = 256 << 20  # slot scratch per slice at most
ENV = "WEIGHTSYNC_DELTA_KERNELS"
assert TILE % SLOT == 0 and TILE <= 1 << 15

try:  # without triton (a CPU host may lack it) the torch path runs and these kernels are never defined
    import triton
    import triton.language as tl
except Exception:
    triton = None

# Triton's interpreter patches triton.language module-wide while a kernel runs: sources in threads of one
# process (the tests) launch one at a time there. Compiled launches need no lock.
_interpreter_lock = threading.Lock()


def _launching(device: Any) -> contextlib.AbstractContextManager[Any]:
    """Around a launch: the tensors' GPU made current (triton launches on the current one), or under the
    interpreter its lock."""
    if os.environ.get("TRITON_INTERPRET", "") == "1":
        return _interpreter_lock
    if device.type == "cuda":
        import torch

        return torch.cuda.device(device)
    return contextlib.nullcontext()


if triton is not None:
    @triton.jit
    def _tile(key_at, key_start, key_end, tile_key, tile_start, ref_ptr, t, TILE: tl.constexpr,
              VEC: tl.constexpr):
        """Tile ``t``: its first word in the space, its words, and where its key's current words from it
        are (``key_at``: each key's address in words from the reference's). ``VEC`` > 1: every key's
        words and address are aligned to 16 bytes (``VEC`` words), which lets the loads be 16-byte
        vectors (the host checks it: the compiler cannot see it through the tables)."""
        key = tl.load(tile_key + t)
        start = tl.multiple_of(tl.load(tile_start + t), VEC)
        kstart = tl.multiple_of(tl.load(key_start + key), VEC)
        n = tl.minimum(tl.load(key_end + key) - start, TILE)
        at = tl.multiple_of(tl.load(key_at + key), VEC)
        return start, n, ref_ptr + at + (start - kstart)

    @triton.jit
    def _compact(key_at, key_start, key_end, tile_key, tile_start, ref_ptr, counts_ptr, slot_idx, slot_val,
                 t0, TILE: tl.constexpr, SLOT: tl.constexpr, VEC: tl.constexpr):
        pid = tl.program_id(0)
        start, n, cur = _tile(key_at, key_start, key_end, tile_key, tile_start, ref_ptr, t0 + pid, TILE,
                              VEC)
        o = tl.arange(0, TILE)
        inside = o < n
        if n == TILE:  # a whole tile (all but a key's last): loads without a mask can be vectors
            x = tl.load(cur + o)
            r = tl.load(ref_ptr + start + o)
        else:
            x = tl.load(cur + o, mask=inside, other=0)
            r = tl.load(ref_ptr + start + o, mask=inside, other=0)
        changed = (x != r) & inside
        c = changed.to(tl.int32)
        count = tl.sum(c, axis=0)
        tl.store(counts_ptr + pid, count)
        if (count > 0) & (count <= SLOT):
            at = pid.to(tl.int64) * SLOT + (tl.cumsum(c, axis=0) - c)
            tl.store(slot_idx + at, o.to(tl.int16), mask=changed)
            tl.store(slot_val + at, x, mask=changed)
            tl.store(ref_ptr + start + o, x, mask=changed)

    @triton.jit
    def _place(key_at, key_start, key_end, tile_key, tile_start, ref_ptr, counts_ptr, ends_ptr, slot_idx,
               slot_val, out_idx, out_val, t0, TILE: tl.constexpr, SLOT: tl.constexpr, VEC: tl.constexpr):
        pid = tl.program_id(0)
        count = tl.load(counts_ptr + pid)
        base = tl.load(ends_ptr + pid) - count  # where the tile's changes go in the slice's output
        start = tl.load(tile_start + t0 + pid)
        j = tl.arange(0, SLOT)
        if (count > 0) & (count <= SLOT):
            m = j < count
            at = pid.to(tl.int64) * SLOT + j
            local = tl.load(slot_idx + at, mask=m, other=0).to(tl.int64)
            tl.store(out_idx + base + j, start + local, mask=m)
            tl.store(out_val + base + j, tl.load(slot_val + at, mask=m, other=0), mask=m)
        elif count > SLOT:  # overflowed: its reference is untouched, so compared again here
            start, n, cur = _tile(key_at, key_start, key_end, tile_key, tile_start, ref_ptr, t0 + pid, TILE,
                                  VEC)
            run = base
            for s in tl.static_range(0, TILE, SLOT):
                o = s + j
                inside = o < n
                x = tl.load(cur + o, mask=inside, other=0)
                r = tl.load(ref_ptr + start + o, mask=inside, other=0)
                changed = (x != r) & inside
                c = changed.to(tl.int32)
                at = run + (tl.cumsum(c, axis=0) - c)
                tl.store(out_idx + at, start + o, mask=changed)
                tl.store(out_val + at, x, mask=changed)
                tl.store(ref_ptr + start + o, x, mask=changed)
                run += tl.sum(c, axis=0)

    @triton.jit
    def _scatter16(pair_run, pair_block, run_at, run_lo, run_hi, ends_ptr, low_ptr, vals_ptr,
                   BLOCK: tl.constexpr, CH: tl.constexpr):
        """One (run, block) pair of an ENC_IDX16 stream: the run's changed words in the block (changed
        indices ``run_lo:run_hi`` of the stream, clipped to the block's) stored at their place in the
        run's key: word ``block * BLOCK + low16 + run_at`` from ``vals_ptr`` (``run_at``: the key's words
        from the values' address, plus the run's shift from stream positions to the key's words)."""
        pid = tl.program_id(0)
        r = tl.load(pair_run + pid)
        b = tl.load(pair_block + pid).to(tl.int64)
        lo = tl.maximum(tl.load(ends_ptr + b), tl.load(run_lo + r))
        hi = tl.minimum(tl.load(ends_ptr + b + 1), tl.load(run_hi + r))
        base = b * BLOCK + tl.load(run_at + r)
        for s in range(lo, hi, CH):
            j = s + tl.arange(0, CH)
            m = j < hi
            low = tl.load(low_ptr + j, mask=m, other=0).to(tl.int64) & 0xFFFF
            tl.store(vals_ptr + base + low, tl.load(vals_ptr + j, mask=m, other=0), mask=m)


# the receiver's run rows (target, shift, first and last+1 entry, first and last+1 stream position) in the
# order delta_cuda's scatters read them (first and last+1 entry, shift, target, the positions)
_CUDA_RUN_COLUMNS = [2, 3, 1, 0, 4, 5]


def _values_and_runs(payload: Any, vals_at: int, w: int, k: int, runs: Any) -> tuple[Any, np.ndarray] | None:
    """A stream's ``k`` values (``w``-byte words at byte ``vals_at`` of ``payload``) and ``runs`` as an
    int64 table; None where a run's target is not a whole number of words from the values (the kernels
    address targets in words)."""
    from weightsync.delta.units import word_dtype

    vals = payload[vals_at:vals_at + w * k].view(word_dtype(w))
    table = np.asarray(runs, np.int64).reshape(-1, 6)
    if np.any((table[:, 0] - int(vals.data_ptr())) % w):
        return None
    return vals, table


def scatter_bitmap(payload: Any, n: int, k: int, w: int, vals_at: int, runs: Any, device: Any,
                   refusal_flag: Callable[[], Any]) -> str:
    """:func:`scatter_idx16` for an ENC_BITMAP stream (bit ``i % 8`` of byte ``i // 8`` set for each
    changed word ``i``): on CUDA by weightsync.delta.cuda's kernels straight from the bits
    (``cuda``); where the bits below ``n`` are not exactly ``k`` nothing is scattered, and a change outside
    its run is not stored; either sets the flag (a zeroed int32 on the device) ``refusal_flag()`` gives.
    "" (the caller's torch ops) elsewhere, or where a target is not a whole number of words from the
    values."""
    import torch

    if device.type != "cuda":
        return ""
    from weightsync.delta import cuda as delta_cuda

    mod = delta_cuda.module(device)
    found = _values_and_runs(payload, vals_at, w, k, runs)
    if mod is None or found is None:
        return ""
    vals, table = found
    bits = payload[:4 * -(-n // 32)].view(torch.int32)
    delta_cuda.scatter_bitmap(mod, bits, n, k, vals, table[:, _CUDA_RUN_COLUMNS], refusal_flag())
    return "cuda"


def scatter_idx16(payload: Any, n: int, k: int, w: int, vals_at: int, runs: Any, device: Any,
                  refusal_flag: Callable[[], Any]) -> str:
    """Scatters the contiguous runs of an ENC_IDX16 stream (``payload``: uint8 from the stream's start,
    ``n`` words of which ``k`` changed, values at byte ``vals_at``) into their keys with one kernel:
    ``runs`` rows of (target: the address of the key's first byte, shift: the key's word of stream
    position 0, first and last+1 changed index, first and last+1 stream position). Returns which kernels
    scattered (``cuda``: weightsync.delta.cuda's, else ``triton``), "" (nothing done) where a
    target is not a whole number of words from the values or no kernel can run (the caller's torch ops
    scatter). The CUDA kernel checks the stream against its entries: what does not match is not stored
    and sets the flag (a zeroed int32 on the device) ``refusal_flag()`` gives."""
    import torch

    from weightsync.delta.units import BLOCK, _align

    nb = -(-n // BLOCK)
    found = _values_and_runs(payload, vals_at, w, k, runs)
    if found is None:
        return ""
    vals, runs = found
    low = payload[_align(4 * nb):_align(4 * nb) + 2 * k].view(torch.int16)
    if device.type == "cuda":  # the CUDA C++ scatter first (weightsync.delta.cuda)
        from weightsync.delta import cuda as delta_cuda

        mod = delta_cuda.module(device)
        if mod is not None:
            ends = delta_cuda.block_ends(mod, payload[:4 * nb].view(torch.int32))
            delta_cuda.scatter_runs(mod, ends, low, vals, runs[:, _CUDA_RUN_COLUMNS], refusal_flag())
            return "cuda"
    if triton is None:
        return ""
    table = runs[:, 1:]
    at = (runs[:, 0] - int(vals.data_ptr())) // w + table[:, 0]
    first, last = table[:, 3] // BLOCK, (table[:, 4] - 1) // BLOCK
    per = last - first + 1
    pair_run = np.repeat(np.arange(len(runs), dtype=np.int32), per)
    pair_block = (np.arange(int(per.sum()), dtype=np.int64) - np.repeat(np.cumsum(per) - per, per)
                  + np.repeat(first, per)).astype(np.int32)
    host = np.concatenate([at, table[:, 1], table[:, 2]])
    dev = torch.from_numpy(host)
    pairs = torch.from_numpy(np.stack([pair_run, pair_block]))
    if device.type == "cuda":  # small tables: pinned and non-blocking (no wait for the device)
        dev = dev.pin_memory().to(device, non_blocking=True)
        pairs = pairs.pin_memory().to(device, non_blocking=True)
    if not len(pair_run):
        return "triton"
    m = len(runs)
    with _launching(device):
        _scatter16[(len(pair_run),)](pairs[0], pairs[1], dev[:m], dev[m:2 * m], dev[2 * m:],
                                     _block_ends(payload, nb, device), low, vals, BLOCK=BLOCK, CH=1024,
                                     num_warps=4)
    return "triton"


def _block_ends(payload: Any, nb: int, device: Any) -> Any:
    """An ENC_IDX16 stream's ``nb`` block counts (its head) as the int64 cumsum from 0: block ``b``'s
    entries are ``ends[b]:ends[b + 1]``."""
    import torch

    ends = torch.zeros(nb + 1, dtype=torch.int64, device=device)
    torch.cumsum(payload[:4 * nb].view(torch.int32), 0, out=ends[1:])
    return ends


def enabled(device: Any) -> bool:
    """Whether the kernels run for tensors on ``device``: CUDA with triton or NVRTC's kernels, unless the
    environment turns them off; on CPU only when forced under Triton's interpreter (tests)."""
    flag = os.environ.get(ENV, "")
    if flag == "0":
        return False
    if device.type == "cuda":  # the CUDA C++ kernels need no triton
        from weightsync.delta import cuda as delta_cuda

        return triton is not None or delta_cuda.wanted()
    return flag == "1" and os.environ.get("TRITON_INTERPRET", "") == "1" and triton is not None


class Compactor:
    """One word space's tile tables (built once; rebuilt if a tensor's storage moved) and its compare."""

    def __init__(self, word: int, starts: np.ndarray, device: Any) -> None:
        self.word = word
        self.starts = np.asarray(starts, np.int64)
        self.device = device
        self.addrs: list[int] = []
        self.ref_addr = 0
        self.usable = True  # every key's address is a whole number of words from the reference's
        self.tables: tuple[Any, ...] = ()
        self.slices: list[tuple[int, int]] = []  # tile ranges
        self.vec = 1  # words per 16 bytes where every key's words and address are 16-byte aligned
        self.slice_ends: list[int] = []
        self.scratch_bytes = 0
        self.keys: tuple[Any, ...] = ()
        self.cuda_tables: tuple[Any, ...] | None = None
        self.cuda_tile_starts: np.ndarray = np.zeros(0, np.int64)  # cuda_tables' tile starts on the host
        # the kernels of the last compare: "cuda" (weightsync.delta.cuda), "triton" (these)
        self.backend = ""
        # whether the last compare put the changed values into the reference (the Triton kernels do; the
        # CUDA ones leave it to the caller)
        self.ref_updated = False
        # tests: fill the scratch and the outputs with this byte first (an entry left unwritten shows)
        self.poison: int | None = None
        # a compare started by launch: the keys' and the reference's addresses it read, its collect
        self.pending: tuple[list[int], int, Any] | None = None
        self._host_count: Any = None  # pinned: the collect's count for the host
        # the last compare's searches of the query given to search_ahead (numpy), else None
        self.cuts: Any = None

    def _tables(self, views: Sequence[Any], ref: Any) -> None:
        import torch

        addrs = [int(v.data_ptr()) for v in views]
        if addrs == self.addrs and ref.data_ptr() == self.ref_addr:
            return
        # A key's words are found from the reference's address (a pointer the kernels are given, so the
        # compiler knows its alignment): the distance in words, which must be whole.
        dist = np.array(addrs, np.int64) - int(ref.data_ptr())
        self.usable = not np.any(dist % self.word)
        tile_key, tile_start = self._tiles(TILE)
        dev = self.device
        self.keys = (torch.from_numpy(dist // self.word).to(dev),
                     torch.from_numpy(self.starts[:-1].copy()).to(dev),
                     torch.from_numpy(self.starts[1:].copy()).to(dev))
        self.tables = (*self.keys, torch.from_numpy(tile_key).to(dev), torch.from_numpy(tile_start).to(dev))
        self.cuda_tables = None
        aligned = all(a % 16 == 0 for a in [*addrs, int(ref.data_ptr())]) and \
            not np.any(self.starts * self.word % 16)
        self.vec = 16 // self.word if aligned else 1
        per_slice = max(1, min(COMPARE_SLICE // TILE, SCRATCH_BYTES // (SLOT * (2 + self.word))))
        total = len(tile_key)
        self.slices = [(a, min(a + per_slice, total)) for a in range(0, total, per_slice)]
        # the word after each slice's last (where its last tile ends in the space)
        self.slice_ends = [int(min(tile_start[b - 1] + TILE, self.starts[tile_key[b - 1] + 1]))
                           for _, b in self.slices]
        self.addrs, self.ref_addr = addrs, int(ref.data_ptr())

    def _tiles(self, tile: int) -> tuple[np.ndarray, np.ndarray]:
        """The space cut into tiles of ``tile`` words (a key's last one may be short): each tile's key and
        first word."""
        sizes = np.diff(self.starts)
        ntiles = -(-sizes // tile)
        tile_key = np.repeat(np.arange(len(sizes), dtype=np.int32), ntiles)
        first = np.concatenate([[0], np.cumsum(ntiles)])[:-1]
        within = np.arange(int(ntiles.sum()), dtype=np.int64) - np.repeat(first, ntiles)
        return tile_key, self.starts[:-1][tile_key] + within * tile

    def _cuda(self) -> Any:
        """The CUDA kernels' module where they run on this device (their tile tables made), else None."""
        import torch

        if self.device.type != "cuda":
            return None
        from weightsync.delta import cuda as delta_cuda

        mod = delta_cuda.module(self.device)
        if mod is not None and self.cuda_tables is None:  # its tiles are larger (32 KB)
            tile_key, tile_start = self._tiles(delta_cuda.tile_words(self.word))
            self.cuda_tables = (*self.keys, torch.from_numpy(tile_key).to(self.device),
                                torch.from_numpy(tile_start).to(self.device))
            self.cuda_tile_starts = tile_start
        return mod

    def launch(self, views: Sequence[Any], ref: Any, hint: int, stream: Any) -> bool:
        """Starts the CUDA compare of the space on ``stream`` (which must wait for the keys' and the
        reference's writers) and returns at once; the next :meth:`compare` with the same tensors takes
        its outcome. False (nothing started) where the CUDA kernels do not run here: :meth:`compare`
        does all of it then."""
        import torch

        self.pending = None
        self._tables(views, ref)
        mod = self._cuda() if self.usable else None
        nt = int(self.cuda_tables[3].numel()) if mod is not None else 0
        if not nt:
            return False
        from weightsync.delta import cuda as delta_cuda

        if self._host_count is None:
            self._host_count = torch.empty(1, dtype=torch.int64, pin_memory=True)
        self.pending = (self.addrs, self.ref_addr, delta_cuda.launch(
            mod, self.cuda_tables, self.cuda_tile_starts, self.vec > 1, self.word, ref, hint,
            int(self.starts[-1]), self.poison, stream, self._host_count))
        self._note_cuda(nt, hint)
        return True

    def search_ahead(self, query: Any, stream: Any) -> None:
        """Queues on ``stream`` the searches of ``query`` (int64 positions in the space) over the changes
        of the compare started by :meth:`launch`, so that :meth:`compare` waits for the device once, gives
        their answers in :attr:`cuts` and the changes as the collect left them
        (:class:`weightsync.delta.cuda.TileChanges`). Nothing where no compare was launched."""
        if self.pending is not None:
            self.pending[2].search_ahead(query, stream)
            self.scratch_bytes += 8 * self.pending[2].ntiles  # the tiles' prefix

    def _note_cuda(self, nt: int, hint: int) -> None:
        from weightsync.delta.units import first_room

        self.backend = "cuda"
        self.ref_updated = False
        # the tiles' counts and places, the scratch of (16-bit word, value) per change
        self.scratch_bytes = (2 * nt + 1) * 8 + first_room(hint, int(self.starts[-1])) * (2 + self.word)

    def compare(self, views: Sequence[Any], ref: Any, hint: int) -> tuple[Any, Any] | Any | None:
        """The changed words of the space (``views``: its keys' word views in order, ``ref``: its
        reference) as (sorted int64 positions, values), or as the CUDA collect left them where
        :meth:`search_ahead` was queued (:class:`weightsync.delta.cuda.TileChanges`, its
        searches' answers in :attr:`cuts`); the reference takes the values here where
        :attr:`ref_updated` says so after the call (the Triton kernels), else the caller copies them in
        (the CUDA kernels). ``hint``: how many changed words to make room for first. A compare started
        by :meth:`launch` on these tensors is finished here. None (nothing done) where a key's address
        is not a whole number of words from the reference's (the torch path compares that space)."""
        import torch

        pending, self.pending = self.pending, None
        self.cuts = None
        self._tables(views, ref)
        if pending is not None and pending[0] == self.addrs and pending[1] == self.ref_addr:
            found = pending[2].finish()
            self.cuts = pending[2].cuts
            return found
        if not self.usable:
            return None
        total = int(self.starts[-1])
        mod = self._cuda()
        if mod is not None:
            from weightsync.delta import cuda as delta_cuda

            nt = int(self.cuda_tables[3].numel())
            self._note_cuda(nt, hint)
            return delta_cuda.compare(mod, self.cuda_tables, self.cuda_tile_starts, self.vec > 1, self.word,
                                      ref, hint, total, self.poison)
        if triton is None:
            return None
        self.backend = "triton"
        self.ref_updated = True
        compact, place = _compact, _place
        out_idx = torch.empty(min(max(hint, 1024), max(total, 1)), dtype=torch.int64, device=self.device)
        out_val = torch.empty(out_idx.numel(), dtype=ref.dtype, device=self.device)
        if self.poison is not None:
            out_idx.view(torch.uint8).fill_(self.poison)
            out_val.view(torch.uint8).fill_(self.poison)
        k = 0
        self.scratch_bytes = 0
        for (a, b), end in zip(self.slices, self.slice_ends, strict=True):
            nt = b - a
            counts = torch.empty(nt, dtype=torch.int32, device=self.device)
            slot_idx = torch.empty(nt * SLOT, dtype=torch.int16, device=self.device)
            slot_val = torch.empty(nt * SLOT, dtype=ref.dtype, device=self.device)
            if self.poison is not None:
                for t in (counts, slot_idx, slot_val):
                    t.view(torch.uint8).fill_(self.poison)
            self.scratch_bytes = max(self.scratch_bytes, nt * (SLOT * (2 + self.word) + 12))
            with _launching(self.device):
                compact[(nt,)](*self.tables, ref, counts, slot_idx, slot_val, a, TILE=TILE, SLOT=SLOT,
                               VEC=self.vec, num_warps=8)
            ends = torch.cumsum(counts, 0)
            m = int(ends[-1])  # a host synchronization (the slice's count)
            if k + m > out_idx.numel():  # grown by the density seen so far (as the torch path's buffer)
                seen = max(end, 1)  # words compared so far
                grow = min(max(total, 1), max((k + m) * total // seen + 1024, k + m))
                idx2 = torch.empty(grow, dtype=torch.int64, device=self.device)
                val2 = torch.empty(grow, dtype=ref.dtype, device=self.device)
                if self.poison is not None:
                    idx2.view(torch.uint8).fill_(self.poison)
                    val2.view(torch.uint8).fill_(self.poison)
                idx2[:k].copy_(out_idx[:k])
                val2[:k].copy_(out_val[:k])
                out_idx, out_val = idx2, val2
            if m:
                with _launching(self.device):
                    place[(nt,)](*self.tables, ref, counts, ends, slot_idx, slot_val, out_idx[k:],
                                 out_val[k:], a, TILE=TILE, SLOT=SLOT, VEC=self.vec, num_warps=4)
            k += m
            del counts, slot_idx, slot_val, ends
        return out_idx[:k], out_val[:k]
