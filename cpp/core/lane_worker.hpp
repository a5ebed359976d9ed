// The worker of one lane (a NIC, or the copy engines): the thread that alone posts to and polls it, the
// queues other threads reach it through, and what it keeps per path (queues, failed paths and their
// probes, the landing and announce rings).
#pragma once

#include <atomic>
#include <chrono>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

#include "core/engine.hpp"
#include "core/lane.hpp"

namespace weightsync {

// Owns one lane (a NIC, or the copy engines) and the thread that alone touches it. Everything reaches
// the worker through its queues: commands (register, add peer) and pieces to post.
class LaneWorker {
 public:
  LaneWorker(Engine* engine, int index, std::unique_ptr<Lane> lane, const EngineConfig& cfg);
  ~LaneWorker();

  void start();
  // Stops the thread; pieces still queued or in flight fail with "engine closed".
  void stop();

  // Runs `fn` on the worker thread and waits for it (bounded by timeout_s).
  void call(const std::function<void(Lane&)>& fn, double timeout_s);
  // Queues a command without waiting for it (releasing registrations from a destructor).
  void post_command(std::function<void(Lane&)> fn);
  void submit(std::vector<Piece*> pieces);

  Lane& lane() { return *lane_; }
  LaneStats stats();

  // The landing ring of a fabric NIC (on this worker's thread only): `count` receive buffers of
  // `slot_bytes` at `base`, posted now and again each time the engine is done with one.
  void start_landing(char* base, uint64_t slot_bytes, uint32_t count, void* desc);
  // The engine is done with buffer `slot` (its copy finished or it was dropped); on this worker's thread.
  void landing_done(uint32_t slot);
  void count_landed(uint64_t bytes, bool imm) {
    landed_++;
    landed_bytes_ += bytes;
    if (imm) imm_received_++;
  }
  void count_dropped() { landing_dropped_++; }
  void count_duplicate() { imm_duplicates_++; }
  // The announce ring (core/announce.hpp): receives for announces of RMA pieces, posted on this NIC's
  // worker; throws TransportError if they cannot be.
  void start_announces();

 private:
  void run();
  struct PeerQueue;
  void post_pending();
  // Posts from one peer's queue until it is empty, refused (EAGAIN, back-off) or the window is full;
  // false when the window is full.
  bool post_queue(PeerQueue& q, std::chrono::steady_clock::time_point now);
  void enqueue(Piece* p);
  void mark_ready(uint64_t peer_id, PeerQueue& q);
  void forget_if_idle(uint64_t peer_id);
  bool window_full(uint64_t next_len) const;
  // Whether another NIC's path to `peer` completed a write within the stall timeout.
  bool sibling_progressed(const Peer& peer, std::chrono::steady_clock::time_point now) const;
  void handle(const Completion& c);
  void fail_path(Peer* peer, const std::string& why);
  // The writes still draining on a failed path with no NIC left to retry on: their transfers fail.
  void abandon_draining(uint64_t peer_id, PeerQueue& q, const std::string& why);
  // The writes still draining on a failed path when its drain time ran out: the path's connection is
  // closed for good (Lane::close_path), then each is posted again on another NIC, the same piece (or, one
  // the provider has not handed back, a copy of it with the same announce name); where the lane has no
  // connection to close, they stay with the provider until it returns them.
  void settle_draining(uint64_t peer_id);
  void check_stalls();
  void shutdown_pieces();
  void landing_received(const Completion& c);
  void drain_landing();
  void announce_received(const Completion& c);
  void repost_announces();
  // A send buffer for one announce (registered on this lane): its index, or -1 if none can be had.
  int take_announce_slot();
  void release_announce_slot(Piece* p);
  // Fills `req` with `p`'s announce (its bytes are placed); false if no send buffer could be had.
  bool build_announce(Piece* p, WriteRequest& req);

  Engine* engine_;
  int index_;
  LaneCaps caps_;  // what the lane can do (asked once)
  std::unique_ptr<Lane> lane_;
  uint64_t window_bytes_;
  uint64_t window_ops_;
  std::chrono::duration<double> stall_timeout_;

  std::mutex mu_;
  std::vector<std::function<void(Lane&)>> commands_;
  std::vector<Piece*> incoming_;
  bool stop_ = false;
  std::thread thread_;

  // Worker-thread state. One FIFO per peer (a path is (peer, this NIC)): every ordering the engine
  // relies on is per path, and a peer the provider keeps refusing (EAGAIN while it cannot connect) or
  // that stalls holds back only its own queue, never another peer's writes.
  struct PeerQueue {
    Peer* peer = nullptr;  // kept alive by the pieces queued or in flight to it
    std::shared_ptr<Peer> ref;   // ... and by this, for a path that fails (probed afterwards)
    std::deque<Piece*> pending;  // in `seq` order
    uint64_t outstanding = 0;
    std::chrono::steady_clock::time_point progress{};       // last completion (or first post after idle)
    std::chrono::steady_clock::time_point blocked_since{};  // its head refused with EAGAIN since
    std::chrono::steady_clock::time_point retry_at{};       // no post before this (back-off)
    int eagain_streak = 0;
    int conn_errors = 0;  // connections dropped since the last success: while > 0, one write at a time
    // The path failed with writes in flight: they drain (each completes, or comes back as an error and
    // is posted again elsewhere) until this deadline; whatever is still out then is settled
    // (settle_draining).
    std::chrono::steady_clock::time_point drain_deadline{};
    bool ready = false;   // listed in ready_
  };
  std::unordered_map<uint64_t, PeerQueue> queues_;  // by peer id
  std::deque<uint64_t> ready_;                       // peers with queued pieces, served round robin
  uint64_t next_seq_ = 1;
  std::unordered_set<Piece*> outstanding_;
  std::vector<Piece*> stale_;  // given-up pieces the provider may still complete
  uint64_t outstanding_bytes_ = 0;
  std::chrono::steady_clock::time_point last_stall_check_{};

  // Landing ring (fabric NICs). Receives match messages in the order they were posted, and buffers
  // are handed to the engine and posted again strictly in that order: the engine then sees a path's
  // messages in the order they were sent (FI_ORDER_SAS), even where a large message completes later
  // than a small one behind it.
  struct LandingBuf {
    LaneContext tctx;
    uint32_t slot = 0;
    enum State { kPosted, kReceived, kBusy, kDone } state = kPosted;
    Completion c;
  };
  char* land_base_ = nullptr;
  uint64_t land_slot_bytes_ = 0;
  void* land_desc_ = nullptr;
  std::vector<std::unique_ptr<LandingBuf>> land_bufs_;
  std::deque<uint32_t> land_posted_;  // posted, in posting order (= matching order)
  std::deque<uint32_t> land_busy_;    // handed to the engine, in order; posted again from the front
  std::deque<uint32_t> land_repost_;  // refused with EAGAIN: posted again first, in order

  // Announces (core/announce.hpp): this NIC's ring of receives for them, and the registered buffers its
  // own announces are sent from (one per announce in flight, more registered as needed).
  struct AnnounceRecv {
    LaneContext tctx;
    unsigned char* buf = nullptr;
    void* desc = nullptr;
  };
  static constexpr size_t kAnnounceRecvs = 256;
  static constexpr size_t kAnnounceSlotBytes = 64;
  static constexpr size_t kAnnounceChunk = 256;  // send buffers registered at a time
  std::vector<std::unique_ptr<AnnounceRecv>> ann_recvs_;
  std::unordered_set<void*> ann_recv_ctx_;
  std::deque<AnnounceRecv*> ann_repost_;  // refused with EAGAIN: posted again with the next completion
  std::vector<std::unique_ptr<unsigned char[]>> ann_mem_;
  std::vector<MemRegistration> ann_regs_;
  std::vector<std::pair<unsigned char*, void*>> ann_slots_;  // every send buffer and its descriptor
  std::vector<int> ann_free_;
  unsigned char* register_announce_chunk(size_t count, void** desc);

  std::atomic<uint64_t> bytes_completed_{0}, writes_completed_{0}, imm_received_{0}, imm_duplicates_{0}, errors_{0},
      rerouted_{0}, failed_paths_{0}, restored_paths_{0}, in_flight_{0}, landed_{0}, landed_bytes_{0},
      landing_dropped_{0};
  // Failed paths of this NIC, probed with back-off until one answers (then restored). Holds the peer.
  struct FailedPath {
    std::shared_ptr<Peer> peer;
    std::chrono::steady_clock::time_point next_probe{};
    std::chrono::duration<double> backoff{0.5};
    Piece* probe = nullptr;  // in flight
    std::chrono::steady_clock::time_point probe_sent{};
  };
  std::unordered_map<uint64_t, FailedPath> failed_;  // by peer id
  void probe_failed_paths();
  void probe_answered(Piece* p, bool ok);
};

}  // namespace weightsync
