// Landing regions: GPU memory the fabric NICs cannot register is still a destination for fabric peers
// (Engine members; see EngineConfig::landing_slots). Writers cut an op into tagged messages
// (make_landing_pieces); each NIC lane keeps a ring of receive buffers (LaneWorker::start_landing), and
// land() copies every message into place on the copy lane, counting its immediate once it is there.
#include <rdma/fi_errno.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <string>
#include <unordered_set>

#include "core/engine.hpp"
#include "core/lane_worker.hpp"
#include "core/errors.hpp"
#include "core/log.hpp"

namespace weightsync {

void Engine::make_landing_pieces(const WriteOp& op, const std::shared_ptr<TransferState>& transfer,
                                 const std::shared_ptr<LocalRegion>& src,
                                 const std::shared_ptr<RegistrationHold>& pin,
                                 const std::shared_ptr<RemoteRegion>& dst, bool has_imm,
                                 std::vector<std::vector<Piece*>>& per_nic) {
  // A landing region takes tagged messages of at most slot_bytes, each copied into place (and its
  // immediate counted) in the order its NIC matched them. The op is cut into the same pieces as an RMA
  // write (so it delivers the same immediates, Engine::imm_count), each piece sent as messages of at
  // most slot_bytes, all on one NIC: then a message that announces others (a piece's trailer, a 2-D
  // write's immediate) is matched after them (FI_ORDER_SAS), and copied after them at the destination.
  const bool two_d = op.rows > 1;
  const uint64_t sp = two_d && op.src_pitch ? op.src_pitch : op.len;
  const uint64_t dp = two_d && op.dst_pitch ? op.dst_pitch : op.len;
  const bool span = !two_d || (sp == op.len && dp == op.len);
  const uint64_t total = op.len * op.rows;
  const uint64_t slot = dst->slot_bytes;
  const int nic = pick_nic(*dst->peer, rr_.fetch_add(1));
  // Without send ordering, a trailer is posted once the messages before it are placed at the target.
  const bool delivery = !fabric_sends_ordered_;
  std::vector<Piece*> data;
  auto on_nic = [&](Piece* p) {  // a message, on the op's one NIC
    p->tagged = true;
    p->fixed_nic = nic;
    p->nic = nic;
    return p;
  };
  auto make = [&](uint64_t src_off, uint64_t dst_off, uint64_t len) {
    return on_nic(new_piece(op, transfer, src, pin, dst, src_off, dst_off, len));
  };
  // data[first..] complete, then one zero-length message carrying the immediate follows them.
  auto announce = [&](size_t first, uint64_t dst_off) {
    Piece* t = on_nic(trailer_piece(op, transfer, dst, dst_off));
    // The bytes it stands for, from dst_off: up to the end of the last message before it.
    for (size_t k = first; k < data.size(); ++k) {
      t->announce_span = std::max(t->announce_span, data[k]->dst_off + data[k]->len - dst_off);
    }
    t->has_imm = true;
    t->delivery = fabric_delivery_complete_;
    if (data.size() == first) {
      data.push_back(t);  // nothing to wait for: it is an ordinary (empty) message
      return;
    }
    auto group = std::make_shared<PieceGroup>(data.size() - first);
    group->trailer = t;
    for (size_t k = first; k < data.size(); ++k) {
      data[k]->group = group;
      data[k]->delivery = delivery;
    }
    transfer->add_pending(1);  // the trailer
  };
  // One piece: messages of at most `slot` bytes; with `imm`, the piece's one immediate after them.
  auto piece = [&](uint64_t src_off, uint64_t dst_off, uint64_t len, bool imm) {
    const size_t first = data.size();
    for (uint64_t o = 0; o < len; o += slot) data.push_back(make(src_off + o, dst_off + o, std::min(slot, len - o)));
    if (!imm) return;
    if (data.size() - first == 1) {
      data.back()->has_imm = true;  // one message: it carries its own immediate
      data.back()->announce_span = len;
    } else {
      announce(first, dst_off);
    }
  };
  if (!two_d) {
    const uint64_t step = piece_size(op.len);
    if (op.len == 0 && has_imm) piece(op.src_off, op.dst_off, 0, true);
    for (uint64_t o = 0; o < op.len; o += step) {
      piece(op.src_off + o, op.dst_off + o, std::min(step, op.len - o), has_imm);
    }
  } else {
    if (span) {
      piece(op.src_off, op.dst_off, total, false);
    } else {
      for (uint64_t r = 0; r < op.rows; ++r) piece(op.src_off + r * sp, op.dst_off + r * dp, op.len, false);
    }
    if (has_imm) announce(0, op.dst_off);  // one immediate for the whole block, after every row
  }
  for (Piece* p : data) {
    // Complete at delivery where the provider can (see make_pieces): a message lost with its
    // connection is an error, retried, not a silent success.
    p->delivery = p->delivery || fabric_delivery_complete_;
    if (!src->on_fabric && p->src == src) {
      // The NICs cannot read this source: staged first; send_staged keeps it on fixed_nic.
      p->stage = 1;
      per_nic.back().push_back(p);
      continue;
    }
    per_nic[nic < 0 ? workers_.size() : static_cast<size_t>(nic)].push_back(p);
  }
}

void Engine::ensure_landing() {
  std::lock_guard<std::mutex> lock(landing_init_mu_);
  if (landing_ready_) return;
  const uint64_t slots = cfg_.landing_slots;
  const uint64_t slot = cfg_.landing_slot_bytes;
  const uint64_t per_nic = slots * slot;
  char* base = nullptr;
  bool pinned = false;
  std::shared_ptr<LocalRegion> region = register_host_buffer(per_nic * fabric_nics_, "landing", &base, &pinned);
  // From here on receives may be posted into it: the memory is kept (and freed by close) even if a
  // later NIC fails, since the provider may write into a buffer posted on an earlier one.
  landing_base_ = base;
  landing_pinned_ = pinned;
  landing_region_ = region;
  landing_guard_.reset(new unsigned char[uint64_t(kLandingIndices) * 8]());
  for (size_t i = 0; i < fabric_nics_; ++i) {
    LaneWorker* w = workers_[i].get();
    char* ring = base + i * per_nic;
    void* desc = region->regs[i].local_desc;
    w->call([w, ring, slot, slots, desc](Lane&) { w->start_landing(ring, slot, uint32_t(slots), desc); },
            kCommandTimeoutS);
  }
  landing_ready_ = true;
}

std::shared_ptr<Engine::LandingEntry> Engine::landing_entry(uint64_t index) {
  std::lock_guard<std::mutex> lock(landing_mu_);
  return index < landing_.size() ? landing_[index] : nullptr;
}

void Engine::make_landing(LocalRegion& region) {
  ensure_landing();
  auto entry = std::make_shared<LandingEntry>();
  entry->ptr = static_cast<char*>(region.ptr);
  entry->len = region.len;
  entry->kind = region.kind;
  entry->region_id = region.id;
  int index = -1;
  {
    std::lock_guard<std::mutex> lock(landing_mu_);
    if (landing_live_ >= kLandingIndices) {
      throw TransportError("cannot register more than " + std::to_string(kLandingIndices) +
                           " landing regions (GPU memory the NICs cannot register); deregister some first");
    }
    if (landing_.empty()) landing_.resize(kLandingIndices);
    while (landing_[landing_next_]) landing_next_ = (landing_next_ + 1) % kLandingIndices;
    index = static_cast<int>(landing_next_);
    landing_next_ = (landing_next_ + 1) % kLandingIndices;
    landing_[index] = entry;
    landing_live_++;
  }
  // The guard: 8 host bytes of this index, registered on every fabric NIC for this region alone (a new
  // key each time), so a writer holding the descriptor of a retired region is refused.
  std::vector<MemRegistration> guards(fabric_nics_);
  size_t i = 0;
  try {
    for (; i < fabric_nics_; ++i) {
      MemRegistration* g = &guards[i];
      void* ptr = landing_guard_.get() + uint64_t(index) * 8;
      workers_[i]->call([=](Lane& t) { *g = t.register_memory(ptr, 8, MemKind::kHost, -1); }, kCommandTimeoutS);
    }
  } catch (...) {
    for (size_t j = 0; j < i; ++j) {
      MemRegistration reg = guards[j];
      workers_[j]->post_command([reg](Lane& t) { t.deregister(reg); });
    }
    retire_landing(index, region.id, false);
    throw;
  }
  for (size_t k = 0; k < fabric_nics_; ++k) region.regs[k] = guards[k];
  region.landing = index;
  region.landing_slot_bytes = cfg_.landing_slot_bytes;
}

void Engine::retire_landing(int index, uint64_t region_id, bool wait) {
  if (index < 0) return;
  std::shared_ptr<LandingEntry> e;
  {
    std::lock_guard<std::mutex> lock(landing_mu_);
    if (static_cast<size_t>(index) >= landing_.size() || !landing_[index] || landing_[index]->region_id != region_id) {
      return;  // retired already
    }
    e = std::move(landing_[index]);
    landing_[index] = nullptr;
    landing_live_--;
  }
  std::unique_lock<std::mutex> lock(e->mu);
  e->valid = false;  // land() checks it under this lock: no copy starts after this
  if (wait && !closed_) {
    // Copies already started take microseconds; bounded in case the cuda lane is stuck.
    if (!e->cv.wait_for(lock, std::chrono::seconds(10), [&] { return e->copies == 0; })) {
      log_warning(std::to_string(e->copies) + " landing copies into region " + std::to_string(region_id) +
                  " still running after 10 s");
    }
  }
}

void Engine::landing_dropped(LaneWorker& w, uint64_t len, const std::string& what) {
  w.count_dropped();
  // Dropped messages are counted; the first few are also told, so a misconfiguration shows.
  if (landing_drops_logged_++ < 10) {
    log_warning("engine " + uid_.substr(0, 8) + " dropped a message of " + std::to_string(len) + " bytes for " +
                what);
  }
}

bool Engine::drop_landing(LaneWorker& w, const Completion& c, const std::string& why) {
  landing_dropped(w, c.len, "landing region " + std::to_string(landing_index(c.tag)) + " at offset " +
                               std::to_string(landing_offset(c.tag)) + " on NIC " + w.lane().nic_name() + ": " + why);
  return true;
}

bool Engine::land(int nic, uint32_t slot, const char* buf, const Completion& c) {
  LaneWorker& w = *workers_[nic];
  const uint64_t index = landing_index(c.tag);
  const uint64_t off = landing_offset(c.tag);
  const bool announce = (c.tag & kLandingAnnounceBit) != 0;
  if (c.error != 0) {
    // Longer than the ring's buffers: the writer's descriptor is not this region's. Its piece's
    // announce, next on this ring for this index, is not counted either (see land_message).
    if (!announce && c.error == FI_ETRUNC) void_landing(nic, index, off);
    return drop_landing(w, c, "the receive failed: " + c.message);
  }
  if (announce) {
    // A piece's announce (core/announce.hpp): its bytes came before it in this ring. A piece already
    // counted (its announce sent again after a lost acknowledgement) is dropped here; the first one goes
    // on as an empty message with the immediate, counted once the copies before it are done.
    if (c.len != kAnnounceBytes || !c.has_imm) return drop_landing(w, c, "a malformed announce");
    const AnnounceName name = AnnounceName::read(reinterpret_cast<const unsigned char*>(buf));
    auto voided = landing_voided_[nic].find(index);
    if (voided != landing_voided_[nic].end()) {
      std::deque<uint64_t>& offs = voided->second;
      // One recorded drop per message of this piece (distinct offsets within its span): several
      // writes of the same place each leave their own, for their own announces.
      std::unordered_set<uint64_t> taken;
      std::deque<uint64_t> kept;
      for (uint64_t o : offs) {
        const bool mine = o >= off && o - off < std::max<uint64_t>(name.span, 1) && taken.insert(o).second;
        if (!mine) kept.push_back(o);
      }
      const bool hit = !taken.empty();
      offs.swap(kept);
      if (offs.empty()) landing_voided_[nic].erase(voided);
      if (hit) return drop_landing(w, c, "the announce of a piece whose bytes were dropped");
    }
    if (!dedup_.first(name)) {
      w.count_duplicate();
      return true;
    }
    Completion empty = c;
    empty.len = 0;
    empty.tag = c.tag & ~((1ull << kLandingOffsetBits) - 1);  // offset 0: nothing is written
    return land_message(nic, slot, buf, empty);
  }
  return land_message(nic, slot, buf, c);
}

void Engine::void_landing(int nic, uint64_t index, uint64_t off) {
  std::deque<uint64_t>& offs = landing_voided_[nic][index];
  offs.push_back(off);
  if (offs.size() > kMaxVoided) offs.pop_front();
}

bool Engine::land_message(int nic, uint32_t slot, const char* buf, const Completion& c) {
  LaneWorker& w = *workers_[nic];
  const uint64_t index = landing_index(c.tag);
  const uint64_t off = landing_offset(c.tag);
  std::shared_ptr<LandingEntry> e = landing_entry(index);
  if (!e) return drop_landing(w, c, "no such landing region (deregistered?)");
  std::unique_lock<std::mutex> lock(e->mu);
  if (!e->valid) return drop_landing(w, c, "the region was deregistered");
  if (off > e->len || c.len > e->len - off) {
    // Bytes the writer meant for a larger region: they are dropped, and so is the announce of their
    // piece that follows them on this ring, or the counter would count bytes that never landed. (A
    // writer whose messages interleave with these on this ring and index may lose its announce too:
    // its counter then times out rather than count wrong, and only behind a writer with a forged or
    // foreign descriptor.)
    void_landing(nic, index, off);
    return drop_landing(w, c, "past the end of the region (" + std::to_string(e->len) + " bytes)");
  }
  if (e->kind == MemKind::kHost) {
    // land_host_regions (tests): copied here, under the entry's lock, so deregistration waits for it.
    if (c.len) std::memcpy(e->ptr + off, buf, c.len);
    lock.unlock();
    w.count_landed(c.len, c.has_imm);
    if (c.has_imm) counters_.add(c.imm);
    return true;
  }
  if (local_copies() == nullptr) return drop_landing(w, c, "no cuda lane to copy it to the GPU");
  e->copies++;
  lock.unlock();
  auto* job = new LandingJob();
  job->nic = nic;
  job->slot = slot;
  job->entry = e;
  job->len = c.len;
  job->off = off;
  job->has_imm = c.has_imm;
  job->imm = c.imm;
  Engine* self = this;
  workers_[cuda_lane_]->post_command([self, job, buf](Lane& t) {
    int rc = t.local_copies()->post_landing_copy(job->entry->ptr + job->off, buf, job->len, job);
    if (rc != 0) self->landing_copied(job, false, "the copy could not start: " + t.error_string(-rc));
  });
  return false;
}

void Engine::landing_copied(void* ctx, bool ok, const std::string& why) {
  auto* job = static_cast<LandingJob*>(ctx);
  LaneWorker* w = workers_[job->nic].get();
  if (ok) {
    // Counted before the immediate: whoever wakes on the immediate sees the stats include it.
    w->count_landed(job->len, job->has_imm);
    if (job->has_imm) counters_.add(job->imm);
  } else {
    landing_dropped(*w, job->len, "a landing region: " + why);
  }
  {
    std::lock_guard<std::mutex> lock(job->entry->mu);
    job->entry->copies--;
  }
  job->entry->cv.notify_all();
  const uint32_t slot = job->slot;
  w->post_command([w, slot](Lane&) { w->landing_done(slot); });
  delete job;
}

std::vector<LaneStats> Engine::stats() {
  std::vector<LaneStats> out;
  for (auto& w : workers_) out.push_back(w->stats());
  return out;
}

}  // namespace weightsync
