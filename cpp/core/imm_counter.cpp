#include "core/imm_counter.hpp"

#include <algorithm>
#include <chrono>

namespace weightsync {

void ImmCounters::add(uint32_t imm, uint64_t n) {
  uint64_t total;
  bool wake;
  {
    std::lock_guard<std::mutex> lock(mu_);
    Slot& s = slots_[imm];
    s.credit += n;
    s.total += n;
    total = s.total;
    wake = s.waiters > 0 && s.credit >= s.wake_at;
  }
  if (wake) cv_.notify_all();
  if (observer_) observer_(imm, total);
}

bool ImmCounters::wait(uint32_t imm, uint64_t n, double timeout_s) {
  std::unique_lock<std::mutex> lock(mu_);
  auto ready = [&] { return closed_ || slots_[imm].credit >= n; };
  if (!ready()) {
    // Register before sleeping. wake_at only ever drops while anyone waits (the smallest need among
    // them, or less: a waiter that left may have needed less), so no waiter's level is ever skipped;
    // at worst one wakes early and sleeps again.
    {
      Slot& w = slots_[imm];
      w.waiters++;
      w.wake_at = std::min(w.wake_at, n);
    }
    bool ok = true;
    if (timeout_s < 0) {
      cv_.wait(lock, ready);
    } else {
      auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(timeout_s);
      ok = cv_.wait_until(lock, deadline, ready);
    }
    Slot& w = slots_[imm];
    if (--w.waiters == 0) w.wake_at = ~0ull;
    if (!ok) return false;
  }
  Slot& s = slots_[imm];
  if (s.credit < n) return false;  // closed before enough arrived
  s.credit -= n;
  return true;
}

uint64_t ImmCounters::value(uint32_t imm) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = slots_.find(imm);
  return it == slots_.end() ? 0 : it->second.credit;
}

uint64_t ImmCounters::total(uint32_t imm) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = slots_.find(imm);
  return it == slots_.end() ? 0 : it->second.total;
}

uint64_t ImmCounters::reset(uint32_t imm) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = slots_.find(imm);
  if (it == slots_.end()) return 0;
  uint64_t held = it->second.credit;
  it->second.credit = 0;
  return held;
}

void ImmCounters::close() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    closed_ = true;
  }
  cv_.notify_all();
}

bool ImmCounters::closed() const {
  std::lock_guard<std::mutex> lock(mu_);
  return closed_;
}

}  // namespace weightsync
