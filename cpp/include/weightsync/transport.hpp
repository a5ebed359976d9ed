// A transport only registers memory, posts writes and polls for completions. It knows nothing about
// transfers, sharding, retries or counters: the engine above it does all the accounting. One transport
// instance is one NIC (a libfabric domain + endpoint, or later a CUDA device), and it is only ever
// touched by the single worker thread that owns it, so implementations need no locking of their own.
#pragma once

#include <cerrno>
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace weightsync {

enum class MemKind : int { kHost = 0, kCuda = 1 };

// What a transport hands back for one registration of one buffer.
struct MemRegistration {
  void* handle = nullptr;      // transport-owned (for fabric: fid_mr*)
  void* local_desc = nullptr;  // passed back on every post that reads from this buffer
  uint64_t remote_base = 0;    // what a peer adds its offset to: the virtual address or 0 (offset mode)
  uint64_t key = 0;            // what a peer must present to write here
  std::string blob;            // anything else a peer needs (cuda: the IPC handle and offset)
};

// Scratch space a transport may use per posted operation (libfabric's FI_CONTEXT2 needs 64 bytes).
// It must be the first member of whatever the engine passes as `context`.
struct TransportContext {
  alignas(16) unsigned char scratch[64];
};

struct WriteRequest {
  const void* src = nullptr;
  size_t len = 0;
  void* src_desc = nullptr;
  uint64_t peer = 0;  // transport-level peer handle from insert_peer
  uint64_t remote_addr = 0;
  uint64_t key = 0;
  bool has_imm = false;
  uint32_t imm = 0;
  void* context = nullptr;  // starts with a TransportContext
  // Local completion only after the bytes are placed in the target's memory (FI_DELIVERY_COMPLETE),
  // not merely sent: the engine needs it where another write's immediate announces these bytes.
  bool delivery_complete = false;
  // cuda lane only. A 2-D copy: `rows` rows of `len` bytes, `src_pitch`/`dst_pitch` apart (rows > 1).
  uint64_t rows = 1;
  uint64_t src_pitch = 0;
  uint64_t dst_pitch = 0;
  uint32_t imm_repeat = 1;  // immediates to push for this one copy (the engine's count for the write)
  uint64_t remote_region = 0;  // the destination's region id, checked against its live registrations
  // fabric only: send a tagged message instead of an RMA write (a landing region at the destination,
  // memory its NICs cannot register: the message lands in one of its receive buffers, see Engine).
  // `remote_addr`/`key` are then unused; `imm`, if any, travels as the message's CQ data.
  bool tagged = false;
  uint64_t tag = 0;
};

struct Completion {
  // kRecv: a receive posted with post_recv completed (error != 0: it failed, e.g. truncated); the buffer
  // is the transport's no more until posted again. kLanded: the cuda lane finished (or failed, error != 0)
  // a copy started with CudaTransport::post_landing_copy.
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

class Transport {
 public:
  virtual ~Transport() = default;

  virtual std::string kind() const = 0;      // "fabric" or "cuda"
  virtual std::string provider() const = 0;  // e.g. "tcp;ofi_rxm"
  virtual std::string nic_name() const = 0;  // e.g. "lo", "rdmap0s6"
  virtual std::string address() const = 0;   // opaque bytes a peer passes to insert_peer
  virtual std::string describe_address(const std::string& address) const = 0;  // printable form

  virtual MemRegistration register_memory(void* ptr, size_t len, MemKind kind, int device) = 0;
  virtual void deregister(const MemRegistration& reg) = 0;

  virtual uint64_t insert_peer(const std::string& address) = 0;
  // Makes a peer's exported memory (MemRegistration::blob) writable from here; returns its address.
  virtual uint64_t import_remote(const std::string& blob) { (void)blob; return 0; }
  // Whether writes to this peer deliver their immediates themselves (else the engine signals them).
  virtual bool delivers_imm(uint64_t peer) const { (void)peer; return true; }

  // 0 when posted, -EAGAIN when the queue is full (poll and try again), another negative errno on error.
  virtual int post_write(const WriteRequest& req) = 0;
  // Appends up to `max` completions to `out`; returns how many were appended.
  virtual size_t poll(std::vector<Completion>& out, size_t max) = 0;
  // Sleeps until a completion may be ready, `signal()` is called, or `timeout_ms` passes.
  virtual void wait(int timeout_ms) = 0;
  // Wakes a concurrent `wait` (the only method another thread may call).
  virtual void signal() = 0;

  // Whether post_write honours WriteRequest::delivery_complete, and whether writes on one path are
  // placed at the target in the order they were posted (then a later write cannot overtake them).
  virtual bool delivery_complete() const { return true; }
  virtual bool orders_writes() const { return false; }

  // Tagged messages (fabric): whether the endpoint was opened with FI_TAGGED, and whether two sends on
  // one path are matched at the target in the order they were posted (FI_ORDER_SAS).
  virtual bool tagged() const { return false; }
  virtual bool orders_sends() const { return false; }
  // Posts a tagged receive of up to `len` bytes that matches any tag. 0, -EAGAIN or another -errno.
  virtual int post_recv(void* buf, size_t len, void* desc, void* context) {
    (void)buf, (void)len, (void)desc, (void)context;
    return -ENOSYS;
  }

  virtual uint64_t max_write() const = 0;       // largest single write the transport accepts
  virtual size_t max_outstanding() const = 0;   // operations it can hold in flight
  virtual std::string error_string(int err) const = 0;
};

}  // namespace weightsync
