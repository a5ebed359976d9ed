// The delta push's host-memory work (host_delta.hpp). The compare is bound by memory bandwidth on any
// recent CPU: it reads each current word and its reference word once; what else it does per word has to
// stay below that. Hence: 32-byte blocks compared as four 64-bit xors, an unchanged block (most of them:
// RL steps change about 2% of BF16 words) skipped on one branch; in a changed block, each 64-bit lane's
// changed words found as one bit per word (no per-word compares), each change written out and into the
// reference while its line is in cache.
#include "delta/host_delta.hpp"
#include "block.h"  // weightsync/delta/block.h: the ENC_IDX16 block, shared with the CUDA kernels

#include <algorithm>
#include <condition_variable>
#include <cstdio>
#include <cstring>
#include <exception>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define WS_HOST_DELTA_AVX2 1
#include <immintrin.h>
#else
#define WS_HOST_DELTA_AVX2 0
#endif

#if !defined(__BYTE_ORDER__) || __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "the delta codec reads words out of 64-bit lanes little-endian"
#endif

namespace weightsync::host_delta {
namespace {

using u8 = unsigned char;

// Below this many words a thread costs more to start than it saves.
constexpr int64_t kMinWordsPerThread = int64_t(1) << 18;
constexpr int kMaxThreads = 256;
constexpr int64_t kBlockWords = WS_DELTA_BLOCK_WORDS;  // ENC_IDX16: words per block

inline uint64_t load64(const u8* p) {
  uint64_t v;
  std::memcpy(&v, p, 8);
  return v;
}
template <typename W>
inline W load_w(const u8* p) {
  W v;
  std::memcpy(&v, p, sizeof(W));
  return v;
}
template <typename W>
inline void store_w(u8* p, W v) {
  std::memcpy(p, &v, sizeof(W));
}

// The top bit of each WB-byte lane of x that is not zero, every other bit clear: the low bits of a lane
// plus all-ones-but-the-top carry into its top bit exactly when one of them is set (never beyond it).
template <int WB>
inline uint64_t nonzero_lanes(uint64_t x) {
  if constexpr (WB == 8) {
    return x ? uint64_t(1) << 63 : 0;
  } else {
    constexpr uint64_t top = WB == 1 ? 0x8080808080808080ull : WB == 2 ? 0x8000800080008000ull : 0x8000000080000000ull;
    constexpr uint64_t low = ~top;
    return (((x & low) + low) | x) & top;
  }
}

// Where the changes go when the thread's place in the output is known (the first range): straight into
// the output while it has room; a change past `cap` is counted only (the reference keeps its old word).
template <typename W>
struct Direct {
  int64_t* idx;
  W* val;
  int64_t cap;
  int64_t n = 0;
  int64_t* idx_out() { return idx; }
  W* val_out() { return val; }
  static constexpr bool kOld = false;
  W* old_out() { return nullptr; }
  void room(int64_t) {}
  // whether the next m changes all fit (a vector path then writes up to m entries from n on)
  bool fast(int64_t m) const { return n + m <= cap; }
  void put(int64_t pos, W v, u8* ref) {
    if (n < cap) {
      idx[n] = pos;
      val[n] = v;
      store_w<W>(ref, v);
    }
    ++n;
  }
};

// Where they go otherwise (later ranges: the place depends on the counts before): a scratch of position,
// new value and old reference word, the reference updated now (the line is in cache); once the counts
// are known the changes that fit are copied into the output and the others' old words put back.
template <typename W>
struct Scratch {
  // Where the entries are: the caller's memory to begin with (reused from push to push: fresh memory
  // costs a page fault per 4 KB, on a VM a third of the compare), the heap once that is full.
  int64_t* idx = nullptr;
  W* val = nullptr;
  W* old = nullptr;
  int64_t size = 0;
  int64_t n = 0;
  std::unique_ptr<u8[]> owned;
  static constexpr bool kOld = true;
  static constexpr int64_t kEntryBytes = 8 + 2 * sizeof(W);
  int64_t* idx_out() { return idx; }
  W* val_out() { return val; }
  W* old_out() { return old; }
  // Room for `entries` in `bytes` at p (8-byte aligned).
  void place(u8* p, int64_t entries) {
    idx = reinterpret_cast<int64_t*>(p);
    val = reinterpret_cast<W*>(p + entries * 8);
    old = val + entries;
    size = entries;
  }
  void grow(int64_t need) {
    const int64_t s = std::max({need, 2 * size, int64_t(4096)});
    std::unique_ptr<u8[]> mem(new u8[s * kEntryBytes]);
    int64_t* i2 = reinterpret_cast<int64_t*>(mem.get());
    W* v2 = reinterpret_cast<W*>(mem.get() + s * 8);
    W* o2 = v2 + s;
    if (n) {
      std::memcpy(i2, idx, n * sizeof(int64_t));
      std::memcpy(v2, val, n * sizeof(W));
      std::memcpy(o2, old, n * sizeof(W));
    }
    owned = std::move(mem);
    idx = i2;
    val = v2;
    old = o2;
    size = s;
  }
  void room(int64_t m) {
    if (n + m > size) grow(n + m);
  }
  bool fast(int64_t m) {
    room(m);
    return true;
  }
  void put(int64_t pos, W v, u8* ref) {
    idx[n] = pos;
    val[n] = v;
    old[n] = load_w<W>(ref);
    store_w<W>(ref, v);
    ++n;
  }
};

// The changed words of one 64-bit lane (x: current xor reference, c: current; pos: the lane's first word).
template <typename W, typename Sink>
inline void lane(uint64_t x, uint64_t c, int64_t pos, u8* ref, Sink& sink) {
  constexpr int WB = sizeof(W);
  if constexpr (WB == 8) {
    if (x) sink.put(pos, W(c), ref);
  } else {
    uint64_t m = nonzero_lanes<WB>(x);
    while (m) {
      const int k = __builtin_ctzll(m) / (8 * WB);
      m &= m - 1;
      sink.put(pos + k, W(c >> (8 * WB * k)), ref + k * WB);
    }
  }
}

// Words pos .. pos + n of the space: current ones at cur, reference ones at ref.
template <typename W, typename Sink>
void scan(const u8* cur, u8* ref, int64_t pos, int64_t n, Sink& sink) {
  constexpr int WB = sizeof(W);
  constexpr int64_t BW = 32 / WB;  // words per block
  constexpr int64_t LW = 8 / WB;   // words per lane
  int64_t i = 0;
  for (; i + BW <= n; i += BW) {
    const u8* c = cur + i * WB;
    u8* r = ref + i * WB;
    const uint64_t c0 = load64(c), c1 = load64(c + 8), c2 = load64(c + 16), c3 = load64(c + 24);
    const uint64_t x0 = c0 ^ load64(r), x1 = c1 ^ load64(r + 8), x2 = c2 ^ load64(r + 16),
                   x3 = c3 ^ load64(r + 24);
    if (!(x0 | x1 | x2 | x3)) continue;
    sink.room(BW);
    lane<W>(x0, c0, pos + i, r, sink);
    lane<W>(x1, c1, pos + i + LW, r + 8, sink);
    lane<W>(x2, c2, pos + i + 2 * LW, r + 16, sink);
    lane<W>(x3, c3, pos + i + 3 * LW, r + 24, sink);
  }
  for (; i < n; ++i) {
    const W c = load_w<W>(cur + i * WB);
    u8* r = ref + i * WB;
    if (c != load_w<W>(r)) {
      sink.room(1);
      sink.put(pos + i, c, r);
    }
  }
}

#if WS_HOST_DELTA_AVX2
// The vector path (x86-64 CPUs with AVX2 and BMI1, chosen at run time). Its reason is branches: changes
// fall at random, so any branch on "this block / lane / word changed" mispredicts about as often as it
// is taken, and each mispredict throws away the loads in flight: at a few percent of BF16 words changed a
// branchy scalar path runs several times slower than its reads. Here the words go in chunks of 64: a chunk's change mask (one bit per word) by vector
// compares, then its first kSlots changes written without a branch (positions from the mask's lowest
// bits, each slot written whatever the count: the sink has room, and the count advances by the bits set),
// the rest (a chunk with more than kSlots changes: rare at RL's rates) by a loop; the changed 32-byte
// blocks stored into the reference, an unchanged one's store sent to a dummy instead (a select, not a
// branch). Only a whole group of kChunks chunks without a change is skipped by a branch (predictable at
// both ends: nearly none or nearly all of them unchanged).
#define WS_AVX2 __attribute__((target("avx2,bmi,popcnt")))

constexpr int kSlots = 4;
constexpr int kChunks = 4;

WS_AVX2 inline __m256i load256(const u8* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }

// One bit per word of the 64 at c (current) and r (reference): set where they differ.
template <typename W>
WS_AVX2 inline uint64_t change_mask(const u8* c, const u8* r) {
  constexpr int WB = sizeof(W);
  uint64_t eq = 0;
  if constexpr (WB == 1) {
    for (int q = 0; q < 2; ++q) {
      const __m256i e = _mm256_cmpeq_epi8(load256(c + 32 * q), load256(r + 32 * q));
      eq |= uint64_t(uint32_t(_mm256_movemask_epi8(e))) << (32 * q);
    }
  } else if constexpr (WB == 2) {
    for (int q = 0; q < 2; ++q) {
      const __m256i e0 = _mm256_cmpeq_epi16(load256(c + 64 * q), load256(r + 64 * q));
      const __m256i e1 = _mm256_cmpeq_epi16(load256(c + 64 * q + 32), load256(r + 64 * q + 32));
      // packed to bytes within 128-bit lanes (words 0-7, 16-23 | 8-15, 24-31), then put in order
      const __m256i p = _mm256_permute4x64_epi64(_mm256_packs_epi16(e0, e1), 0xD8);
      eq |= uint64_t(uint32_t(_mm256_movemask_epi8(p))) << (32 * q);
    }
  } else if constexpr (WB == 4) {
    for (int q = 0; q < 8; ++q) {
      const __m256i e = _mm256_cmpeq_epi32(load256(c + 32 * q), load256(r + 32 * q));
      eq |= uint64_t(uint32_t(_mm256_movemask_ps(_mm256_castsi256_ps(e)))) << (8 * q);
    }
  } else {
    for (int q = 0; q < 16; ++q) {
      const __m256i e = _mm256_cmpeq_epi64(load256(c + 32 * q), load256(r + 32 * q));
      eq |= uint64_t(uint32_t(_mm256_movemask_pd(_mm256_castsi256_pd(e)))) << (4 * q);
    }
  }
  return ~eq;
}

// Chunk of 64 words at c / r (first at space position pos) with change mask m: its changes to the sink
// (which has room for 64 more), its changed blocks into the reference.
template <typename W, typename Sink>
WS_AVX2 inline void put_chunk(Sink& sink, int64_t pos, uint64_t m, const u8* c, u8* r, u8* dummy) {
  constexpr int WB = sizeof(W);
  const int64_t n = sink.n;
  int64_t* oi = sink.idx_out() + n;
  W* ov = sink.val_out() + n;
  W* oo = Sink::kOld ? sink.old_out() + n : nullptr;
  uint64_t rest = m;
  for (int j = 0; j < kSlots; ++j) {  // a slot past the count writes word 0's values: overwritten later
    const int b = int(_tzcnt_u64(rest)) & 63;
    oi[j] = pos + b;
    ov[j] = load_w<W>(c + b * WB);
    if constexpr (Sink::kOld) oo[j] = load_w<W>(r + b * WB);
    rest = _blsr_u64(rest);
  }
  const int count = int(_mm_popcnt_u64(m));
  if (count > kSlots) {
    for (int j = kSlots; rest; ++j) {
      const int b = int(_tzcnt_u64(rest));
      oi[j] = pos + b;
      ov[j] = load_w<W>(c + b * WB);
      if constexpr (Sink::kOld) oo[j] = load_w<W>(r + b * WB);
      rest = _blsr_u64(rest);
    }
  }
  sink.n = n + count;
  constexpr int kBlocks = 2 * WB;  // 32-byte blocks of the chunk
  constexpr int kBits = 32 / WB;   // words (mask bits) per block
  constexpr uint64_t kBlockMask = kBits == 64 ? ~uint64_t(0) : (uint64_t(1) << kBits) - 1;
  for (int q = 0; q < kBlocks; ++q) {
    u8* dst = (m >> (q * kBits)) & kBlockMask ? r + 32 * q : dummy;
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), load256(c + 32 * q));
  }
}

// scan() on AVX2.
template <typename W, typename Sink>
WS_AVX2 void scan_avx2(const u8* cur, u8* ref, int64_t pos, int64_t n, Sink& sink) {
  constexpr int WB = sizeof(W);
  constexpr int64_t G = 64 * kChunks;  // words per group
  alignas(32) u8 dummy[32];
  int64_t i = 0;
  for (; i + G <= n; i += G) {
    const u8* c = cur + i * WB;
    u8* r = ref + i * WB;
    uint64_t m[kChunks];
    uint64_t any = 0;
    for (int h = 0; h < kChunks; ++h) {
      m[h] = change_mask<W>(c + 64 * WB * h, r + 64 * WB * h);
      any |= m[h];
    }
    if (!any) continue;
    if (!sink.fast(G)) {  // the output's last room: word by word, up to cap
      for (int64_t j = 0; j < G; ++j) {
        const W v = load_w<W>(c + j * WB);
        if (v != load_w<W>(r + j * WB)) sink.put(pos + i + j, v, r + j * WB);
      }
      continue;
    }
    for (int h = 0; h < kChunks; ++h) {
      put_chunk<W>(sink, pos + i + 64 * h, m[h], c + 64 * WB * h, r + 64 * WB * h, dummy);
    }
  }
  scan<W>(cur + i * WB, ref + i * WB, pos + i, n - i, sink);  // the last words
}

bool has_avx2() {
  static const bool yes =
      __builtin_cpu_supports("avx2") && __builtin_cpu_supports("bmi") && __builtin_cpu_supports("popcnt");
  return yes;
}
#endif

// scan() by the best path this CPU has.
template <typename W, typename Sink>
void scan_any(const u8* cur, u8* ref, int64_t pos, int64_t n, Sink& sink) {
#if WS_HOST_DELTA_AVX2
  if (has_avx2()) return scan_avx2<W>(cur, ref, pos, n, sink);
#endif
  scan<W>(cur, ref, pos, n, sink);
}

// A one-time rendezvous of the compare's threads (C++17 has no std::barrier).
class Rendezvous {
 public:
  explicit Rendezvous(int n) : left_(n) {}
  void arrive() {
    std::lock_guard<std::mutex> lock(mu_);
    if (--left_ == 0) cv_.notify_all();
  }
  void arrive_and_wait() {
    std::unique_lock<std::mutex> lock(mu_);
    if (--left_ == 0) {
      cv_.notify_all();
      return;
    }
    cv_.wait(lock, [this] { return left_ == 0; });
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  int left_;
};

template <typename W>
int64_t compare_w(u8* ref, const Segment* keys, const std::vector<int64_t>& starts, int64_t total,
                  int64_t* out_idx, W* out_val, int64_t cap, int threads, u8* scratch_mem, int64_t scratch_bytes) {
  constexpr int WB = sizeof(W);
  // Words a..b of the space, key by key (empty keys have equal starts: passed over).
  auto walk = [&](int64_t a, int64_t b, auto& sink) {
    size_t s = size_t(std::upper_bound(starts.begin(), starts.end(), a) - starts.begin()) - 1;
    while (a < b) {
      const int64_t end = std::min(b, starts[s + 1]);
      if (end > a) scan_any<W>(static_cast<const u8*>(keys[s].addr) + (a - starts[s]) * WB, ref + a * WB, a, end - a, sink);
      a = std::max(a, end);
      ++s;
    }
  };
  Direct<W> direct{out_idx, out_val, cap};
  const int T = int(std::min<int64_t>({int64_t(threads), std::max<int64_t>(1, total / kMinWordsPerThread),
                                       int64_t(kMaxThreads)}));
  if (T <= 1) {
    walk(0, total, direct);
    return direct.n;
  }
  std::vector<int64_t> cut(T + 1);
  for (int t = 0; t <= T; ++t) cut[t] = t == T ? total : (total / T * t) & ~int64_t(63);
  std::vector<Scratch<W>> scratch(T);
  std::vector<int64_t> counts(T, 0);
  std::vector<std::exception_ptr> errors(T);
  Rendezvous counted(T);
  auto work = [&](int t) {
    try {
      if (t == 0) {
        walk(cut[0], cut[1], direct);
        counts[0] = direct.n;
      } else {
        // the caller's scratch split between the threads that need one, else room for this range's share
        // of the caller's guess; grown as it fills
        const int64_t stride = scratch_bytes / (T - 1) / 8 * 8;  // each thread's part, 8-byte aligned
        const int64_t share = stride / Scratch<W>::kEntryBytes;
        if (share >= 4096) {
          scratch[t].place(scratch_mem + (t - 1) * stride, share);
        } else {
          const int64_t words = cut[t + 1] - cut[t];
          scratch[t].grow(int64_t(double(cap) * double(words) / double(total)) + 1024);
        }
        walk(cut[t], cut[t + 1], scratch[t]);
        counts[t] = scratch[t].n;
      }
    } catch (...) {
      errors[t] = std::current_exception();
    }
    counted.arrive_and_wait();
    if (t == 0) return;
    for (const auto& e : errors) {
      if (e) return;
    }
    int64_t at = 0;
    for (int s = 0; s < t; ++s) at += counts[s];
    const Scratch<W>& sc = scratch[t];
    const int64_t fit = std::max<int64_t>(0, std::min(cap - at, sc.n));
    if (fit > 0) {
      std::memcpy(out_idx + at, sc.idx, fit * sizeof(int64_t));
      std::memcpy(out_val + at, sc.val, fit * sizeof(W));
    }
    for (int64_t j = fit; j < sc.n; ++j) store_w<W>(ref + sc.idx[j] * WB, sc.old[j]);  // past cap: as it was
  };
  std::vector<std::thread> pool;
  pool.reserve(T - 1);
  try {
    for (int t = 1; t < T; ++t) pool.emplace_back(work, t);
  } catch (...) {
    // the threads that did not start fail the compare, and arrive for it so that the others are released
    for (int t = int(pool.size()) + 1; t < T; ++t) {
      errors[t] = std::current_exception();
      counted.arrive();
    }
  }
  work(0);
  for (auto& th : pool) th.join();
  for (const auto& e : errors) {
    if (e) std::rethrow_exception(e);
  }
  int64_t sum = 0;
  for (int64_t c : counts) sum += c;
  return sum;
}

bool aligned(const void* p, int64_t a) { return reinterpret_cast<uintptr_t>(p) % uintptr_t(a) == 0; }

std::string hex(const void* p) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "0x%llx", static_cast<unsigned long long>(reinterpret_cast<uintptr_t>(p)));
  return buf;
}

bool overlap(const void* a, int64_t na, const void* b, int64_t nb) {
  const uintptr_t x = reinterpret_cast<uintptr_t>(a), y = reinterpret_cast<uintptr_t>(b);
  return na > 0 && nb > 0 && x < y + uintptr_t(nb) && y < x + uintptr_t(na);
}

[[noreturn]] void bad(const std::string& what) { throw std::invalid_argument(what); }

void check_word(const char* fn, int word) {
  if (word != 1 && word != 2 && word != 4 && word != 8) {
    bad(std::string(fn) + ": word must be 1, 2, 4 or 8 bytes, not " + std::to_string(word));
  }
}

void check_threads(const char* fn, int threads) {
  if (threads < 1) bad(std::string(fn) + ": threads must be at least 1, not " + std::to_string(threads));
}

// Runs work(t) for t in 0 .. T-1, T - 1 of them on threads of their own (where a thread cannot be had,
// the share runs here); rethrows the first failure.
template <typename Work>
void on_threads(int T, Work&& work) {
  std::vector<std::exception_ptr> errors(T);
  auto guarded = [&](int t) {
    try {
      work(t);
    } catch (...) {
      errors[t] = std::current_exception();
    }
  };
  std::vector<std::thread> pool;
  int started = 1;
  try {
    for (; started < T; ++started) pool.emplace_back(guarded, started);
  } catch (...) {  // no thread to be had: the shares not started are done here
  }
  for (int t = started; t < T; ++t) guarded(t);
  guarded(0);
  for (auto& th : pool) th.join();
  for (const auto& e : errors) {
    if (e) std::rethrow_exception(e);
  }
}

template <typename W>
void scatter_w(const std::vector<int64_t>& ends, const uint16_t* low, const u8* vals, const ScatterRun* runs,
               size_t nruns, int threads) {
  constexpr int WB = sizeof(W);
  // entries per run, end to end: thread t takes its share of them
  std::vector<int64_t> at(nruns + 1, 0);
  for (size_t r = 0; r < nruns; ++r) at[r + 1] = at[r] + (runs[r].hi - runs[r].lo);
  const int64_t total = at[nruns];
  const int T = int(std::min<int64_t>({int64_t(threads), std::max<int64_t>(1, total / (kMinWordsPerThread / 4)),
                                       int64_t(kMaxThreads)}));
  on_threads(T, [&](int t) {
    const int64_t g0 = total / T * t, g1 = t == T - 1 ? total : total / T * (t + 1);
    size_t r = size_t(std::upper_bound(at.begin(), at.end(), g0) - at.begin()) - 1;
    for (int64_t g = g0; g < g1 && r < nruns; ++r) {
      const ScatterRun& run = runs[r];
      int64_t j = run.lo + (g - at[r]);
      const int64_t stop = run.lo + (std::min(g1, at[r + 1]) - at[r]);
      if (j >= stop) continue;
      g += stop - j;
      u8* key = static_cast<u8*>(run.addr);
      size_t b = size_t(std::upper_bound(ends.begin(), ends.end(), j) - ends.begin()) - 1;
      while (j < stop) {  // block by block: its entries j .. e
        while (j >= ends[b + 1]) ++b;
        const int64_t e = std::min(stop, ends[b + 1]);
        const int64_t first = int64_t(b) * kBlockWords;  // the block's first stream position
        // A block whose every position lies in the run and lands in the key needs no check per entry
        // (checking each costs a good share of the scatter's time).
        const bool inside = first >= run.pos_lo && first + kBlockWords <= run.pos_hi && first + run.shift >= 0 &&
                            first + kBlockWords + run.shift <= run.words;
        if (inside) {
          u8* at = key + (first + run.shift) * WB;
          for (; j < e; ++j) store_w<W>(at + int64_t(low[j]) * WB, load_w<W>(vals + j * WB));
          continue;
        }
        for (; j < e; ++j) {
          const int64_t p = first + low[j];
          const int64_t dst = p + run.shift;
          if (p < run.pos_lo || p >= run.pos_hi || dst < 0 || dst >= run.words) {
            bad("delta_scatter_idx16: entry " + std::to_string(j) + " (stream position " + std::to_string(p) +
                ") of run " + std::to_string(r) + " lies outside the run's positions [" +
                std::to_string(run.pos_lo) + ", " + std::to_string(run.pos_hi) + ") or its key's " +
                std::to_string(run.words) + " words (word " + std::to_string(dst) + ")");
          }
          store_w<W>(key + dst * WB, load_w<W>(vals + j * WB));
        }
      }
    }
  });
}

// Byte range [a, b) of a bitmap of `nbytes` bytes as 64-bit words, the last one short: its bits below
// `n` (words past it are 0), each handed to f(word index, bits).
template <typename F>
void bitmap_words(const u8* bits, int64_t n, int64_t a, int64_t b, F&& f) {
  const int64_t nbytes = (n + 7) / 8;
  for (int64_t byte = a; byte < b; byte += 8) {
    uint64_t x = 0;
    if (byte + 8 <= nbytes) {
      x = load64(bits + byte);
    } else {
      for (int64_t j = byte; j < nbytes; ++j) x |= uint64_t(bits[j]) << (8 * (j - byte));
    }
    const int64_t first = byte * 8;  // the word of bit 0
    if (first + 64 > n) x &= n - first >= 64 ? ~uint64_t(0) : (uint64_t(1) << (n - first)) - 1;
    f(byte / 8, x);
  }
}

}  // namespace

int64_t compare(int word, void* ref, int64_t ref_words, const Segment* keys, size_t nkeys, int64_t* out_idx,
                void* out_val, int64_t cap, int threads, void* scratch, int64_t scratch_bytes) {
  const char* fn = "delta_compare";
  check_word(fn, word);
  check_threads(fn, threads);
  if (ref_words < 0) bad("delta_compare: ref_words must be >= 0, not " + std::to_string(ref_words));
  if (cap < 0) bad("delta_compare: cap must be >= 0, not " + std::to_string(cap));
  if (ref_words > 0 && ref == nullptr) bad("delta_compare: the reference is null");
  if (!aligned(ref, word)) bad("delta_compare: the reference at " + hex(ref) + " is not aligned to its " +
                               std::to_string(word) + "-byte words");
  if (nkeys > 0 && keys == nullptr) bad("delta_compare: the keys are null");
  if (cap > 0) {
    if (out_idx == nullptr || out_val == nullptr) bad("delta_compare: an output is null with room for changes");
    if (!aligned(out_idx, 8)) bad("delta_compare: out_idx at " + hex(out_idx) + " is not 8-byte aligned");
    if (!aligned(out_val, word)) bad("delta_compare: out_val at " + hex(out_val) + " is not aligned to its " +
                                     std::to_string(word) + "-byte words");
  }
  if (scratch_bytes < 0 || (scratch_bytes > 0 && scratch == nullptr) || !aligned(scratch, 8)) {
    bad("delta_compare: the scratch (" + std::to_string(scratch_bytes) + " bytes at " + hex(scratch) +
        ") must be null and empty or 8-byte aligned");
  }
  const int64_t ref_bytes = ref_words * word;
  if (overlap(scratch, scratch_bytes, ref, ref_bytes) || overlap(scratch, scratch_bytes, out_idx, cap * 8) ||
      overlap(scratch, scratch_bytes, out_val, cap * word)) {
    bad("delta_compare: the scratch overlaps the reference or an output");
  }
  if (overlap(out_idx, cap * 8, ref, ref_bytes) || overlap(out_val, cap * word, ref, ref_bytes) ||
      overlap(out_idx, cap * 8, out_val, cap * word)) {
    bad("delta_compare: the outputs overlap each other or the reference");
  }
  std::vector<int64_t> starts(nkeys + 1, 0);
  for (size_t i = 0; i < nkeys; ++i) {
    const int64_t w = keys[i].words;
    if (w < 0) bad("delta_compare: key " + std::to_string(i) + " has " + std::to_string(w) + " words");
    if (w > 0 && keys[i].addr == nullptr) bad("delta_compare: key " + std::to_string(i) + "'s address is null");
    if (overlap(keys[i].addr, w * word, ref, ref_bytes)) {
      bad("delta_compare: key " + std::to_string(i) + " at " + hex(keys[i].addr) + " overlaps the reference");
    }
    if (w > ref_words - starts[i]) {
      bad("delta_compare: the keys hold more words than the reference's " + std::to_string(ref_words));
    }
    starts[i + 1] = starts[i] + w;
  }
  if (starts[nkeys] != ref_words) {
    bad("delta_compare: the keys hold " + std::to_string(starts[nkeys]) + " words, the reference " +
        std::to_string(ref_words));
  }
  u8* r = static_cast<u8*>(ref);
  u8* sc = static_cast<u8*>(scratch);
  switch (word) {
    case 1: return compare_w<uint8_t>(r, keys, starts, ref_words, out_idx, static_cast<uint8_t*>(out_val), cap, threads, sc, scratch_bytes);
    case 2: return compare_w<uint16_t>(r, keys, starts, ref_words, out_idx, static_cast<uint16_t*>(out_val), cap, threads, sc, scratch_bytes);
    case 4: return compare_w<uint32_t>(r, keys, starts, ref_words, out_idx, static_cast<uint32_t*>(out_val), cap, threads, sc, scratch_bytes);
    default: return compare_w<uint64_t>(r, keys, starts, ref_words, out_idx, static_cast<uint64_t*>(out_val), cap, threads, sc, scratch_bytes);
  }
}

void bitmap_to_idx16(const uint8_t* bits, int64_t n, int64_t k, int32_t* counts, uint16_t* low, int threads) {
  const char* fn = "delta_bitmap_to_idx16";
  check_threads(fn, threads);
  if (n < 0 || k < 0 || k > n) {
    bad(std::string(fn) + ": a bitmap of " + std::to_string(k) + " changed words out of " + std::to_string(n));
  }
  const int64_t nb = (n + kBlockWords - 1) / kBlockWords;
  if (nb > 0 && (bits == nullptr || counts == nullptr)) bad(std::string(fn) + ": the bits or the counts are null");
  if (k > 0 && low == nullptr) bad(std::string(fn) + ": the indices are null");
  if (!aligned(counts, 4)) bad(std::string(fn) + ": the block counts at " + hex(counts) + " are not 4-byte aligned");
  if (!aligned(low, 2)) bad(std::string(fn) + ": the indices at " + hex(low) + " are not 2-byte aligned");
  constexpr int64_t kBlockBytes = kBlockWords / 8;
  const int64_t nbytes = (n + 7) / 8;
  // blocks per thread: a thread's share is whole blocks (its counts and its entries are its own)
  const int T = int(std::min<int64_t>({int64_t(threads), std::max<int64_t>(1, nb / 16), int64_t(kMaxThreads)}));
  auto share = [&](int t) { return std::pair<int64_t, int64_t>(nb / T * t, t == T - 1 ? nb : nb / T * (t + 1)); };
  on_threads(T, [&](int t) {  // the counts first: nothing is written to `low` unless they sum to k
    const auto [b0, b1] = share(t);
    for (int64_t b = b0; b < b1; ++b) {
      int64_t c = 0;
      bitmap_words(bits, n, b * kBlockBytes, std::min(nbytes, (b + 1) * kBlockBytes),
                   [&](int64_t, uint64_t x) { c += __builtin_popcountll(x); });
      counts[b] = int32_t(c);
    }
  });
  std::vector<int64_t> at(size_t(nb) + 1, 0);
  for (int64_t b = 0; b < nb; ++b) at[b + 1] = at[b] + counts[b];
  if (at[nb] != k) {
    bad(std::string(fn) + ": the bitmap of " + std::to_string(n) + " words sets " + std::to_string(at[nb]) +
        " bits below " + std::to_string(n) + ", its header says " + std::to_string(k) + " changed");
  }
  on_threads(T, [&](int t) {
    const auto [b0, b1] = share(t);
    if (b0 >= b1) return;
    uint16_t* out = low + at[b0];
    bitmap_words(bits, n, b0 * kBlockBytes, std::min(nbytes, b1 * kBlockBytes), [&](int64_t word, uint64_t x) {
      const uint16_t base = uint16_t((word * 64) & 0xffff);  // a 64-bit word never straddles a block
      while (x) {
        *out++ = uint16_t(base + __builtin_ctzll(x));
        x &= x - 1;
      }
    });
  });
}

void bitmap_set(uint8_t* bits, int64_t n, const int64_t* positions, int64_t m, int64_t shift) {
  const char* fn = "delta_bitmap_set";
  if (n < 0 || m < 0) bad(std::string(fn) + ": " + std::to_string(m) + " positions in a bitmap of " + std::to_string(n));
  if (m > 0 && (bits == nullptr || positions == nullptr)) bad(std::string(fn) + ": the bits or the positions are null");
  for (int64_t j = 0; j < m; ++j) {  // checked first: a bad position sets nothing
    const int64_t q = positions[j] + shift;
    if (q < 0 || q >= n) {
      bad(std::string(fn) + ": position " + std::to_string(j) + " (" + std::to_string(positions[j]) + " + " +
          std::to_string(shift) + ") lies outside the bitmap's " + std::to_string(n) + " words");
    }
  }
  for (int64_t j = 0; j < m; ++j) {
    const int64_t q = positions[j] + shift;
    bits[q >> 3] |= uint8_t(1u << (q & 7));
  }
}

void scatter_idx16(int word, int64_t n, int64_t k, const int32_t* counts, const uint16_t* low, const void* vals,
                   const ScatterRun* runs, size_t nruns, int threads) {
  const char* fn = "delta_scatter_idx16";
  check_word(fn, word);
  check_threads(fn, threads);
  if (n < 0 || k < 0 || k > n) {
    bad("delta_scatter_idx16: a stream of " + std::to_string(k) + " changed words out of " + std::to_string(n));
  }
  const int64_t nb = (n + kBlockWords - 1) / kBlockWords;
  if (nb > 0 && counts == nullptr) bad("delta_scatter_idx16: the block counts are null");
  if (k > 0 && (low == nullptr || vals == nullptr)) bad("delta_scatter_idx16: the indices or values are null");
  if (!aligned(counts, 4)) bad("delta_scatter_idx16: the block counts at " + hex(counts) + " are not 4-byte aligned");
  if (!aligned(low, 2)) bad("delta_scatter_idx16: the indices at " + hex(low) + " are not 2-byte aligned");
  if (nruns > 0 && runs == nullptr) bad("delta_scatter_idx16: the runs are null");
  std::vector<int64_t> ends(size_t(nb) + 1, 0);
  for (int64_t b = 0; b < nb; ++b) {
    if (counts[b] < 0 || counts[b] > kBlockWords) {
      bad("delta_scatter_idx16: block " + std::to_string(b) + " counts " + std::to_string(counts[b]) + " entries");
    }
    ends[b + 1] = ends[b] + counts[b];
  }
  if (ends[nb] != k) {
    bad("delta_scatter_idx16: the block counts sum to " + std::to_string(ends[nb]) + ", not the stream's " +
        std::to_string(k) + " changed words");
  }
  for (size_t r = 0; r < nruns; ++r) {
    const ScatterRun& run = runs[r];
    const std::string name = "delta_scatter_idx16: run " + std::to_string(r);
    if (run.lo < 0 || run.hi < run.lo || run.hi > k) {
      bad(name + " takes entries [" + std::to_string(run.lo) + ", " + std::to_string(run.hi) + ") of " +
          std::to_string(k));
    }
    if (run.pos_lo < 0 || run.pos_hi < run.pos_lo || run.pos_hi > n) {
      bad(name + " spans stream positions [" + std::to_string(run.pos_lo) + ", " + std::to_string(run.pos_hi) +
          ") of " + std::to_string(n));
    }
    if (run.words < 0) bad(name + "'s key has " + std::to_string(run.words) + " words");
    if (run.hi > run.lo && run.addr == nullptr) bad(name + "'s key address is null");
  }
  const u8* v = static_cast<const u8*>(vals);
  switch (word) {
    case 1: return scatter_w<uint8_t>(ends, low, v, runs, nruns, threads);
    case 2: return scatter_w<uint16_t>(ends, low, v, runs, nruns, threads);
    case 4: return scatter_w<uint32_t>(ends, low, v, runs, nruns, threads);
    default: return scatter_w<uint64_t>(ends, low, v, runs, nruns, threads);
  }
}

}  // namespace weightsync::host_delta
