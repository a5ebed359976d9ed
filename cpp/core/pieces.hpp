// How a write is cut into pieces, and so how many immediates it delivers. This is the one place the
// rule lives: the engine cuts writes by it (Engine::imm_count, Engine::make_pieces), and the binding
// exposes it to the planner (weightsync._ext._core.imm_counts), which must expect exactly the
// immediates the engine delivers.
#pragma once

#include <algorithm>
#include <cstdint>

namespace weightsync {

struct PieceRule {
  uint64_t nics = 1;                       // fabric NICs writes are striped over (at least 1)
  uint64_t stripe_threshold = 1ull << 20;  // writes above this are split across all NICs
  uint64_t max_piece = 16ull << 20;        // no single piece is larger (positive)

  static uint64_t ceil_div(uint64_t a, uint64_t b) { return (a + b - 1) / b; }

  // Bytes per piece of a 1-D write of `nbytes`: the whole write up to the threshold; above it, a
  // multiple of the NIC count of equal pieces (so every NIC carries the same share), 4 KiB aligned,
  // none larger than max_piece.
  uint64_t piece_size(uint64_t nbytes) const {
    if (nbytes <= std::min(stripe_threshold, max_piece)) return std::max<uint64_t>(nbytes, 1);
    const uint64_t n = std::max<uint64_t>(nics, 1);
    const uint64_t count = n * ceil_div(nbytes, n * max_piece);
    return std::min(ceil_div(ceil_div(nbytes, count), 4096) * 4096, max_piece);
  }

  // Immediates a write of `nbytes` (per row) delivers: one per piece for a 1-D write, exactly one for
  // a 2-D write (rows > 1: one trailing immediate whatever its size and lane), one for a zero-length
  // write (it only signals), none without an immediate.
  uint64_t imm_count(uint64_t nbytes, bool has_imm, uint64_t rows = 1) const {
    if (!has_imm) return 0;
    if (rows > 1) return 1;
    if (nbytes == 0) return 1;
    return ceil_div(nbytes, piece_size(nbytes));
  }
};

// The rule as a pure function of its inputs.
inline uint64_t imm_count(uint64_t nbytes, bool has_imm, uint64_t rows, uint64_t nics, uint64_t stripe_threshold,
                          uint64_t max_piece) {
  return PieceRule{nics, stripe_threshold, max_piece}.imm_count(nbytes, has_imm, rows);
}

}  // namespace weightsync
