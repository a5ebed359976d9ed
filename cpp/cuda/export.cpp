// The cuda lane's memory export and import: a registered region is exported as a CUDA IPC handle, or
// (memory cuIpcGetMemHandle refuses: CUDA VMM mappings, as PyTorch's expandable segments make) as one
// POSIX fd per physical allocation; a peer opens the handle, or duplicates the fds with pidfd_getfd and
// maps them, in the context of the GPU that writes.
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

#ifndef SYS_pidfd_open
#define SYS_pidfd_open 434
#endif
#ifndef SYS_pidfd_getfd
#define SYS_pidfd_getfd 438
#endif

}  // namespace

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

}  // namespace weightsync
