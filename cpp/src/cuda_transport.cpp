#include "weightsync/cuda_transport.hpp"

#include <dlfcn.h>
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <mutex>
#include <thread>

#include "weightsync/errors.hpp"

namespace weightsync {

namespace {

// The few driver types we need, declared here so the build needs no CUDA headers.
using CUresult = int;
using CUdevice = int;
using CUdeviceptr = unsigned long long;
struct CUipcMemHandle {
  char reserved[64];
};
struct CUuuid {
  char bytes[16];
};
constexpr CUresult CUDA_SUCCESS = 0;
constexpr CUresult CUDA_ERROR_NOT_READY = 600;
constexpr unsigned CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS = 1;
constexpr unsigned CU_EVENT_DISABLE_TIMING = 2;
constexpr unsigned CU_STREAM_NON_BLOCKING = 1;
constexpr int CU_DEVICE_ATTRIBUTE_MAX_PITCH = 11;
constexpr int CU_MEMORYTYPE_UNIFIED = 4;  // the driver tells host from device by the address
// Rows per cuMemcpy2DAsync call: the driver documents no limit on Height; staying far below any 32-bit
// count costs one more call per 64 Ki rows.
constexpr uint64_t kMaxCopyRows = 1 << 16;
constexpr int kRingFullTimeoutS = 5;  // longest wait for room in a peer's immediate ring

// CUDA_MEMCPY2D (the _v2 layout, size_t fields), as in cuda.h.
struct CudaMemcpy2D {
  size_t srcXInBytes;
  size_t srcY;
  int srcMemoryType;
  const void* srcHost;
  CUdeviceptr srcDevice;
  void* srcArray;
  size_t srcPitch;
  size_t dstXInBytes;
  size_t dstY;
  int dstMemoryType;
  void* dstHost;
  CUdeviceptr dstDevice;
  void* dstArray;
  size_t dstPitch;
  size_t WidthInBytes;
  size_t Height;
};

}  // namespace

struct CudaApi {
  CUresult (*cuInit)(unsigned);
  CUresult (*cuDeviceGetCount)(int*);
  CUresult (*cuDeviceGet)(CUdevice*, int);
  CUresult (*cuDeviceGetUuid)(CUuuid*, CUdevice);
  CUresult (*cuDevicePrimaryCtxRetain)(void**, CUdevice);
  CUresult (*cuDevicePrimaryCtxRelease)(CUdevice);
  CUresult (*cuCtxSetCurrent)(void*);
  CUresult (*cuMemGetAddressRange)(CUdeviceptr*, size_t*, CUdeviceptr);
  CUresult (*cuIpcGetMemHandle)(CUipcMemHandle*, CUdeviceptr);
  CUresult (*cuIpcOpenMemHandle)(CUdeviceptr*, CUipcMemHandle, unsigned);
  CUresult (*cuIpcCloseMemHandle)(CUdeviceptr);
  CUresult (*cuMemcpyAsync)(CUdeviceptr, CUdeviceptr, size_t, void*);
  CUresult (*cuMemcpy2DAsync)(const CudaMemcpy2D*, void*);
  CUresult (*cuMemcpyHtoDAsync)(CUdeviceptr, const void*, size_t, void*);
  CUresult (*cuStreamSynchronize)(void*);
  CUresult (*cuMemHostAlloc)(void**, size_t, unsigned);
  CUresult (*cuMemFreeHost)(void*);
  CUresult (*cuDeviceGetAttribute)(int*, int, CUdevice);
  CUresult (*cuStreamCreate)(void**, unsigned);
  CUresult (*cuStreamDestroy)(void*);
  CUresult (*cuEventCreate)(void**, unsigned);
  CUresult (*cuEventRecord)(void*, void*);
  CUresult (*cuEventQuery)(void*);
  CUresult (*cuEventDestroy)(void*);
  CUresult (*cuGetErrorString)(CUresult, const char**);
  std::string error;  // why loading failed
};

namespace {

const CudaApi* load_api() {
  static CudaApi api{};
  static std::once_flag once;
  std::call_once(once, [] {
    void* lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (lib == nullptr) {
      api.error = std::string("libcuda.so.1 not found (") + dlerror() + ")";
      return;
    }
    bool ok = true;
    auto sym = [&](auto& fn, const char* name) {
      fn = reinterpret_cast<std::remove_reference_t<decltype(fn)>>(dlsym(lib, name));
      if (fn == nullptr) {
        ok = false;
        api.error += std::string(api.error.empty() ? "" : ", ") + "missing " + name;
      }
    };
    sym(api.cuInit, "cuInit");
    sym(api.cuDeviceGetCount, "cuDeviceGetCount");
    sym(api.cuDeviceGet, "cuDeviceGet");
    sym(api.cuDeviceGetUuid, "cuDeviceGetUuid_v2");
    sym(api.cuDevicePrimaryCtxRetain, "cuDevicePrimaryCtxRetain");
    sym(api.cuDevicePrimaryCtxRelease, "cuDevicePrimaryCtxRelease_v2");
    sym(api.cuCtxSetCurrent, "cuCtxSetCurrent");
    sym(api.cuMemGetAddressRange, "cuMemGetAddressRange_v2");
    sym(api.cuIpcGetMemHandle, "cuIpcGetMemHandle");
    sym(api.cuIpcOpenMemHandle, "cuIpcOpenMemHandle_v2");
    sym(api.cuIpcCloseMemHandle, "cuIpcCloseMemHandle");
    sym(api.cuMemcpyAsync, "cuMemcpyAsync");
    sym(api.cuMemcpy2DAsync, "cuMemcpy2DAsync_v2");
    sym(api.cuMemcpyHtoDAsync, "cuMemcpyHtoDAsync_v2");
    sym(api.cuStreamSynchronize, "cuStreamSynchronize");
    sym(api.cuMemHostAlloc, "cuMemHostAlloc");
    sym(api.cuMemFreeHost, "cuMemFreeHost");
    sym(api.cuDeviceGetAttribute, "cuDeviceGetAttribute");
    sym(api.cuStreamCreate, "cuStreamCreate");
    sym(api.cuStreamDestroy, "cuStreamDestroy_v2");
    sym(api.cuEventCreate, "cuEventCreate");
    sym(api.cuEventRecord, "cuEventRecord");
    sym(api.cuEventQuery, "cuEventQuery");
    sym(api.cuEventDestroy, "cuEventDestroy_v2");
    sym(api.cuGetErrorString, "cuGetErrorString");
    if (!ok) return;
    CUresult rc = api.cuInit(0);
    if (rc != CUDA_SUCCESS) api.error = "cuInit failed with CUDA error " + std::to_string(rc);
  });
  return &api;
}

std::string cu_error(const CudaApi* api, CUresult rc) {
  const char* s = nullptr;
  if (api && api->cuGetErrorString && api->cuGetErrorString(rc, &s) == CUDA_SUCCESS && s) return s;
  return "CUDA error " + std::to_string(rc);
}

std::string hex(const char* p, size_t n) {
  static const char* d = "0123456789abcdef";
  std::string s;
  for (size_t i = 0; i < n; ++i) {
    s += d[(static_cast<unsigned char>(p[i]) >> 4) & 15];
    s += d[static_cast<unsigned char>(p[i]) & 15];
  }
  return s;
}

// address = host '\n' uuid '\n' pid
std::vector<std::string> split_address(const std::string& a) {
  std::vector<std::string> parts;
  size_t start = 0;
  for (size_t i = 0; i <= a.size(); ++i) {
    if (i == a.size() || a[i] == '\n') {
      parts.push_back(a.substr(start, i - start));
      start = i + 1;
    }
  }
  return parts;
}

}  // namespace

std::string cuda_unavailable_reason() {
  const CudaApi* api = load_api();
  if (!api->error.empty()) return api->error;
  int n = 0;
  if (api->cuDeviceGetCount(&n) != CUDA_SUCCESS || n == 0) return "no CUDA device visible";
  return "";
}

int cuda_device_count() {
  const CudaApi* api = load_api();
  int n = 0;
  if (!api->error.empty() || api->cuDeviceGetCount(&n) != CUDA_SUCCESS) return 0;
  return n;
}

std::string host_identity() {
  char host[256] = {0};
  gethostname(host, sizeof(host) - 1);
  std::string boot;
  std::ifstream f("/proc/sys/kernel/random/boot_id");
  std::getline(f, boot);
  return std::string(host) + "/" + boot;
}

CudaTransport::CudaTransport(int device, int streams, double spin_us)
    : api_(load_api()), device_(device), spin_us_(spin_us) {
  if (!api_->error.empty()) throw TransportError("cuda transport unavailable: " + api_->error);
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
  host_ = host_identity();
  ring_ = ImmRing::create();
  address_ = host_ + "\n" + uuid_ + "\n" + std::to_string(getpid()) + "\n" + std::to_string(ring_.fd());
}

CudaTransport::~CudaTransport() {
  if (ctx_ == nullptr) return;
  make_current();
  for (auto& f : inflight_) {
    if (f.event) api_->cuEventDestroy(f.event);
  }
  if (landing_stream_) api_->cuStreamSynchronize(landing_stream_);
  for (auto& [ev, ctx] : landing_) api_->cuEventDestroy(ev);
  if (landing_stream_) api_->cuStreamDestroy(landing_stream_);
  for (void* e : free_events_) api_->cuEventDestroy(e);
  for (auto& [handle, base] : opened_) api_->cuIpcCloseMemHandle(base);
  for (void* s : streams_) api_->cuStreamDestroy(s);
  CUdevice dev = 0;
  if (api_->cuDeviceGet(&dev, device_) == CUDA_SUCCESS) api_->cuDevicePrimaryCtxRelease(dev);
}

void CudaTransport::check(int rc, const char* what) const {
  if (rc != CUDA_SUCCESS) {
    throw TransportError(std::string(what) + " failed on cuda:" + std::to_string(device_) + ": " +
                         cu_error(api_, rc));
  }
}

void CudaTransport::make_current() const {
  // Every call runs on the worker thread; the context is set once per call site to stay correct
  // if the thread also served another device.
  api_->cuCtxSetCurrent(ctx_);
}

std::string CudaTransport::describe_address(const std::string& address) const {
  auto p = split_address(address);
  return p.size() == 4 ? p[1] + " pid " + p[2] : "cuda peer";
}

MemRegistration CudaTransport::register_memory(void* ptr, size_t len, MemKind kind, int) {
  MemRegistration reg;
  if (kind != MemKind::kCuda || len == 0) return reg;  // host memory: a copy source, nothing to export
  make_current();
  CUdeviceptr base = 0;
  size_t size = 0;
  check(api_->cuMemGetAddressRange(&base, &size, reinterpret_cast<CUdeviceptr>(ptr)), "cuMemGetAddressRange");
  CUipcMemHandle handle{};
  int rc = api_->cuIpcGetMemHandle(&handle, base);
  if (rc != CUDA_SUCCESS) {
    throw TransportError("cannot export GPU memory for CUDA IPC (" + cu_error(api_, rc) +
                         "); memory from PyTorch's expandable segments cannot be exported this way: "
                         "unset PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True for registered tensors");
  }
  // blob: the allocation's handle (64 bytes), then the region's offset in it and the allocation size.
  const uint64_t offset = reinterpret_cast<CUdeviceptr>(ptr) - base;
  const uint64_t alloc = size;
  reg.blob.assign(handle.reserved, sizeof(handle.reserved));
  reg.blob.append(reinterpret_cast<const char*>(&offset), 8);
  reg.blob.append(reinterpret_cast<const char*>(&alloc), 8);
  reg.blob.append(uuid_);
  return reg;
}

void CudaTransport::deregister(const MemRegistration&) {}

uint64_t CudaTransport::insert_peer(const std::string& address) {
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

bool CudaTransport::delivers_imm(uint64_t peer) const { return peer_rings_.count(peer) != 0; }

uint64_t CudaTransport::import_remote(const std::string& blob) {
  if (blob.size() < 80) throw UsageError("region descriptor has no CUDA IPC handle (is it GPU memory?)");
  std::string handle_bytes = blob.substr(0, 64);
  uint64_t offset = 0;
  std::memcpy(&offset, blob.data() + 64, 8);
  auto it = opened_.find(handle_bytes);
  if (it == opened_.end()) {
    make_current();
    CUipcMemHandle handle{};
    std::memcpy(handle.reserved, handle_bytes.data(), 64);
    CUdeviceptr base = 0;
    // Opened with the writing GPU current: the mapping lives in our context, so copies run at NVLink speed.
    int rc = api_->cuIpcOpenMemHandle(&base, handle, CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS);
    if (rc != CUDA_SUCCESS) {
      throw TransportError("cannot open the CUDA IPC handle of " + blob.substr(80) + " on " + name_ + ": " +
                           cu_error(api_, rc) +
                           " (the owner must be alive on this host, and the GPUs must be able to reach "
                           "each other: check `nvidia-smi topo -m`)");
    }
    it = opened_.emplace(handle_bytes, base).first;
  }
  return it->second + offset;
}

void CudaTransport::set_region_live(uint64_t id, bool live) {
  if (!ring_.set_live(id, live)) {
    throw TransportError("cannot export more GPU regions on " + name_ + ": " +
                         std::to_string(ImmRing::kLiveSlots) + " are registered; deregister some first");
  }
}

void* CudaTransport::alloc_pinned(size_t bytes) {
  make_current();
  void* p = nullptr;
  check(api_->cuMemHostAlloc(&p, bytes, 0), "cuMemHostAlloc");
  return p;
}

void CudaTransport::free_pinned(void* p) {
  if (p == nullptr) return;
  make_current();
  api_->cuMemFreeHost(p);  // at close: nothing left to report a failure to
}

void* CudaTransport::take_event() {
  if (!free_events_.empty()) {
    void* ev = free_events_.back();
    free_events_.pop_back();
    return ev;
  }
  void* ev = nullptr;
  return api_->cuEventCreate(&ev, CU_EVENT_DISABLE_TIMING) == CUDA_SUCCESS ? ev : nullptr;
}

int CudaTransport::post_landing_copy(void* dst, const void* src, size_t len, void* context) {
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

std::vector<void*> CudaTransport::drain_landing() {
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

int CudaTransport::enqueue_copy(const WriteRequest& req, void* stream) {
  const CUdeviceptr dst = static_cast<CUdeviceptr>(req.remote_addr);
  const CUdeviceptr src = reinterpret_cast<CUdeviceptr>(req.src);
  if (req.len == 0) return CUDA_SUCCESS;
  if (req.rows <= 1 || (req.src_pitch == req.len && req.dst_pitch == req.len)) {
    return api_->cuMemcpyAsync(dst, src, req.len * std::max<uint64_t>(req.rows, 1), stream);
  }
  if (req.src_pitch > max_pitch_ || req.dst_pitch > max_pitch_) {
    // Beyond what a 2-D copy accepts: one copy per row, all on this stream (the event covers them all).
    for (uint64_t r = 0; r < req.rows; ++r) {
      CUresult rc = api_->cuMemcpyAsync(dst + r * req.dst_pitch, src + r * req.src_pitch, req.len, stream);
      if (rc != CUDA_SUCCESS) return rc;
    }
    return CUDA_SUCCESS;
  }
  for (uint64_t r = 0; r < req.rows; r += kMaxCopyRows) {
    CudaMemcpy2D c{};
    c.srcMemoryType = CU_MEMORYTYPE_UNIFIED;
    c.srcDevice = src + r * req.src_pitch;
    c.srcPitch = req.src_pitch;
    c.dstMemoryType = CU_MEMORYTYPE_UNIFIED;
    c.dstDevice = dst + r * req.dst_pitch;
    c.dstPitch = req.dst_pitch;
    c.WidthInBytes = req.len;
    c.Height = std::min<uint64_t>(kMaxCopyRows, req.rows - r);
    CUresult rc = api_->cuMemcpy2DAsync(&c, stream);
    if (rc != CUDA_SUCCESS) return rc;
  }
  return CUDA_SUCCESS;
}

int CudaTransport::post_write(const WriteRequest& req) {
  // A copy into a peer that exited still "succeeds" (our mapping keeps its memory alive), and so does
  // pushing into its ring: check that the process is there, so the writer learns it is gone.
  auto pid = peer_pids_.find(req.peer);
  if (pid != peer_pids_.end() && kill(pid->second, 0) != 0 && errno == ESRCH) return -EPIPE;
  // The owner may have deregistered the region (and reused its memory): its live table says so. There
  // is no table to ask without a shared ring (the doorbell fallback); see the header.
  auto ring = peer_rings_.find(req.peer);
  if (ring != peer_rings_.end() && req.remote_region != 0 && !ring->second.is_live(req.remote_region)) {
    return -ESTALE;
  }
  last_busy_ = std::chrono::steady_clock::now();
  const bool copies = req.len > 0;
  if (!copies) {
    // Only an immediate (the trailer of a cut-up or 2-D write, whose copies are all done): no event.
    // Not queued behind other writes' copies: it depends on none of them.
    ready_.push_back({nullptr, req.context, req.peer, req.has_imm, req.imm, req.imm_repeat});
    return 0;
  }
  make_current();
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
  inflight_.push_back({ev, req.context, req.peer, req.has_imm, req.imm, req.imm_repeat});
  return 0;
}

size_t CudaTransport::poll(std::vector<Completion>& out, size_t max) {
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
    CUresult rc = f.event ? api_->cuEventQuery(f.event) : CUDA_SUCCESS;
    if (rc == CUDA_ERROR_NOT_READY) break;
    if (instant) {
      ready_.pop_front();
    } else {
      inflight_.pop_front();
    }
    if (f.event) free_events_.push_back(f.event);
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

void CudaTransport::wait(int timeout_ms) {
  // Copies in flight finish in microseconds to milliseconds: look again soon. Idle for longer than
  // spin_us: sleep until a peer pushes an immediate, the worker is signalled (new work), or the
  // timeout passes. Within spin_us of the last copy or immediate, keep polling: a write or immediate
  // that follows soon (a stream of small writes) then costs neither side a futex wake-up.
  const auto idle = std::chrono::steady_clock::now() - last_busy_;
  if (inflight_.empty() && ready_.empty() && landing_.empty() &&
      idle > std::chrono::duration<double, std::micro>(spin_us_)) {
    ring_.sleep(int64_t(timeout_ms) * 1000);
  } else {
    // A timed sleep would cost the timer slack (50 us by default) on every completion: yield instead.
    std::this_thread::yield();
  }
}

void CudaTransport::signal() { ring_.wake(); }

std::string CudaTransport::error_string(int err) const {
  if (err >= 1000) return cu_error(api_, err - 1000);
  if (err == EPIPE) return "the peer process exited";
  if (err == ESTALE) return "the destination region was deregistered (its memory may be reused)";
  return std::strerror(err);
}

}  // namespace weightsync
