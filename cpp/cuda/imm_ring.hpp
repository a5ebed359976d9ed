// Immediates between processes of one host, through shared memory: the copy engines cannot raise an
// immediate at the destination, so a source that finished a copy pushes the immediate into the
// destination's ring, and the destination's cuda worker pops it into its counters. Microseconds instead
// of a round trip through a NIC.
//
// A bounded multi-producer, single-consumer queue (per-slot sequence numbers) in a memfd that peers
// open through /proc/<pid>/fd/<fd>, so nothing is left behind when the owner exits. A futex in the same
// page wakes a sleeping consumer.
#pragma once

#include <atomic>
#include <cstdint>
#include <string>

namespace weightsync {

class ImmRing {
 public:
  static constexpr uint64_t kSlots = 1 << 14;
  static constexpr uint64_t kLiveSlots = 1 << 15;

  // Creates this process's ring (the consumer side).
  static ImmRing create();
  // Maps a peer's ring (the producer side); throws TransportError when it cannot.
  static ImmRing open(int pid, int fd);

  ImmRing() = default;
  ImmRing(ImmRing&& other) noexcept;
  ImmRing& operator=(ImmRing&& other) noexcept;
  ImmRing(const ImmRing&) = delete;
  ImmRing& operator=(const ImmRing&) = delete;
  ~ImmRing();

  bool valid() const { return shared_ != nullptr; }
  int fd() const { return fd_; }

  // Producer: false when the ring is full (the caller retries later).
  bool push(uint32_t imm);
  // Consumer: true and the next immediate, or false when empty.
  bool pop(uint32_t& imm);
  // Consumer: the bell's count now. Taken before the consumer last looks for work, it makes sleep()
  // return at once for a wake() that came after that look (it would otherwise be lost: the waker saw no
  // sleeper, and the sleeper would wait on the bell as the wake left it).
  uint32_t ticket() const;
  // Consumer: sleeps until something is pushed, wake() is called after `ticket` was taken, or timeout_us
  // passes.
  void sleep(int64_t timeout_us, uint32_t ticket);
  // Wakes a sleeping consumer (producers call it after push; the owner for its own work queue).
  void wake();

  // The owner's table of live registrations: which of its region ids peers may still copy into. A peer
  // checks it before each copy, so a region the owner deregistered (and may have freed and reused) is
  // refused instead of overwritten. Owner side: false when the table is full. Thread-safe for the owner.
  bool set_live(uint64_t id, bool live);
  // Producer side (any process mapping the ring): whether region `id` is registered now.
  bool is_live(uint64_t id) const;

 private:
  struct Slot {
    std::atomic<uint64_t> seq;
    uint32_t imm;
    uint32_t pad;
  };
  struct Shared {
    alignas(64) std::atomic<uint64_t> head;
    alignas(64) std::atomic<uint32_t> bell;
    std::atomic<uint32_t> sleeping;
    alignas(64) Slot slots[kSlots];
    // Open addressing by id; 0: never used (ends a search), kDead: freed (a search goes on past it).
    alignas(64) std::atomic<uint64_t> live[kLiveSlots];
  };
  static constexpr uint64_t kDead = ~0ull;

  Shared* shared_ = nullptr;
  int fd_ = -1;
  uint64_t tail_ = 0;  // consumer only
};

}  // namespace weightsync
