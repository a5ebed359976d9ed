"""The delta push's device kernels in CUDA C++ (issue 18), compiled at run time
(:mod:`weightsync.delta.nvrtc`): the sender's compare, the encode of a sparse stream (ENC_IDX16 or
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

Why this shape (docs/BENCHMARKS.md, "The compare without a look-back, the reference left to finish", and
"The changes read where the collect left them"): the Triton kernels' in-tile compaction costs more than
the reads themselves; a single pass that places each tile by a decoupled look-back over its predecessors'
counts spent a fifth of its time waiting on them, and storing the changes into the reference inside the
compare another sixth (its lines have left L2 by then). Putting the changes in order and encoding from
the ordered copy moved 28 bytes a change beside the next part's compare, whose kernels it held up.

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

from weightsync.delta import nvrtc
from weightsync.delta.sender import first_room
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

// ws_tile_search: for each of ``nq`` space positions in ``query``, how many of the space's changes lie
// before it (what torch.searchsorted over the changes in word order gives), from the collect's tables alone:
// the changes of the tiles before the position's tile (``first``: the exclusive prefix of the tile counts)
// and, by a binary search of the tile's 16-bit words (in word order within a tile), its own before it.
// One thread per position. Nothing where more than ``cap`` changed (the host runs the collect again).
extern "C" __global__ void __launch_bounds__(THREADS) ws_tile_search(
        const i64* tile_start, const i64* tile_count, const i64* tile_base, const i64* first,
        const unsigned short* tmp_off, i64 ntiles, const u64* used, i64 cap, const i64* query, i64 nq,
        i64* cuts) {
    const i64 qi = (i64)blockIdx.x * THREADS + threadIdx.x;
    if (qi >= nq || (i64)*used > cap) return;
    const i64 q = query[qi];
    if (q <= tile_start[0]) {
        cuts[qi] = 0;
        return;
    }
    i64 a = 0, b = ntiles - 1;  // the last tile starting at or before q
    while (a < b) {
        const i64 m = (a + b + 1) >> 1;
        if (tile_start[m] <= q) a = m; else b = m - 1;
    }
    const i64 rel = q - tile_start[a], n = tile_count[a], base = tile_base[a];
    i64 lo = 0, hi = n;  // the tile's first change at or after q
    if (rel > 65535) lo = n;
    while (lo < hi) {
        const i64 m = (lo + hi) >> 1;
        if ((i64)tmp_off[base + m] < rel) lo = m + 1; else hi = m;
    }
    cuts[qi] = first[a] + lo;
}

// Entry e at stream position p into the stream's index section, for every lane of the warp (``live``:
// whether this lane has one). ENC_IDX16 (BITS false): the low 16 bits of p at low[e], and p's 65536-word
// block counted, one atomic per block a warp's entries fall in. ENC_BITMAP (BITS true): bit p % 32 of
// 32-bit word p / 32 (bit p % 8 of byte p / 8 on a little-endian device) set, the section zeroed
// beforehand: the bits of lanes after this one that name the same word are or-ed into this lane's by a
// segmented reduction over shuffles (a lane's changes are in word order, so those lanes follow each
// other), and the first lane of each such run stores them with one atomicOr.
template <bool BITS>
__device__ __forceinline__ void put_index(bool live, i64 p, i64 e, void* index, int* counts) {
    const int lane = threadIdx.x & 31;
    if (BITS) {
        u32* bits = reinterpret_cast<u32*>(index);
        // a dead lane gets a word no live one has (positions are at least 0), so it joins no run
        const i64 word = live ? (p >> 5) : -1 - lane;
        u32 v = live ? 1u << (p & 31) : 0u;
        #pragma unroll
        for (int d = 1; d < 32; d <<= 1) {
            const u32 o = __shfl_down_sync(FULL, v, d);
            const i64 ow = __shfl_down_sync(FULL, word, d);
            if (lane + d < 32 && ow == word) v |= o;
        }
        const i64 before = __shfl_up_sync(FULL, word, 1);
        if (live && (lane == 0 || before != word)) atomicOr(&bits[word], v);
        return;
    }
    const u32 active = __ballot_sync(FULL, live);
    if (!live) return;
    reinterpret_cast<short*>(index)[e] = (short)(p & 0xffff);
    const int block = (int)(p >> 16);
    const u32 same = __match_any_sync(active, block);
    if (lane == __ffs(same) - 1) atomicAdd(&counts[block], __popc(same));
}

// A sparse stream's entries from runs of a space's changes taken straight from the collect's scratch
// (what encode_runs does from the ordered changes, without them): run r (table rows lo, shift, out, count)
// takes the space's changes lo .. lo + count in word order to entries out .. out + count, at stream
// position p = the change's position + shift. A warp per tile of tiles t_lo .. t_hi: the tile's changes
// are those first[t] .. first[t] + tile_count[t] in word order (at tile_base[t] in the scratch). Each
// entry's index written by put_index (ENC_IDX16 or, BITS, ENC_BITMAP).
template <typename W, bool BITS>
__device__ __forceinline__ void encode_tiles(const i64* tile_start, const i64* tile_count,
                                             const i64* tile_base, const i64* first,
                                             const unsigned short* tmp_off, const W* tmp_val, i64 t_lo,
                                             i64 t_hi, const i64* table, int nruns, void* index, W* out_vals,
                                             int* counts) {
    const int lane = threadIdx.x & 31;
    const i64 t = t_lo + (i64)blockIdx.x * (THREADS / 32) + (threadIdx.x >> 5);
    if (t >= t_hi) return;  // the whole warp
    const i64 n = tile_count[t];
    if (!n) return;
    const i64* lo = table;
    const i64* shift = table + nruns;
    const i64* out = table + 2 * (i64)nruns;
    const i64* count = table + 3 * (i64)nruns;
    const i64 base = tile_base[t], i0 = first[t], start = tile_start[t];
    int r = 0, top = nruns - 1;  // the last run starting at or before the tile's first change
    while (r < top) {
        const int m = (r + top + 1) >> 1;
        if (lo[m] <= i0) r = m; else top = m - 1;
    }
    if (lo[r] + count[r] <= i0 && (r + 1 >= nruns || lo[r + 1] >= i0 + n)) return;  // in no run
    for (i64 jj = 0; jj < n; jj += 32) {
        const i64 j = jj + lane;
        bool live = false;
        i64 p = 0, e = 0;
        if (j < n) {
            const i64 i = i0 + j;
            while (r + 1 < nruns && lo[r + 1] <= i) r++;
            const i64 k = i - lo[r];
            if (k >= 0 && k < count[r]) {
                p = start + (i64)tmp_off[base + j] + shift[r];
                e = out[r] + k;
                out_vals[e] = tmp_val[base + j];
                live = true;
            }
        }
        put_index<BITS>(live, p, e, index, counts);
    }
}

// ws_ref_tiles: the space's changes from the collect's scratch into its reference, a warp per tile.
template <typename W>
__device__ __forceinline__ void ref_tiles(const i64* tile_start, const i64* tile_count,
                                          const i64* tile_base, const unsigned short* tmp_off,
                                          const W* tmp_val, i64 ntiles, W* ref) {
    const i64 t = (i64)blockIdx.x * (THREADS / 32) + (threadIdx.x >> 5);
    if (t >= ntiles) return;
    const i64 n = tile_count[t], base = tile_base[t], start = tile_start[t];
    for (i64 j = threadIdx.x & 31; j < n; j += 32) ref[start + tmp_off[base + j]] = tmp_val[base + j];
}

// ws_encode_tiles_* (ENC_IDX16: index the 16-bit indices, counts the block counts) and ws_bitmap_tiles_*
// (ENC_BITMAP: index the bits, counts unused).
#define ENCODE_TILES(NAME, W, BITS)                                                                       \
extern "C" __global__ void __launch_bounds__(THREADS) NAME(                                               \
        const i64* tile_start, const i64* tile_count, const i64* tile_base, const i64* first,             \
        const unsigned short* tmp_off, const W* tmp_val, i64 t_lo, i64 t_hi, const i64* table, int nruns, \
        void* index, W* out_vals, int* counts) {                                                          \
    encode_tiles<W, BITS>(tile_start, tile_count, tile_base, first, tmp_off, tmp_val, t_lo, t_hi, table,  \
                          nruns, index, out_vals, counts);                                                \
}
#define TILES(W, SUFFIX)                                                                                  \
ENCODE_TILES(ws_encode_tiles_##SUFFIX, W, false)                                                          \
ENCODE_TILES(ws_bitmap_tiles_##SUFFIX, W, true)                                                           \
extern "C" __global__ void __launch_bounds__(THREADS) ws_ref_tiles_##SUFFIX(                              \
        const i64* tile_start, const i64* tile_count, const i64* tile_base, const unsigned short* tmp_off, \
        const W* tmp_val, i64 ntiles, W* ref) {                                                           \
    ref_tiles<W>(tile_start, tile_count, tile_base, tmp_off, tmp_val, ntiles, ref);                      \
}
TILES(unsigned char, w1)
TILES(unsigned short, w2)
TILES(unsigned int, w4)
TILES(u64, w8)

// A sparse stream's entries from runs of the compare's output: run r (table rows lo, shift, out, count)
// takes changed words lo .. lo + count of the space (positions idx, values vals) to entries
// out .. out + count of the stream: stream position p = idx + shift, its index by put_index (ENC_IDX16
// or, BITS, ENC_BITMAP) and its value there. Entries between runs are other writes' (not touched). One
// thread per entry j < total.
template <typename W, bool BITS>
__device__ __forceinline__ void encode_runs(const i64* idx, const W* vals, const i64* table, int nruns,
                                            i64 total, void* index, W* out_vals, int* counts) {
    const i64 j = (i64)blockIdx.x * THREADS + threadIdx.x;
    const i64* lo = table;
    const i64* shift = table + nruns;
    const i64* out = table + 2 * (i64)nruns;
    const i64* count = table + 3 * (i64)nruns;
    bool live = false;
    i64 p = 0;
    if (j < total) {
        int a = 0, b = nruns - 1;  // the last run whose first entry is at or before j
        while (a < b) {
            const int m = (a + b + 1) >> 1;
            if (out[m] <= j) a = m; else b = m - 1;
        }
        const i64 k = j - out[a];
        if (k >= 0 && k < count[a]) {
            const i64 i = lo[a] + k;
            p = idx[i] + shift[a];
            out_vals[j] = vals[i];
            live = true;
        }
    }
    put_index<BITS>(live, p, j, index, counts);
}

// ws_encode_* (ENC_IDX16) and ws_bitmap_* (ENC_BITMAP), as ENCODE_TILES's pair.
#define ENCODE_RUNS(NAME, W, BITS)                                                                        \
extern "C" __global__ void __launch_bounds__(THREADS) NAME(                                               \
        const i64* idx, const W* vals, const i64* table, int nruns, i64 total, void* index, W* out_vals,  \
        int* counts) {                                                                                    \
    encode_runs<W, BITS>(idx, vals, table, nruns, total, index, out_vals, counts);                       \
}
#define ENCODE(W, SUFFIX)                                                                                 \
ENCODE_RUNS(ws_encode_##SUFFIX, W, false)                                                                 \
ENCODE_RUNS(ws_bitmap_##SUFFIX, W, true)
ENCODE(unsigned char, w1)
ENCODE(unsigned short, w2)
ENCODE(unsigned int, w4)
ENCODE(u64, w8)

// ws_bitmap_set_i32 / _i64: the bits of stream positions pos[i] + shift (i < m) set in an ENC_BITMAP
// stream's section (zeroed beforehand), a thread per position: the index writer's positions given in
// pieces (a strided write's, the changes where they were put in order).
#define BITMAP_SET(T, SUFFIX)                                                                             \
extern "C" __global__ void __launch_bounds__(THREADS) ws_bitmap_set_##SUFFIX(                             \
        const T* pos, i64 m, i64 shift, u32* bits) {                                                      \
    const i64 i = (i64)blockIdx.x * THREADS + threadIdx.x;                                                \
    const bool live = i < m;                                                                              \
    put_index<true>(live, live ? (i64)pos[i] + shift : 0, 0, bits, nullptr);                             \
}
BITMAP_SET(int, i32)
BITMAP_SET(i64, i64)

// A receiver's table of runs (column-major rows: first and last+1 entry, shift from stream positions to
// the key's words, the key's address, first and last+1 stream position) and the one way its entries are
// stored, the stream's positions checked (a stream from the wire is not trusted to keep to its runs).
struct RunTable {
    const i64 *lo, *hi, *shift, *addr, *pos_lo, *pos_hi;
    int n;
    __device__ __forceinline__ RunTable(const i64* t, int nruns)
        : lo(t), hi(t + nruns), shift(t + 2 * (i64)nruns), addr(t + 3 * (i64)nruns),
          pos_lo(t + 4 * (i64)nruns), pos_hi(t + 5 * (i64)nruns), n(nruns) {}
    // The last run starting at or before entry j.
    __device__ __forceinline__ int find(i64 j) const {
        int a = 0, top = n - 1;
        while (a < top) {
            const int m = (a + top + 1) >> 1;
            if (lo[m] <= j) a = m; else top = m - 1;
        }
        return a;
    }
    // Entry j, at stream position p, into its run's key (r: the run of an earlier entry of this thread,
    // stepped on: entries only increase). An entry of no run (a strided write's: the caller's torch ops)
    // is left; one at a position outside its run is not stored and sets *refused.
    template <typename W>
    __device__ __forceinline__ void store(int& r, i64 j, i64 p, const W* vals, int* refused) const {
        while (r + 1 < n && lo[r + 1] <= j) r++;
        if (j < lo[r] || j >= hi[r]) return;
        if (p >= pos_lo[r] && p < pos_hi[r]) reinterpret_cast<W*>(addr[r])[p + shift[r]] = vals[j];
        else *refused = 1;
    }
};

// The receiver: an ENC_IDX16 stream's entries scattered into their keys, one block per 65536-word block
// of the stream (its entries ends[b] .. ends[b + 1], ``nb`` blocks). Run r (table rows lo, hi, shift,
// address, first and last+1 stream position: entries lo .. hi go to key words stream position + shift of
// the key at that address) is found by a binary search for a thread's first entry, then by stepping
// (entries only increase). Entries of no run (a strided write's: the caller's torch ops) are left. The
// stream came over the wire and is not trusted to be whole: nothing is stored where the block counts do
// not sum to ``k`` (the caller's count), none of a block whose entries would lie outside 0 .. k (a count
// below 0), and no entry outside its run's positions; each of these sets *refused.
template <typename W>
__device__ __forceinline__ void scatter_runs(const i64* ends, i64 nb, i64 k, const unsigned short* low,
                                             const W* vals, const i64* table, int nruns, int* refused) {
    const i64 b = blockIdx.x;
    const RunTable runs(table, nruns);
    const i64 first = ends[b], last = ends[b + 1];
    if (ends[nb] != k || first < 0 || last > k || first > last) {
        if (threadIdx.x == 0) *refused = 1;
        return;
    }
    i64 j = first + threadIdx.x;
    if (j >= last) return;
    int r = runs.find(j);
    for (; j < last; j += THREADS) runs.store<W>(r, j, b * 65536 + low[j], vals, refused);
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
        const i64* ends, i64 nb, i64 k, const unsigned short* low, const W* vals, const i64* table,        \
        int nruns, int* refused) {                                                                        \
    scatter_runs<W>(ends, nb, k, low, vals, table, nruns, refused);                                       \
}
SCATTER(ws_scatter_w1, unsigned char)
SCATTER(ws_scatter_w2, unsigned short)
SCATTER(ws_scatter_w4, unsigned int)
SCATTER(ws_scatter_w8, u64)

// 32-bit word wi of an ENC_BITMAP section of n words: its bits at or past n cleared (a stream's own
// section is zeroed there; one from the wire is not trusted to be), 0 past the section.
__device__ __forceinline__ u32 bitmap_word(const u32* bits, i64 n, i64 wi) {
    const i64 lo = wi * 32;
    if (lo >= n) return 0;
    const u32 m = bits[wi];
    return n - lo < 32 ? m & ((1u << (n - lo)) - 1u) : m;
}

// ws_bitmap_counts: an ENC_BITMAP stream's changed words per 65536-word block (what an ENC_IDX16
// stream's block counts hold; ws_block_ends makes them the entries' ends), a block per block, thread j
// reading 32-bit words j, j + THREADS, ... of it (coalesced).
extern "C" __global__ void __launch_bounds__(THREADS) ws_bitmap_counts(const u32* bits, i64 n, int* counts) {
    __shared__ int sums[THREADS / 32];
    const i64 w0 = (i64)blockIdx.x * 2048;
    int c = 0;
    #pragma unroll
    for (int i = 0; i < 2048 / THREADS; i++)
        c += __popc(bitmap_word(bits, n, w0 + i * THREADS + threadIdx.x));
    #pragma unroll
    for (int d = 16; d; d >>= 1) c += __shfl_down_sync(FULL, c, d);
    if ((threadIdx.x & 31) == 0) sums[threadIdx.x >> 5] = c;
    __syncthreads();
    if (threadIdx.x == 0) {
        int t = 0;
        for (int i = 0; i < THREADS / 32; i++) t += sums[i];
        counts[blockIdx.x] = t;
    }
}

// The receiver: an ENC_BITMAP stream's changed words scattered into their keys straight from its bits
// (no 16-bit indices made in device memory), a block per 65536-word block of the stream, whose entries
// start at ends[b] (ws_bitmap_counts, ws_block_ends). The block takes its words in R rounds of 8192: in
// round i thread j reads 32-bit word i * THREADS + j of the block, so (round, thread, bit) is the words'
// order; where a thread's changes start comes from a scan of the rounds' counts, as ws_collect places
// its changes. Each round's changes go through shared memory (their words within the round, 16 bits),
// then a thread per change stores it: consecutive threads store consecutive changes, as the ENC_IDX16
// scatter does (a thread storing its own bits' changes spread a warp's stores over 32 lines, and took
// 2.6 times as long). Run r (table rows lo, hi, shift, address, first and last+1 stream position):
// entries lo .. hi go to key words stream position + shift of the key at that address, and only those at
// positions inside the run (a stream from the wire is not trusted to put them there). Nothing at all
// where the bits below n are not exactly k (the caller's count): a value past the stream's would be read.
// Either sets *refused.
template <typename W>
__device__ __forceinline__ void bitmap_scatter(const u32* bits, i64 n, const i64* ends, i64 nb, i64 k,
                                               const W* vals, const i64* table, int nruns, int* refused) {
    if (ends[nb] != k) {  // the same for every thread: none reaches the scan below
        if (blockIdx.x == 0 && threadIdx.x == 0) *refused = 1;
        return;
    }
    constexpr int R = 2048 / THREADS;  // rounds
    constexpr int G = (R + 3) / 4;
    constexpr int ROUND_WORDS = THREADS * 32;  // 8192: a word's place in its round fits 16 bits
    __shared__ u64 s_warps[G][THREADS / 32];
    __shared__ unsigned short s_pos[ROUND_WORDS];
    const RunTable runs(table, nruns);
    const i64 b = blockIdx.x, w0 = b * 2048;
    u32 m[R];
    u64 packed[G];
    #pragma unroll
    for (int g = 0; g < G; g++) packed[g] = 0;
    #pragma unroll
    for (int i = 0; i < R; i++) {
        m[i] = bitmap_word(bits, n, w0 + i * THREADS + threadIdx.x);
        packed[i / 4] |= (u64)__popc(m[i]) << (16 * (i % 4));
    }
    int at[R], round_count[R];  // this thread's first change in round i, within the round; the round's
    #pragma unroll
    for (int g = 0; g < G; g++) {
        u64 tot;
        const u64 pre = block_scan(packed[g], s_warps[g], &tot);
        #pragma unroll
        for (int q = 0; q < 4 && 4 * g + q < R; q++) {
            at[4 * g + q] = (int)((pre >> (16 * q)) & 0xffff);
            round_count[4 * g + q] = (int)((tot >> (16 * q)) & 0xffff);
        }
    }
    i64 first = ends[b];  // the round's first entry
    int r = -1;
    #pragma unroll
    for (int i = 0; i < R; i++) {
        u32 mm = m[i];
        int o = at[i];
        while (mm) {
            s_pos[o++] = (unsigned short)(threadIdx.x * 32 + __ffs(mm) - 1);
            mm &= mm - 1;
        }
        __syncthreads();
        const i64 p0 = (w0 + (i64)i * THREADS) * 32;  // the round's first stream position
        for (int c = threadIdx.x; c < round_count[i]; c += THREADS) {
            const i64 j = first + c;
            if (r < 0) r = runs.find(j);
            runs.store<W>(r, j, p0 + s_pos[c], vals, refused);
        }
        first += round_count[i];
        __syncthreads();  // s_pos is the next round's
    }
}

#define BITMAP_SCATTER(W, SUFFIX)                                                                         \
extern "C" __global__ void __launch_bounds__(THREADS) ws_bitmap_scatter_##SUFFIX(                         \
        const u32* bits, i64 n, const i64* ends, i64 nb, i64 k, const W* vals, const i64* table,          \
        int nruns, int* refused) {                                                                        \
    bitmap_scatter<W>(bits, n, ends, nb, k, vals, table, nruns, refused);                                 \
}
BITMAP_SCATTER(unsigned char, w1)
BITMAP_SCATTER(unsigned short, w2)
BITMAP_SCATTER(unsigned int, w4)
BITMAP_SCATTER(u64, w8)
"""

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

    from weightsync.delta.sender import _to_device

    return _to_device(np.ascontiguousarray(np.asarray(rows, np.int64).T), device)


class Collect:
    """A space's ``ws_collect`` launched on a stream, its count not yet read: the tiles' counts and places,
    the scratch of (16-bit word, value) per change, the count copied to pinned host memory and an event
    after that copy. The caller's host goes on (deciding and encoding another part) while the device
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

    from weightsync.delta.sender import BLOCK

    nb = -(-n // BLOCK)
    if not len(runs) or nb <= 0:
        return
    counts = torch.empty(nb, dtype=torch.int32, device=bits.device)
    _launch(mod, "ws_bitmap_counts", nb, [bits, n, counts], bits.device)
    ends = block_ends(mod, counts)
    mark("scatter: bitmap counted")
    _launch(mod, f"ws_bitmap_scatter_w{vals.element_size()}", nb,
            [bits, n, ends, nb, k, vals, _table(runs, vals.device), len(runs), refused], vals.device)
