// The delta push's device kernels (weightsync/delta/cuda.py says what each does and launches them),
// compiled at run time by NVRTC (weightsync/delta/nvrtc.py) with this directory on its include path.
#include "block.h"

static_assert(WS_DELTA_BLOCK_BITS == 16, "ENC_IDX16 stores a word's index within its block in 16 bits");

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
    reinterpret_cast<short*>(index)[e] = (short)(p & (WS_DELTA_BLOCK_WORDS - 1));
    const int block = (int)(p >> WS_DELTA_BLOCK_BITS);
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
    for (; j < last; j += THREADS) runs.store<W>(r, j, b * WS_DELTA_BLOCK_WORDS + low[j], vals, refused);
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
    const i64 w0 = (i64)blockIdx.x * (WS_DELTA_BLOCK_WORDS / 32);
    int c = 0;
    #pragma unroll
    for (int i = 0; i < WS_DELTA_BLOCK_WORDS / 32 / THREADS; i++)
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
    constexpr int R = WS_DELTA_BLOCK_WORDS / 32 / THREADS;  // rounds
    constexpr int G = (R + 3) / 4;
    constexpr int ROUND_WORDS = THREADS * 32;  // 8192: a word's place in its round fits 16 bits
    __shared__ u64 s_warps[G][THREADS / 32];
    __shared__ unsigned short s_pos[ROUND_WORDS];
    const RunTable runs(table, nruns);
    const i64 b = blockIdx.x, w0 = b * (WS_DELTA_BLOCK_WORDS / 32);
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
