// A lane worker's failed paths: how a path (a peer through this NIC) is taken for failed (an error, or a
// stall while another NIC reaches the same peer), what becomes of the writes still on it (drained, then
// settled on another NIC or abandoned), and the probes that restore it.
#include <algorithm>

#include "core/errors.hpp"
#include "core/lane_worker.hpp"
#include "core/log.hpp"

namespace weightsync {

namespace {
using Clock = std::chrono::steady_clock;
}  // namespace

void LaneWorker::fail_path(Peer* peer, const std::string& why) {
  {
    std::lock_guard<std::mutex> lock(peer->mu);
    peer->last_error = "NIC " + lane_->nic_name() + ": " + why;
  }
  // Mark the path first, so the engine routes the pieces below (and new writes) to other NICs.
  if (!peer->path_failed[index_].exchange(true)) {
    failed_paths_++;
    // An operator sees why a path went away (and, from the probe, when it came back), not only a count.
    log_warning("path to " + peer->label + " on NIC " + lane_->nic_name() + " failed (" + why + ")");
  }
  {
    FailedPath& f = failed_[peer->id];
    auto it = queues_.find(peer->id);
    if (!f.peer && it != queues_.end()) f.peer = it->second.ref;
    f.next_probe = Clock::now() + std::chrono::duration_cast<Clock::duration>(f.backoff);
    if (!f.peer) failed_.erase(peer->id);  // no handle on it (cannot happen: it had pieces here)
  }
  PeerQueue& q = queues_[peer->id];
  q.peer = peer;
  if (q.outstanding > 0) {
    // Writes in flight on the path are not copied elsewhere: RMA has no cancel, and a copy posted while
    // the original is still in the provider gets its immediate counted twice and lets the original's
    // bytes land after it, even after later writes to the same place (issue 15 case 7). They drain
    // instead: each one completes (it landed: done, counted once) or comes back as an error (out of the
    // provider, and with the connection aborted, out of the kernel too: posted again elsewhere, the same
    // piece). Aborting the connection drops what the kernel still holds for it and makes the provider
    // fail the writes at once; where the lane cannot abort, the writes get longer to resolve. One still
    // out when the drain time runs out is not given up (that lost the destination's version although
    // another NIC reached it): settle_draining closes the connection for good and posts it again.
    const bool aborted = !engine_->test_hooks().no_path_abort && lane_->abort_path(peer->paths[index_]);
    bool elsewhere = false;  // another NIC could take a retry
    for (size_t j = 0; j < engine_->num_nics(); ++j) {
      if (static_cast<int>(j) != index_ && !peer->path_failed[j].load()) elsewhere = true;
    }
    if (!elsewhere) {
      // No NIC left to retry on: the writes fail now, as they would once resolved (they stay with the
      // worker until the provider releases them).
      abandon_draining(peer->id, q, peer->label + " is unreachable on every NIC (last: " + why + ")");
    } else {
      q.drain_deadline = Clock::now() + std::chrono::duration_cast<Clock::duration>(
                                            aborted ? stall_timeout_ : 2 * stall_timeout_);
    }
  }
  // Writes queued here but never posted move to the peer's other NICs.
  std::deque<Piece*> queued;
  queued.swap(q.pending);
  q.blocked_since = Clock::time_point{};
  q.conn_errors = 0;
  for (Piece* p : queued) {
    rerouted_++;
    engine_->reroute(p, index_, why);
  }
  forget_if_idle(peer->id);
}

void LaneWorker::abandon_draining(uint64_t peer_id, PeerQueue& q, const std::string& why) {
  std::vector<Piece*> left;
  for (Piece* p : outstanding_) {
    if (p->dst->peer->id == peer_id) left.push_back(p);
  }
  for (Piece* p : left) {
    outstanding_.erase(p);
    outstanding_bytes_ -= p->posted_len;
    engine_->abandon(p, why);
    stale_.push_back(p);
  }
  in_flight_ = outstanding_.size();
  q.outstanding = 0;
  q.drain_deadline = Clock::time_point{};
}

namespace {

// A piece to post again in place of `old`, which the provider has not handed back (it stays with the
// worker, stale, until the provider does or the endpoint closes): the same write, the same announce name
// (so its immediate is counted once whichever copy's announce arrives), its transfer and group counting
// the copy instead of it. What belongs to the old posting (the provider's context, its place in a
// queue, its announce buffer and window bytes, its connection errors) starts afresh; the staging slot
// and the NIC load its bytes were charged to move to the copy, which sends from the slot and is placed
// again.
Piece* retry_copy(Piece* old) {
  auto* p = new Piece(*old);
  p->tctx = LaneContext{};
  p->stale = false;
  p->seq = 0;
  p->conn_errors = 0;
  p->announce_slot = -1;
  p->posted_len = 0;
  old->stage_slot = -1;
  old->load_nic = -1;
  old->load_bytes = 0;
  old->stale = true;
  return p;
}

}  // namespace

void LaneWorker::settle_draining(uint64_t peer_id) {
  auto it = queues_.find(peer_id);
  if (it == queues_.end() || it->second.peer == nullptr) return;
  Peer* peer = it->second.peer;
  it->second.drain_deadline = Clock::time_point{};
  // Why the writes still out are not simply given up (case 7's first rule, which failed their
  // transfers): since announces, a piece posted again is counted once whichever copy arrives
  // (core/announce.hpp), so what a retry must still never allow is the first copy's bytes landing after
  // it, and after later writes to the same place (the next version). Giving the write up does not stop
  // that either: the push fails that destination and the next version is written while the bytes may
  // still be on their way. What stops it is ending the connection: with a zero linger the kernel drops
  // what it still holds and sends nothing more of it (no retransmission, not after link-up either); what
  // can still land are bytes already at the peer (its progress places them at once) or in the network
  // (gone within the links' queueing delay), long before a version pushed after this one. On RDMA NICs
  // the same holds for a reliable connection that is torn down (its QP flushed or destroyed sends nothing
  // more; packets in the fabric live for a bounded time); a connectionless provider (EFA SRD) returns
  // every write itself, done or failed, once its own retransmissions are over, and a write it returned
  // as failed will not be sent again by it.
  uint64_t path = peer->paths[index_];
  if (!lane_->close_path(path)) {
    // Nothing of ours to end: the provider still owns these writes and returns each of them in the end
    // (done, or failed and then posted again elsewhere); the caller's timeout bounds the wait.
    log_warning("NIC " + lane_->nic_name() + ": writes to " + peer->label + " still in flight " +
                std::to_string(stall_timeout_.count()) +
                " s after its path failed; the lane cannot end the connection, so they wait for the provider");
    return;
  }
  peer->paths[index_] = path;
  // The provider hands back what was posted on the closed connection: each such write comes back as an
  // error and is posted again elsewhere by handle(), as itself.
  std::vector<Completion> returned;
  for (int round = 0; round < 8; ++round) {
    returned.clear();
    lane_->poll(returned, 256);
    for (const Completion& c : returned) handle(c);
    if (returned.empty()) break;
  }
  std::vector<Piece*> left;
  for (Piece* p : outstanding_) {
    if (p->dst->peer->id == peer_id) left.push_back(p);
  }
  const std::string why = "in flight on NIC " + lane_->nic_name() + " when its path to " + peer->label +
                          " failed, and not handed back when the path's connection was closed";
  for (Piece* p : left) {
    // Its connection is gone: nothing of it leaves this host any more, whatever the provider still holds.
    outstanding_.erase(p);
    outstanding_bytes_ -= p->posted_len;
    Piece* copy = retry_copy(p);
    stale_.push_back(p);
    rerouted_++;
    engine_->reroute(copy, index_, why);
  }
  in_flight_ = outstanding_.size();
  it = queues_.find(peer_id);
  if (it != queues_.end()) {
    if (!left.empty()) it->second.outstanding = 0;
    forget_if_idle(peer_id);
  }
}

bool LaneWorker::sibling_progressed(const Peer& peer, Clock::time_point now) const {
  const int64_t now_ns = std::chrono::duration_cast<std::chrono::nanoseconds>(now.time_since_epoch()).count();
  const int64_t window_ns = std::chrono::duration_cast<std::chrono::nanoseconds>(stall_timeout_).count();
  for (size_t j = 0; j < engine_->num_nics(); ++j) {
    if (static_cast<int>(j) == index_ || peer.path_failed[j].load()) continue;
    const int64_t last = peer.path_progress_ns[j].load();
    if (last != 0 && now_ns - last < window_ns) return true;
  }
  return false;
}

void LaneWorker::check_stalls() {
  const auto now = Clock::now();
  std::vector<std::pair<Peer*, std::string>> failing;
  std::vector<uint64_t> overdue;  // failed paths whose drain time ran out with writes still out
  for (auto& [peer_id, q] : queues_) {
    if (q.peer == nullptr) continue;
    if (q.peer->path_failed[index_].load()) {
      if (q.outstanding > 0 && q.drain_deadline != Clock::time_point{} && now > q.drain_deadline) {
        overdue.push_back(peer_id);
      }
      continue;
    }
    const bool stalled = q.outstanding > 0 && now - q.progress > stall_timeout_;
    const bool blocked = !q.pending.empty() && q.blocked_since != Clock::time_point{} &&
                         now - q.blocked_since > stall_timeout_;
    if (!stalled && !blocked) continue;
    const std::string secs = std::to_string(stall_timeout_.count());
    const Lane::PathState state =
        stalled ? lane_->path_state(q.peer->paths[index_], stall_timeout_.count()) : Lane::PathState::kUnknown;
    if (state == Lane::PathState::kAlive) {
      // Its connection still has data acknowledged, or the peer's buffer is full: a slow link or a peer
      // that is not draining, not a dead one. Nothing is failed or moved; a write there is never copied.
      continue;
    }
    if (state == Lane::PathState::kDead) {
      // Data waiting on the connection and nothing acknowledged for the stall timeout: the link.
      failing.emplace_back(q.peer, "NIC " + lane_->nic_name() + ": nothing acknowledged for " + secs +
                                       " s with data waiting (link down?)");
    } else if (blocked && q.outstanding == 0) {
      // Nothing of ours in flight to it, and the provider has refused every write for that long: it
      // cannot connect (the peer is gone, or the link is down).
      failing.emplace_back(q.peer, "NIC " + lane_->nic_name() + " accepted no write to it for " + secs +
                                       " s (cannot connect: link down or peer gone)");
    } else if (sibling_progressed(*q.peer, now)) {
      // Another NIC reaches the same peer meanwhile: this NIC's path, not the peer, is the problem.
      failing.emplace_back(q.peer, "no completion on NIC " + lane_->nic_name() + " for " + secs +
                                       " s while another NIC reached the peer (link down?)");
    }
    // Otherwise the peer is slow on every path (paused, or draining its landing ring slowly): that is
    // back-pressure, not a failure. The writes stay posted; the caller's own timeout bounds the wait.
  }
  for (auto& [peer, why] : failing) fail_path(peer, why);
  for (uint64_t peer_id : overdue) settle_draining(peer_id);
  probe_failed_paths();
}

void LaneWorker::probe_failed_paths() {
  const auto now = Clock::now();
  for (auto it = failed_.begin(); it != failed_.end();) {
    FailedPath& f = it->second;
    Peer& peer = *f.peer;
    if (!peer.path_failed[index_].load() || f.peer.use_count() == 1) {
      // Restored, or nobody holds the peer any more (nothing can be written to it): forget it.
      if (f.probe) {
        f.probe->stale = true;
        stale_.push_back(f.probe);
      }
      it = failed_.erase(it);
      continue;
    }
    auto backoff = [&] {
      f.backoff = std::min(f.backoff * 2, std::chrono::duration<double>(8.0));
      f.next_probe = now + std::chrono::duration_cast<Clock::duration>(f.backoff);
    };
    if (f.probe && now - f.probe_sent > stall_timeout_) {
      // No answer: superseded (the reset below cancels it; its completion is ignored).
      f.probe->stale = true;
      stale_.push_back(f.probe);
      f.probe = nullptr;
      backoff();
    }
    auto q = queues_.find(it->first);
    const bool draining = q != queues_.end() && q->second.outstanding > 0;
    if (f.probe || draining || now < f.next_probe) {
      ++it;
      continue;
    }
    // A fresh connection, then a zero-length write into the peer's doorbell that completes only once
    // delivered: an answer means the path works again.
    peer.paths[index_] = lane_->reset_path(peer.paths[index_]);
    const int rn = peer.remote_nic[index_];
    auto* p = new Piece();
    p->probe = true;
    p->nic = index_;
    WriteRequest req;
    req.src = engine_->doorbell()->ptr;
    req.len = 0;
    req.src_desc = engine_->doorbell()->regs[index_].local_desc;
    req.peer = peer.paths[index_];
    req.remote_addr = rn < static_cast<int>(peer.doorbell_base.size()) ? peer.doorbell_base[rn] : 0;
    req.key = rn < static_cast<int>(peer.doorbell_key.size()) ? peer.doorbell_key[rn] : 0;
    req.context = p;
    req.delivery_complete = caps_.delivery_complete;
    const int rc = lane_->post_write(req);
    if (rc != 0) {
      delete p;  // refused (still connecting, or no route): not in the provider
      backoff();
    } else {
      f.probe = p;
      f.probe_sent = now;
    }
    ++it;
  }
}

void LaneWorker::probe_answered(Piece* p, bool ok) {
  for (auto& [id, f] : failed_) {
    if (f.probe != p) continue;
    f.probe = nullptr;
    if (ok) {
      f.peer->path_failed[index_] = false;
      f.peer->path_progress_ns[index_] =
          std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now().time_since_epoch()).count();
      restored_paths_++;
      log_info("path to " + f.peer->label + " on NIC " + lane_->nic_name() + " restored (a probe write landed)");
      failed_.erase(id);
    } else {
      f.backoff = std::min(f.backoff * 2, std::chrono::duration<double>(8.0));
      f.next_probe = Clock::now() + std::chrono::duration_cast<Clock::duration>(f.backoff);
    }
    break;
  }
  delete p;
}

}  // namespace weightsync
