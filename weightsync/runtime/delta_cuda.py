"""The delta push's device kernels in CUDA C++ (issue 18), compiled at run time
(:mod:`weightsync.runtime.nvrtc`): the sender's compare, the encode of an ENC_IDX16 stream from the
compare's runs, and the receiver's scatter of such a stream.

The compare finds what the Triton path of :meth:`weightsync.runtime.delta_kernels.Compactor.compare`
finds (the sorted int64 positions of the space's changed words and their values) reading the current
tensors and the reference once, with one host synchronization, but leaves the reference alone: the
caller copies the changes into it later (:meth:`weightsync.runtime.delta.DeltaSender.finish`, while the
destinations apply theirs), off the push's path. Two kernels:

* ``ws_collect``: each block of 256 threads takes one 32 KB tile (:func:`tile_words` words; the
  Compactor's tables of these tiles), loads it in 16-byte vectors where aligned, counts its changes with
  ``__popc`` of per-thread bit masks and a warp-shuffle scan, takes room for them at the end of a scratch
  with one ``atomicAdd`` and writes there each change's word within the tile (16 bits) and its value, in
  order; the tile's count and its place in the scratch go into two tables. Tiles finish in any order and
  none waits for another.
* ``ws_order``: after an exclusive ``cumsum`` of the tile counts, each block copies one tile's changes
  from the scratch to their place in word order, as int64 positions in the space.

Why this shape (docs/BENCHMARKS.md, "The compare without a look-back, the reference left to finish"):
the Triton kernels' in-tile compaction costs more than the reads themselves; a single pass that places
each tile by a decoupled look-back over its predecessors' counts spent a fifth of its time waiting on
them, and storing the changes into the reference inside the compare another sixth (its lines have left
L2 by then).

The scratch has room for ``cap`` changes (the caller's guess: the last push's count and a margin). A
change past ``cap`` is not written; the count comes back (the host read), and if it exceeds ``cap`` the
collect runs again with room for all of them (the reference is unchanged, so it finds the same changes).

Every kernel runs on torch's current stream of its tensors' device; :func:`module` gives them where
NVRTC can compile them and ``WEIGHTSYNC_DELTA_KERNELS`` does not choose another path.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

from weightsync.runtime import nvrtc
from weightsync.runtime.delta import first_room
from weightsync.runtime.trace import mark

THREADS = 256
ROUNDS = 8  # a block's tile: 8 rounds of 256 threads' 16-byte chunks (32 KB)


def tile_words(word: int, rounds: int = ROUNDS) -> int:
    return rounds * THREADS * 16 // word

SOURCE = r"""
typedef unsigned long long u64;
typedef long long i64;
typedef unsigned int u32;
struct __align__(16) V16 { u64 a, b; };

#define THREADS 256
// Compile-time choices (scripts/bench_delta_kernels.py times others): 16-byte chunks per thread per tile,
// and the blocks per multiprocessor the registers are limited for (0: the compiler's choice).
#ifndef ROUNDS
#define ROUNDS 8
#endif
#ifndef MIN_BLOCKS
#define MIN_BLOCKS 0
#endif
#if MIN_BLOCKS
#define BOUNDS __launch_bounds__(THREADS, MIN_BLOCKS)
#else
#define BOUNDS __launch_bounds__(THREADS)
#endif
#define FULL 0xffffffffu

// Exclusive prefix over the block's threads of v (four 16-bit counts side by side: no field carries, a
// round's count per block is at most 4096), and the block's total. warp_sums: this scan's own.
__device__ __forceinline__ u64 block_scan(u64 v, u64* warp_sums, u64* total) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    u64 x = v;
    #pragma unroll
    for (int d = 1; d < 32; d <<= 1) {
        u64 y = __shfl_up_sync(FULL, x, d);
        if (lane >= d) x += y;
    }
    if (lane == 31) warp_sums[warp] = x;
    __syncthreads();
    if (warp == 0) {
        u64 s = lane < THREADS / 32 ? warp_sums[lane] : 0;
        #pragma unroll
        for (int d = 1; d < THREADS / 32; d <<= 1) {
            u64 y = __shfl_up_sync(FULL, s, d);
            if (lane >= d) s += y;
        }
        if (lane < THREADS / 32) warp_sums[lane] = s;  // inclusive per warp
    }
    __syncthreads();
    const u64 before = warp ? warp_sums[warp - 1] : 0;
    *total = warp_sums[THREADS / 32 - 1];
    return before + x - v;
}

// Word k of a 16-byte chunk by shifts (an index into a register array would put it on the stack).
template <typename W>
__device__ __forceinline__ W word_of(const V16& v, int k) {
    const int bit = k * (int)sizeof(W) * 8;
    const u64 half = bit < 64 ? v.a : v.b;
    return (W)(half >> (bit & 63));
}

// ws_collect: block t compares tile t, ROUNDS * THREADS 16-byte chunks (32 KB at 8 rounds: 32768 /
// sizeof(W) words; a key's last tile may be short), VW = 16 / sizeof(W) words a chunk. In round i thread j
// holds chunk i * THREADS + j, so each round's loads are coalesced and (round, thread, word) is the words'
// order. The tile takes room for its changes at the end of the scratch with one atomicAdd on *used, so
// no tile waits for another, and writes each change's word within the tile (16 bits) and value there, in
// order; its count and where they start go into tile_count and tile_base. A change past ``cap`` is not
// written (*used tells the caller how many there were).
template <typename W>
__device__ __forceinline__ void collect(const i64* key_at, const i64* key_start, const i64* key_end,
                                        const int* tile_key, const i64* tile_start, const W* ref,
                                        u64* used, i64* tile_count, i64* tile_base, unsigned short* tmp_off,
                                        W* tmp_val, i64 cap, int vec) {
    constexpr int VW = 16 / sizeof(W);
    constexpr int TILE = ROUNDS * THREADS * VW;
    static_assert(TILE <= 65536, "a word's place in its tile is stored in 16 bits");
    constexpr int G = (ROUNDS + 3) / 4;  // 64-bit scans of four rounds' counts each
    __shared__ u64 s_warps[G][THREADS / 32];
    __shared__ i64 s_base;
    const i64 t = blockIdx.x;
    const int key = tile_key[t];
    const i64 start = tile_start[t];
    const i64 left = key_end[key] - start;
    const int n = left < TILE ? (int)left : TILE;
    const W* cur = ref + key_at[key] + (start - key_start[key]);
    const W* rf = ref + start;
    const bool whole = vec && n == TILE;

    union Chunk { V16 v; W w[VW]; };
    Chunk x[ROUNDS], r[ROUNDS];
    if (whole) {
        #pragma unroll
        for (int i = 0; i < ROUNDS; i++) {
            const int c = i * THREADS + threadIdx.x;
            x[i].v = reinterpret_cast<const V16*>(cur)[c];
            r[i].v = reinterpret_cast<const V16*>(rf)[c];
        }
    } else {
        #pragma unroll
        for (int i = 0; i < ROUNDS; i++) {
            const int c = i * THREADS + threadIdx.x;
            #pragma unroll
            for (int k = 0; k < VW; k++) {
                const int o = c * VW + k;
                x[i].w[k] = o < n ? cur[o] : (W)0;
                r[i].w[k] = o < n ? rf[o] : (W)0;
            }
        }
    }
    u32 mask[ROUNDS];
    u64 packed[G];
    #pragma unroll
    for (int g = 0; g < G; g++) packed[g] = 0;
    #pragma unroll
    for (int i = 0; i < ROUNDS; i++) {
        u32 m = 0;
        #pragma unroll
        for (int k = 0; k < VW; k++) m |= (u32)(x[i].w[k] != r[i].w[k]) << k;
        mask[i] = m;
        packed[i / 4] |= (u64)__popc(m) << (16 * (i % 4));
    }
    // where round i's changes of this thread start in the tile: the rounds before it, then the threads
    // before this one in round i
    int at[ROUNDS];
    int agg = 0;
    #pragma unroll
    for (int g = 0; g < G; g++) {
        u64 tot;
        const u64 pre = block_scan(packed[g], s_warps[g], &tot);
        #pragma unroll
        for (int q = 0; q < 4 && 4 * g + q < ROUNDS; q++) {
            at[4 * g + q] = agg + (int)((pre >> (16 * q)) & 0xffff);
            agg += (int)((tot >> (16 * q)) & 0xffff);
        }
    }
    if (threadIdx.x == 0) {
        const i64 base = agg ? (i64)atomicAdd(used, (u64)agg) : 0;
        s_base = base;
        tile_count[t] = agg;
        tile_base[t] = base;
    }
    __syncthreads();
    const i64 base = s_base;
    #pragma unroll
    for (int i = 0; i < ROUNDS; i++) {
        u32 m = mask[i];
        if (!m) continue;
        const int c = i * THREADS + threadIdx.x;
        i64 pos = base + at[i];
        while (m) {
            const int k = __ffs(m) - 1;
            m &= m - 1;
            if (pos < cap) {
                tmp_off[pos] = (unsigned short)(c * VW + k);
                tmp_val[pos] = word_of<W>(x[i].v, k);
            }
            pos++;
        }
    }
}

// ws_order: block t copies tile t's changes from the scratch to their place in word order (``first``:
// the exclusive prefix of the tile counts), as positions in the space (int64). Nothing where more than
// ``cap`` changed (the scratch holds only some of them: the host runs the collect again).
template <typename W>
__device__ __forceinline__ void order(const i64* tile_start, const i64* tile_count, const i64* tile_base,
                                      const i64* first, const unsigned short* tmp_off, const W* tmp_val,
                                      i64* out_idx, W* out_val, const u64* used, i64 cap) {
    if ((i64)*used > cap) return;
    const i64 t = blockIdx.x;
    const i64 n = tile_count[t], from = tile_base[t], to = first[t], start = tile_start[t];
    for (i64 j = threadIdx.x; j < n; j += THREADS) {
        out_idx[to + j] = start + tmp_off[from + j];
        out_val[to + j] = tmp_val[from + j];
    }
}

#define COMPARE(W, SUFFIX)                                                                                \
extern "C" __global__ void BOUNDS ws_collect_##SUFFIX(                                                    \
        const i64* key_at, const i64* key_start, const i64* key_end, const int* tile_key,                 \
        const i64* tile_start, const W* ref, u64* used, i64* tile_count, i64* tile_base,                  \
        unsigned short* tmp_off, W* tmp_val, i64 cap, int vec) {                                          \
    collect<W>(key_at, key_start, key_end, tile_key, tile_start, ref, used, tile_count, tile_base,       \
               tmp_off, tmp_val, cap, vec);                                                               \
}                                                                                                         \
extern "C" __global__ void __launch_bounds__(THREADS) ws_order_##SUFFIX(                                  \
        const i64* tile_start, const i64* tile_count, const i64* tile_base, const i64* first,             \
        const unsigned short* tmp_off, const W* tmp_val, i64* out_idx, W* out_val, const u64* used,       \
        i64 cap) {                                                                                        \
    order<W>(tile_start, tile_count, tile_base, first, tmp_off, tmp_val, out_idx, out_val, used, cap);   \
}
COMPARE(unsigned char, w1)
COMPARE(unsigned short, w2)
COMPARE(unsigned int, w4)
COMPARE(u64, w8)

// ws_fill_tail: positions ``*used`` .. ``cap`` of an ordered output (room for ``cap``) set past every
// position, so that a search over all ``cap`` finds what one over the ``*used`` changes would, before
// the host knows how many there are. Nothing where more than ``cap`` changed.
extern "C" __global__ void __launch_bounds__(THREADS) ws_fill_tail(i64* out_idx, const u64* used, i64 cap) {
    const i64 k = (i64)*used;
    if (k > cap) return;
    for (i64 j = k + (i64)blockIdx.x * THREADS + threadIdx.x; j < cap; j += (i64)gridDim.x * THREADS)
        out_idx[j] = 0x7fffffffffffffffLL;
}

// An ENC_IDX16 stream's entries from runs of the compare's output: run r (table rows lo, shift, out,
// count) takes changed words lo .. lo + count of the space (positions idx, values vals) to entries
// out .. out + count of the stream: stream position p = idx + shift, its low 16 bits and its value there,
// and p's 65536-word block counted (one atomic per block a warp's entries fall in). Entries between runs
// are other writes' (not touched). One thread per entry j < total.
template <typename W>
__device__ __forceinline__ void encode_runs(const i64* idx, const W* vals, const i64* table, int nruns,
                                            i64 total, short* low, W* out_vals, int* counts) {
    const i64 j = (i64)blockIdx.x * THREADS + threadIdx.x;
    const i64* lo = table;
    const i64* shift = table + nruns;
    const i64* out = table + 2 * (i64)nruns;
    const i64* count = table + 3 * (i64)nruns;
    bool live = false;
    int block = 0;
    if (j < total) {
        int a = 0, b = nruns - 1;  // the last run whose first entry is at or before j
        while (a < b) {
            const int m = (a + b + 1) >> 1;
            if (out[m] <= j) a = m; else b = m - 1;
        }
        const i64 k = j - out[a];
        if (k >= 0 && k < count[a]) {
            const i64 i = lo[a] + k;
            const i64 p = idx[i] + shift[a];
            low[j] = (short)(p & 0xffff);
            out_vals[j] = vals[i];
            block = (int)(p >> 16);
            live = true;
        }
    }
    const u32 active = __ballot_sync(FULL, live);
    if (live) {
        const u32 same = __match_any_sync(active, block);
        if ((int)(threadIdx.x & 31) == __ffs(same) - 1) atomicAdd(&counts[block], __popc(same));
    }
}

#define ENCODE(NAME, W)                                                                                   \
extern "C" __global__ void __launch_bounds__(THREADS) NAME(                                               \
        const i64* idx, const W* vals, const i64* table, int nruns, i64 total, short* low, W* out_vals,   \
        int* counts) {                                                                                    \
    encode_runs<W>(idx, vals, table, nruns, total, low, out_vals, counts);                               \
}
ENCODE(ws_encode_w1, unsigned char)
ENCODE(ws_encode_w2, unsigned short)
ENCODE(ws_encode_w4, unsigned int)
ENCODE(ws_encode_w8, u64)

// The receiver: an ENC_IDX16 stream's entries scattered into their keys, one block per 65536-word block
// of the stream (its entries ends[b] .. ends[b + 1]). Run r (table rows lo, hi, shift, address: entries
// lo .. hi go to key words stream position + shift of the key at that address) is found by a binary
// search for a thread's first entry, then by stepping (entries only increase). Entries of no run (a
// strided write's: the caller's torch ops) are left.
template <typename W>
__device__ __forceinline__ void scatter_runs(const i64* ends, const unsigned short* low, const W* vals,
                                             const i64* table, int nruns) {
    const i64 b = blockIdx.x;
    const i64* lo = table;
    const i64* hi = table + nruns;
    const i64* shift = table + 2 * (i64)nruns;
    const i64* addr = table + 3 * (i64)nruns;
    const i64 first = ends[b], last = ends[b + 1];
    i64 j = first + threadIdx.x;
    if (j >= last) return;
    int r = 0, top = nruns - 1;  // the last run starting at or before j
    while (r < top) {
        const int m = (r + top + 1) >> 1;
        if (lo[m] <= j) r = m; else top = m - 1;
    }
    for (; j < last; j += THREADS) {
        while (r + 1 < nruns && lo[r + 1] <= j) r++;
        if (j < lo[r] || j >= hi[r]) continue;
        W* key = reinterpret_cast<W*>(addr[r]);
        key[b * 65536 + low[j] + shift[r]] = vals[j];
    }
}

// ws_block_ends: an ENC_IDX16 stream's block counts (int32, ``nb``) as the int64 prefix from 0 (``ends``:
// nb + 1), by one block: each thread sums its share of the counts in order, a block-wide scan of those
// sums places each share. One launch in place of torch's (a fill and a scan of several launches): the
// receiver's host queues it on the last part's path.
extern "C" __global__ void __launch_bounds__(THREADS) ws_block_ends(const int* counts, i64 nb, i64* ends) {
    __shared__ i64 sums[THREADS];
    const i64 per = (nb + THREADS - 1) / THREADS;
    const i64 a = threadIdx.x * per, b = min(a + per, nb);
    i64 mine = 0;
    for (i64 i = a; i < b; i++) mine += counts[i];
    sums[threadIdx.x] = mine;
    __syncthreads();
    for (int d = 1; d < THREADS; d <<= 1) {  // inclusive scan of the shares (Hillis-Steele)
        const i64 v = threadIdx.x >= d ? sums[threadIdx.x - d] : 0;
        __syncthreads();
        sums[threadIdx.x] += v;
        __syncthreads();
    }
    i64 at = sums[threadIdx.x] - mine;
    if (threadIdx.x == 0) ends[0] = 0;
    for (i64 i = a; i < b; i++) {
        at += counts[i];
        ends[i + 1] = at;
    }
}

#define SCATTER(NAME, W)                                                                                  \
extern "C" __global__ void __launch_bounds__(THREADS) NAME(                                               \
        const i64* ends, const unsigned short* low, const W* vals, const i64* table, int nruns) {         \
    scatter_runs<W>(ends, low, vals, table, nruns);                                                       \
}
SCATTER(ws_scatter_w1, unsigned char)
SCATTER(ws_scatter_w2, unsigned short)
SCATTER(ws_scatter_w4, unsigned int)
SCATTER(ws_scatter_w8, u64)
"""

_P, _Q, _I = nvrtc.PTR, nvrtc.I64, nvrtc.I32
SIGNATURES = {**{f"ws_collect_w{w}": _P * 11 + _Q + _I for w in (1, 2, 4, 8)},
              **{f"ws_order_w{w}": _P * 9 + _Q for w in (1, 2, 4, 8)},
              "ws_fill_tail": _P * 2 + _Q,
              "ws_block_ends": _P + _Q + _P,
              **{f"ws_encode_w{w}": _P * 3 + _I + _Q + _P * 3 for w in (1, 2, 4, 8)},
              **{f"ws_scatter_w{w}": _P * 4 + _I for w in (1, 2, 4, 8)}}
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

    from weightsync.runtime.delta import _to_device

    return _to_device(np.ascontiguousarray(np.asarray(rows, np.int64).T), device)


class Collect:
    """A space's ``ws_collect`` launched on a stream, its count not yet read: the tiles' counts and places,
    the scratch of (16-bit word, value) per change, the count copied to pinned host memory and an event
    after that copy. The caller's host goes on (deciding and encoding another part) while the device
    compares; :func:`finish` reads the count and orders the changes. :meth:`order_ahead` queues the
    ordering and the caller's searches too, so that the host waits once, for everything."""

    def __init__(self, mod: nvrtc.Module, tables: Sequence[Any], ntiles: int, vec: bool, word: int, ref: Any,
                 cap: int, poison: int | None, stream: Any, host_count: Any) -> None:
        import torch

        self.mod, self.tables, self.ntiles, self.vec, self.word = mod, tables, ntiles, vec, word
        self.ref = ref
        self.poison, self.stream, self.host_count = poison, stream, host_count
        # order_ahead: its outputs (room for ``cap``), the searches' answers on the host, an event after them
        self.ahead: tuple[Any, Any, Any, Any] | None = None
        self.cuts: Any = None  # finish: the searches' answers (numpy), where order_ahead was queued
        device = ref.device
        with torch.cuda.stream(stream):
            # per tile its count and its place in the scratch, then the scratch's used count
            self.counts = torch.empty(2 * ntiles + 1, dtype=torch.int64, device=device)
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

    def _order(self, k: int) -> tuple[Any, Any]:
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
        first = torch.cumsum(tile_count, 0) - tile_count
        _launch(self.mod, f"ws_order_w{self.word}", nt,
                [self.tables[4], tile_count, tile_base, first, self.tmp_off, self.tmp_val, out_idx, out_val,
                 used, self.cap], device)
        return out_idx, out_val

    def order_ahead(self, query: Any, stream: Any) -> None:
        """Queues on ``stream`` (which waits for the collect) what :meth:`finish` would do once the count is
        read: the changes ordered into outputs with room for ``cap``, the room past the count filled past
        every position, and ``torch.searchsorted`` of ``query`` (int64 positions in the space) over them,
        copied to the host with the count. The host then waits once, for all of it, and no kernel of it
        waits for the host."""
        import torch

        device = self.ref.device
        with torch.cuda.stream(stream):
            out_idx, out_val = self._order(self.cap)
            _launch(self.mod, "ws_fill_tail", max(1, min(-(-self.cap // THREADS), 1024)),
                    [out_idx, self.counts[2 * self.ntiles:], self.cap], device)
            host = torch.empty(1 + int(query.numel()), dtype=torch.int64, pin_memory=True)
            host[:1].copy_(self.counts[2 * self.ntiles:], non_blocking=True)
            if query.numel():
                host[1:].copy_(torch.searchsorted(out_idx, query), non_blocking=True)
            done = torch.cuda.Event()
            done.record(stream)
        self.ahead = (out_idx, out_val, host, done)

    def finish(self) -> tuple[Any, Any]:
        """The space's changed words as (sorted int64 positions, values), the order kernel queued on
        torch's current stream of the device (which waits for the collect first), or (order_ahead) what
        it queued, with :attr:`cuts`. One host wait: for the count, or for all order_ahead queued (two
        where more than the room changed: the collect runs again with room for all; the reference is
        unchanged, so it finds the same changes)."""
        import torch

        device = self.ref.device
        if self.ahead is not None:
            out_idx, out_val, host, done = self.ahead
            self.ahead = None
            done.synchronize()
            mark("collect counted, ordered and searched")
            k = int(host[0])
            if k <= self.cap:
                current = torch.cuda.current_stream(device)
                current.wait_event(done)
                for t in (out_idx, out_val):  # made on the order stream, read on this one
                    t.record_stream(current)
                self.cuts = host[1:].numpy().copy()
                return out_idx[:k], out_val[:k]
        self.event.synchronize()
        mark("collect counted")
        k = int(self.host_count[0])
        if k > self.cap:
            with torch.cuda.stream(self.stream):
                self._run(k)
            self.event.synchronize()
        return self._order(k)


def compare(mod: nvrtc.Module, tables: Sequence[Any], ntiles: int, vec: bool, word: int, ref: Any,
            hint: int, total_words: int, poison: int | None = None, stream: Any = None,
            host_count: Any = None) -> tuple[Any, Any]:
    """The space's changed words as (sorted int64 positions, values); the reference is left as it was
    (the caller copies the values into it). :func:`launch` and its :meth:`Collect.finish` in one."""
    import torch

    if not ntiles:
        return torch.empty(0, dtype=torch.int64, device=ref.device), ref.new_empty(0)
    return launch(mod, tables, ntiles, vec, word, ref, hint, total_words, poison, stream, host_count).finish()


def launch(mod: nvrtc.Module, tables: Sequence[Any], ntiles: int, vec: bool, word: int, ref: Any,
           hint: int, total_words: int, poison: int | None = None, stream: Any = None,
           host_count: Any = None) -> Collect:
    """The collect of a space (``ntiles`` > 0) launched on ``stream`` (None: torch's current stream of
    the device), with room for ``hint`` and a margin. ``tables``: the Compactor's (key_at, key_start,
    key_end, tile_key, tile_start) on the device; ``host_count``: one int64 of pinned host memory for
    the count (made here if None). The stream must already wait for whatever wrote ``ref`` and the
    keys."""
    import torch

    device = ref.device
    if stream is None:
        stream = torch.cuda.current_stream(device)
    if host_count is None:
        host_count = torch.empty(1, dtype=torch.int64, pin_memory=True)
    return Collect(mod, tables, ntiles, vec, word, ref, first_room(hint, total_words), poison, stream,
                   host_count)


def encode_runs(mod: nvrtc.Module, idx: Any, vals: Any, runs: Any, low: Any, out_vals: Any,
                counts: Any) -> None:
    """ENC_IDX16 entries of a stream from runs of the compare's output, on the tensors' stream (no host
    synchronization): ``runs`` rows (first changed word in ``idx``/``vals``, shift from space to stream
    positions, first entry in the stream, count); ``low`` (int16) and ``out_vals`` the stream's index and
    value sections, ``counts`` (int32, zeroed or holding other entries' counts) its block counts, added to."""
    if not len(runs):
        return
    total = int(runs[-1][2] + runs[-1][3])  # the last run's last entry, plus one
    _launch(mod, f"ws_encode_w{vals.element_size()}", -(-total // THREADS),
            [idx, vals, _table(runs, idx.device), len(runs), total, low, out_vals, counts], idx.device)


def block_ends(mod: nvrtc.Module, counts: Any) -> Any:
    """An ENC_IDX16 stream's block counts (``counts``: int32 on the device) as the int64 prefix from 0, on
    the tensors' stream: block ``b``'s entries are ``ends[b]:ends[b + 1]``."""
    import torch

    nb = int(counts.numel())
    ends = torch.empty(nb + 1, dtype=torch.int64, device=counts.device)
    _launch(mod, "ws_block_ends", 1, [counts, nb, ends], counts.device)
    return ends


def scatter_runs(mod: nvrtc.Module, ends: Any, low: Any, vals: Any, runs: Any) -> None:
    """The receiver's scatter of an ENC_IDX16 stream's contiguous runs, on the tensors' stream: ``ends``
    (int64, the cumsum of the block counts from 0), ``low`` (int16) and ``vals`` its sections, ``runs``
    rows (first and last+1 entry, shift from stream positions to the key's words, the key's address)."""
    nb = int(ends.numel()) - 1
    if not len(runs) or nb <= 0:
        return
    mark("scatter: block ends queued")
    _launch(mod, f"ws_scatter_w{vals.element_size()}", nb,
            [ends, low, vals, _table(runs, vals.device), len(runs)], vals.device)
