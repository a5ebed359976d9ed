#include "cuda/cuda_lane.hpp"

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
constexpr size_t kMaxBatchCopies = 1024;  // copies per cuMemcpyBatchAsync call

// The virtual memory management API (cuda.h, CUDA >= 10.2): C enums are ints.
using CUmemGenericAllocationHandle = unsigned long long;
struct CUmemLocation {  // CUmemLocation_v1
  int type;             // CUmemLocationType
  int id;
};
struct CUmemcpyAttributes {  // CUmemcpyAttributes_v1 (CUDA >= 12.8)
  int srcAccessOrder;          // CUmemcpySrcAccessOrder
  CUmemLocation srcLocHint;    // hints: only for managed memory
  CUmemLocation dstLocHint;
  unsigned flags;
};
constexpr int CU_MEMCPY_SRC_ACCESS_ORDER_STREAM = 1;  // read the source in stream order
struct CUmemAllocationProp {  // CUmemAllocationProp_v1
  int type;                   // CUmemAllocationType
  int requestedHandleTypes;   // CUmemAllocationHandleType (a bit mask)
  CUmemLocation location;
  void* win32HandleMetaData;
  struct {
    unsigned char compressionType;
    unsigned char gpuDirectRDMACapable;
    unsigned short usage;
    unsigned char reserved[4];
  } allocFlags;
};
static_assert(sizeof(CUmemAllocationProp) == 32, "CUmemAllocationProp layout");
// What we hand the driver to fill: slack behind it, in case a driver ever writes a longer struct.
struct PropBuf {
  CUmemAllocationProp p;
  unsigned char slack[64];
};
struct CUmemAccessDesc {  // CUmemAccessDesc_v1
  CUmemLocation location;
  int flags;  // CUmemAccess_flags
};
static_assert(sizeof(CUmemAccessDesc) == 12, "CUmemAccessDesc layout");
constexpr int CU_MEM_ALLOCATION_TYPE_PINNED = 1;
constexpr int CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR = 1;
constexpr int CU_MEM_HANDLE_TYPE_FABRIC = 8;
constexpr int CU_MEM_LOCATION_TYPE_DEVICE = 1;
constexpr int CU_MEM_ACCESS_FLAGS_PROT_READWRITE = 3;
constexpr int CU_MEM_ALLOC_GRANULARITY_MINIMUM = 0;

// A VMM export's blob: kVmmMagic, owner pid, export nonce, export id, chunk count (8 bytes each), then per
// chunk (physical allocation, in address order, contiguous) its start relative to the region's start
// (int64, <= 0 for the first), its size and the owner's fd for it (8 bytes each); then the owner's GPU
// uuid, like an IPC blob. An IPC blob is always 80 bytes + uuid, which no VMM blob is (40 + 24n).
constexpr char kVmmMagic[8] = {'W', 'S', 'V', 'M', 'M', 'v', '1', '\0'};
constexpr size_t kVmmHeader = 40;
constexpr size_t kVmmChunk = 24;
// One physical allocation of a VMM export, as the blob lists it (kVmmChunk bytes each).
struct VmmChunk {
  int64_t offset;  // of its start, relative to the region's start
  uint64_t size;
  int fd;          // in the owner (exporting) process
};
constexpr size_t kIpcBlob = 80;

#ifndef SYS_pidfd_open
#define SYS_pidfd_open 434
#endif
#ifndef SYS_pidfd_getfd
#define SYS_pidfd_getfd 438
#endif

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
  // The VMM API (for memory cuIpcGetMemHandle refuses); optional: null where the driver lacks it.
  CUresult (*cuMemRetainAllocationHandle)(CUmemGenericAllocationHandle*, void*);
  CUresult (*cuMemGetAllocationPropertiesFromHandle)(CUmemAllocationProp*, CUmemGenericAllocationHandle);
  CUresult (*cuMemGetAllocationGranularity)(size_t*, const CUmemAllocationProp*, int);
  CUresult (*cuMemExportToShareableHandle)(void*, CUmemGenericAllocationHandle, int, unsigned long long);
  CUresult (*cuMemImportFromShareableHandle)(CUmemGenericAllocationHandle*, void*, int);
  CUresult (*cuMemRelease)(CUmemGenericAllocationHandle);
  CUresult (*cuMemAddressReserve)(CUdeviceptr*, size_t, size_t, CUdeviceptr, unsigned long long);
  CUresult (*cuMemAddressFree)(CUdeviceptr, size_t);
  CUresult (*cuMemMap)(CUdeviceptr, size_t, size_t, CUmemGenericAllocationHandle, unsigned long long);
  CUresult (*cuMemUnmap)(CUdeviceptr, size_t);
  CUresult (*cuMemSetAccess)(CUdeviceptr, size_t, const CUmemAccessDesc*, size_t);
  // Batched copies; optional. CUDA 13 drivers name the current form _v2 (12.8's also took a failIdx).
  CUresult (*cuMemcpyBatchAsync_v2)(CUdeviceptr*, CUdeviceptr*, size_t*, size_t, CUmemcpyAttributes*, size_t*,
                                    size_t, void*);
  CUresult (*cuMemcpyBatchAsync_v1)(CUdeviceptr*, CUdeviceptr*, size_t*, size_t, CUmemcpyAttributes*, size_t*,
                                    size_t, size_t*, void*);
  std::string vmm_error;  // which VMM entry points are missing (empty: all there)
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
    auto opt = [&](auto& fn, const char* name) {
      fn = reinterpret_cast<std::remove_reference_t<decltype(fn)>>(dlsym(lib, name));
      if (fn == nullptr) api.vmm_error += std::string(api.vmm_error.empty() ? "" : ", ") + "missing " + name;
    };
    opt(api.cuMemRetainAllocationHandle, "cuMemRetainAllocationHandle");
    opt(api.cuMemGetAllocationPropertiesFromHandle, "cuMemGetAllocationPropertiesFromHandle");
    opt(api.cuMemGetAllocationGranularity, "cuMemGetAllocationGranularity");
    opt(api.cuMemExportToShareableHandle, "cuMemExportToShareableHandle");
    opt(api.cuMemImportFromShareableHandle, "cuMemImportFromShareableHandle");
    opt(api.cuMemRelease, "cuMemRelease");
    opt(api.cuMemAddressReserve, "cuMemAddressReserve");
    opt(api.cuMemAddressFree, "cuMemAddressFree");
    opt(api.cuMemMap, "cuMemMap");
    opt(api.cuMemUnmap, "cuMemUnmap");
    opt(api.cuMemSetAccess, "cuMemSetAccess");
    api.cuMemcpyBatchAsync_v2 =
        reinterpret_cast<decltype(api.cuMemcpyBatchAsync_v2)>(dlsym(lib, "cuMemcpyBatchAsync_v2"));
    if (api.cuMemcpyBatchAsync_v2 == nullptr) {
      api.cuMemcpyBatchAsync_v1 =
          reinterpret_cast<decltype(api.cuMemcpyBatchAsync_v1)>(dlsym(lib, "cuMemcpyBatchAsync"));
    }
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

std::string hex_addr(uint64_t a) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "0x%llx", static_cast<unsigned long long>(a));
  return buf;
}

void put64(std::string& s, uint64_t v) { s.append(reinterpret_cast<const char*>(&v), 8); }

uint64_t get64(const std::string& s, size_t at) {
  uint64_t v = 0;
  std::memcpy(&v, s.data() + at, 8);
  return v;
}

// Whether `blob` is a VMM export (see kVmmMagic); its chunk count in `chunks`.
bool is_vmm_blob(const std::string& blob, uint64_t& chunks) {
  if (blob.size() < kVmmHeader + kVmmChunk || std::memcmp(blob.data(), kVmmMagic, 8) != 0) return false;
  chunks = get64(blob, 32);
  // Then exactly the owner's uuid ("GPU-" + 32 hex digits): 76 + 24n bytes, never an IPC blob's 116.
  if (chunks == 0 || chunks >= (1ull << 32)) return false;
  const size_t body = kVmmHeader + chunks * kVmmChunk;
  return blob.size() == body + 36 && blob.compare(body, 4, "GPU-") == 0;
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

MemRegistration CudaLane::register_memory(void* ptr, size_t len, MemKind kind, int) {
  MemRegistration reg;
  if (kind != MemKind::kCuda || len == 0) return reg;  // host memory: a copy source, nothing to export
  make_current();
  CUdeviceptr base = 0;
  size_t size = 0;
  int range_rc = api_->cuMemGetAddressRange(&base, &size, reinterpret_cast<CUdeviceptr>(ptr));
  if (range_rc != CUDA_SUCCESS) {
    // Not memory the driver knows as one allocation: maybe a CUDA virtual-memory mapping.
    export_vmm(reinterpret_cast<CUdeviceptr>(ptr), len, range_rc, reg);
    return reg;
  }
  CUipcMemHandle handle{};
  int rc = api_->cuIpcGetMemHandle(&handle, base);
  if (rc != CUDA_SUCCESS) {
    // A CUDA virtual-memory mapping (PyTorch's expandable segments): exported as file descriptors.
    export_vmm(reinterpret_cast<CUdeviceptr>(ptr), len, rc, reg);
    return reg;
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

void CudaLane::export_vmm(uint64_t ptr, size_t len, int ipc_error, MemRegistration& reg) {
  const std::string what = "GPU memory at " + hex_addr(ptr) + " (" + std::to_string(len) + " bytes) on " + name_;
  if (!api_->vmm_error.empty()) {
    throw TransportError("cannot export " + what + " for CUDA IPC (" + cu_error(api_, ipc_error) +
                         "), and this driver lacks the virtual memory API to export it otherwise (" +
                         api_->vmm_error + "): update the NVIDIA driver, or unset "
                         "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True for registered tensors");
  }
  std::vector<VmmChunk> chunks;
  // Until they are handed over to vmm_exports_: closed on any failure.
  struct Fds {
    std::vector<VmmChunk>* chunks;
    bool keep = false;
    ~Fds() {
      if (!keep) {
        for (auto& c : *chunks) close(c.fd);
      }
    }
  } fds{&chunks};
  // The handle of the physical allocation mapped at `a`, or 0 where nothing is (a retain, released again).
  auto handle_at = [&](CUdeviceptr a, CUmemGenericAllocationHandle& h) -> CUresult {
    h = 0;
    CUresult r = api_->cuMemRetainAllocationHandle(&h, reinterpret_cast<void*>(a));
    if (r != CUDA_SUCCESS) return r;
    check(api_->cuMemRelease(h), "cuMemRelease");
    return CUDA_SUCCESS;
  };
  const CUdeviceptr end = ptr + len;
  CUdeviceptr a = ptr;
  while (a < end) {
    CUmemGenericAllocationHandle h = 0;
    CUresult r = api_->cuMemRetainAllocationHandle(&h, reinterpret_cast<void*>(a));
    if (r != CUDA_SUCCESS) {
      throw TransportError(
          "cannot export " + what + ": CUDA IPC refused it (" + cu_error(api_, ipc_error) +
          ") and at " + hex_addr(a) + " it is no CUDA virtual-memory mapping either (cuMemRetainAllocationHandle: " +
          cu_error(api_, r) + "); register memory from cudaMalloc/PyTorch's allocator, with or without "
          "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True");
    }
    // The retain added a reference: drop it on every way out of this iteration.
    struct Held {
      const CudaApi* api;
      CUmemGenericAllocationHandle h;
      bool released = false;
      ~Held() {
        if (!released) api->cuMemRelease(h);
      }
    } held{api_, h};
    PropBuf props{};
    check(api_->cuMemGetAllocationPropertiesFromHandle(&props.p, h), "cuMemGetAllocationPropertiesFromHandle");
    const CUmemAllocationProp& prop = props.p;
    if ((prop.requestedHandleTypes & CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR) == 0) {
      std::string types = std::to_string(prop.requestedHandleTypes);
      if (prop.requestedHandleTypes == 0) types += ": none";
      if (prop.requestedHandleTypes & CU_MEM_HANDLE_TYPE_FABRIC) {
        types += ": a fabric handle; PyTorch creates expandable segments with fabric handles where the "
                 "driver allows them (IMEX channels)";
      }
      throw TransportError(
          "cannot export " + what + ": it is a CUDA virtual-memory mapping (PyTorch's expandable segments), "
          "but its physical allocation at " + hex_addr(a) + " was not created exportable as a POSIX file "
          "descriptor (requestedHandleTypes " + types + "), the only way weightsync shares such memory: "
          "unset PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True for registered tensors, or use a "
          "PyTorch that creates expandable segments with CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR");
    }
    // The allocation's mapped range. cuMemGetAddressRange gives the range of the one mapping under `a`
    // (PyTorch maps each segment page with a cuMemMap of its own); checked here, since the driver
    // documents it for cuMemAlloc only: both ends must belong to the same allocation, and the
    // addresses just outside must not.
    CUdeviceptr lo = 0;
    size_t size = 0;
    const CUresult range_rc = api_->cuMemGetAddressRange(&lo, &size, a);
    CUmemGenericAllocationHandle other = 0;
    auto same = [&](CUdeviceptr x) { return handle_at(x, other) == CUDA_SUCCESS && other == h; };
    bool exact = range_rc == CUDA_SUCCESS && size > 0 && lo <= a && a - lo < size && same(lo) &&
                 same(lo + size - 1) && !(lo > 0 && same(lo - 1)) && !same(lo + size);
    if (!exact) {
      // Otherwise: walk granule by granule (mappings start and end on the allocation granularity).
      size_t g = 0;
      PropBuf gp = props;
      check(api_->cuMemGetAllocationGranularity(&g, &gp.p, CU_MEM_ALLOC_GRANULARITY_MINIMUM),
            "cuMemGetAllocationGranularity");
      if (g == 0) throw TransportError("cuMemGetAllocationGranularity returned 0 on " + name_);
      lo = a - a % g;
      while (lo >= g && same(lo - g)) lo -= g;
      CUdeviceptr hi = a - a % g + g;
      while (same(hi)) hi += g;
      size = hi - lo;
    }
    if (lo > a || lo + size <= a) {
      throw TransportError("cannot find the mapped range of the CUDA allocation at " + hex_addr(a) + " on " +
                           name_ + " (got " + hex_addr(lo) + " + " + std::to_string(size) + ")");
    }
    int fd = -1;
    r = api_->cuMemExportToShareableHandle(&fd, h, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0);
    if (r != CUDA_SUCCESS || fd < 0) {
      throw TransportError("cannot export " + what + ": cuMemExportToShareableHandle (POSIX file descriptor) "
                           "failed for the allocation at " + hex_addr(lo) + ": " + cu_error(api_, r) +
                           " (each physical allocation under a registered region keeps one file descriptor "
                           "open: if this process ran out, raise `ulimit -n`)");
    }
    fcntl(fd, F_SETFD, FD_CLOEXEC);  // not inherited by children (best effort)
    chunks.push_back({static_cast<int64_t>(lo) - static_cast<int64_t>(ptr), size, fd});
    held.released = true;
    check(api_->cuMemRelease(h), "cuMemRelease");
    a = lo + size;
  }
  if (export_nonce_ == 0) {
    std::random_device rd;
    export_nonce_ = (uint64_t(rd()) << 32) ^ rd() ^ uint64_t(getpid());
    if (export_nonce_ == 0) export_nonce_ = 1;
  }
  const uint64_t id = next_export_++;
  reg.blob.assign(kVmmMagic, 8);
  put64(reg.blob, static_cast<uint64_t>(getpid()));
  put64(reg.blob, export_nonce_);
  put64(reg.blob, id);
  put64(reg.blob, chunks.size());
  std::vector<int> kept;
  for (auto& c : chunks) {
    put64(reg.blob, static_cast<uint64_t>(c.offset));
    put64(reg.blob, c.size);
    put64(reg.blob, static_cast<uint64_t>(static_cast<int64_t>(c.fd)));
    kept.push_back(c.fd);
  }
  reg.blob.append(uuid_);
  vmm_exports_.emplace(id, std::move(kept));
  fds.keep = true;
  reg.handle = reinterpret_cast<void*>(static_cast<uintptr_t>(id));
}

void CudaLane::deregister(const MemRegistration& reg) {
  // A VMM export: its file descriptors close (IPC exports hold nothing). Peers that mapped it keep
  // their mappings; the live table keeps them from writing.
  if (reg.handle == nullptr) return;
  auto it = vmm_exports_.find(static_cast<uint64_t>(reinterpret_cast<uintptr_t>(reg.handle)));
  if (it == vmm_exports_.end()) return;
  for (int fd : it->second) close(fd);
  vmm_exports_.erase(it);
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

uint64_t CudaLane::import_vmm(const std::string& blob) {
  uint64_t n = 0;
  is_vmm_blob(blob, n);
  const size_t body = kVmmHeader + n * kVmmChunk;
  const std::string owner_uuid = blob.substr(body);
  const std::string key = blob.substr(0, body);  // owner pid, export id and chunks: unique per export
  auto found = vmm_imported_.find(key);
  if (found != vmm_imported_.end()) {
    return found->second.va - static_cast<uint64_t>(found->second.first);
  }
  if (!api_->vmm_error.empty()) {
    throw TransportError("cannot map GPU memory of " + owner_uuid + " exported through the CUDA virtual memory "
                         "API (PyTorch's expandable segments): this driver lacks it (" + api_->vmm_error +
                         "); update the NVIDIA driver, or have the owner unset "
                         "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True for registered tensors");
  }
  const int pid = static_cast<int>(get64(blob, 8));
  std::vector<VmmChunk> chunks;
  for (uint64_t i = 0; i < n; ++i) {
    const size_t at = kVmmHeader + i * kVmmChunk;
    chunks.push_back({static_cast<int64_t>(get64(blob, at)), get64(blob, at + 8),
                      static_cast<int>(static_cast<int64_t>(get64(blob, at + 16)))});
  }
  const std::string whose = owner_uuid + " (pid " + std::to_string(pid) + ")";
  make_current();
  // Our device's granularity: the owner's layout must fit it (it does between GPUs of one kind).
  CUdevice dev = 0;
  check(api_->cuDeviceGet(&dev, device_), "cuDeviceGet");
  PropBuf gp{};
  gp.p.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  gp.p.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  gp.p.location.id = dev;
  size_t g = 0;
  check(api_->cuMemGetAllocationGranularity(&g, &gp.p, CU_MEM_ALLOC_GRANULARITY_MINIMUM),
        "cuMemGetAllocationGranularity");
  if (g == 0) g = 1;
  const int64_t first = chunks.front().offset;
  uint64_t span = 0;
  for (const auto& c : chunks) {
    const uint64_t rel = static_cast<uint64_t>(c.offset - first);
    if (c.size == 0 || rel != span || c.size % g != 0) {
      throw TransportError("malformed or unmappable VMM export of " + whose + ": chunk at " +
                           std::to_string(c.offset) + " + " + std::to_string(c.size) + " bytes (expected at " +
                           std::to_string(static_cast<int64_t>(span) + first) + ", a multiple of " +
                           std::to_string(g) + " bytes, the allocation granularity of " + name_ + ")");
    }
    span += c.size;
  }
  // The owner's file descriptors, duplicated into this process.
  const long pidfd = syscall(SYS_pidfd_open, pid, 0);
  if (pidfd < 0) {
    const int err = errno;
    if (err == ENOSYS) {
      throw TransportError("cannot map GPU memory of " + whose + " (PyTorch's expandable segments): the kernel "
                           "lacks pidfd_open (Linux >= 5.6 is needed to share CUDA virtual memory between "
                           "processes); update the kernel or unset PYTORCH_CUDA_ALLOC_CONF="
                           "expandable_segments:True in the destination");
    }
    throw TransportError("cannot map GPU memory of " + whose + ": pidfd_open failed: " + std::strerror(err) +
                         (err == ESRCH ? " (the owner process is gone)" : ""));
  }
  struct Cleanup {
    const CudaApi* api;
    int pidfd;
    std::vector<int> fds;
    std::vector<CUmemGenericAllocationHandle> handles;
    CUdeviceptr va = 0;
    size_t reserved = 0;
    std::vector<std::pair<CUdeviceptr, size_t>> maps;
    bool keep = false;
    ~Cleanup() {
      close(pidfd);
      for (int fd : fds) close(fd);
      if (keep) return;
      for (auto& [a, sz] : maps) api->cuMemUnmap(a, sz);
      for (auto h : handles) api->cuMemRelease(h);
      if (reserved) api->cuMemAddressFree(va, reserved);
    }
  } cl{api_, static_cast<int>(pidfd), {}, {}, 0, 0, {}, false};
  for (const auto& c : chunks) {
    const long fd = syscall(SYS_pidfd_getfd, static_cast<int>(pidfd), c.fd, 0);
    if (fd < 0) {
      const int err = errno;
      std::string msg = "cannot map GPU memory of " + whose + " (PyTorch's expandable segments): pidfd_getfd "
                        "of its fd " + std::to_string(c.fd) + " failed: " + std::strerror(err);
      if (err == EPERM || err == EACCES) {
        msg += ". Duplicating another process's file descriptors needs ptrace permission over it: run "
               "both as root, give this process CAP_SYS_PTRACE (containers: --cap-add SYS_PTRACE; a "
               "seccomp profile may also block pidfd_getfd), or set kernel.yama.ptrace_scope=0 "
               "(`sysctl -w kernel.yama.ptrace_scope=0`); or unset PYTORCH_CUDA_ALLOC_CONF="
               "expandable_segments:True in the destination";
      } else if (err == ENOSYS) {
        msg += " (the kernel lacks pidfd_getfd: Linux >= 5.6 is needed; update the kernel or unset "
               "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True in the destination)";
      } else if (err == EBADF) {
        msg += " (the owner closed it: was the region deregistered?)";
      } else if (err == ESRCH) {
        msg += " (the owner process is gone)";
      }
      throw TransportError(msg);
    }
    cl.fds.push_back(static_cast<int>(fd));
    CUmemGenericAllocationHandle h = 0;
    CUresult r = api_->cuMemImportFromShareableHandle(&h, reinterpret_cast<void*>(static_cast<intptr_t>(fd)),
                                                      CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR);
    if (r != CUDA_SUCCESS) {
      throw TransportError("cannot import GPU memory of " + whose + " (cuMemImportFromShareableHandle of its "
                           "fd " + std::to_string(c.fd) + "): " + cu_error(api_, r) +
                           " (the owner must be alive on this host and its fd still a CUDA export; an invalid "
                           "device error may mean the owner's GPU must be visible here too: CUDA_VISIBLE_DEVICES)");
    }
    cl.handles.push_back(h);
  }
  CUdeviceptr va = 0;
  CUresult r = api_->cuMemAddressReserve(&va, span, g, 0, 0);
  if (r != CUDA_SUCCESS) {
    throw TransportError("cannot reserve " + std::to_string(span) + " bytes of virtual address space on " + name_ +
                         " for GPU memory of " + whose + ": " + cu_error(api_, r));
  }
  cl.va = va;
  cl.reserved = span;
  for (size_t i = 0; i < chunks.size(); ++i) {
    const CUdeviceptr at = va + static_cast<uint64_t>(chunks[i].offset - first);
    r = api_->cuMemMap(at, chunks[i].size, 0, cl.handles[i], 0);
    if (r != CUDA_SUCCESS) {
      throw TransportError("cannot map GPU memory of " + whose + " on " + name_ + " (cuMemMap of " +
                           std::to_string(chunks[i].size) + " bytes): " + cu_error(api_, r));
    }
    cl.maps.emplace_back(at, chunks[i].size);
  }
  CUmemAccessDesc access{};
  access.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  access.location.id = dev;
  access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  r = api_->cuMemSetAccess(va, span, &access, 1);
  if (r != CUDA_SUCCESS) {
    throw TransportError("cannot make GPU memory of " + whose + " writable from " + name_ + " (cuMemSetAccess): " +
                         cu_error(api_, r) + " (the GPUs must be able to reach each other: check "
                         "`nvidia-smi topo -m`)");
  }
  // Mapped: the mappings keep the memory; the handles and our fds can go.
  cl.keep = true;
  VmmImport imp{va, span, {}, first};
  for (auto& m : cl.maps) imp.maps.emplace_back(m.first, m.second);
  vmm_imported_.emplace(key, std::move(imp));
  CUresult release_rc = CUDA_SUCCESS;
  for (auto h : cl.handles) {
    r = api_->cuMemRelease(h);
    if (r != CUDA_SUCCESS && release_rc == CUDA_SUCCESS) release_rc = r;
  }
  check(release_rc, "cuMemRelease (of an imported allocation handle, after mapping it)");
  return va - static_cast<uint64_t>(first);
}

uint64_t CudaLane::import_remote(const std::string& blob) {
  uint64_t vmm_chunks = 0;
  if (is_vmm_blob(blob, vmm_chunks)) return import_vmm(blob);
  if (blob.size() < kIpcBlob) throw UsageError("region descriptor has no CUDA IPC handle (is it GPU memory?)");
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
    // microseconds each separate copy costs them (docs/BENCHMARKS.md).
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
    ring_.sleep(int64_t(timeout_ms) * 1000);
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
