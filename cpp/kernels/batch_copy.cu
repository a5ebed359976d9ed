// The cuda lane's batched copy: many writes (1-D or 2-D) in one launch, cut into 64 KiB tiles that a
// persistent grid walks; the source is this GPU's memory, the destination a peer GPU's memory mapped
// through CUDA IPC (stores go over NVLink). Why: a copy-engine copy costs a few microseconds of setup
// on the GPU, so a push made of hundreds of 4-60 MiB tensors ran at 0.85 of the copy-engine bandwidth
// one copy per tensor, and at 0.94 as one launch of this kernel (docs/BENCHMARKS.md).
// Built to PTX by scripts/gen_copy_kernel.sh (cpp/src/batch_copy_ptx.inc); the driver compiles it at
// run time. Descriptor i covers tiles [tile0_i, tile0_{i+1}); the host fills it (cuda_transport.cpp).


struct WsCopyDesc {
  unsigned long long src, dst, row_bytes, rows, src_pitch, dst_pitch, tile0;
};

#define WS_TILE 65536ull
#define WS_THREADS 512

__device__ __forceinline__ void ws_copy_span(const char* s, char* q, unsigned long long len) {
  const unsigned tid = threadIdx.x;
  if (((((unsigned long long)s) ^ ((unsigned long long)q)) & 15) == 0) {
    unsigned long long head = (16 - (((unsigned long long)s) & 15)) & 15;
    if (head > len) head = len;
    for (unsigned long long i = tid; i < head; i += WS_THREADS) q[i] = s[i];
    const uint4* s4 = reinterpret_cast<const uint4*>(s + head);
    uint4* q4 = reinterpret_cast<uint4*>(q + head);
    const unsigned long long n4 = (len - head) >> 4;
    unsigned long long i = tid;
    // Eight loads in flight before the first store: the stores go over NVLink and must not wait on
    // one load at a time.
    for (; i + 7 * WS_THREADS < n4; i += 8 * WS_THREADS) {
      uint4 r[8];
#pragma unroll
      for (int j = 0; j < 8; ++j) r[j] = s4[i + j * WS_THREADS];
#pragma unroll
      for (int j = 0; j < 8; ++j) q4[i + j * WS_THREADS] = r[j];
    }
    for (; i < n4; i += WS_THREADS) q4[i] = s4[i];
    for (unsigned long long k = head + (n4 << 4) + tid; k < len; k += WS_THREADS) q[k] = s[k];
  } else {
    for (unsigned long long k = tid; k < len; k += WS_THREADS) q[k] = s[k];
  }
}

extern "C" __global__ void __launch_bounds__(WS_THREADS) ws_copy(const WsCopyDesc* __restrict__ d, int n,
                                                                 unsigned long long ntiles) {
  // Each block takes one contiguous range of tiles: it finds its first descriptor once (binary search)
  // and then only steps forward. A search per tile cost microseconds of dependent loads each, which
  // made writes of a tile or two (MoE experts) slower than copy-engine copies.
  const unsigned long long per = (ntiles + gridDim.x - 1) / gridDim.x;
  unsigned long long t = blockIdx.x * per;
  const unsigned long long end = t + per < ntiles ? t + per : ntiles;
  if (t >= end) return;
  int i = 0, hi = n - 1;
  while (i < hi) {
    int mid = (i + hi + 1) >> 1;
    if (d[mid].tile0 <= t) i = mid; else hi = mid - 1;
  }
  for (; t < end; ++t) {
    while (i + 1 < n && d[i + 1].tile0 <= t) ++i;
    const unsigned long long row_bytes = d[i].row_bytes;
    const unsigned long long k = t - d[i].tile0;
    const unsigned long long per_row = (row_bytes + WS_TILE - 1) / WS_TILE;
    const unsigned long long row = k / per_row, off = (k - row * per_row) * WS_TILE;
    const unsigned long long len = row_bytes - off < WS_TILE ? row_bytes - off : WS_TILE;
    ws_copy_span(reinterpret_cast<const char*>(d[i].src + row * d[i].src_pitch + off),
                 reinterpret_cast<char*>(d[i].dst + row * d[i].dst_pitch + off), len);
  }
}
