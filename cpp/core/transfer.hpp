// The future behind every write: how many pieces are still in flight, how many immediates the write
// delivers to the destination's counter, and the first error if any piece failed for good.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <string>
#include <thread>
#include <algorithm>

namespace weightsync {

class TransferState {
 public:
  TransferState(uint64_t pieces, uint64_t imm_count, uint64_t bytes, std::string what)
      : pending_(pieces), imm_count_(imm_count), bytes_(bytes), what_(std::move(what)) {}

  // More pieces than the write started with (pieces made after construction, signals a copy fans out to).
  void add_pending(uint64_t n) {
    std::lock_guard<std::mutex> lock(mu_);
    pending_ += n;
  }

  // Fails the transfer as a whole (a triggered write whose op went bad, a cancelled trigger).
  void fail(const std::string& error) {
    std::lock_guard<std::mutex> lock(mu_);
    if (!failed_) {
      failed_ = true;
      error_ = error;
    }
    pending_ = 0;
    finished_.store(true, std::memory_order_release);
    cv_.notify_all();
  }

  void piece_done() {
    std::lock_guard<std::mutex> lock(mu_);
    if (pending_ > 0 && --pending_ == 0) {
      finished_.store(true, std::memory_order_release);
      cv_.notify_all();
    }
  }

  // A piece failed for good (no NIC left to retry on, or an error retrying cannot fix).
  void piece_failed(const std::string& error) {
    std::lock_guard<std::mutex> lock(mu_);
    if (!failed_) {
      failed_ = true;
      error_ = error;
    }
    if (pending_ > 0) --pending_;
    finished_.store(true, std::memory_order_release);
    cv_.notify_all();
  }

  // Copy-engine writes finish within microseconds: a waiter that polls that long first spares both
  // threads a futex sleep and wake-up (the engine sets it for writes that went only to the cuda lane).
  void set_wait_spin(double us) { wait_spin_us_ = us; }

  // True once every piece completed or one failed; false on timeout.
  bool wait(double timeout_s) {
    const double spin = wait_spin_us_.load();
    if (spin > 0) {
      const auto until = std::chrono::steady_clock::now() +
                         std::chrono::duration<double, std::micro>(std::min(spin, timeout_s * 1e6));
      while (!finished_.load(std::memory_order_acquire) && std::chrono::steady_clock::now() < until) {
        std::this_thread::yield();
      }
    }
    std::unique_lock<std::mutex> lock(mu_);
    auto ready = [&] { return pending_ == 0 || failed_; };
    return cv_.wait_for(lock, std::chrono::duration<double>(timeout_s), ready);
  }

  bool done() {
    std::lock_guard<std::mutex> lock(mu_);
    return pending_ == 0 || failed_;
  }
  bool failed() {
    std::lock_guard<std::mutex> lock(mu_);
    return failed_;
  }
  std::string error() {
    std::lock_guard<std::mutex> lock(mu_);
    return error_;
  }
  uint64_t pending() {
    std::lock_guard<std::mutex> lock(mu_);
    return pending_;
  }
  uint64_t imm_count() const { return imm_count_; }
  uint64_t bytes() const { return bytes_; }
  const std::string& what() const { return what_; }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  uint64_t pending_;
  std::atomic<bool> finished_{false};
  std::atomic<double> wait_spin_us_{0};  // may be set while a waiter runs (a trigger firing)
  const uint64_t imm_count_;
  const uint64_t bytes_;
  bool failed_ = false;
  std::string error_;
  const std::string what_;  // "write of N bytes to peer P region R", for error messages
};

}  // namespace weightsync
