// The delta push's work on host memory: the sender's compare of a word space with its
// reference and the receiver's scatter of an ENC_IDX16 stream, for tensors in CPU memory. The CUDA
// kernels of weightsync/runtime/delta_cuda.py do the same on a GPU; these follow their contracts
// (weightsync/runtime/delta_host.py is the Python face). Nothing here depends on the engine.
#pragma once

#include <cstddef>
#include <cstdint>

namespace weightsync::host_delta {

// One key of a word space: its current words (any address: loads and stores are unaligned-safe) and how
// many. The keys lie end to end in the space, in the order given, and so in the reference.
struct Segment {
  const void* addr;
  int64_t words;
};

// The space's changed words (bitwise, as `word`-byte integers: NaN payloads, -0.0 and denormals count as
// what they are): their positions in the space (sorted, int64) to out_idx and new values to out_val,
// each change put into the reference (`ref`, the keys' words as last pushed, `ref_words` of them). Room
// for `cap` changes: the first `cap` are written and put into the reference, later ones neither, so a
// second run over the same input finds exactly the rest. Output entries past the count (below `cap`) may
// be overwritten (the vector path stores whole slots). Returns how many changed in all. Work is split
// over up to `threads` threads (contiguous word ranges); all but the first collect their changes in a
// scratch, `scratch` (`scratch_bytes`, 8-byte aligned; 8 + 2 * word bytes an entry, split between them)
// while it has room, then the heap. Throws std::invalid_argument naming a bad argument; a failure part
// way (memory) leaves the reference holding some new values.
int64_t compare(int word, void* ref, int64_t ref_words, const Segment* keys, size_t nkeys, int64_t* out_idx,
                void* out_val, int64_t cap, int threads, void* scratch = nullptr, int64_t scratch_bytes = 0);

// One contiguous run of an ENC_IDX16 stream's entries: entries lo .. hi go to words `stream position +
// shift` of the key at `addr` (`words` words); their stream positions lie in pos_lo .. pos_hi.
struct ScatterRun {
  void* addr;
  int64_t words;
  int64_t shift;
  int64_t lo, hi;
  int64_t pos_lo, pos_hi;
};

// The receiver's scatter of an ENC_IDX16 stream of `n` words of which `k` changed (`counts`: its int32
// per-65536-word block counts, `low`: the k 16-bit indices, `vals`: the k values) into its runs' keys.
// Every entry is checked: block counts that do not sum to k, an entry whose position is outside its run's
// or whose target is outside its key throw std::invalid_argument (data from the wire is not trusted to
// write memory). Up to `threads` threads.
void scatter_idx16(int word, int64_t n, int64_t k, const int32_t* counts, const uint16_t* low, const void* vals,
                   const ScatterRun* runs, size_t nruns, int threads);

// An ENC_BITMAP stream's bits (bit i % 8 of byte i / 8 set for each changed word i < n) as what an
// ENC_IDX16 stream holds: each set bit's position's low 16 bits to `low` (in order), and the int32 count
// per 65536-word block to `counts` (ceil(n / 65536) of them), so that scatter_idx16 applies it. Bits past
// word n (the last byte's spare ones) are not words of the stream and are ignored. Throws
// std::invalid_argument where the bits below n are not exactly `k` (nothing written to `low` then). Up to
// `threads` threads (whole blocks each).
void bitmap_to_idx16(const uint8_t* bits, int64_t n, int64_t k, int32_t* counts, uint16_t* low, int threads);

// The sender's side of it: bit `position + shift` set for each of `m` positions (int64), in a bitmap of
// `n` words (bits past them untouched). Throws std::invalid_argument where one falls outside 0 .. n
// (nothing is set then).
void bitmap_set(uint8_t* bits, int64_t n, const int64_t* positions, int64_t m, int64_t shift);

}  // namespace weightsync::host_delta
