// Completion counters with credit semantics: the receiver counts arriving immediates per value.
// Immediates that arrive before anyone waits are kept as credit; wait(n) consumes n credits.
// No ordering between writes is assumed, so a counter is the only way to learn that a set of writes landed.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <unordered_map>

namespace weightsync {

class ImmCounters {
 public:
  // Called by NIC workers for every remote completion carrying an immediate.
  void add(uint32_t imm, uint64_t n = 1);

  // Blocks until `n` credits for `imm` are available, then consumes them. Returns false on timeout
  // (nothing consumed). A negative timeout waits forever (only used internally with its own bound).
  bool wait(uint32_t imm, uint64_t n, double timeout_s);

  // Credits currently held for `imm` (arrived and not yet consumed).
  uint64_t value(uint32_t imm) const;

  // Total immediates ever received for `imm` (never decremented): for statistics and tests.
  uint64_t total(uint32_t imm) const;

  // Drop the credits of `imm` (for example a version that was abandoned), returning how many were held.
  uint64_t reset(uint32_t imm);

  // Called after every add() with the value and its new total, outside the lock, on the adding thread
  // (a NIC worker): the engine's triggered writes. Set once, before any immediate can arrive.
  void set_observer(std::function<void(uint32_t imm, uint64_t total)> fn) { observer_ = std::move(fn); }

  // Wakes all waiters so they observe `closed` and return; used when the engine shuts down.
  void close();
  bool closed() const;

 private:
  struct Slot {
    uint64_t credit = 0;
    uint64_t total = 0;
    // Waiters on this value, and a credit level at or below what each of them needs: add() wakes them
    // only once it is reached. Waking a waiter on every immediate (tens of thousands per push for a MoE
    // model) cost the adding worker a futex call and the waiter a context switch each time, and left the
    // destination a hundred milliseconds behind its writers.
    uint32_t waiters = 0;
    uint64_t wake_at = ~0ull;
  };
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::unordered_map<uint32_t, Slot> slots_;
  bool closed_ = false;
  std::function<void(uint32_t, uint64_t)> observer_;
};

}  // namespace weightsync
