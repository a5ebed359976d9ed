// The transfer engine: one per process (per GPU). It owns one worker thread per lane (LaneWorker: each
// NIC, and the cuda lane's copy engines), splits every large write into pieces striped across all NICs
// (core/pieces.hpp), routes pieces around NICs that fail, and counts completions: local ones per
// transfer, remote immediates per value (ImmCounters). Landing regions and host staging, the ways fabric
// peers reach GPU memory the NICs cannot register, are implemented in fabric/landing.cpp and
// fabric/staging.cpp.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
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

#include "core/announce.hpp"
#include "core/imm_counter.hpp"
#include "core/pieces.hpp"
#include "core/transfer.hpp"
#include "core/lane.hpp"

namespace weightsync {

class Engine;
class LaneWorker;  // core/lane_worker.hpp

// Everything an engine is opened with. The defaults here are the only ones: the binding exposes this
// struct as weightsync._ext.EngineConfig, and TransferEngine starts from a default-constructed one.
struct EngineConfig {
  std::string transport = "fabric";  // the lane policy: NIC lanes (plus the cuda lane if cuda_device >= 0)
  std::string provider;            // empty: pick automatically
  std::vector<std::string> nics;   // libfabric domain names; empty: all of the provider's
  uint64_t stripe_threshold = 1ull << 20;  // writes above this are split across all NICs
  uint64_t max_piece = 16ull << 20;        // no single posted write is larger
  uint64_t window_bytes = 64ull << 20;     // bytes in flight per NIC
  uint64_t window_ops = 256;               // operations in flight per NIC (capped by the provider)
  double stall_timeout_s = 5.0;  // a NIC path with work in flight and no completion for this long failed
  int cuda_device = -1;          // >= 0: add a cuda lane (copy engines) for same-host GPU peers
  // cuda lane: a 1-D write is cut into copies of this size (0: one copy per write), spread over
  // `cuda_streams` streams. Copy engines need no NIC-sized pieces; fewer, larger copies cost less.
  uint64_t cuda_piece = 0;  // one copy per write: each extra copy costs a launch and an event
  int cuda_streams = 1;
  // cuda lane: 1-D copies smaller than this, posted together, go to the driver as one batched copy of at
  // most this many bytes (0: one call per copy). The copy engines then skip their per-copy gap.
  uint64_t cuda_batch_bytes = 64ull << 20;
  // cuda lane: how long an idle worker keeps polling before it sleeps (a wake-up costs microseconds).
  double cuda_spin_us = 50.0;
  // GPU sources the NICs cannot register (no FI_HMEM) reach fabric peers through this many pinned host
  // slots of max_piece bytes: the copy of piece i+1 into a slot overlaps the network write of piece i.
  uint64_t staging_slots = 4;
  // Landing regions: GPU memory the fabric NICs cannot register (no FI_HMEM) is still a destination for
  // fabric peers. Writes into it arrive as tagged messages in a ring of `landing_slots` page-locked host
  // buffers of `landing_slot_bytes` (0: max_piece) per NIC, each copied to the GPU on the cuda lane,
  // its immediate counted once the copy is done, and the buffer posted again. The provider's flow
  // control (a large message waits for a posted receive) bounds what is in flight.
  uint64_t landing_slots = 8;
  uint64_t landing_slot_bytes = 0;
  // false: the cuda lane only stages and lands; peers on this host are written over the fabric NICs
  // (and this engine does not offer its cuda lane to them: see weightsync/engine.py).
  bool cuda_peers = true;
  // The engine key K (hex) that fabric peers must prove when they connect, on lanes that authenticate
  // connections (tcp: fabric/msg_lane.hpp). Derived from the group secret in Python (the secret never
  // reaches the engine); empty: peers without a key are accepted (a standalone engine).
  std::string auth_key;
};

// Switches that make host memory take the paths of GPU memory the NICs cannot register, so that tests
// run those paths on machines without GPUs. Never set in production: they are not part of EngineConfig
// (Python reaches them only through TransferEngine._for_tests).
struct TestHooks {
  // Host sources are kept off the NICs and staged like GPU memory (copied into the slots with memcpy).
  bool stage_host_sources = false;
  // Host regions are landing regions too (not registered on the NICs; the ring is malloc'd and copied
  // out with memcpy on the NIC's worker).
  bool land_host_regions = false;
  // The first `lose_imm_acks` writes carrying an immediate that complete at the writer are taken as
  // failed there (a path error, as when a link dies after the write landed but before its
  // acknowledgement came back): the write is retried on another NIC although its immediate arrived.
  uint32_t lose_imm_acks = 0;
  // This engine's writes carry their immediates as remote CQ data of the write itself, as before
  // announces (core/announce.hpp): no de-duplication. For benchmarks of what announces cost; the engine
  // still receives announces from others.
  bool cq_data_immediates = false;
  // A failed path's connection is not aborted when the path fails (as where a lane finds no socket of
  // its own to abort, or has no connections): its writes stay in flight, unresolved, until the drain
  // time runs out (LaneWorker::settle_draining).
  bool no_path_abort = false;
};

// What keeps a region's registrations (NIC MRs, its entry in the live table of the cuda lane) and its
// memory alive: the region until it is deregistered, and every piece still reading from it (queued, in
// the provider, or superseded but not yet released by it). The last one releases.
struct RegistrationHold {
  std::weak_ptr<Engine> engine;
  uint64_t id = 0;
  std::vector<MemRegistration> regs;
  int landing = -1;  // the region's landing index, retired with it
  // The owner of the memory (the binding: a reference to the Python buffer, whose deleter never
  // touches Python on a worker thread). Dropped only after the registrations are released, so neither
  // the caller dropping its last reference nor a timed-out wait can free memory a NIC still reads.
  std::shared_ptr<void> owner;
  ~RegistrationHold();
};

// Memory registered on every NIC of the engine.
struct LocalRegion {
  uint64_t id = 0;
  void* ptr = nullptr;
  uint64_t len = 0;
  MemKind kind = MemKind::kHost;
  int device = -1;
  std::vector<MemRegistration> regs;  // one per NIC (fabric NICs first, then the cuda lane)
  size_t fabric_nics = 0;
  bool on_fabric = true;  // false: GPU memory the fabric NICs could not register (no FI_HMEM)
  std::string fabric_error;
  // >= 0: a landing region (see EngineConfig::landing_slots): fabric peers write into it with tagged
  // messages of at most landing_slot_bytes, tagged (landing << 48) | offset. Its fabric registrations
  // (`regs`, the descriptor's keys) are then those of a few guard bytes of host memory, closed when the
  // region is deregistered, so that a writer finds out (see Engine::post_ops).
  int landing = -1;
  uint64_t landing_slot_bytes = 0;
  std::atomic<bool> valid{true};
  std::shared_ptr<Engine> engine;  // registrations are released through the engine's workers
  // Null once deregistered. Pieces take their own reference (pin) while the region is valid.
  std::shared_ptr<RegistrationHold> pin() {
    std::lock_guard<std::mutex> lock(hold_mu);
    return hold;
  }
  std::mutex hold_mu;
  std::shared_ptr<RegistrationHold> hold;
};

// A remote engine, reachable through each of our NICs (local NIC i talks to its NIC i mod M).
struct Peer {
  uint64_t id = 0;
  std::string uid;    // the remote engine's identity (hex)
  std::string label;  // printable, for error messages
  std::vector<uint64_t> paths;     // lane-level peer handle per lane (insert_peer)
  // paths[0, nic_paths) go through our NICs; a cuda lane's comes after them. Its path_failed entry only
  // says whether copy engines reach the peer (set at connect for a peer on another host or GPU-less),
  // which is no NIC failure: what reports failed NIC paths reads the first nic_paths entries.
  size_t nic_paths = 0;
  std::vector<int> remote_nic;     // remote NIC paired with local NIC i
  // Per lane: whether the path through it failed (writes move to the other NICs; a probe restores
  // it), and when it last completed a write (steady-clock ns): a stalled path is taken for failed only
  // while another path to the same peer made progress (then the NIC, not the peer, is the problem).
  std::unique_ptr<std::atomic<bool>[]> path_failed;
  std::unique_ptr<std::atomic<int64_t>[]> path_progress_ns;
  // Per NIC: bytes of data pieces placed on it for this peer and not finished yet (Engine::place). A
  // piece goes to the least loaded healthy NIC, so a peer's bytes split evenly over its NICs whatever
  // else turns the engine's counters, and a slower NIC gets less.
  std::unique_ptr<std::atomic<int64_t>[]> nic_load;
  size_t remote_nics = 0;
  bool cuda = false;                 // same host, both engines have a cuda lane
  bool cuda_imm = false;             // the cuda lane delivers immediates itself (shared-memory ring)
  std::vector<uint64_t> doorbell_base, doorbell_key;  // per remote NIC: where copy completions signal
  std::mutex mu;
  std::string last_error;
  // Ids of the announces of pieces to this peer (core/announce.hpp): the last one handed out.
  std::atomic<uint64_t> announces{0};
};

// Memory of a peer we may write into, from its descriptor.
struct RemoteRegion {
  std::shared_ptr<Peer> peer;
  uint64_t id = 0;
  uint64_t len = 0;
  std::vector<uint64_t> base;  // per remote NIC
  std::vector<uint64_t> key;   // per remote NIC
  uint64_t cuda_addr = 0;      // mapped through CUDA IPC on our cuda lane (0: not reachable that way)
  int landing = -1;            // >= 0: a landing region; base/key are then its guard's
  uint64_t slot_bytes = 0;     // landing region: largest message its receive buffers take
};

struct Piece;

// The pieces of one write that deliver a single immediate between them (2-D writes; cuda-lane writes cut
// into several copies): none carries the immediate; once all completed, the trailer (a zero-length write
// carrying it) is posted. Fabric pieces of a group complete at delivery, so the trailer cannot overtake
// their bytes.
struct PieceGroup {
  explicit PieceGroup(uint64_t n) : remaining(n) {}
  ~PieceGroup();
  std::atomic<uint64_t> remaining;
  std::atomic<bool> failed{false};
  Piece* trailer = nullptr;  // owned until posted
};

// One posted write (a piece of a transfer). The lane's context must be the first member.
struct Piece {
  LaneContext tctx;
  std::shared_ptr<TransferState> transfer;
  std::shared_ptr<LocalRegion> src;
  std::shared_ptr<RegistrationHold> pin;  // the source's registrations stay until this piece is done
  uint64_t src_off = 0;
  std::shared_ptr<RemoteRegion> dst;
  uint64_t dst_off = 0;
  uint64_t len = 0;
  bool has_imm = false;
  uint32_t imm = 0;
  uint32_t imm_repeat = 1;  // cuda lane: immediates pushed for this copy (the write's whole count)
  uint64_t rows = 1, src_pitch = 0, dst_pitch = 0;  // cuda lane: a 2-D copy (fabric posts rows singly)
  bool delivery = false;  // fabric: complete only once placed at the target (a trailer announces it)
  std::shared_ptr<PieceGroup> group;
  // Staged source (GPU memory off the NICs): 1 while copied into its slot, 2 while sent from it.
  int stage = 0;
  int stage_slot = -1;
  void* stage_ptr = nullptr;
  int nic = -1;
  uint64_t signals = 0;  // cuda lane: immediates to deliver over a fabric NIC once the copy is done
  bool stale = false;  // given up (engine closed, outcome unknown, an unanswered probe): completion ignored
  uint64_t seq = 0;     // its place in its peer's queue on the worker it is queued on (posting order)
  int conn_errors = 0;  // times its connection was dropped under it (a peer that keeps refusing it)
  bool tagged = false;  // into a landing region: a tagged message, not an RMA write
  int fixed_nic = -1;   // landing: every message of the op on this NIC (send order = landing order)
  bool probe = false;   // a zero-length write into a peer's doorbell that tests a failed path (no transfer)
  // Exactly-once immediates (core/announce.hpp): the immediate goes as an announce after the bytes.
  bool announce = false;   // set when first posted on a NIC that announces
  bool data_done = false;  // its bytes are placed (or it has none): only the announce is left
  uint64_t announce_id = 0;  // its name's piece id, kept across retries (0: none yet)
  int announce_slot = -1;    // the send buffer of its announce on the worker it is posted on
  uint64_t posted_len = 0;   // bytes it holds of its NIC's window while posted
  int load_nic = -1;         // the NIC whose Peer::nic_load counts its bytes (Engine::place), -1: none
  uint64_t load_bytes = 0;
  uint64_t announce_span = 0;  // landing: the bytes from dst_off its announce stands for
};

struct LaneStats {
  std::string name;
  std::string provider;
  uint64_t bytes_completed = 0;
  uint64_t writes_completed = 0;
  uint64_t imm_received = 0;
  uint64_t imm_duplicates = 0;  // announces of pieces already counted (retried after a lost ack): dropped
  uint64_t errors = 0;
  uint64_t rerouted = 0;
  uint64_t failed_paths = 0;    // paths marked failed (cumulative)
  uint64_t restored_paths = 0;  // failed paths a probe found working again (cumulative)
  uint64_t in_flight = 0;
  uint64_t landed = 0;           // messages copied into landing regions
  uint64_t landed_bytes = 0;
  uint64_t landing_dropped = 0;  // messages for a landing region that was gone, or out of its bounds
  uint64_t auth_refused = 0;     // connection requests refused for want of a valid key proof
};

// One write of a batch. rows > 1 makes it 2-D: `rows` rows of `len` bytes, the rows `src_pitch` and
// `dst_pitch` bytes apart (0: `len`, rows back to back). A 2-D write delivers exactly one immediate on
// every lane, whatever its size; a 1-D write delivers one per piece (Engine::imm_count).
struct WriteOp {
  uint32_t src;     // index into the batch's local regions
  uint64_t src_off;
  uint32_t dst;     // index into the batch's remote regions
  uint64_t dst_off;
  uint64_t len;
  uint32_t imm;
  uint64_t rows = 1;
  uint64_t src_pitch = 0;
  uint64_t dst_pitch = 0;
};

// A write the engine posts by itself once immediates have arrived (relays: forward a chunk as soon as
// it landed, from a worker thread, without Python).
struct Trigger {
  uint64_t id = 0;
  uint32_t imm = 0;
  uint64_t count = 0;  // fires when the counter's total for `imm` reaches this
  std::vector<std::shared_ptr<LocalRegion>> srcs;
  std::vector<std::shared_ptr<RemoteRegion>> dsts;
  std::vector<WriteOp> ops;
  bool has_imm = false;
  std::shared_ptr<TransferState> transfer;  // its one extra pending piece stands for "not fired yet"
};

class Engine : public std::enable_shared_from_this<Engine> {
 public:
  static constexpr double kCommandTimeoutS = 30.0;  // longest a command on a lane's worker may take
  static std::shared_ptr<Engine> create(const EngineConfig& cfg, const TestHooks& hooks = {});
  ~Engine();
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  const std::string& uid() const { return uid_; }
  std::string provider() const;
  std::string transport_kind() const;
  std::vector<std::string> nic_names() const;
  std::vector<std::string> nic_addresses() const;
  size_t num_nics() const { return fabric_nics_; }
  std::string cuda_address() const;
  std::string cuda_name() const;
  std::vector<uint64_t> doorbell_bases() const;
  std::vector<uint64_t> doorbell_keys() const;
  // The configuration in force: the one given, with the choices the lanes made (provider, NICs) and
  // the clamps applied (max_piece to what every NIC accepts, stripe_threshold to max_piece).
  const EngineConfig& config() const { return cfg_; }
  const TestHooks& test_hooks() const { return hooks_; }
  // TestHooks::lose_imm_acks: whether this completion of a write carrying an immediate is to be lost.
  bool take_lost_ack() {
    if (hooks_.lose_imm_acks == 0) return false;
    uint32_t left = lost_acks_left_.load();
    while (left > 0 && !lost_acks_left_.compare_exchange_weak(left, left - 1)) {
    }
    return left > 0;
  }
  // Per lane, NIC lanes first: its type name and what it can do.
  std::vector<std::pair<std::string, LaneCaps>> lane_caps() const;
  // How the fabric NICs make a 2-D write's immediate follow its rows: "delivery" (rows complete at
  // delivery, FI_DELIVERY_COMPLETE), "ordered" (all on one NIC, writes placed in order) or "" (neither:
  // 2-D writes with an immediate are refused).
  std::string two_d_mode() const {
    return fabric_delivery_complete_ ? "delivery" : fabric_ordered_ ? "ordered" : "";
  }

  // internal: the engine's own buffers (doorbell, staging slots), always registered on the NICs.
  // `owner` (may be null) keeps the memory alive for as long as any piece reads from it.
  std::shared_ptr<LocalRegion> register_memory(void* ptr, uint64_t len, MemKind kind, int device,
                                               bool internal = false, std::shared_ptr<void> owner = {});
  void deregister(const std::shared_ptr<LocalRegion>& region);

  std::shared_ptr<Peer> connect(const std::string& uid, const std::string& provider,
                                const std::vector<std::string>& addresses, const std::string& cuda_address,
                                const std::vector<uint64_t>& doorbell_base,
                                const std::vector<uint64_t>& doorbell_key);
  // landing >= 0: a landing region of the peer, written with messages of at most slot_bytes.
  std::shared_ptr<RemoteRegion> import_region(const std::shared_ptr<Peer>& peer, uint64_t id, uint64_t len,
                                              const std::vector<uint64_t>& base,
                                              const std::vector<uint64_t>& key, const std::string& cuda_blob,
                                              int landing = -1, uint64_t slot_bytes = 0);

  // Immediates a write of `nbytes` (per row) delivers: PieceRule::imm_count with this engine's NIC
  // count and (clamped) stripe_threshold and max_piece.
  uint64_t imm_count(uint64_t nbytes, bool has_imm, uint64_t rows = 1) const;
  PieceRule piece_rule() const;

  std::shared_ptr<TransferState> write(const std::vector<std::shared_ptr<LocalRegion>>& srcs,
                                       const std::vector<std::shared_ptr<RemoteRegion>>& dsts,
                                       const WriteOp* ops, size_t n, bool has_imm);

  // Registers `ops` to be written once the total of immediates `imm` received here (consumed or not)
  // reaches `count`; at once if it already has. Validated now and again when it fires. Returns the
  // trigger's id and the transfer of the write it will post (failed if cancelled or closed first).
  std::pair<uint64_t, std::shared_ptr<TransferState>> forward(
      uint32_t imm, uint64_t count, const std::vector<std::shared_ptr<LocalRegion>>& srcs,
      const std::vector<std::shared_ptr<RemoteRegion>>& dsts, const WriteOp* ops, size_t n, bool has_imm);
  // Cancels one trigger (id != 0), those of one immediate (all_of_imm) or all; returns how many.
  size_t cancel_forwards(uint64_t id, bool by_imm, uint32_t imm);
  size_t pending_forwards();
  bool forward_pending(uint64_t id);

  ImmCounters& counters() { return counters_; }
  // Sets the engine key (hex; see EngineConfig::auth_key) on every NIC lane, for connections set up from
  // now on: an engine made before its group was known (a user's own engine) gets its group's key here.
  void set_auth_key(const std::string& hex);
  std::vector<LaneStats> stats();
  void close();
  bool closed() const { return closed_.load(); }

  // The engine's doorbell (target and source of zero-length writes: signals, trailers, path probes).
  const std::shared_ptr<LocalRegion>& doorbell() const { return doorbell_; }
  // Called by workers.
  void piece_done(Piece* p, int nic);
  // Routes a piece whose path (nic, peer) failed to another NIC, or fails it when none is left.
  void reroute(Piece* p, int failed_nic, const std::string& why);
  void piece_failed(Piece* p, const std::string& why);
  // A piece whose outcome cannot be learnt (still in the provider on a failed path that could not be
  // aborted): its transfer fails now, without a retry (a retry could be counted twice, and the original
  // could land after it); the piece itself stays with the worker until the provider releases it.
  void abandon(Piece* p, const std::string& why);
  // The provider released an abandoned piece: its staging slot (if any) is free again, the piece goes.
  void release_abandoned(Piece* p);
  // `owner` goes with the last deregistration command, so the memory outlives its registrations.
  void release_region(uint64_t id, std::vector<MemRegistration> regs, int landing = -1,
                      std::shared_ptr<void> owner = {});
  // A tagged receive of NIC `nic` completed into `buf` (its landing ring's buffer `slot`): check it and
  // copy it into its landing region. true: done with the buffer now (copied, or dropped); false: a copy
  // on the cuda lane is under way, and the engine calls LaneWorker::landing_done when it is over.
  bool land(int nic, uint32_t slot, const char* buf, const Completion& c);
  // The tag of a message into landing region `index` at byte `off` (land() takes it apart).
  static uint64_t landing_tag(int index, uint64_t off) {
    return ((uint64_t(index) & ((1ull << kLandingIndexBits) - 1)) << kLandingOffsetBits) | off;
  }
  // A landing tag's region index and byte offset (the inverse of landing_tag).
  static uint64_t landing_index(uint64_t tag) {
    return (tag >> kLandingOffsetBits) & ((1ull << kLandingIndexBits) - 1);
  }
  static uint64_t landing_offset(uint64_t tag) { return tag & ((1ull << kLandingOffsetBits) - 1); }
  // The tag of the announce of a piece written into landing region `index` (core/announce.hpp).
  static uint64_t landing_announce_tag(int index, uint64_t off) {
    return kLandingAnnounceBit | landing_tag(index, off);
  }
  // Whether fabric pieces carry their immediates as announces (core/announce.hpp): every NIC sends
  // tagged messages and completes writes at delivery. Else as remote CQ data of the write itself.
  bool announces() const { return announces_; }
  // The name this engine gives its pieces for `peer` (piece id left 0).
  AnnounceName announce_name(const Peer& peer) const { return AnnounceName{uid_hi_, uid_lo_, peer.id, 0}; }
  // An announce arrived: counts its immediate unless that piece was counted already (false then).
  bool announced(const AnnounceName& name, uint32_t imm) {
    if (!dedup_.first(name)) return false;
    counters_.add(imm);
    return true;
  }
  // land() for a message of data, or an announce that was counted first (as an empty message).
  bool land_message(int nic, uint32_t slot, const char* buf, const Completion& c);
  // The cuda lane finished (ok) or failed a landing copy started by land().
  void landing_copied(void* job, bool ok, const std::string& why);

 private:
  Engine(const EngineConfig& cfg, const TestHooks& hooks);
  void start();
  uint64_t piece_size(uint64_t nbytes) const;
  int pick_nic(Peer& peer, uint64_t hint);
  // A data piece's NIC: the healthy one with the least of the peer's bytes placed and not finished
  // (ties: from `hint` on); charges the piece's bytes to it. -1: none healthy.
  int place(Piece* p, uint64_t hint);
  // The piece's bytes leave the NIC load they were charged to (place): it is done, failed, abandoned,
  // or about to be placed again.
  void unload(Piece* p);
  void send_signals(Piece* copy);
  void group_member_done(Piece* p, bool ok);
  void post_trailer(Piece* t);
  // One piece of `op` (the caller sets what differs by lane).
  static Piece* new_piece(const WriteOp& op, const std::shared_ptr<TransferState>& transfer,
                          const std::shared_ptr<LocalRegion>& src, const std::shared_ptr<RegistrationHold>& pin,
                          const std::shared_ptr<RemoteRegion>& dst, uint64_t src_off, uint64_t dst_off,
                          uint64_t len);
  // The zero-length piece that carries `op`'s immediate after its other pieces (read from the doorbell).
  Piece* trailer_piece(const WriteOp& op, const std::shared_ptr<TransferState>& transfer,
                       const std::shared_ptr<RemoteRegion>& dst, uint64_t dst_off);
  // The pieces of one op, appended per lane; `pins` holds the batch's source pins.
  void make_pieces(const WriteOp& op, const std::shared_ptr<TransferState>& transfer,
                   const std::shared_ptr<LocalRegion>& src, const std::shared_ptr<RegistrationHold>& pin,
                   const std::shared_ptr<RemoteRegion>& dst, bool has_imm,
                   std::vector<std::vector<Piece*>>& per_nic);
  // The copy lane's host/device copies (LaneCaps::local_copies), or null without one.
  LocalCopies* local_copies();
  struct Checked {
    std::vector<std::shared_ptr<RegistrationHold>> pins;
    uint64_t imms = 0, bytes = 0;
    std::string what;
  };
  Checked check_ops(const std::vector<std::shared_ptr<LocalRegion>>& srcs,
                    const std::vector<std::shared_ptr<RemoteRegion>>& dsts, const WriteOp* ops, size_t n,
                    bool has_imm);
  void post_ops(const std::shared_ptr<TransferState>& transfer, const Checked& checked,
                const std::vector<std::shared_ptr<LocalRegion>>& srcs,
                const std::vector<std::shared_ptr<RemoteRegion>>& dsts, const WriteOp* ops, size_t n,
                bool has_imm);
  void on_immediate(uint32_t imm, uint64_t total);
  // Staging of sources the NICs cannot read (see EngineConfig::staging_slots).
  // Host memory for the engine's own buffers (staging slots, landing ring), registered on every NIC:
  // page-locked through the cuda lane where there is one, else malloc'd (*pinned says which).
  std::shared_ptr<LocalRegion> register_host_buffer(uint64_t bytes, const char* what, char** base, bool* pinned);
  // Counts a landing message that was not written (on NIC `w`) and logs the first few (core/log.hpp).
  void landing_dropped(LaneWorker& w, uint64_t len, const std::string& what);
  // landing_dropped for landing message `c`, naming its region and offset (from its tag) and NIC; true.
  bool drop_landing(LaneWorker& w, const Completion& c, const std::string& why);
  void ensure_staging();
  void stage(std::vector<Piece*> pieces);
  void pump_staging();
  void send_staged(Piece* p);
  void release_slot(Piece* p);
  void fire(const std::shared_ptr<Trigger>& t);
  // Landing regions (see EngineConfig::landing_slots).
  void ensure_landing();
  void make_landing(LocalRegion& region);
  // Takes a landing index out of service: messages for it are dropped from now on. With `wait`, copies
  // into the region already under way are waited for (bounded), so its memory may be freed afterwards.
  void retire_landing(int index, uint64_t region_id, bool wait);
  void make_landing_pieces(const WriteOp& op, const std::shared_ptr<TransferState>& transfer,
                           const std::shared_ptr<LocalRegion>& src, const std::shared_ptr<RegistrationHold>& pin,
                           const std::shared_ptr<RemoteRegion>& dst, bool has_imm,
                           std::vector<std::vector<Piece*>>& per_nic);

  EngineConfig cfg_;
  TestHooks hooks_;
  std::atomic<uint32_t> lost_acks_left_{0};
  std::string uid_;
  std::vector<std::unique_ptr<LaneWorker>> workers_;  // fabric NICs, then the cuda lane if any
  size_t fabric_nics_ = 0;
  int cuda_lane_ = -1;
  std::vector<unsigned char> doorbell_mem_ = std::vector<unsigned char>(64);
  std::shared_ptr<LocalRegion> doorbell_;  // target of zero-length writes that carry copy completions
  ImmCounters counters_;
  AnnounceDedup dedup_;  // the pieces counted, by name (core/announce.hpp)
  bool announces_ = false;      // our pieces' immediates go as announces
  bool announce_ring_ = false;  // we receive announces (every NIC tagged and delivery-complete)
  uint64_t uid_hi_ = 0, uid_lo_ = 0;  // uid_ as 128 bits, for announces
  std::atomic<bool> closed_{false};
  bool fabric_delivery_complete_ = true;  // every NIC can complete a write at delivery
  bool fabric_ordered_ = true;            // every NIC places the writes of one path in order
  bool fabric_tagged_ = true;             // every NIC sends tagged messages (can write landing regions)
  bool fabric_sends_ordered_ = true;      // ... and matches a path's messages in posting order
  std::atomic<uint64_t> next_region_{1}, next_peer_{1}, rr_{0};
  struct StagingPool {
    std::mutex mu;
    char* base = nullptr;
    uint64_t slot_bytes = 0;
    bool pinned = false;  // cuMemHostAlloc'd (else malloc'd, tests)
    std::shared_ptr<LocalRegion> region;
    std::shared_ptr<RegistrationHold> pin;
    std::vector<int> free;
    std::deque<Piece*> waiting;
  };
  std::mutex staging_init_mu_;
  std::unique_ptr<StagingPool> staging_;
  std::atomic<bool> staging_ready_{false};
  std::mutex triggers_mu_;
  std::unordered_multimap<uint32_t, std::shared_ptr<Trigger>> triggers_;  // by immediate
  std::atomic<size_t> trigger_count_{0};  // lets on_immediate skip the lock when there are none
  std::atomic<uint64_t> next_trigger_{1};
  std::mutex regions_mu_;
  std::unordered_map<uint64_t, std::vector<MemRegistration>> live_regions_;
  // Landing regions by index (14 bits in a message's tag). An index is reused only after all others
  // were handed out since (round robin), so a message late for a retired region is all but certain
  // to find its index empty rather than another region's.
  struct LandingEntry {
    std::mutex mu;
    std::condition_variable cv;
    bool valid = true;
    char* ptr = nullptr;
    uint64_t len = 0;
    MemKind kind = MemKind::kHost;
    uint64_t region_id = 0;
    uint64_t copies = 0;  // cuda-lane copies into it under way (retiring waits for them)
  };
  // A landed message on its way to GPU memory: the copy lane copies it from the ring buffer, then the
  // engine counts its immediate and gives the buffer back to its NIC.
  struct LandingJob {
    int nic = -1;
    uint32_t slot = 0;
    std::shared_ptr<LandingEntry> entry;
    uint64_t len = 0;
    uint64_t off = 0;
    bool has_imm = false;
    uint32_t imm = 0;
  };
  std::atomic<uint64_t> landing_drops_logged_{0};
  // 14 bits of a message's tag (core/announce.hpp: bits 63 and 62 tell announces from data).
  static constexpr uint32_t kLandingIndices = 1u << kLandingIndexBits;
  std::mutex landing_mu_;
  std::vector<std::shared_ptr<LandingEntry>> landing_;  // by index; null: free
  uint32_t landing_next_ = 0;
  uint32_t landing_live_ = 0;
  std::mutex landing_init_mu_;
  bool landing_ready_ = false;
  char* landing_base_ = nullptr;  // fabric_nics_ rings of landing_slots x landing slot bytes
  bool landing_pinned_ = false;
  std::shared_ptr<LocalRegion> landing_region_;
  std::unique_ptr<unsigned char[]> landing_guard_;  // 8 guard bytes per landing index
  std::shared_ptr<LandingEntry> landing_entry(uint64_t index);
  // Per fabric NIC (touched by its worker alone), per landing index: offsets of data messages that ring
  // dropped as the writer's mistake (too long, out of bounds). The announce of a piece spanning one of
  // them is dropped with it (and the offset forgotten). At most kMaxVoided per index (oldest go first).
  std::vector<std::unordered_map<uint64_t, std::deque<uint64_t>>> landing_voided_;
  static constexpr size_t kMaxVoided = 1024;
  void void_landing(int nic, uint64_t index, uint64_t off);
};

}  // namespace weightsync
