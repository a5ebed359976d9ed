#include "cuda/imm_ring.hpp"

#include <fcntl.h>
#include <linux/futex.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <ctime>
#include <mutex>
#include <new>

#include "core/errors.hpp"

namespace weightsync {

namespace {

long futex(std::atomic<uint32_t>* addr, int op, uint32_t val, const timespec* timeout) {
  // Not FUTEX_PRIVATE: the word lives in memory shared between processes.
  return syscall(SYS_futex, reinterpret_cast<uint32_t*>(addr), op, val, timeout, nullptr, 0);
}

}  // namespace

ImmRing ImmRing::create() {
  ImmRing ring;
  ring.fd_ = static_cast<int>(syscall(SYS_memfd_create, "weightsync-imm-ring", 0));
  if (ring.fd_ < 0) throw TransportError(std::string("memfd_create failed: ") + std::strerror(errno));
  if (ftruncate(ring.fd_, sizeof(Shared)) != 0) {
    throw TransportError(std::string("ftruncate of the immediate ring failed: ") + std::strerror(errno));
  }
  void* p = mmap(nullptr, sizeof(Shared), PROT_READ | PROT_WRITE, MAP_SHARED, ring.fd_, 0);
  if (p == MAP_FAILED) throw TransportError(std::string("mmap of the immediate ring failed: ") + std::strerror(errno));
  ring.shared_ = new (p) Shared();
  for (uint64_t i = 0; i < kSlots; ++i) ring.shared_->slots[i].seq.store(i, std::memory_order_relaxed);
  std::atomic_thread_fence(std::memory_order_release);
  return ring;
}

ImmRing ImmRing::open(int pid, int fd) {
  ImmRing ring;
  const std::string path = "/proc/" + std::to_string(pid) + "/fd/" + std::to_string(fd);
  ring.fd_ = ::open(path.c_str(), O_RDWR | O_CLOEXEC);
  if (ring.fd_ < 0) {
    throw TransportError("cannot open the immediate ring of process " + std::to_string(pid) + " (" + path +
                         "): " + std::strerror(errno));
  }
  void* p = mmap(nullptr, sizeof(Shared), PROT_READ | PROT_WRITE, MAP_SHARED, ring.fd_, 0);
  if (p == MAP_FAILED) {
    ::close(ring.fd_);
    ring.fd_ = -1;
    throw TransportError("cannot map the immediate ring of process " + std::to_string(pid));
  }
  ring.shared_ = static_cast<Shared*>(p);
  return ring;
}

ImmRing::ImmRing(ImmRing&& other) noexcept { *this = std::move(other); }

ImmRing& ImmRing::operator=(ImmRing&& other) noexcept {
  if (this != &other) {
    this->~ImmRing();
    shared_ = other.shared_;
    fd_ = other.fd_;
    tail_ = other.tail_;
    other.shared_ = nullptr;
    other.fd_ = -1;
  }
  return *this;
}

ImmRing::~ImmRing() {
  if (shared_ != nullptr) munmap(shared_, sizeof(Shared));
  if (fd_ >= 0) ::close(fd_);
  shared_ = nullptr;
  fd_ = -1;
}

bool ImmRing::push(uint32_t imm) {
  Shared* s = shared_;
  uint64_t pos = s->head.load(std::memory_order_relaxed);
  for (;;) {
    Slot& slot = s->slots[pos & (kSlots - 1)];
    const uint64_t seq = slot.seq.load(std::memory_order_acquire);
    const int64_t diff = static_cast<int64_t>(seq) - static_cast<int64_t>(pos);
    if (diff == 0) {
      if (s->head.compare_exchange_weak(pos, pos + 1, std::memory_order_relaxed)) {
        slot.imm = imm;
        slot.seq.store(pos + 1, std::memory_order_release);
        wake();
        return true;
      }
    } else if (diff < 0) {
      return false;  // full: the consumer is behind by a whole ring
    } else {
      pos = s->head.load(std::memory_order_relaxed);
    }
  }
}

bool ImmRing::pop(uint32_t& imm) {
  Slot& slot = shared_->slots[tail_ & (kSlots - 1)];
  if (slot.seq.load(std::memory_order_acquire) != tail_ + 1) return false;
  imm = slot.imm;
  slot.seq.store(tail_ + kSlots, std::memory_order_release);
  ++tail_;
  return true;
}

uint32_t ImmRing::ticket() const { return shared_->bell.load(std::memory_order_seq_cst); }

void ImmRing::sleep(int64_t timeout_us, uint32_t ticket) {
  shared_->sleeping.store(1, std::memory_order_seq_cst);
  // Re-check after announcing that we sleep: a push in between has rung the bell or is visible now. A
  // wake since the ticket has moved the bell, so the futex does not wait.
  Slot& next = shared_->slots[tail_ & (kSlots - 1)];
  if (next.seq.load(std::memory_order_acquire) != tail_ + 1 &&
      shared_->bell.load(std::memory_order_seq_cst) == ticket) {
    timespec ts{static_cast<time_t>(timeout_us / 1000000), static_cast<long>((timeout_us % 1000000) * 1000)};
    futex(&shared_->bell, FUTEX_WAIT, ticket, &ts);
  }
  shared_->sleeping.store(0, std::memory_order_relaxed);
}

namespace {
std::mutex& live_mutex() {
  // One table per process (its own ring): the few register/deregister calls share a lock.
  static std::mutex mu;
  return mu;
}
}  // namespace

bool ImmRing::set_live(uint64_t id, bool live) {
  if (shared_ == nullptr || id == 0 || id == kDead) return false;
  std::lock_guard<std::mutex> lock(live_mutex());
  const uint64_t start = id % kLiveSlots;
  if (live) {
    // Ids are never reused, so the first free or freed slot along the probe is ours.
    for (uint64_t k = 0; k < kLiveSlots; ++k) {
      std::atomic<uint64_t>& slot = shared_->live[(start + k) % kLiveSlots];
      const uint64_t v = slot.load(std::memory_order_relaxed);
      if (v == id) return true;
      if (v == 0 || v == kDead) {
        slot.store(id, std::memory_order_release);
        return true;
      }
    }
    return false;
  }
  for (uint64_t k = 0; k < kLiveSlots; ++k) {
    std::atomic<uint64_t>& slot = shared_->live[(start + k) % kLiveSlots];
    const uint64_t v = slot.load(std::memory_order_relaxed);
    if (v == 0) return true;  // not there
    if (v == id) {
      slot.store(kDead, std::memory_order_seq_cst);
      return true;
    }
  }
  return true;
}

bool ImmRing::is_live(uint64_t id) const {
  if (shared_ == nullptr || id == 0 || id == kDead) return false;
  const uint64_t start = id % kLiveSlots;
  for (uint64_t k = 0; k < kLiveSlots; ++k) {
    const uint64_t v = shared_->live[(start + k) % kLiveSlots].load(std::memory_order_acquire);
    if (v == id) return true;
    if (v == 0) return false;
  }
  return false;
}

void ImmRing::wake() {
  shared_->bell.fetch_add(1, std::memory_order_seq_cst);
  if (shared_->sleeping.load(std::memory_order_seq_cst)) futex(&shared_->bell, FUTEX_WAKE, 1, nullptr);
}

}  // namespace weightsync
