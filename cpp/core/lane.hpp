// A lane only registers memory, posts writes and polls for completions. It knows nothing about
// transfers, sharding, retries or counters: the engine above it does all the accounting. One lane is one
// path out of this process (a libfabric NIC: domain + endpoint; or the copy engines of this GPU), and it
// is only ever touched by the single worker thread that owns it (LaneWorker), so implementations need no
// locking of their own. A lane says what it can do (LaneCaps); the engine and the worker ask that, never
// which class it is. Lanes are made by name through the registry at the end of this file.
#pragma once

#include <cerrno>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

namespace weightsync {

struct EngineConfig;

enum class MemKind : int { kHost = 0, kCuda = 1 };

// What a lane hands back for one registration of one buffer.
struct MemRegistration {
  void* handle = nullptr;      // lane-owned (for fabric: fid_mr*)
  void* local_desc = nullptr;  // passed back on every post that reads from this buffer
  uint64_t remote_base = 0;    // what a peer adds its offset to: the virtual address or 0 (offset mode)
  uint64_t key = 0;            // what a peer must present to write here
  std::string blob;            // anything else a peer needs (cuda: the IPC handle and offset)
};

// Scratch space a lane may use per posted operation (libfabric's FI_CONTEXT2 needs 64 bytes).
// It must be the first member of whatever the engine passes as `context`.
struct LaneContext {
  alignas(16) unsigned char scratch[64];
};

// What a lane can do, NIXL-style: asked once when the lane is opened (cheap to copy, never changes).
struct LaneCaps {
  bool is_nic = false;            // a network NIC: paced by a byte window, its paths to peers can stall
                                  // and fail (pieces then move to another NIC lane); else local hardware
  bool writes_host = false;       // remote memory kinds it writes: host ...
  bool writes_cuda = false;       // ... and GPU memory (CUDA, or FI_HMEM on a NIC)
  bool rma_keys = false;          // writes address a peer's registration by base + key (RDMA)
  bool maps_remote = false;       // writes go to a peer's memory mapped here (RemoteRegion::cuda_addr)
  bool two_d = false;             // posts a 2-D write (WriteRequest::rows) as one request
  bool own_imm = false;           // delivers immediates itself (CQ data; a shared ring where the peer has
                                  // one: Lane::delivers_imm says per peer); else the engine signals them
  bool batching = false;          // gathers consecutive writes into one submission to the hardware
  bool tagged = false;            // tagged messages (Lane::post_recv, WriteRequest::tagged): landing rings
  bool orders_sends = false;      // two sends on one path are matched at the target in posting order
  bool delivery_complete = false; // honours WriteRequest::delivery_complete (FI_DELIVERY_COMPLETE)
  bool orders_writes = false;     // writes on one path are placed at the target in posting order
  bool local_copies = false;      // copies between this process's host and device memory (LocalCopies)
  bool unlimited_window = false;  // queues work on hardware of its own: no byte window needed
  bool control_queue = false;     // sends control messages (WriteRequest::control: announces) on a queue
                                  // of their own per path, so they never wait behind data posted there
                                  // before them; else they share the data's queue (and wait for it)
};

// A 2-D write: `rows` rows of WriteRequest::len bytes, `src_pitch`/`dst_pitch` apart (lanes with
// LaneCaps::two_d; the others are given 1-D pieces only).
struct RowGeometry {
  uint64_t rows = 1;
  uint64_t src_pitch = 0;
  uint64_t dst_pitch = 0;
};

// A write into memory mapped from a peer (lanes with LaneCaps::maps_remote).
struct MappedTarget {
  uint32_t imm_repeat = 1;     // immediates to push for this one copy (the engine's count for the write)
  uint64_t remote_region = 0;  // the destination's region id, checked against its live registrations
};

// A tagged message instead of an RMA write (lanes with LaneCaps::tagged): into a landing region at the
// destination, memory its NICs cannot register; the message lands in one of its receive buffers (see
// Engine). `remote_addr`/`key` are then unused; `imm`, if any, travels as the message's CQ data.
struct TaggedSend {
  bool tagged = false;
  uint64_t tag = 0;
};

// One posted write. The common part every lane reads, then one part per capability: each lane reads
// only the parts of what it can do (all by value: nothing to allocate on the hot path).
struct WriteRequest {
  const void* src = nullptr;
  size_t len = 0;
  void* src_desc = nullptr;
  uint64_t peer = 0;  // lane-level peer handle from insert_peer (0: a local copy, LocalCopies)
  uint64_t remote_addr = 0;
  uint64_t key = 0;
  bool has_imm = false;
  uint32_t imm = 0;
  void* context = nullptr;  // starts with a LaneContext
  // Local completion only after the bytes are placed in the target's memory (FI_DELIVERY_COMPLETE),
  // not merely sent: the engine needs it where another write's immediate announces these bytes.
  bool delivery_complete = false;
  // A small control message (an announce: a tagged send whose bytes were placed already): lanes with
  // LaneCaps::control_queue send it on the path's control queue, not behind the data posted on the path.
  bool control = false;
  RowGeometry geometry;
  MappedTarget mapped;
  TaggedSend tagged;
};

struct Completion {
  // kRecv: a receive posted with post_recv completed (error != 0: it failed, e.g. truncated); the buffer
  // is the lane's no more until posted again. kLanded: the cuda lane finished (or failed, error != 0)
  // a copy started with LocalCopies::post_landing_copy.
  enum Kind { kLocalDone, kLocalError, kRemoteImm, kRecv, kLanded };
  Kind kind = kLocalDone;
  void* context = nullptr;  // for local completions: the WriteRequest's context; kRecv/kLanded: the post's
  uint32_t imm = 0;         // for kRemoteImm, and kRecv with has_imm
  bool has_imm = false;     // kRecv: the message carried CQ data
  uint64_t len = 0;         // kRecv: bytes received
  uint64_t tag = 0;         // kRecv: the message's tag
  int error = 0;            // for kLocalError (and failed kRecv/kLanded): a positive FI_E* / errno code
  std::string message;      // for kLocalError: provider's words
};

// Copies between this process's host and device memory, offered by a lane with LaneCaps::local_copies
// (the cuda lane): the engine's page-locked buffers, landing copies and staging copies go through it.
// Called on the lane's worker (or, for free_pinned, once the worker is joined).
class LocalCopies {
 public:
  virtual ~LocalCopies() = default;
  // Page-locked host memory the lane's device copies from and to at full speed.
  virtual void* alloc_pinned(size_t bytes) = 0;
  virtual void free_pinned(void* p) = 0;
  // `len` bytes from page-locked host memory into device memory, in FIFO order; completes later as a
  // Completion::kLanded with `context` (after every landing copy posted before it). 0 or -errno.
  virtual int post_landing_copy(void* dst, const void* src, size_t len, void* context) = 0;
  // Waits for every landing copy queued; returns the contexts of those not yet reported (never will be).
  virtual std::vector<void*> drain_landing() = 0;
};

class Lane {
 public:
  virtual ~Lane() = default;

  virtual LaneCaps caps() const = 0;
  virtual std::string kind() const = 0;      // the registry name it was made by: "fabric", "cuda"
  virtual std::string provider() const = 0;  // e.g. "tcp;ofi_rxm"
  virtual std::string nic_name() const = 0;  // e.g. "lo", "rdmap0s6", "cuda:GPU-..."
  virtual std::string address() const = 0;   // opaque bytes a peer passes to insert_peer
  virtual std::string describe_address(const std::string& address) const = 0;  // printable form

  virtual MemRegistration register_memory(void* ptr, size_t len, MemKind kind, int device) = 0;
  virtual void deregister(const MemRegistration& reg) = 0;

  virtual uint64_t insert_peer(const std::string& address) = 0;
  // Drops the lane's connection state for a peer handle and makes a fresh one to the same address
  // (returned; may equal the old one). Writes still posted on the old connection come back as error
  // completions; the next post connects again. Lanes without connections return `peer` unchanged.
  virtual uint64_t reset_path(uint64_t peer) { return peer; }
  // What the lane's transport says about a path with writes outstanding: kAlive when its connection
  // holds data for the peer and had some acknowledged within `window_s` (a slow but working link),
  // kDead when it holds data and nothing was acknowledged that long, kUnknown where the lane cannot tell
  // (no connections, none found, or nothing queued in it: then the wait is the peer's, not the link's).
  enum class PathState { kUnknown, kAlive, kDead };
  virtual PathState path_state(uint64_t peer, double window_s) {
    (void)peer, (void)window_s;
    return PathState::kUnknown;
  }
  // Aborts the path's connection so that nothing still queued on it can reach the peer later (the
  // kernel drops what it has not sent and resets the connection instead of a graceful close, which
  // would go on sending); the writes still posted on it then come back as error completions. false
  // where the lane cannot (no connections, or none found): its writes may still land later.
  virtual bool abort_path(uint64_t peer) {
    (void)peer;
    return false;
  }
  // Ends the path's connection (both, where the lane has a control queue of its own) for good, abortively (zero linger: the kernel drops what it still holds
  // and resets the connection, where a graceful close would go on delivering it, possibly after a retry
  // and after later writes to the same place), and closes the endpoint the lane has for it, so the
  // provider hands back every write still posted on it (error completions, found by the next poll).
  // `peer` becomes the handle for a fresh connection. true when nothing posted on the old connection can
  // leave this host any more; false where the lane has no connection of its own to end (connectionless
  // providers): its writes stay with the provider until it returns them.
  virtual bool close_path(uint64_t& peer) {
    (void)peer;
    return false;
  }
  // The engine key K that peers must prove at connection set-up (raw bytes; see fabric/peer_auth.hpp),
  // for lanes that authenticate their connections; the others ignore it (their peers are gated by the
  // remote keys handed out through the secret-gated coordinator only).
  virtual void set_auth_key(const std::string& key) { (void)key; }
  // Connection requests refused for want of a valid proof (any thread may read it).
  virtual uint64_t auth_refused() const { return 0; }
  // Makes a peer's exported memory (MemRegistration::blob) writable from here; returns its address
  // (lanes with LaneCaps::maps_remote).
  virtual uint64_t import_remote(const std::string& blob) { (void)blob; return 0; }
  // Whether writes to this peer deliver their immediates themselves (else the engine signals them).
  virtual bool delivers_imm(uint64_t peer) const { (void)peer; return caps().own_imm; }
  // Marks one of our exported regions writable by peers or not, for lanes whose writers check that
  // before every write (the cuda lane's live table). Any thread may call it: deregistration must take
  // effect at once. Lanes whose writers are refused by their hardware (closed MRs) ignore it.
  virtual void set_region_live(uint64_t id, bool live) { (void)id, (void)live; }
  // The lane's host/device copies (LaneCaps::local_copies), or null.
  virtual LocalCopies* local_copies() { return nullptr; }

  // 0 when posted, -EAGAIN when the queue is full (poll and try again), another negative errno on error.
  virtual int post_write(const WriteRequest& req) = 0;
  // Appends up to `max` completions to `out`; returns how many were appended.
  virtual size_t poll(std::vector<Completion>& out, size_t max) = 0;
  // Called by the worker before it looks for new work (commands, writes to post): a `wait` after it
  // returns at once if `signal()` came in between, so a signal is never lost in that window.
  virtual void arm() {}
  // Sleeps until a completion may be ready, `signal()` is called (since `arm`), or `timeout_ms` passes.
  virtual void wait(int timeout_ms) = 0;
  // Wakes a concurrent `wait` (the only method another thread may call, with set_region_live).
  virtual void signal() = 0;

  // Posts a tagged receive of up to `len` bytes that matches the tags equal to `tag` in every bit not
  // set in `ignore` (LaneCaps::tagged); receives that match a message are taken in posting order.
  // 0, -EAGAIN or another -errno.
  virtual int post_recv(void* buf, size_t len, void* desc, void* context, uint64_t tag, uint64_t ignore) {
    (void)buf, (void)len, (void)desc, (void)context, (void)tag, (void)ignore;
    return -ENOSYS;
  }

  virtual uint64_t max_write() const = 0;       // largest single write the lane accepts
  virtual size_t max_outstanding() const = 0;   // operations it can hold in flight
  virtual std::string error_string(int err) const = 0;
};

// The lane types an engine can open, by name. Adding a lane is a folder (cpp/<name>/) with its Lane
// subclass and a LaneType, and one line in register_builtin_lanes (core/lane_registry.cpp).
struct LaneType {
  std::string name;
  // Settles the choices this type makes in the config before any lane opens (fabric: the provider and
  // the NIC list); may throw TransportError.
  std::function<void(EngineConfig&)> configure;
  // The lanes of this type an engine with `cfg` has (fabric: one per NIC; cuda: one if cuda_device >= 0).
  std::function<std::vector<std::unique_ptr<Lane>>(const EngineConfig&)> open;
};

// Every registered type, in registration order (the engine opens NIC lanes first: see Engine).
const std::vector<LaneType>& lane_types();
// Adds a type (before any engine is made; register_builtin_lanes does it for the built-in ones).
void register_lane_type(LaneType type);

}  // namespace weightsync
