// The CUDA driver as the cuda lane uses it: libcuda is loaded at run time (dlopen), so one build serves
// machines with and without GPUs, and the few driver types and entry points it needs are declared here
// (no CUDA headers at build time).
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

namespace weightsync {

namespace cu {


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

}  // namespace cu

// The driver's entry points, resolved once (load_api).

struct CudaApi {
  using CUresult = cu::CUresult;
  using CUdevice = cu::CUdevice;
  using CUdeviceptr = cu::CUdeviceptr;
  using CUuuid = cu::CUuuid;
  using CUipcMemHandle = cu::CUipcMemHandle;
  using CudaMemcpy2D = cu::CudaMemcpy2D;
  using CUmemGenericAllocationHandle = cu::CUmemGenericAllocationHandle;
  using CUmemAllocationProp = cu::CUmemAllocationProp;
  using CUmemAccessDesc = cu::CUmemAccessDesc;
  using CUmemcpyAttributes = cu::CUmemcpyAttributes;
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

// The driver, loaded and initialised on first use; `error` says why it is unusable (empty: usable).
const CudaApi* load_api();
// The driver's name for a CUresult.
std::string cu_error(const CudaApi* api, cu::CUresult rc);

namespace cu {

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

inline std::string hex(const char* p, size_t n) {
  static const char* d = "0123456789abcdef";
  std::string s;
  for (size_t i = 0; i < n; ++i) {
    s += d[(static_cast<unsigned char>(p[i]) >> 4) & 15];
    s += d[static_cast<unsigned char>(p[i]) & 15];
  }
  return s;
}

// address = host '\n' uuid '\n' pid
inline std::vector<std::string> split_address(const std::string& a) {
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

inline std::string hex_addr(uint64_t a) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "0x%llx", static_cast<unsigned long long>(a));
  return buf;
}

inline void put64(std::string& s, uint64_t v) { s.append(reinterpret_cast<const char*>(&v), 8); }

inline uint64_t get64(const std::string& s, size_t at) {
  uint64_t v = 0;
  std::memcpy(&v, s.data() + at, 8);
  return v;
}

// Whether `blob` is a VMM export (see kVmmMagic); its chunk count in `chunks`.
inline bool is_vmm_blob(const std::string& blob, uint64_t& chunks) {
  if (blob.size() < kVmmHeader + kVmmChunk || std::memcmp(blob.data(), kVmmMagic, 8) != 0) return false;
  chunks = get64(blob, 32);
  // Then exactly the owner's uuid ("GPU-" + 32 hex digits): 76 + 24n bytes, never an IPC blob's 116.
  if (chunks == 0 || chunks >= (1ull << 32)) return false;
  const size_t body = kVmmHeader + chunks * kVmmChunk;
  return blob.size() == body + 36 && blob.compare(body, 4, "GPU-") == 0;
}

}  // namespace cu

}  // namespace weightsync
