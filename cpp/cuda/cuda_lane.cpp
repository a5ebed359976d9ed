#include "cuda/cuda_lane.hpp"
#include "cuda/driver.hpp"

#include <dlfcn.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <mutex>
#include <random>
#include <thread>

#include "core/engine.hpp"
#include "core/errors.hpp"

namespace weightsync {

using namespace cu;

namespace {

// Rows per cuMemcpy2DAsync call: the driver documents no limit on Height; staying far below any 32-bit
// count costs one more call per 64 Ki rows.
constexpr uint64_t kMaxCopyRows = 1 << 16;
constexpr int kRingFullTimeoutS = 5;  // longest wait for room in a peer's immediate ring
constexpr size_t kMaxBatchCopies = 1024;  // copies per cuMemcpyBatchAsync call

}  // namespace


CudaLane::CudaLane(int device, int streams, double spin_us, uint64_t batch_bytes)
    : api_(load_api()), device_(device), spin_us_(spin_us) {
  if (!api_->error.empty()) throw TransportError("cuda lane unavailable: " + api_->error);
  CUdevice dev = 0;
  check(api_->cuDeviceGet(&dev, device), "cuDeviceGet");
  CUuuid uuid{};
  check(api_->cuDeviceGetUuid(&uuid, dev), "cuDeviceGetUuid");
  uuid_ = "GPU-" + hex(uuid.bytes, 16);
  name_ = "cuda:" + std::to_string(device) + " (" + uuid_ + ")";
  check(api_->cuDevicePrimaryCtxRetain(&ctx_, dev), "cuDevicePrimaryCtxRetain");
  make_current();
  int max_pitch = 0;
  check(api_->cuDeviceGetAttribute(&max_pitch, CU_DEVICE_ATTRIBUTE_MAX_PITCH, dev), "cuDeviceGetAttribute");
  max_pitch_ = static_cast<size_t>(max_pitch);
  for (int i = 0; i < std::max(streams, 1); ++i) {
    void* s = nullptr;
    check(api_->cuStreamCreate(&s, CU_STREAM_NON_BLOCKING), "cuStreamCreate");
    streams_.push_back(s);
  }
  // Landing copies get their own stream: FIFO among themselves (a landed message's immediate may only
  // count once every message before it on that NIC is in place), never queued behind peer copies.
  check(api_->cuStreamCreate(&landing_stream_, CU_STREAM_NON_BLOCKING), "cuStreamCreate");
  // Without the batch entry points (drivers before 12.8) every copy is its own call, as before.
  if (api_->cuMemcpyBatchAsync_v2 != nullptr || api_->cuMemcpyBatchAsync_v1 != nullptr) batch_bytes_ = batch_bytes;
  host_ = host_identity();
  ring_ = ImmRing::create();
  address_ = host_ + "\n" + uuid_ + "\n" + std::to_string(getpid()) + "\n" + std::to_string(ring_.fd());
}

CudaLane::~CudaLane() {
  if (ctx_ == nullptr) return;
  make_current();
  for (auto& f : inflight_) {
    if (f.event && f.owns_event) api_->cuEventDestroy(f.event);
  }
  if (landing_stream_) api_->cuStreamSynchronize(landing_stream_);
  for (auto& [ev, ctx] : landing_) api_->cuEventDestroy(ev);
  if (landing_stream_) api_->cuStreamDestroy(landing_stream_);
  for (void* e : free_events_) api_->cuEventDestroy(e);
  for (auto& [handle, base] : opened_) api_->cuIpcCloseMemHandle(base);
  if (!vmm_imported_.empty()) {
    // No copy may still be writing through a mapping that goes.
    for (void* s : streams_) api_->cuStreamSynchronize(s);
    for (auto& [key, imp] : vmm_imported_) {
      for (auto& [a, sz] : imp.maps) api_->cuMemUnmap(a, sz);
      api_->cuMemAddressFree(imp.va, imp.reserved);
    }
  }
  for (auto& [id, fds] : vmm_exports_) {
    for (int fd : fds) close(fd);
  }
  for (void* s : streams_) api_->cuStreamDestroy(s);
  CUdevice dev = 0;
  if (api_->cuDeviceGet(&dev, device_) == CUDA_SUCCESS) api_->cuDevicePrimaryCtxRelease(dev);
}

void CudaLane::check(int rc, const char* what) const {
  if (rc != CUDA_SUCCESS) {
    throw TransportError(std::string(what) + " failed on cuda:" + std::to_string(device_) + ": " +
                         cu_error(api_, rc));
  }
}

void CudaLane::make_current() const {
  // Every call runs on the worker thread; the context is set once per call site to stay correct
  // if the thread also served another device.
  api_->cuCtxSetCurrent(ctx_);
}

std::string CudaLane::describe_address(const std::string& address) const {
  auto p = split_address(address);
  return p.size() == 4 ? p[1] + " pid " + p[2] : "cuda peer";
}

uint64_t CudaLane::insert_peer(const std::string& address) {
  auto p = split_address(address);
  if (p.size() != 4) throw TransportError("malformed cuda peer address");
  if (p[0] != host_) throw TransportError("cuda peer " + p[1] + " is on another host");
  const uint64_t handle = next_peer_++;
  peer_pids_[handle] = std::stoi(p[2]);
  try {
    peer_rings_.emplace(handle, ImmRing::open(std::stoi(p[2]), std::stoi(p[3])));
  } catch (const TransportError&) {
    // No shared memory with that process (another container?): the engine signals over a NIC instead.
  }
  return handle;
}

bool CudaLane::delivers_imm(uint64_t peer) const { return peer_rings_.count(peer) != 0; }

void CudaLane::set_region_live(uint64_t id, bool live) {
  if (!ring_.set_live(id, live)) {
    throw TransportError("cannot export more GPU regions on " + name_ + ": " +
                         std::to_string(ImmRing::kLiveSlots) + " are registered; deregister some first");
  }
}

void* CudaLane::alloc_pinned(size_t bytes) {
  make_current();
  void* p = nullptr;
  check(api_->cuMemHostAlloc(&p, bytes, 0), "cuMemHostAlloc");
  return p;
}

void CudaLane::free_pinned(void* p) {
  if (p == nullptr) return;
  make_current();
  api_->cuMemFreeHost(p);  // at close: nothing left to report a failure to
}

void* CudaLane::take_event() {
  if (!free_events_.empty()) {
    void* ev = free_events_.back();
    free_events_.pop_back();
    return ev;
  }
  void* ev = nullptr;
  return api_->cuEventCreate(&ev, CU_EVENT_DISABLE_TIMING) == CUDA_SUCCESS ? ev : nullptr;
}

int CudaLane::post_landing_copy(void* dst, const void* src, size_t len, void* context) {
  make_current();
  void* ev = take_event();
  if (ev == nullptr) return -ENOMEM;
  if (len > 0) {
    CUresult rc = api_->cuMemcpyHtoDAsync(reinterpret_cast<CUdeviceptr>(dst), src, len, landing_stream_);
    if (rc != CUDA_SUCCESS) {
      free_events_.push_back(ev);
      return -(1000 + rc);
    }
  }
  // Recorded even after an empty copy: its event then completes only after the copies before it.
  if (api_->cuEventRecord(ev, landing_stream_) != CUDA_SUCCESS) {
    free_events_.push_back(ev);
    return -EIO;
  }
  landing_.emplace_back(ev, context);
  last_busy_ = std::chrono::steady_clock::now();
  return 0;
}

std::vector<void*> CudaLane::drain_landing() {
  std::vector<void*> out;
  if (landing_.empty()) return out;
  make_current();
  api_->cuStreamSynchronize(landing_stream_);  // at close: nothing left to report a failure to
  for (auto& [ev, ctx] : landing_) {
    free_events_.push_back(ev);
    out.push_back(ctx);
  }
  landing_.clear();
  return out;
}

// Bytes of `req` when they form one contiguous run on both sides (a 1-D write, or rows packed without
// gaps), else 0: such a write is one plain copy, and may join a batch.
static uint64_t contiguous_bytes(const WriteRequest& req) {
  if (req.geometry.rows <= 1 || (req.geometry.src_pitch == req.len && req.geometry.dst_pitch == req.len)) {
    return req.len * std::max<uint64_t>(req.geometry.rows, 1);
  }
  return 0;
}

int CudaLane::enqueue_copy(const WriteRequest& req, void* stream) {
  const CUdeviceptr dst = static_cast<CUdeviceptr>(req.remote_addr);
  const CUdeviceptr src = reinterpret_cast<CUdeviceptr>(req.src);
  if (req.len == 0) return CUDA_SUCCESS;
  if (const uint64_t bytes = contiguous_bytes(req); bytes > 0) return api_->cuMemcpyAsync(dst, src, bytes, stream);
  if (req.geometry.src_pitch > max_pitch_ || req.geometry.dst_pitch > max_pitch_) {
    // Beyond what a 2-D copy accepts: one copy per row, all on this stream (the event covers them all).
    for (uint64_t r = 0; r < req.geometry.rows; ++r) {
      CUresult rc = api_->cuMemcpyAsync(dst + r * req.geometry.dst_pitch, src + r * req.geometry.src_pitch, req.len, stream);
      if (rc != CUDA_SUCCESS) return rc;
    }
    return CUDA_SUCCESS;
  }
  for (uint64_t r = 0; r < req.geometry.rows; r += kMaxCopyRows) {
    CudaMemcpy2D c{};
    c.srcMemoryType = CU_MEMORYTYPE_UNIFIED;
    c.srcDevice = src + r * req.geometry.src_pitch;
    c.srcPitch = req.geometry.src_pitch;
    c.dstMemoryType = CU_MEMORYTYPE_UNIFIED;
    c.dstDevice = dst + r * req.geometry.dst_pitch;
    c.dstPitch = req.geometry.dst_pitch;
    c.WidthInBytes = req.len;
    c.Height = std::min<uint64_t>(kMaxCopyRows, req.geometry.rows - r);
    CUresult rc = api_->cuMemcpy2DAsync(&c, stream);
    if (rc != CUDA_SUCCESS) return rc;
  }
  return CUDA_SUCCESS;
}

int CudaLane::post_write(const WriteRequest& req) {
  // A copy into a peer that exited still "succeeds" (our mapping keeps its memory alive), and so does
  // pushing into its ring: check that the process is there, so the writer learns it is gone.
  auto pid = peer_pids_.find(req.peer);
  if (pid != peer_pids_.end() && kill(pid->second, 0) != 0 && errno == ESRCH) return -EPIPE;
  // The owner may have deregistered the region (and reused its memory): its live table says so. There
  // is no table to ask without a shared ring (the doorbell fallback); see the header.
  auto ring = peer_rings_.find(req.peer);
  if (ring != peer_rings_.end() && req.mapped.remote_region != 0 && !ring->second.is_live(req.mapped.remote_region)) {
    return -ESTALE;
  }
  last_busy_ = std::chrono::steady_clock::now();
  const bool copies = req.len > 0;
  if (!copies) {
    // Only an immediate (the trailer of a cut-up or 2-D write, whose copies are all done): no event.
    // Not queued behind other writes' copies: it depends on none of them.
    ready_.push_back({nullptr, req.context, req.peer, req.has_imm, req.imm, req.mapped.imm_repeat});
    return 0;
  }
  make_current();
  const uint64_t bytes = contiguous_bytes(req);
  if (batch_bytes_ > 0 && bytes > 0 && bytes < batch_bytes_) {
    // Into the batch: the copy engines then take the copies back to back, without the few
    // microseconds each separate copy costs them.
    if (batched_ + bytes > batch_bytes_) flush_batch();
    batch_dst_.push_back(static_cast<CUdeviceptr>(req.remote_addr));
    batch_src_.push_back(reinterpret_cast<CUdeviceptr>(req.src));
    batch_len_.push_back(bytes);
    batch_.push_back({nullptr, req.context, req.peer, req.has_imm, req.imm, req.mapped.imm_repeat});
    batched_ += bytes;
    if (batch_.size() >= kMaxBatchCopies) flush_batch();
    return 0;
  }
  flush_batch();  // copies leave in the order they were posted
  void* ev = take_event();
  if (ev == nullptr) return -ENOMEM;
  void* stream = streams_[next_stream_++ % streams_.size()];
  int rc = enqueue_copy(req, stream);
  if (rc != CUDA_SUCCESS) {
    free_events_.push_back(ev);
    return -(1000 + rc);  // distinguishable from errno values in error_string
  }
  if (api_->cuEventRecord(ev, stream) != CUDA_SUCCESS) {
    free_events_.push_back(ev);
    return -EIO;
  }
  inflight_.push_back({ev, req.context, req.peer, req.has_imm, req.imm, req.mapped.imm_repeat});
  return 0;
}

void CudaLane::flush_batch() {
  if (batch_.empty()) return;
  make_current();
  void* stream = streams_[next_stream_++ % streams_.size()];
  const size_t n = batch_.size();
  CUresult rc = CUDA_SUCCESS;
  if (n > 1) {
    CUmemcpyAttributes attr{};
    attr.srcAccessOrder = CU_MEMCPY_SRC_ACCESS_ORDER_STREAM;  // the source may still be being written
    size_t first = 0;
    size_t fail = 0;
    rc = api_->cuMemcpyBatchAsync_v2
             ? api_->cuMemcpyBatchAsync_v2(batch_dst_.data(), batch_src_.data(), batch_len_.data(), n, &attr,
                                           &first, 1, stream)
             : api_->cuMemcpyBatchAsync_v1(batch_dst_.data(), batch_src_.data(), batch_len_.data(), n, &attr,
                                           &first, 1, &fail, stream);
  }
  if (n == 1 || rc != CUDA_SUCCESS) {
    // One copy, or a batch the driver refused (how much of it was queued is not said): each copy on
    // its own, so that the one at fault is the one that fails. A copy queued twice writes the same bytes.
    for (size_t i = 0; i < n; ++i) {
      batch_[i].error = api_->cuMemcpyAsync(batch_dst_[i], batch_src_[i], batch_len_[i], stream);
    }
  }
  void* ev = take_event();
  if (ev != nullptr && api_->cuEventRecord(ev, stream) != CUDA_SUCCESS) {
    free_events_.push_back(ev);
    ev = nullptr;
  }
  if (ev == nullptr) {
    // No event to tell when the copies end: wait for them here (rare: the driver is out of resources).
    CUresult sync = api_->cuStreamSynchronize(stream);
    for (auto& f : batch_) {
      if (f.error == CUDA_SUCCESS) f.error = sync;
    }
  }
  size_t waiting = 0;
  for (size_t i = 0; i < n; ++i) {
    Inflight f = batch_[i];
    if (f.error != CUDA_SUCCESS || ev == nullptr) {
      f.event = nullptr;
      ready_.push_back(f);
      continue;
    }
    f.event = ev;
    f.owns_event = false;
    inflight_.push_back(f);
    ++waiting;
  }
  // The batch's last entry returns the event to the pool (entries complete in order); with none
  // waiting on it, it goes back now.
  if (waiting > 0) {
    inflight_.back().owns_event = true;
  } else if (ev != nullptr) {
    free_events_.push_back(ev);
  }
  batch_.clear();
  batch_dst_.clear();
  batch_src_.clear();
  batch_len_.clear();
  batched_ = 0;
}

size_t CudaLane::poll(std::vector<Completion>& out, size_t max) {
  // Whatever the worker posted since its last poll goes to the GPU now, as one batch.
  flush_batch();
  size_t got = 0;
  uint32_t imm = 0;
  while (got < max && ring_.pop(imm)) {
    Completion c;
    c.kind = Completion::kRemoteImm;
    c.imm = imm;
    out.push_back(c);
    ++got;
  }
  // Immediates arriving keep a destination's worker polling too: the next ones then need no futex wake.
  if (got > 0) last_busy_ = std::chrono::steady_clock::now();
  // Landing copies, strictly in order (one stream): the engine delivers each one's immediate when it
  // is reported, so a later copy must never be reported before an earlier one.
  while (!landing_.empty() && got < max) {
    auto [ev, ctx] = landing_.front();
    CUresult rc = api_->cuEventQuery(ev);
    if (rc == CUDA_ERROR_NOT_READY) break;
    landing_.pop_front();
    free_events_.push_back(ev);
    last_busy_ = std::chrono::steady_clock::now();
    Completion c;
    c.kind = Completion::kLanded;
    c.context = ctx;
    if (rc != CUDA_SUCCESS) {
      c.error = EIO;
      c.message = "landing copy failed: " + cu_error(api_, rc);
    }
    out.push_back(std::move(c));
    ++got;
  }
  // Streams complete in order; across streams a later copy may finish first, which only delays its
  // report until the ones before it are done. One event query per completion: the front's.
  while ((!ready_.empty() || !inflight_.empty()) && got < max) {
    const bool instant = !ready_.empty();
    Inflight f = instant ? ready_.front() : inflight_.front();
    CUresult rc = f.event ? api_->cuEventQuery(f.event) : f.error;
    if (rc == CUDA_ERROR_NOT_READY) break;
    if (instant) {
      ready_.pop_front();
    } else {
      inflight_.pop_front();
    }
    if (f.event && f.owns_event) free_events_.push_back(f.event);
    last_busy_ = std::chrono::steady_clock::now();
    Completion c;
    c.context = f.context;
    if (rc == CUDA_SUCCESS) {
      c.kind = Completion::kLocalDone;
      auto ring = f.has_imm ? peer_rings_.find(f.peer) : peer_rings_.end();
      if (ring != peer_rings_.end()) {
        // The bytes are in place: now the immediates. A full ring means the consumer is a whole ring
        // behind; it drains in microseconds, unless its process is gone or stuck: then the write fails
        // (bounded, so this worker never hangs on a dead peer).
        const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(kRingFullTimeoutS);
        for (uint32_t k = 0; k < f.imm_repeat && c.kind == Completion::kLocalDone; ++k) {
          while (!ring->second.push(f.imm)) {
            auto pid = peer_pids_.find(f.peer);
            const bool gone = pid != peer_pids_.end() && kill(pid->second, 0) != 0 && errno == ESRCH;
            if (gone || std::chrono::steady_clock::now() > deadline) {
              c.kind = Completion::kLocalError;
              c.error = gone ? EPIPE : ETIMEDOUT;
              c.message = gone ? "the peer process exited before its immediate could be delivered"
                               : "the peer's immediate ring stayed full for " + std::to_string(kRingFullTimeoutS) +
                                     " s (its engine is not draining it)";
              break;
            }
            std::this_thread::sleep_for(std::chrono::microseconds(5));
          }
        }
      }
    } else {
      c.kind = Completion::kLocalError;
      c.error = EIO;
      c.message = "copy failed: " + cu_error(api_, rc);
    }
    out.push_back(std::move(c));
    ++got;
  }
  return got;
}

void CudaLane::wait(int timeout_ms) {
  // Copies in flight finish in microseconds to milliseconds: look again soon. Idle for longer than
  // spin_us: sleep until a peer pushes an immediate, the worker is signalled (new work), or the
  // timeout passes. Within spin_us of the last copy or immediate, keep polling: a write or immediate
  // that follows soon (a stream of small writes) then costs neither side a futex wake-up.
  flush_batch();
  const auto idle = std::chrono::steady_clock::now() - last_busy_;
  if (inflight_.empty() && ready_.empty() && landing_.empty() &&
      idle > std::chrono::duration<double, std::micro>(spin_us_)) {
    ring_.sleep(int64_t(timeout_ms) * 1000, ticket_);
  } else {
    // A timed sleep would cost the timer slack (50 us by default) on every completion: yield instead.
    std::this_thread::yield();
  }
}

void CudaLane::signal() { ring_.wake(); }

std::string CudaLane::error_string(int err) const {
  if (err >= 1000) return cu_error(api_, err - 1000);
  if (err == EPIPE) return "the peer process exited";
  if (err == ESTALE) return "the destination region was deregistered (its memory may be reused)";
  return std::strerror(err);
}

LaneCaps CudaLane::caps() const {
  LaneCaps c;
  c.writes_cuda = true;
  c.maps_remote = true;
  c.two_d = true;
  c.own_imm = true;  // through the peer's shared ring where it has one (delivers_imm)
  c.batching = batch_bytes_ > 0;
  c.delivery_complete = true;  // a copy is complete once its bytes are in place
  c.local_copies = true;
  c.unlimited_window = true;
  return c;
}

LaneType cuda_lane_type() {
  LaneType t;
  t.name = "cuda";
  t.configure = [](EngineConfig& cfg) {
    if (cfg.cuda_device >= 0 && cfg.cuda_streams < 1) throw TransportError("cuda_streams must be at least 1");
  };
  t.open = [](const EngineConfig& cfg) {
    std::vector<std::unique_ptr<Lane>> lanes;
    if (cfg.cuda_device >= 0) {
      lanes.push_back(std::make_unique<CudaLane>(cfg.cuda_device, cfg.cuda_streams, cfg.cuda_spin_us,
                                                 cfg.cuda_batch_bytes));
    }
    return lanes;
  };
  return t;
}

}  // namespace weightsync
