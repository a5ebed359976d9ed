#include "cuda/driver.hpp"

#include <dlfcn.h>
#include <unistd.h>

#include <fstream>
#include <mutex>
#include <type_traits>

#include "cuda/cuda_lane.hpp"

namespace weightsync {

using namespace cu;


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

}  // namespace weightsync
