"""The delta push's device kernels in CUDA C++ (their source: kernels.cu beside this module), compiled at
run time (:mod:`weightsync.delta.nvrtc`): the sender's compare, the encode of a sparse stream (ENC_IDX16 or
ENC_BITMAP) from the compare's changes, and the receiver's scatter of such a stream.

The compare reads the current tensors and the reference once, with one host synchronization, and leaves
the reference alone: the caller copies the changes into it later
(:meth:`weightsync.delta.sender.DeltaSender.finish`, while the destinations apply theirs), off the push's
path. Its kernels:

* ``ws_collect``: each block of 256 threads takes one 32 KB tile (:func:`tile_words` words; the
  Compactor's tables of these tiles), loads it in 16-byte vectors where aligned, counts its changes with
  ``__popc`` of per-thread bit masks and a warp-shuffle scan, takes room for them at the end of a scratch
  with one ``atomicAdd`` and writes there each change's word within the tile (16 bits) and its value, in
  order; the tile's count and its place in the scratch go into two tables. Tiles finish in any order and
  none waits for another.
* ``ws_tile_search``: how many changes lie before given positions (where each key's and each write's
  changes start), from the exclusive ``cumsum`` of the tile counts and a search within one tile.
* ``ws_encode_tiles`` / ``ws_bitmap_tiles`` and ``ws_ref_tiles``: a stream's entries (16-bit indices and
  block counts, or bits) and the reference's update, read straight from the scratch, a warp per tile
  (:class:`TileChanges`).
* ``ws_bitmap_counts`` and ``ws_bitmap_scatter``: the receiver's scatter of an ENC_BITMAP stream straight
  from its bits (no 16-bit indices made: a stream of a billion changes would want 2 GB for them), each
  change checked against its write, a refusal flag set where the bits do not match the entries.
* ``ws_order``: the changes in word order as int64 positions and values, a block per tile, for what wants
  them so (:meth:`TileChanges.ordered`; :func:`compare`).

Why this shape: an in-tile compaction (the Triton kernels') costs more than the reads themselves; a
single pass that places each tile by a decoupled look-back over its predecessors' counts waits on them;
storing the changes into the reference inside the compare reads lines that have left L2 by then; and
putting the changes in order before the encode moves bytes per change beside the next span's compare,
whose kernels it holds up (scripts/bench_delta_kernels.py times the alternatives).

The scratch has room for ``cap`` changes (the caller's guess: the last push's count and a margin). A
change past ``cap`` is not written; the count comes back (the host read), and if it exceeds ``cap`` the
collect runs again with room for all of them (the reference is unchanged, so it finds the same changes).

Every kernel runs on torch's current stream of its tensors' device; :func:`module` gives them where
NVRTC can compile them and ``WEIGHTSYNC_DELTA_KERNELS`` does not choose another path.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from weightsync.delta import nvrtc
from weightsync.delta.units import first_room
from weightsync.runtime.trace import mark

THREADS = 256
ROUNDS = 8  # a block's tile: 8 rounds of 256 threads' 16-byte chunks (32 KB)


def tile_words(word: int, rounds: int = ROUNDS) -> int:
    return rounds * THREADS * 16 // word

# The kernels' source (package data beside this module; NVRTC finds block.h there too).
SOURCE = (Path(__file__).resolve().parent / "kernels.cu").read_text()

_P, _Q, _I = nvrtc.PTR, nvrtc.I64, nvrtc.I32
SIGNATURES = {**{f"ws_collect_w{w}": _P * 11 + _Q + _I for w in (1, 2, 4, 8)},
              **{f"ws_order_w{w}": _P * 9 + _Q for w in (1, 2, 4, 8)},
              "ws_tile_search": _P * 5 + _Q + _P + _Q + _P + _Q + _P,
              **{f"ws_encode_tiles_w{w}": _P * 6 + _Q * 2 + _P + _I + _P * 3 for w in (1, 2, 4, 8)},
              **{f"ws_ref_tiles_w{w}": _P * 5 + _Q + _P for w in (1, 2, 4, 8)},
              "ws_block_ends": _P + _Q + _P,
              **{f"ws_bitmap_tiles_w{w}": _P * 6 + _Q * 2 + _P + _I + _P * 3 for w in (1, 2, 4, 8)},
              **{f"ws_encode_w{w}": _P * 3 + _I + _Q + _P * 3 for w in (1, 2, 4, 8)},
              **{f"ws_bitmap_w{w}": _P * 3 + _I + _Q + _P * 3 for w in (1, 2, 4, 8)},
              **{f"ws_bitmap_set_i{b}": _P + _Q * 2 + _P for b in (32, 64)},
              **{f"ws_scatter_w{w}": _P + _Q * 2 + _P * 3 + _I + _P for w in (1, 2, 4, 8)},
              "ws_bitmap_counts": _P + _Q + _P,
              **{f"ws_bitmap_scatter_w{w}": _P + _Q + _P + _Q * 2 + _P * 2 + _I + _P for w in (1, 2, 4, 8)}}
ENV = "WEIGHTSYNC_DELTA_KERNELS"


def wanted() -> bool:
    """Whether the CUDA kernels are to be tried (``WEIGHTSYNC_DELTA_KERNELS``: unset, ``1`` or ``cuda``;
    ``triton`` takes the Triton kernels, ``0`` the torch ops)."""
    return os.environ.get(ENV, "") in ("", "1", "cuda")


_failed: dict[int, str] = {}  # device index -> why the module did not load (tried once per process)


def module(device: Any) -> nvrtc.Module | None:
    """The compiled kernels on ``device``, or None where they are not :func:`wanted` or cannot be had
    (no NVRTC, compile failure: the reason is kept in :func:`unavailable`); the caller takes the Triton or
    torch path then."""
    if device.type != "cuda" or not wanted():
        return None
    idx = device.index if device.index is not None else 0
    if idx in _failed:
        return None
    try:
        return nvrtc.load("delta_compact", SOURCE, SIGNATURES, device)
    except nvrtc.NvrtcUnavailable as exc:
        _failed[idx] = str(exc)
        return None


def unavailable(device: Any) -> str | None:
    return _failed.get(device.index if device.index is not None else 0)


def _launch(mod: nvrtc.Module, name: str, grid: int, args: Sequence[Any], device: Any) -> None:
    """Kernel ``name`` of ``mod`` on torch's current stream of ``device`` (made current around it)."""
    import torch

    with torch.cuda.device(device):
        mod[name].launch(grid, THREADS, args, torch.cuda.current_stream(device).cuda_stream)


def _table(rows: Any, device: Any) -> Any:
    """Rows of int64 fields as a column-major table on ``device`` (one array per field, as the kernels
    read them), sent without waiting for the device."""
    import numpy as np

    from weightsync.delta.units import _to_device

    return _to_device(np.ascontiguousarray(np.asarray(rows, np.int64).T), device)


class Collect:
    """A space's ``ws_collect`` launched on a stream, its count not yet read: the tiles' counts and places,
    the scratch of (16-bit word, value) per change, the count copied to pinned host memory and an event
    after that copy. The caller's host goes on (deciding and encoding another span) while the device
    compares; :func:`finish` reads the count. :meth:`search_ahead` queues the caller's searches too, so
    that the host waits once, for everything, and gets the changes as the collect left them
    (:class:`TileChanges`), never put in order on the push's path."""

    def __init__(self, mod: nvrtc.Module, tables: Sequence[Any], tile_starts: Any, vec: bool, word: int,
                 ref: Any, cap: int, poison: int | None, stream: Any, host_count: Any) -> None:
        import torch

        self.mod, self.tables, self.vec, self.word = mod, tables, vec, word
        self.tile_starts = tile_starts  # numpy: each tile's first word in the space (tables[4] on the host)
        self.ntiles = len(tile_starts)
        self.ref = ref
        self.poison, self.stream, self.host_count = poison, stream, host_count
        # search_ahead: the tiles' exclusive prefix, the searches' answers on the host, an event after them
        self.ahead: tuple[Any, Any, Any] | None = None
        self.cuts: Any = None  # finish: the searches' answers (numpy), where search_ahead was queued
        device = ref.device
        with torch.cuda.stream(stream):
            # per tile its count and its place in the scratch, then the scratch's used count
            self.counts = torch.empty(2 * self.ntiles + 1, dtype=torch.int64, device=device)
            self.event = torch.cuda.Event()
            self._run(cap)

    def _run(self, cap: int) -> None:
        """One collect with room for ``cap`` changes on the stream, then its count's copy to the host."""
        import torch

        device = self.ref.device
        nt = self.ntiles
        tile_count, tile_base, used = self.counts[:nt], self.counts[nt:2 * nt], self.counts[2 * nt:]
        self.cap = cap
        self.tmp_off = torch.empty(cap, dtype=torch.int16, device=device)
        self.tmp_val = torch.empty(cap, dtype=self.ref.dtype, device=device)
        if self.poison is not None:
            for t in (self.tmp_off, self.tmp_val, self.counts):
                t.view(torch.uint8).fill_(self.poison)
        used.zero_()
        _launch(self.mod, f"ws_collect_w{self.word}", nt,
                [*self.tables, self.ref, used, tile_count, tile_base, self.tmp_off, self.tmp_val, cap,
                 int(self.vec)], device)
        self.host_count.copy_(used, non_blocking=True)
        self.event.record(torch.cuda.current_stream(device))

    def _first(self) -> Any:
        """The exclusive prefix of the tile counts on torch's current stream: where each tile's changes
        start among the space's in word order."""
        import torch

        tile_count = self.counts[:self.ntiles]
        return torch.cumsum(tile_count, 0) - tile_count

    def _order(self, k: int, first: Any = None) -> tuple[Any, Any]:
        """``ws_order`` on torch's current stream into new outputs with room for ``k`` (it waits for the
        collect first): the changes in word order, where at most ``cap`` changed (else nothing)."""
        import torch

        device = self.ref.device
        current = torch.cuda.current_stream(device)
        current.wait_event(self.event)
        nt = self.ntiles
        for t in (self.counts, self.tmp_off, self.tmp_val):  # made on the collect's stream, read on this one
            t.record_stream(current)
        tile_count, tile_base, used = self.counts[:nt], self.counts[nt:2 * nt], self.counts[2 * nt:]
        out_idx = torch.empty(k, dtype=torch.int64, device=device)
        out_val = torch.empty(k, dtype=self.ref.dtype, device=device)
        if self.poison is not None:
            out_idx.view(torch.uint8).fill_(self.poison)
            out_val.view(torch.uint8).fill_(self.poison)
        if first is None:
            first = self._first()
        _launch(self.mod, f"ws_order_w{self.word}", nt,
                [self.tables[4], tile_count, tile_base, first, self.tmp_off, self.tmp_val, out_idx, out_val,
                 used, self.cap], device)
        return out_idx, out_val

    def search_ahead(self, query: Any, stream: Any) -> None:
        """Queues on ``stream`` (which waits for the collect) the tiles' prefix and, for each position of
        ``query`` (int64 positions in the space), how many changes lie before it (``ws_tile_search``: what
        ``torch.searchsorted`` over the ordered changes gives), copied to the host with the count. The
        host then waits once, for all of it, and no kernel of it waits for the host. Nothing is put in
        order: the encode reads the scratch (:meth:`TileChanges.encode`)."""
        import torch

        device = self.ref.device
        nt, nq = self.ntiles, int(query.numel())
        with torch.cuda.stream(stream):
            stream.wait_event(self.event)
            first = self._first()
            host = torch.empty(1 + nq, dtype=torch.int64, pin_memory=True)
            host[:1].copy_(self.counts[2 * nt:], non_blocking=True)
            if nq:
                cuts = torch.empty(nq, dtype=torch.int64, device=device)
                _launch(self.mod, "ws_tile_search", -(-nq // THREADS),
                        [self.tables[4], self.counts[:nt], self.counts[nt:2 * nt], first, self.tmp_off, nt,
                         self.counts[2 * nt:], self.cap, query, nq, cuts], device)
                host[1:].copy_(cuts, non_blocking=True)
            done = torch.cuda.Event()
            done.record(stream)
        self.ahead = (first, host, done)

    def finish(self) -> tuple[Any, Any] | TileChanges:
        """The space's changed words: with :meth:`search_ahead` queued and at most ``cap`` changed, as the
        collect left them (:class:`TileChanges`, the searches' answers in :attr:`cuts`); else as (sorted
        int64 positions, values), the order kernel queued on torch's current stream of the device (which
        waits for the collect first). One host wait: for the count, or for all search_ahead queued (two
        where more than the room changed: the collect runs again with room for all; the reference is
        unchanged, so it finds the same changes)."""
        import torch

        device = self.ref.device
        if self.ahead is not None:
            first, host, done = self.ahead
            self.ahead = None
            done.synchronize()
            mark("collect counted and searched")
            k = int(host[0])
            if k <= self.cap:
                current = torch.cuda.current_stream(device)
                current.wait_event(done)
                for t in (self.counts, self.tmp_off, self.tmp_val, first):  # made on other streams
                    t.record_stream(current)
                self.cuts = host[1:].numpy().copy()
                return TileChanges(self, first, k)
        self.event.synchronize()
        mark("collect counted")
        k = int(self.host_count[0])
        if k > self.cap:
            with torch.cuda.stream(self.stream):
                self._run(k)
            self.event.synchronize()
        return self._order(k)


class TileChanges:
    """A space's changed words as its collect left them, on the device: per tile (32 KB of the space) how
    many changed, where they start in the scratch and among the space's in word order (``first``); in
    the scratch each change's word within its tile (16 bits, in word order within the tile) and value.
    :meth:`encode` writes a stream's entries from it and :meth:`update_ref` the reference, each reading
    4 bytes a change (BF16), against 10 for ordered int64 positions and values and another 14 for putting
    them in order; :meth:`ordered` gives those where a caller needs them."""

    def __init__(self, collect: Collect, first: Any, count: int) -> None:
        self.collect, self.first, self.count = collect, first, count
        self._ordered: tuple[Any, Any] | None = None

    def ordered(self) -> tuple[Any, Any]:
        """(sorted int64 positions, values), made once, on torch's current stream."""
        if self._ordered is None:
            self._ordered = self.collect._order(self.count, self.first)
        return self._ordered

    def _tiles(self) -> list[Any]:
        c = self.collect
        nt = c.ntiles
        return [c.tables[4], c.counts[:nt], c.counts[nt:2 * nt]]

    def tile_range(self, lo: int, hi: int) -> tuple[int, int]:
        """The tiles holding space words ``lo:hi`` (``hi > lo``)."""
        import numpy as np

        starts = self.collect.tile_starts
        return (max(int(np.searchsorted(starts, lo, side="right")) - 1, 0),
                int(np.searchsorted(starts, hi - 1, side="right")))

    def encode(self, runs: Any, tiles: tuple[int, int], index: Any, out_vals: Any, counts: Any,
               bitmap: bool = False) -> None:
        """:func:`encode_runs` from the scratch, on the tensors' stream: ``runs`` rows (first change in word
        order, shift from space to stream positions, first entry in the stream, count); ``tiles`` the range
        of tiles that holds every run's changes (:meth:`tile_range`); ``index``, ``counts`` and ``bitmap``
        as :func:`encode_runs` takes them."""
        c = self.collect
        t0, t1 = tiles
        if not len(runs) or t1 <= t0:
            return
        per = THREADS // 32
        kind = "bitmap" if bitmap else "encode"
        _launch(c.mod, f"ws_{kind}_tiles_w{c.word}", -(-(t1 - t0) // per),
                [*self._tiles(), self.first, c.tmp_off, c.tmp_val, t0, t1, _table(runs, c.ref.device),
                 len(runs), index, out_vals, 0 if bitmap else counts], c.ref.device)

    def update_ref(self) -> None:
        """The changes into the reference the collect compared with, on torch's current stream."""
        c = self.collect
        per = THREADS // 32
        _launch(c.mod, f"ws_ref_tiles_w{c.word}", -(-c.ntiles // per),
                [*self._tiles(), c.tmp_off, c.tmp_val, c.ntiles, c.ref], c.ref.device)

    def record_stream(self, stream: Any) -> None:
        """Its device memory is not reused before ``stream`` is done with it."""
        c = self.collect
        for t in (c.counts, c.tmp_off, c.tmp_val, self.first):
            t.record_stream(stream)


def compare(mod: nvrtc.Module, tables: Sequence[Any], tile_starts: Any, vec: bool, word: int, ref: Any,
            hint: int, total_words: int, poison: int | None = None, stream: Any = None,
            host_count: Any = None) -> tuple[Any, Any]:
    """The space's changed words as (sorted int64 positions, values); the reference is left as it was
    (the caller copies the values into it). :func:`launch` and its :meth:`Collect.finish` in one."""
    import torch

    if not len(tile_starts):
        return torch.empty(0, dtype=torch.int64, device=ref.device), ref.new_empty(0)
    found = launch(mod, tables, tile_starts, vec, word, ref, hint, total_words, poison, stream,
                   host_count).finish()
    assert isinstance(found, tuple)  # nothing was searched ahead
    return found


def launch(mod: nvrtc.Module, tables: Sequence[Any], tile_starts: Any, vec: bool, word: int, ref: Any,
           hint: int, total_words: int, poison: int | None = None, stream: Any = None,
           host_count: Any = None) -> Collect:
    """The collect of a space (at least one tile) launched on ``stream`` (None: torch's current stream of
    the device), with room for ``hint`` and a margin. ``tables``: the Compactor's (key_at, key_start,
    key_end, tile_key, tile_start) on the device, ``tile_starts`` the last on the host (numpy);
    ``host_count``: one int64 of pinned host memory for the count (made here if None). The stream must
    already wait for whatever wrote ``ref`` and the keys."""
    import torch

    device = ref.device
    if stream is None:
        stream = torch.cuda.current_stream(device)
    if host_count is None:
        host_count = torch.empty(1, dtype=torch.int64, pin_memory=True)
    return Collect(mod, tables, tile_starts, vec, word, ref, first_room(hint, total_words), poison, stream,
                   host_count)


def encode_runs(mod: nvrtc.Module, idx: Any, vals: Any, runs: Any, index: Any, out_vals: Any,
                counts: Any, bitmap: bool = False) -> None:
    """Entries of a sparse stream from runs of the compare's output, on the tensors' stream (no host
    synchronization): ``runs`` rows (first changed word in ``idx``/``vals``, shift from space to stream
    positions, first entry in the stream, count); ``out_vals`` the stream's value section. ENC_IDX16:
    ``index`` its 16-bit indices (int16), ``counts`` (int32, zeroed or holding other entries' counts) its
    block counts, added to; ``bitmap`` (ENC_BITMAP): ``index`` its bits (int32 words, zeroed or holding
    other entries' bits), or-ed into, ``counts`` unused."""
    if not len(runs):
        return
    total = int(runs[-1][2] + runs[-1][3])  # the last run's last entry, plus one
    _launch(mod, f"ws_{'bitmap' if bitmap else 'encode'}_w{vals.element_size()}", -(-total // THREADS),
            [idx, vals, _table(runs, idx.device), len(runs), total, index, out_vals,
             0 if bitmap else counts], idx.device)


def bitmap_set(mod: nvrtc.Module, positions: Any, shift: int, bits: Any) -> None:
    """The bits of stream positions ``positions + shift`` (int32 or int64, on the device) set in an
    ENC_BITMAP section ``bits`` (int32 words), on the tensors' stream."""
    import torch

    m = int(positions.numel())
    if not m:
        return
    wide = positions.dtype == torch.int64
    if not wide and positions.dtype != torch.int32:
        positions = positions.to(torch.int64)
        wide = True
    _launch(mod, f"ws_bitmap_set_i{64 if wide else 32}", -(-m // THREADS),
            [positions.contiguous(), m, shift, bits], bits.device)


def block_ends(mod: nvrtc.Module, counts: Any) -> Any:
    """An ENC_IDX16 stream's block counts (``counts``: int32 on the device) as the int64 prefix from 0, on
    the tensors' stream: block ``b``'s entries are ``ends[b]:ends[b + 1]``."""
    import torch

    nb = int(counts.numel())
    ends = torch.empty(nb + 1, dtype=torch.int64, device=counts.device)
    _launch(mod, "ws_block_ends", 1, [counts, nb, ends], counts.device)
    return ends


def scatter_runs(mod: nvrtc.Module, ends: Any, low: Any, vals: Any, runs: Any, refused: Any) -> None:
    """The receiver's scatter of an ENC_IDX16 stream's contiguous runs, on the tensors' stream: ``ends``
    (int64, the cumsum of the block counts from 0), ``low`` (int16) and ``vals`` its sections (``k`` =
    ``low.numel()`` changed words), ``runs`` rows (first and last+1 entry, shift from stream positions to
    the key's words, the key's address, first and last+1 stream position). What does not match (block
    counts not summing to ``k``, an entry outside its run) is not stored and sets ``refused`` (int32 on
    the device)."""
    nb = int(ends.numel()) - 1
    if not len(runs) or nb <= 0:
        return
    mark("scatter: block ends queued")
    _launch(mod, f"ws_scatter_w{vals.element_size()}", nb,
            [ends, nb, int(low.numel()), low, vals, _table(runs, vals.device), len(runs), refused],
            vals.device)


def scatter_bitmap(mod: nvrtc.Module, bits: Any, n: int, k: int, vals: Any, runs: Any, refused: Any) -> None:
    """The receiver's scatter of an ENC_BITMAP stream's contiguous runs straight from its bits, on the
    tensors' stream: ``bits`` its section (int32 words), ``n`` its words, ``k`` its changed words (none is
    scattered unless its bits below ``n`` are exactly that many), ``vals`` its values, ``runs`` rows (first
    and last+1 entry, shift from stream positions to the key's words, the key's address, first and last+1
    stream position; a change outside its run is not stored). Either sets ``refused`` (int32 on the
    device). Its device memory: the block counts and their prefix, 12 bytes per 65536 words."""
    import torch

    from weightsync.delta.units import BLOCK

    nb = -(-n // BLOCK)
    if not len(runs) or nb <= 0:
        return
    counts = torch.empty(nb, dtype=torch.int32, device=bits.device)
    _launch(mod, "ws_bitmap_counts", nb, [bits, n, counts], bits.device)
    ends = block_ends(mod, counts)
    mark("scatter: bitmap counted")
    _launch(mod, f"ws_bitmap_scatter_w{vals.element_size()}", nb,
            [bits, n, ends, nb, k, vals, _table(runs, vals.device), len(runs), refused], vals.device)
