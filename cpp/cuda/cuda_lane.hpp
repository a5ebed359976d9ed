// Same-host GPU-to-GPU writes over NVLink/PCIe with the copy engines. The destination exports CUDA IPC
// handles for the memory it registers; the source opens each handle once in the context of the GPU that
// does the writing (its own), and copies with cuMemcpyAsync on streams of its own: no SMs involved.
// libcuda is loaded at run time, so one build serves machines with and without GPUs.
//
// A copy engine cannot raise an immediate at the destination: once a copy is done, this lane pushes
// its immediate into the destination's shared-memory ring (ImmRing), which the destination's own cuda
// lane drains into its counters. Where the ring cannot be opened, the engine signals over a fabric NIC
// (a zero-length write) instead. Either way the destination's counters see one model.
//
// Memory that cuIpcGetMemHandle refuses (CUDA virtual-memory mappings, as PyTorch's expandable segments
// make) is exported the VMM way instead: one POSIX file descriptor per physical allocation under the
// region, kept open by the owner while the region is registered; a peer duplicates them with
// pidfd_getfd (Linux >= 5.6, ptrace permission over the owner), imports them and maps them, in the
// owner's layout, into a virtual range of its own.
#pragma once

#include <atomic>
#include <cstdint>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "cuda/imm_ring.hpp"
#include "core/lane.hpp"

namespace weightsync {

struct CudaApi;  // the driver entry points, resolved with dlopen/dlsym

// Why CUDA is not usable here (no libcuda, no device), or empty when it is.
std::string cuda_unavailable_reason();
// Number of CUDA devices visible to this process (0 without a driver).
int cuda_device_count();
// Identity of this host (hostname + boot id): peers with equal ids can use CUDA IPC.
std::string host_identity();

class CudaLane final : public Lane, public LocalCopies {
 public:
  // `streams`: copies are spread over this many streams; `spin_us`: an idle worker keeps polling this
  // long after its last copy before it sleeps (back-to-back writes then skip a wake-up).
  // batch_bytes > 0: consecutive 1-D copies posted between two polls go to the driver as one batched
  // copy (cuMemcpyBatchAsync, CUDA >= 12.8) of at most this many bytes, completing together.
  CudaLane(int device, int streams, double spin_us, uint64_t batch_bytes = 0);
  ~CudaLane() override;

  LaneCaps caps() const override;
  std::string kind() const override { return "cuda"; }
  std::string provider() const override { return "cuda"; }
  std::string nic_name() const override { return name_; }
  std::string address() const override { return address_; }
  std::string describe_address(const std::string& address) const override;

  MemRegistration register_memory(void* ptr, size_t len, MemKind kind, int device) override;
  void deregister(const MemRegistration& reg) override;
  uint64_t insert_peer(const std::string& address) override;
  uint64_t import_remote(const std::string& blob) override;
  bool delivers_imm(uint64_t peer) const override;

  int post_write(const WriteRequest& req) override;
  size_t poll(std::vector<Completion>& out, size_t max) override;
  void arm() override { ticket_ = ring_.ticket(); }
  void wait(int timeout_ms) override;
  void signal() override;

  uint64_t max_write() const override { return ~0ull >> 1; }
  size_t max_outstanding() const override { return 4096; }
  std::string error_string(int err) const override;

  const std::string& uuid() const { return uuid_; }

  // Marks one of our exported regions as writable by peers or not (the live table in our ring). Unlike
  // the rest of the lane, any thread may call it: deregistration must take effect at once.
  void set_region_live(uint64_t id, bool live) override;
  LocalCopies* local_copies() override { return this; }
  // Page-locked host memory for staging (this device's context); on the worker, or once it is joined.
  void* alloc_pinned(size_t bytes) override;
  void free_pinned(void* p) override;

  // Landing copies (on the worker): `len` bytes from page-locked host memory into this device's memory,
  // on a stream of their own, in FIFO order. Completes later as a Completion::kLanded with `context`
  // (after every landing copy posted before it). len 0 still completes in that order. 0 or -errno.
  int post_landing_copy(void* dst, const void* src, size_t len, void* context) override;
  // Waits for every landing copy queued (close: before the ring's host memory is freed); returns the
  // contexts of those not yet reported, which will never be.
  std::vector<void*> drain_landing() override;

 private:
  void check(int rc, const char* what) const;
  void make_current() const;
  // An event from the pool, or a new one (null if the driver refused: the caller reports ENOMEM).
  void* take_event();
  // Queues the copy of `req` (1-D or 2-D) on `stream`; returns a CUresult.
  int enqueue_copy(const WriteRequest& req, void* stream);
  // Sends the batch gathered so far to the driver (one call, one event for all of it).
  void flush_batch();
  // The VMM export of [ptr, ptr+len) (ipc_error: why cuIpcGetMemHandle refused it): fills reg.blob and
  // reg.handle (the key of its file descriptors in vmm_exports_).
  void export_vmm(uint64_t ptr, size_t len, int ipc_error, MemRegistration& reg);
  // Maps a peer's VMM export (a blob export_vmm made) here; returns the address of its region's start.
  uint64_t import_vmm(const std::string& blob);

  const CudaApi* api_;
  int device_;
  void* ctx_ = nullptr;
  std::vector<void*> streams_;
  size_t next_stream_ = 0;
  std::string uuid_;
  std::string name_;
  std::string address_;
  std::string host_;
  struct Inflight {
    void* event;  // null: nothing to wait for (a zero-length write), complete at the next poll
    void* context;
    uint64_t peer;
    bool has_imm;
    uint32_t imm;
    uint32_t imm_repeat;
    // The copies of a batch share one event: the batch's last entry returns it to the pool.
    bool owns_event = true;
    int error = 0;  // a CUresult: the copy could not be queued (reported from ready_)
  };
  // The batch being gathered: consecutive 1-D copies, all for one stream, sent at the next poll.
  uint64_t batch_bytes_ = 0;  // the most bytes per batch (0: no batching)
  uint64_t batched_ = 0;      // bytes in the batch so far
  std::vector<unsigned long long> batch_dst_, batch_src_;
  std::vector<size_t> batch_len_;
  std::vector<Inflight> batch_;
  size_t max_pitch_ = 0;  // CU_DEVICE_ATTRIBUTE_MAX_PITCH: larger pitches are copied row by row
  double spin_us_ = 0;
  std::chrono::steady_clock::time_point last_busy_{};
  ImmRing ring_;                                  // immediates other processes push to us
  uint32_t ticket_ = 0;                           // the ring's bell when the worker last armed
  std::unordered_map<uint64_t, ImmRing> peer_rings_;  // by peer handle: where we push theirs
  std::unordered_map<uint64_t, int> peer_pids_;       // by peer handle: to notice a peer that exited
  uint64_t next_peer_ = 1;
  std::deque<Inflight> inflight_;
  std::deque<Inflight> ready_;  // zero-length writes: nothing to wait for, reported at the next poll
  void* landing_stream_ = nullptr;
  std::deque<std::pair<void*, void*>> landing_;  // (event, context) of landing copies, in order
  std::vector<void*> free_events_;
  // Opened peer allocations, by IPC handle bytes: opening one twice in a context fails.
  std::unordered_map<std::string, uint64_t> opened_;
  // Our VMM exports: file descriptors (one per physical allocation) by registration, open until it is
  // deregistered; peers duplicate them from this process.
  std::unordered_map<uint64_t, std::vector<int>> vmm_exports_;
  uint64_t next_export_ = 1;
  uint64_t export_nonce_ = 0;  // random per lane: export ids never repeat across processes
  // Peers' VMM exports mapped here, by the blob's identity (owner pid, export id, chunks): a virtual
  // range of our own with each of the owner's allocations mapped in its place.
  struct VmmImport {
    uint64_t va = 0;      // our reservation
    size_t reserved = 0;  // its size
    std::vector<std::pair<uint64_t, size_t>> maps;  // (address, size) of each mapping in it
    int64_t first = 0;    // the region's start is va - first
  };
  std::unordered_map<std::string, VmmImport> vmm_imported_;
};

// The "cuda" lane type: one lane for EngineConfig::cuda_device when it is >= 0.
LaneType cuda_lane_type();

}  // namespace weightsync
