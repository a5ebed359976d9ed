// The completion queue of a fabric lane (both the RDM lane and the MSG lane): opened with a wait object
// where the provider has one, read in batches into the engine's Completions, and waited on by an idle
// worker. What a completion means differs by lane, so read() asks the lane for each entry.
#pragma once

#include <rdma/fabric.h>
#include <rdma/fi_domain.h>
#include <rdma/fi_eq.h>
#include <rdma/fi_errno.h>

#include <algorithm>
#include <ctime>
#include <string>
#include <utility>
#include <vector>

#include "core/lane.hpp"

namespace weightsync {

class CompletionQueue {
 public:
  static constexpr size_t kSize = 8192;
  static constexpr size_t kBatch = 64;  // entries read per fi_cq_read

  // Tagged format: a landed message's tag says where its bytes go. Some providers (EFA) have no wait
  // objects: the worker then polls with short sleeps. Returns 0 or fi_cq_open's error.
  int open(fid_domain* domain) {
    fi_cq_attr attr{};
    attr.format = FI_CQ_FORMAT_TAGGED;
    attr.size = kSize;
    attr.wait_obj = FI_WAIT_UNSPEC;
    if (fi_cq_open(domain, &attr, &cq_, nullptr) == 0) {
      waitable_ = true;
      return 0;
    }
    attr.wait_obj = FI_WAIT_NONE;
    return fi_cq_open(domain, &attr, &cq_, nullptr);
  }
  void close() {
    if (cq_) fi_close(&cq_->fid);
    cq_ = nullptr;
    stash_valid_ = stash_error_ = false;
  }
  ::fid* queue_fid() { return &cq_->fid; }  // for fi_ep_bind
  fid_cq* cq() const { return cq_; }

  // Reads up to `max` completions into `out`; returns how many it added. `on_entry(e, c)` fills `c`
  // from a successful entry, `on_error(err, c)` adjusts `c` (filled in as a kLocalError with the
  // provider's message) for a failed one; either returns false for an entry with nothing to report.
  template <class OnEntry, class OnError>
  size_t read(std::vector<Completion>& out, size_t max, OnEntry&& on_entry, OnError&& on_error) {
    size_t got = 0;
    auto emit = [&](const fi_cq_tagged_entry& e) {
      Completion c;
      if (!on_entry(e, c)) return;
      out.push_back(std::move(c));
      ++got;
    };
    if (stash_valid_) {
      stash_valid_ = false;
      emit(stash_);
    }
    fi_cq_tagged_entry entries[kBatch];
    while (got < max) {
      const bool had_error = stash_error_;
      stash_error_ = false;
      const ssize_t n = had_error ? -FI_EAVAIL : fi_cq_read(cq_, entries, std::min<size_t>(kBatch, max - got));
      if (n == -FI_EAGAIN) break;
      if (n == -FI_EAVAIL) {
        fi_cq_err_entry err{};
        if (fi_cq_readerr(cq_, &err, 0) < 0) break;
        Completion c;
        c.kind = Completion::kLocalError;
        c.context = err.op_context;
        c.error = err.err ? err.err : FI_EIO;
        char buf[256];
        const char* prov = fi_cq_strerror(cq_, err.prov_errno, err.err_data, buf, sizeof(buf));
        c.message = std::string(fi_strerror(c.error)) + " (" + (prov ? prov : "no provider detail") + ")";
        if (!on_error(err, c)) continue;
        out.push_back(std::move(c));
        ++got;
        continue;
      }
      if (n < 0) {
        Completion c;
        c.kind = Completion::kLocalError;
        c.error = static_cast<int>(-n);
        c.message = "fi_cq_read: " + std::string(fi_strerror(static_cast<int>(-n)));
        out.push_back(std::move(c));
        ++got;
        break;
      }
      for (ssize_t i = 0; i < n; ++i) emit(entries[i]);
      if (static_cast<size_t>(n) < kBatch) break;
    }
    return got;
  }

  // Blocks up to `timeout_ms` for a completion (kept for the next read), or sleeps briefly without a
  // wait object, which keeps an idle worker off the CPU while bounding latency.
  void wait(int timeout_ms) {
    if (stash_valid_ || stash_error_) return;
    if (!waitable_) {
      struct timespec ts{0, 50 * 1000};
      nanosleep(&ts, nullptr);
      return;
    }
    const ssize_t n = fi_cq_sread(cq_, &stash_, 1, nullptr, timeout_ms);
    if (n == 1) {
      stash_valid_ = true;
    } else if (n == -FI_EAVAIL) {
      stash_error_ = true;
    }
  }
  // Wakes a worker blocked in wait().
  void signal() {
    if (waitable_) fi_cq_signal(cq_);
  }

 private:
  fid_cq* cq_ = nullptr;
  bool waitable_ = false;
  // A completion that wait() read while blocking in fi_cq_sread, handed out by the next read().
  bool stash_valid_ = false;
  fi_cq_tagged_entry stash_{};
  bool stash_error_ = false;
};

}  // namespace weightsync
