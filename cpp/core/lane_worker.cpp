// One thread per lane (a NIC, or the copy engines): it alone posts to and polls its lane. Other threads
// reach it through queues. What it does with a piece depends on what the lane can do (LaneCaps).
// A path that fails, and what becomes of its writes, is in core/path_health.cpp.
#include <cerrno>
#include <future>

#include "core/lane_worker.hpp"
#include "core/errors.hpp"
#include "core/log.hpp"

namespace weightsync {

namespace {
using Clock = std::chrono::steady_clock;
constexpr int kIdleWaitMs = 20;  // longest an idle worker sleeps before looking at its queues again
constexpr auto kStallCheckEvery = std::chrono::milliseconds(50);
}  // namespace

LaneWorker::LaneWorker(Engine* engine, int index, std::unique_ptr<Lane> lane,
                     const EngineConfig& cfg)
    : engine_(engine),
      index_(index),
      lane_(std::move(lane)),
      window_bytes_(cfg.window_bytes),
      window_ops_(std::max<uint64_t>(1, std::min<uint64_t>(cfg.window_ops, lane_->max_outstanding()))),
      stall_timeout_(cfg.stall_timeout_s) {
  caps_ = lane_->caps();
  if (caps_.unlimited_window) {
    // Copies queue on the GPU's own streams; the byte window that paces a NIC would only starve them.
    window_bytes_ = ~0ull >> 1;
    window_ops_ = lane_->max_outstanding();
  }
}

LaneWorker::~LaneWorker() {
  stop();
  // Announce buffers' registrations close with the lane still open (their memory goes after it).
  for (const MemRegistration& reg : ann_regs_) lane_->deregister(reg);
  ann_regs_.clear();
  // The lane (and its endpoint) goes first, so no completion can name a piece we free below.
  lane_.reset();
  for (Piece* p : stale_) delete p;
  for (auto& [id, f] : failed_) delete f.probe;
  failed_.clear();
  for (Piece* p : outstanding_) delete p;
  for (auto& [id, q] : queues_) {
    for (Piece* p : q.pending) delete p;
  }
  for (Piece* p : incoming_) delete p;
  stale_.clear();
  outstanding_.clear();
  queues_.clear();
  ready_.clear();
  incoming_.clear();
}

void LaneWorker::start() { thread_ = std::thread([this] { run(); }); }

void LaneWorker::stop() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (stop_ && !thread_.joinable()) return;
    stop_ = true;
  }
  if (lane_) lane_->signal();
  if (thread_.joinable()) thread_.join();
}

void LaneWorker::call(const std::function<void(Lane&)>& fn, double timeout_s) {
  auto done = std::make_shared<std::promise<void>>();
  auto fut = done->get_future();
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (stop_) throw TransportError("engine is closed (NIC " + lane_->nic_name() + ")");
    commands_.push_back([fn, done](Lane& t) {
      try {
        fn(t);
        done->set_value();
      } catch (...) {
        done->set_exception(std::current_exception());
      }
    });
  }
  lane_->signal();
  if (fut.wait_for(std::chrono::duration<double>(timeout_s)) != std::future_status::ready) {
    throw TimeoutError("NIC " + lane_->nic_name() + " worker did not answer within " +
                       std::to_string(timeout_s) + " s");
  }
  fut.get();
}

void LaneWorker::post_command(std::function<void(Lane&)> fn) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (stop_) return;
    commands_.push_back(std::move(fn));
  }
  lane_->signal();
}

void LaneWorker::submit(std::vector<Piece*> pieces) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!stop_) {
      incoming_.insert(incoming_.end(), pieces.begin(), pieces.end());
      pieces.clear();
    }
  }
  for (Piece* p : pieces) engine_->piece_failed(p, "engine is closed");
  lane_->signal();
}

LaneStats LaneWorker::stats() {
  LaneStats s;
  s.name = lane_->nic_name();
  s.provider = lane_->provider();
  s.bytes_completed = bytes_completed_.load();
  s.writes_completed = writes_completed_.load();
  s.imm_received = imm_received_.load();
  s.imm_duplicates = imm_duplicates_.load();
  s.errors = errors_.load();
  s.rerouted = rerouted_.load();
  s.failed_paths = failed_paths_.load();
  s.restored_paths = restored_paths_.load();
  s.in_flight = in_flight_.load();
  s.landed = landed_.load();
  s.landed_bytes = landed_bytes_.load();
  s.landing_dropped = landing_dropped_.load();
  s.auth_refused = lane_->auth_refused();
  return s;
}

void LaneWorker::run() {
  std::vector<std::function<void(Lane&)>> commands;
  std::vector<Piece*> incoming;
  std::vector<Completion> completions;
  completions.reserve(256);
  while (true) {
    bool stopping;
    lane_->arm();  // before looking: a signal from here on ends the wait below at once
    {
      std::lock_guard<std::mutex> lock(mu_);
      commands.swap(commands_);
      incoming.swap(incoming_);
      stopping = stop_;
    }
    for (auto& cmd : commands) cmd(*lane_);
    const bool had_work = !commands.empty() || !incoming.empty();
    commands.clear();
    for (Piece* p : incoming) enqueue(p);
    incoming.clear();
    if (stopping) break;

    const size_t before = outstanding_.size();
    if (!land_repost_.empty()) drain_landing();
    if (!ann_repost_.empty()) repost_announces();
    post_pending();
    completions.clear();
    lane_->poll(completions, 256);
    for (const Completion& c : completions) handle(c);

    auto now = Clock::now();
    if (caps_.is_nic && now - last_stall_check_ > kStallCheckEvery) {
      last_stall_check_ = now;
      check_stalls();
    }
    if (completions.empty() && !had_work && outstanding_.size() == before) {
      // Nothing happened: block in the provider until a completion, a signal, or a short timeout
      // (short while some peer's queue waits out a back-off).
      lane_->wait(ready_.empty() ? kIdleWaitMs : 1);
    }
  }
  shutdown_pieces();
}

void LaneWorker::enqueue(Piece* p) {
  const uint64_t id = p->dst->peer->id;
  PeerQueue& q = queues_[id];
  q.peer = p->dst->peer.get();
  if (!q.ref) q.ref = p->dst->peer;
  p->seq = next_seq_++;
  q.pending.push_back(p);
  mark_ready(id, q);
}

void LaneWorker::mark_ready(uint64_t peer_id, PeerQueue& q) {
  if (q.ready || q.pending.empty()) return;
  q.ready = true;
  ready_.push_back(peer_id);
}

void LaneWorker::forget_if_idle(uint64_t peer_id) {
  auto it = queues_.find(peer_id);
  if (it == queues_.end()) return;
  const PeerQueue& q = it->second;
  if (q.pending.empty() && q.outstanding == 0 && !q.ready && q.conn_errors == 0) queues_.erase(it);
}

bool LaneWorker::window_full(uint64_t next_len) const {
  return outstanding_.size() >= window_ops_ ||
         (outstanding_bytes_ > 0 && outstanding_bytes_ + next_len > window_bytes_);
}

void LaneWorker::post_pending() {
  const auto now = Clock::now();
  for (size_t n = ready_.size(); n > 0; --n) {
    const uint64_t id = ready_.front();
    ready_.pop_front();
    auto it = queues_.find(id);
    if (it == queues_.end()) continue;
    PeerQueue& q = it->second;
    q.ready = false;
    bool room = true;
    if (now >= q.retry_at) room = post_queue(q, now);
    if (!q.pending.empty()) {
      mark_ready(id, q);
    } else {
      forget_if_idle(id);
    }
    if (!room) return;  // the NIC's window is full: the rest wait for completions
  }
}

bool LaneWorker::post_queue(PeerQueue& q, Clock::time_point now) {
  while (!q.pending.empty()) {
    Piece* p = q.pending.front();
    if (p->transfer->failed() && !p->stale) {
      // Its transfer already failed for good: do not spend the link on it.
      q.pending.pop_front();
      engine_->piece_failed(p, p->transfer->error());
      continue;
    }
    // An announce holds no bytes of the window; its piece's bytes were placed already.
    const bool announcing = caps_.is_nic && p->has_imm && engine_->announces() && (p->data_done || p->len == 0);
    if (window_full(announcing ? 0 : p->len)) return false;
    // After a dropped connection, one write at a time until one succeeds: the piece the peer refuses
    // (and drops the connection over) then meets the new connection alone, not the writes behind it.
    if (q.conn_errors > 0 && q.outstanding > 0) return true;
    const Peer& peer = *p->dst->peer;
    if (caps_.is_nic && peer.path_failed[index_].load()) {
      q.pending.pop_front();
      rerouted_++;
      engine_->reroute(p, index_, "path already failed");
      continue;
    }
    WriteRequest req;
    req.src = static_cast<const char*>(p->src->ptr) + p->src_off;
    req.len = p->len;
    req.src_desc = p->src->regs[index_].local_desc;
    req.peer = peer.paths[index_];
    req.has_imm = p->has_imm;
    req.imm = p->imm;
    req.context = p;
    req.delivery_complete = p->delivery;
    if (p->stage == 1 && caps_.local_copies) {
      // A staging copy: device to this host's slot, for a NIC lane to send afterwards. 1-D, no immediate.
      req.remote_addr = reinterpret_cast<uint64_t>(p->stage_ptr);
      req.peer = 0;
      req.has_imm = false;
    } else if (caps_.maps_remote) {
      req.remote_addr = p->dst->cuda_addr + p->dst_off;
      req.geometry = RowGeometry{p->rows, p->src_pitch, p->dst_pitch};
      req.mapped = MappedTarget{p->imm_repeat, p->dst->id};
    } else if (p->tagged) {
      // Into a landing region: a message its engine copies to dst_off (both in the tag).
      req.tagged = TaggedSend{true, Engine::landing_tag(p->dst->landing, p->dst_off)};
    } else {
      const int rn = peer.remote_nic[index_];
      req.remote_addr = p->dst->base[rn] + p->dst_off;
      req.key = p->dst->key[rn];
    }
    if (caps_.is_nic && p->has_imm && engine_->announces()) {
      // Exactly once (core/announce.hpp): the bytes first, without the immediate; once they are placed,
      // the immediate as an announce naming the piece (handle() queues it again for that).
      p->announce = true;
      if (p->len == 0) p->data_done = true;
      if (!p->data_done) {
        req.has_imm = false;
      } else if (!build_announce(p, req)) {
        errors_++;
        q.pending.pop_front();
        engine_->piece_failed(p, "no buffer for its announce could be registered on NIC " + lane_->nic_name());
        continue;
      }
    }
    int rc = lane_->post_write(req);
    if (rc != 0) release_announce_slot(p);
    if (rc == -EAGAIN) {
      // Refused for now (queue full, or a connection still being made): this peer backs off briefly;
      // the others go on.
      if (q.blocked_since == Clock::time_point{}) q.blocked_since = now;
      const int shift = std::min(q.eagain_streak++, 7);
      q.retry_at = now + std::min<Clock::duration>(std::chrono::microseconds(50 << shift),
                                                     std::chrono::milliseconds(5));
      return true;
    }
    q.blocked_since = Clock::time_point{};
    q.eagain_streak = 0;
    q.pending.pop_front();
    if (rc != 0) {
      errors_++;
      if (!caps_.is_nic) {
        engine_->piece_failed(p, "copy into region " + std::to_string(p->dst->id) + " of " + peer.label +
                                     " could not start on " + lane_->nic_name() + ": " +
                                     lane_->error_string(-rc));
      } else {
        const std::string why = "posting failed: " + lane_->error_string(-rc);
        fail_path(p->dst->peer.get(), why);
        rerouted_++;
        engine_->reroute(p, index_, why);
      }
      continue;
    }
    p->nic = index_;
    p->posted_len = p->announce_slot >= 0 ? 0 : p->len;
    outstanding_.insert(p);
    outstanding_bytes_ += p->posted_len;
    in_flight_ = outstanding_.size();
    if (q.outstanding++ == 0) q.progress = now;
  }
  return true;
}

namespace {

constexpr int kTruncated = 265;  // FI_ETRUNC: a message longer than the receive buffer it matched

// How an error completion of a write is taken.
enum class ErrClass {
  kAccess,      // the target refused this write (bad key, out of bounds, too long): the same on every NIC
  kConnection,  // the connection under it was dropped or reset (possibly by the target, refusing the
                // write before it): the path is fine, the write is tried again on a new connection
  kPath,        // the path itself is broken (unreachable, timed out): the write moves to another NIC
};

ErrClass classify(int err) {
  switch (err) {
    case EACCES:
    case EINVAL:
    case EPERM:
    case EKEYREJECTED:
    case EMSGSIZE:
    case kTruncated:
      return ErrClass::kAccess;
    case EPIPE:
    case ECONNRESET:
    case ENOTCONN:
    case ECONNABORTED:
    case ECANCELED:
      return ErrClass::kConnection;
    default:
      return ErrClass::kPath;
  }
}

constexpr auto kReconnectDelay = std::chrono::milliseconds(20);  // lets the provider finish the disconnect

}  // namespace

void LaneWorker::handle(const Completion& completion) {
  const Completion* cp = &completion;
  Completion lost;
  if (completion.kind == Completion::kLocalDone && caps_.is_nic && completion.context != nullptr) {
    const Piece* done = static_cast<const Piece*>(completion.context);
    // The write that delivers the immediate: the announce where there is one, else the write itself.
    const bool delivers_imm = done->has_imm && (!done->announce || done->announce_slot >= 0);
    if (!done->probe && !done->stale && delivers_imm && engine_->take_lost_ack()) {
      // TestHooks::lose_imm_acks: the write landed, but the writer is told otherwise.
      lost = completion;
      lost.kind = Completion::kLocalError;
      lost.error = ETIMEDOUT;
      lost.message = "acknowledgement lost (test hook lose_imm_acks)";
      cp = &lost;
    }
  }
  const Completion& c = *cp;
  if (c.kind == Completion::kRecv) {
    if (ann_recv_ctx_.count(c.context) != 0) {
      announce_received(c);
    } else {
      landing_received(c);
    }
    return;
  }
  if (c.kind == Completion::kLanded) {
    engine_->landing_copied(c.context, c.error == 0, c.message);
    return;
  }
  if (c.kind == Completion::kRemoteImm) {
    imm_received_++;
    engine_->counters().add(c.imm);
    return;
  }
  Piece* p = static_cast<Piece*>(c.context);
  if (p == nullptr) {
    errors_++;
    return;
  }
  if (p->probe && !p->stale) {
    probe_answered(p, c.kind == Completion::kLocalDone);
    return;
  }
  release_announce_slot(p);  // the provider is done with its buffer, whatever the outcome
  if (p->stale) {
    // A piece we already gave up on (its transfer failed): the provider is done with it at last.
    auto it = std::find(stale_.begin(), stale_.end(), p);
    if (it != stale_.end()) stale_.erase(it);
    engine_->release_abandoned(p);
    return;
  }
  outstanding_.erase(p);
  outstanding_bytes_ -= p->posted_len;
  in_flight_ = outstanding_.size();
  Peer* peer = p->dst->peer.get();
  const uint64_t peer_id = peer->id;
  PeerQueue& q = queues_[peer_id];
  q.peer = peer;
  if (!q.ref) q.ref = p->dst->peer;
  const auto now = Clock::now();
  if (q.outstanding > 0) q.outstanding--;
  q.progress = now;
  if (c.kind == Completion::kLocalDone) {
    q.blocked_since = Clock::time_point{};  // the peer answers: a refusal to post is back-pressure
    q.conn_errors = 0;
    if (caps_.is_nic) {
      peer->path_progress_ns[index_] =
          std::chrono::duration_cast<std::chrono::nanoseconds>(now.time_since_epoch()).count();
    }
    if (p->announce && !p->data_done) {
      // Its bytes are placed: now its immediate, as an announce, next on this path (a landing piece's
      // announce must follow its bytes through this NIC's ring at the receiver).
      p->data_done = true;
      bytes_completed_ += p->len;
      auto at = std::upper_bound(q.pending.begin(), q.pending.end(), p,
                                 [](const Piece* a, const Piece* b) { return a->seq < b->seq; });
      q.pending.insert(at, p);
      mark_ready(peer_id, q);
      return;
    }
    if (!p->announce) bytes_completed_ += p->len;
    writes_completed_++;
    engine_->piece_done(p, index_);
    mark_ready(peer_id, q);
    forget_if_idle(peer_id);
    return;
  }
  errors_++;
  if (!caps_.is_nic) {
    // No other lane can copy GPU memory to this peer: the write fails.
    engine_->piece_failed(p, "copy to " + peer->label + " failed on " + lane_->nic_name() + ": " + c.message);
    forget_if_idle(peer_id);
    return;
  }
  const ErrClass kind = classify(c.error);
  if (peer->path_failed[index_].load() && kind != ErrClass::kAccess) {
    // A write that was on the path when it failed, now out of the provider (its connection was reset):
    // it did not land, so it is posted again elsewhere, the same piece, never a concurrent copy.
    rerouted_++;
    engine_->reroute(p, index_, c.message);
    forget_if_idle(peer_id);
    return;
  }
  switch (kind) {
    case ErrClass::kAccess:
      engine_->piece_failed(p, "remote refused the write on NIC " + lane_->nic_name() + ": " + c.message);
      break;
    case ErrClass::kConnection: {
      // Refused at posting because the connection was already broken (never reached the peer) says
      // nothing about this write; dropped while it was on the connection may be the peer refusing it.
      const bool never_sent = c.error == EPIPE || c.error == ENOTCONN;
      q.conn_errors++;
      if (!never_sent) ++p->conn_errors;
      if (!never_sent) {
        q.blocked_since = Clock::time_point{};
      } else if (q.blocked_since == Clock::time_point{}) {
        q.blocked_since = now;  // no connection for as long as the stall timeout: the path failed
      }
      if (p->conn_errors >= 2) {
        // Sent alone on a fresh connection and dropped again: the peer refuses this very write.
        engine_->piece_failed(p, peer->label + " dropped the connection on NIC " + lane_->nic_name() +
                                     " twice under this write (a region it deregistered, a wrong key or "
                                     "an out-of-bounds write?): " + c.message);
      } else {
        // Back into the queue at its place: a path's writes keep their order.
        auto at = std::upper_bound(q.pending.begin(), q.pending.end(), p,
                                   [](const Piece* a, const Piece* b) { return a->seq < b->seq; });
        q.pending.insert(at, p);
        q.retry_at = now + std::min<Clock::duration>(kReconnectDelay * (1 << std::min(q.conn_errors - 1, 5)),
                                                     std::chrono::milliseconds(500));
      }
      // Once nothing else is on the dropped connection, start a fresh one (the provider would
      // otherwise keep the broken one and refuse every later write with EPIPE).
      if (q.outstanding == 0) peer->paths[index_] = lane_->reset_path(peer->paths[index_]);
      break;
    }
    case ErrClass::kPath:
      fail_path(peer, c.message);
      rerouted_++;
      engine_->reroute(p, index_, c.message);
      break;
  }
  mark_ready(peer_id, q);
  forget_if_idle(peer_id);
}

void LaneWorker::start_landing(char* base, uint64_t slot_bytes, uint32_t count, void* desc) {
  if (!land_bufs_.empty()) return;
  land_base_ = base;
  land_slot_bytes_ = slot_bytes;
  land_desc_ = desc;
  for (uint32_t i = 0; i < count; ++i) {
    auto b = std::make_unique<LandingBuf>();
    b->slot = i;
    land_bufs_.push_back(std::move(b));
  }
  for (uint32_t i = 0; i < count; ++i) {
    LandingBuf& b = *land_bufs_[i];
    // The buffer itself is the context (its LaneContext first, the provider's scratch space).
    // Every tag with bit 63 clear (data and announces of landing pieces; core/announce.hpp).
    int rc = lane_->post_recv(land_base_ + uint64_t(i) * land_slot_bytes_, land_slot_bytes_, land_desc_, &b, 0,
                              ~kTagKindMask);
    if (rc != 0) {
      // Nothing was received yet: give the ring up whole, so the engine reports the registration.
      throw TransportError("posting landing buffer " + std::to_string(i) + " on NIC " + lane_->nic_name() +
                           " failed: " + lane_->error_string(-rc) +
                           (i ? " (" + std::to_string(i) + " already posted stay so)" : ""));
    }
    land_posted_.push_back(i);
  }
}

void LaneWorker::landing_received(const Completion& c) {
  // The context is the LandingBuf the receive was posted with.
  auto* b = static_cast<LandingBuf*>(c.context);
  if (b == nullptr || b->slot >= land_bufs_.size() || land_bufs_[b->slot].get() != b || b->state != LandingBuf::kPosted) {
    errors_++;
    return;
  }
  b->state = LandingBuf::kReceived;
  b->c = c;
  drain_landing();
}

void LaneWorker::landing_done(uint32_t slot) {
  if (slot >= land_bufs_.size() || land_bufs_[slot]->state != LandingBuf::kBusy) return;
  land_bufs_[slot]->state = LandingBuf::kDone;
  drain_landing();
}

void LaneWorker::drain_landing() {
  // Hand the buffers over in matching order: a message received early waits for the ones before it.
  while (!land_posted_.empty() && land_bufs_[land_posted_.front()]->state == LandingBuf::kReceived) {
    LandingBuf& b = *land_bufs_[land_posted_.front()];
    land_posted_.pop_front();
    land_busy_.push_back(b.slot);
    b.state = LandingBuf::kBusy;
    const char* data = land_base_ + uint64_t(b.slot) * land_slot_bytes_;
    if (engine_->land(index_, b.slot, data, b.c)) b.state = LandingBuf::kDone;
  }
  // Post them again in the same order, so that the receive queue stays in ring order.
  while (!land_busy_.empty() && land_bufs_[land_busy_.front()]->state == LandingBuf::kDone) {
    land_repost_.push_back(land_busy_.front());
    land_busy_.pop_front();
  }
  while (!land_repost_.empty()) {
    LandingBuf& b = *land_bufs_[land_repost_.front()];
    int rc = lane_->post_recv(land_base_ + uint64_t(b.slot) * land_slot_bytes_, land_slot_bytes_,
                                   land_desc_, &b, 0, ~kTagKindMask);
    if (rc == -EAGAIN) return;  // tried again with the next completion or command
    land_repost_.pop_front();
    if (rc != 0) {
      // The ring is one buffer short from now on (still correct, only slower).
      errors_++;
      log_warning("NIC " + lane_->nic_name() + ": posting landing buffer " + std::to_string(b.slot) +
                  " again failed: " + lane_->error_string(-rc));
      continue;
    }
    b.state = LandingBuf::kPosted;
    land_posted_.push_back(b.slot);
  }
}

unsigned char* LaneWorker::register_announce_chunk(size_t count, void** desc) {
  const size_t bytes = count * kAnnounceSlotBytes;
  std::unique_ptr<unsigned char[]> mem(new unsigned char[bytes]());
  MemRegistration reg = lane_->register_memory(mem.get(), bytes, MemKind::kHost, -1);
  *desc = reg.local_desc;
  ann_regs_.push_back(reg);
  ann_mem_.push_back(std::move(mem));
  return ann_mem_.back().get();
}

void LaneWorker::start_announces() {
  if (!ann_recvs_.empty()) return;
  void* desc = nullptr;
  unsigned char* base = register_announce_chunk(kAnnounceRecvs, &desc);
  for (size_t i = 0; i < kAnnounceRecvs; ++i) {
    auto r = std::make_unique<AnnounceRecv>();
    r->buf = base + i * kAnnounceSlotBytes;
    r->desc = desc;
    ann_recv_ctx_.insert(r.get());
    ann_recvs_.push_back(std::move(r));
  }
  for (auto& r : ann_recvs_) {
    const int rc = lane_->post_recv(r->buf, kAnnounceSlotBytes, r->desc, r.get(), kAnnounceTag, ~kTagKindMask);
    if (rc == -EAGAIN) {
      ann_repost_.push_back(r.get());
    } else if (rc != 0) {
      throw TransportError("posting announce receives on NIC " + lane_->nic_name() + " failed: " +
                           lane_->error_string(-rc));
    }
  }
}

void LaneWorker::announce_received(const Completion& c) {
  auto* r = static_cast<AnnounceRecv*>(c.context);
  if (c.error == 0 && c.len == kAnnounceBytes && c.has_imm) {
    if (engine_->announced(AnnounceName::read(r->buf), c.imm)) {
      imm_received_++;
    } else {
      imm_duplicates_++;  // a retried piece's announce: counted already
    }
  } else {
    errors_++;  // a failed receive (its connection dropped mid-message) or a malformed announce
  }
  ann_repost_.push_back(r);
  repost_announces();
}

void LaneWorker::repost_announces() {
  while (!ann_repost_.empty()) {
    AnnounceRecv* r = ann_repost_.front();
    const int rc = lane_->post_recv(r->buf, kAnnounceSlotBytes, r->desc, r, kAnnounceTag, ~kTagKindMask);
    if (rc == -EAGAIN) return;  // again with the next turn of the loop
    ann_repost_.pop_front();
    if (rc != 0) {
      errors_++;
      log_warning("NIC " + lane_->nic_name() + ": posting an announce receive again failed: " +
                  lane_->error_string(-rc));
    }
  }
}

int LaneWorker::take_announce_slot() {
  if (ann_free_.empty()) {
    void* desc = nullptr;
    unsigned char* base = nullptr;
    try {
      base = register_announce_chunk(kAnnounceChunk, &desc);
    } catch (const TransportError& e) {
      log_warning("NIC " + lane_->nic_name() + ": registering announce buffers failed: " + e.what());
      return -1;
    }
    for (size_t i = 0; i < kAnnounceChunk; ++i) {
      ann_free_.push_back(static_cast<int>(ann_slots_.size()));
      ann_slots_.emplace_back(base + i * kAnnounceSlotBytes, desc);
    }
  }
  const int slot = ann_free_.back();
  ann_free_.pop_back();
  return slot;
}

void LaneWorker::release_announce_slot(Piece* p) {
  if (p->announce_slot < 0) return;
  ann_free_.push_back(p->announce_slot);
  p->announce_slot = -1;
}

bool LaneWorker::build_announce(Piece* p, WriteRequest& req) {
  const int slot = take_announce_slot();
  if (slot < 0) return false;
  p->announce_slot = slot;
  Peer& peer = *p->dst->peer;
  // The piece's name is fixed the first time its announce goes out and kept for every retry.
  if (p->announce_id == 0) p->announce_id = peer.announces.fetch_add(1) + 1;
  AnnounceName name = engine_->announce_name(peer);
  name.piece = p->announce_id;
  auto [buf, desc] = ann_slots_[slot];
  const bool landing = p->tagged && p->dst->landing >= 0;
  req.src = buf;
  req.len = kAnnounceBytes;
  req.src_desc = desc;
  req.remote_addr = 0;
  req.key = 0;
  req.has_imm = true;
  req.imm = p->imm;
  req.delivery_complete = true;  // lost with a connection, it is sent again (and counted once)
  // Its bytes are placed already: nothing orders it after the data posted since, so where the lane has
  // a control queue it goes there instead of waiting behind that data (LaneCaps::control_queue).
  req.control = true;
  if (landing) name.span = p->announce_span;
  name.write(buf);
  req.tagged = TaggedSend{true, landing ? Engine::landing_announce_tag(p->dst->landing, p->dst_off) : kAnnounceTag};
  return true;
}

void LaneWorker::shutdown_pieces() {
  for (auto& [id, q] : queues_) {
    for (Piece* p : q.pending) engine_->piece_failed(p, "engine closed with the write queued");
    q.pending.clear();
  }
  ready_.clear();
  std::vector<Piece*> incoming;
  {
    std::lock_guard<std::mutex> lock(mu_);
    incoming.swap(incoming_);
  }
  for (Piece* p : incoming) engine_->piece_failed(p, "engine closed with the write queued");
  // In-flight pieces stay allocated until the endpoint is closed (the provider still holds them);
  // their transfers fail now so that nobody waits for them.
  for (Piece* p : outstanding_) {
    p->transfer->piece_failed("engine closed with the write in flight");
    p->stale = true;
    stale_.push_back(p);
  }
  outstanding_.clear();
  in_flight_ = 0;
}

}  // namespace weightsync
