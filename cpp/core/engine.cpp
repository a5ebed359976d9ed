#include "core/engine.hpp"

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <cstdio>
#include <random>
#include <sstream>

#include "core/errors.hpp"
#include "core/hex.hpp"
#include "core/lane_worker.hpp"

namespace weightsync {

namespace {

std::string random_uid() {
  std::random_device rd;
  char buf[33];
  for (int i = 0; i < 4; ++i) std::snprintf(buf + 8 * i, 9, "%08x", rd());
  return std::string(buf, 32);
}

}  // namespace

RegistrationHold::~RegistrationHold() {
  if (auto e = engine.lock()) e->release_region(id, std::move(regs), landing, std::move(owner));
}

std::shared_ptr<Engine> Engine::create(const EngineConfig& cfg, const TestHooks& hooks) {
  std::shared_ptr<Engine> engine(new Engine(cfg, hooks));
  engine->start();
  return engine;
}

Engine::Engine(const EngineConfig& cfg, const TestHooks& hooks)
    : cfg_(cfg), hooks_(hooks), lost_acks_left_(hooks.lose_imm_acks), uid_(random_uid()) {
  if (cfg_.transport != "fabric") {
    throw TransportError("transport '" + cfg_.transport + "' is not available in this build (have: fabric)");
  }
  if (cfg_.max_piece == 0) throw TransportError("max_piece must be positive");
  cfg_.stripe_threshold = std::min(cfg_.stripe_threshold, cfg_.max_piece);
  // Every registered lane type settles its choices, then opens its lanes. NIC lanes come first (their
  // index is the NIC index in regions, peers and descriptors), then the local copy lane if any.
  for (const auto& type : lane_types()) type.configure(cfg_);
  std::vector<std::unique_ptr<Lane>> nic_lanes, local_lanes;
  for (const auto& type : lane_types()) {
    for (auto& lane : type.open(cfg_)) (lane->caps().is_nic ? nic_lanes : local_lanes).push_back(std::move(lane));
  }
  if (nic_lanes.empty()) throw TransportError("the engine has no NIC lane (nics is empty)");
  if (local_lanes.size() > 1 || (!local_lanes.empty() && !local_lanes[0]->caps().maps_remote)) {
    throw TransportError("the engine takes one local lane that maps peers' memory (got " +
                         std::to_string(local_lanes.size()) + ")");
  }
  for (auto& lane : nic_lanes) {
    const LaneCaps caps = lane->caps();
    cfg_.max_piece = std::min<uint64_t>(cfg_.max_piece, lane->max_write());
    fabric_delivery_complete_ = fabric_delivery_complete_ && caps.delivery_complete;
    fabric_ordered_ = fabric_ordered_ && caps.orders_writes;
    fabric_tagged_ = fabric_tagged_ && caps.tagged;
    fabric_sends_ordered_ = fabric_sends_ordered_ && caps.orders_sends;
    const int index = static_cast<int>(workers_.size());
    workers_.push_back(std::make_unique<LaneWorker>(this, index, std::move(lane), cfg_));
  }
  fabric_nics_ = workers_.size();
  cfg_.stripe_threshold = std::min(cfg_.stripe_threshold, cfg_.max_piece);
  if (cfg_.landing_slot_bytes == 0) cfg_.landing_slot_bytes = cfg_.max_piece;
  for (auto& w : workers_) cfg_.landing_slot_bytes = std::min<uint64_t>(cfg_.landing_slot_bytes, w->lane().max_write());
  cfg_.landing_slots = std::max<uint64_t>(cfg_.landing_slots, 1);
  announce_ring_ = fabric_tagged_ && fabric_delivery_complete_;
  announces_ = announce_ring_ && !hooks_.cq_data_immediates;
  landing_voided_.resize(fabric_nics_);
  uid_hi_ = std::stoull(uid_.substr(0, 16), nullptr, 16);
  uid_lo_ = std::stoull(uid_.substr(16, 16), nullptr, 16);
  if (!local_lanes.empty()) {
    cuda_lane_ = static_cast<int>(workers_.size());
    workers_.push_back(std::make_unique<LaneWorker>(this, cuda_lane_, std::move(local_lanes[0]), cfg_));
  }
}

void Engine::start() {
  // Raw `this`: the counters live in the engine, and close() joins the workers (the only callers).
  counters_.set_observer([this](uint32_t imm, uint64_t total) { on_immediate(imm, total); });
  for (auto& w : workers_) w->start();
  if (announce_ring_) {
    // Peers' announces may come as soon as our address is out: the rings are posted first.
    for (size_t i = 0; i < fabric_nics_; ++i) {
      LaneWorker* w = workers_[i].get();
      w->call([w](Lane&) { w->start_announces(); }, kCommandTimeoutS);
    }
  }
  // The doorbell: copy-engine completions reach peers as zero-length writes into it. It must not hold
  // the engine alive (the engine owns it), and close() deregisters it with everything else.
  doorbell_ = register_memory(doorbell_mem_.data(), doorbell_mem_.size(), MemKind::kHost, -1, true);
  doorbell_->engine.reset();
}

std::string Engine::cuda_address() const {
  return cuda_lane_ < 0 ? std::string() : workers_[cuda_lane_]->lane().address();
}

std::string Engine::cuda_name() const {
  return cuda_lane_ < 0 ? std::string() : workers_[cuda_lane_]->lane().nic_name();
}

std::vector<uint64_t> Engine::doorbell_bases() const {
  std::vector<uint64_t> out;
  for (size_t i = 0; i < fabric_nics_; ++i) out.push_back(doorbell_->regs[i].remote_base);
  return out;
}

std::vector<uint64_t> Engine::doorbell_keys() const {
  std::vector<uint64_t> out;
  for (size_t i = 0; i < fabric_nics_; ++i) out.push_back(doorbell_->regs[i].key);
  return out;
}

Engine::~Engine() { close(); }

void Engine::set_auth_key(const std::string& hex) {
  const std::string key = unhex(hex);
  for (size_t i = 0; i < fabric_nics_; ++i) {
    workers_[i]->call([key](Lane& lane) { lane.set_auth_key(key); }, kCommandTimeoutS);
  }
}

std::vector<std::pair<std::string, LaneCaps>> Engine::lane_caps() const {
  std::vector<std::pair<std::string, LaneCaps>> out;
  for (const auto& w : workers_) out.emplace_back(w->lane().kind(), w->lane().caps());
  return out;
}

std::string Engine::provider() const { return cfg_.provider; }
std::string Engine::transport_kind() const { return cfg_.transport; }

std::vector<std::string> Engine::nic_names() const {
  std::vector<std::string> out;
  for (size_t i = 0; i < fabric_nics_ && i < workers_.size(); ++i) out.push_back(workers_[i]->lane().nic_name());
  return out;
}

std::vector<std::string> Engine::nic_addresses() const {
  std::vector<std::string> out;
  for (size_t i = 0; i < fabric_nics_ && i < workers_.size(); ++i) out.push_back(workers_[i]->lane().address());
  return out;
}

std::shared_ptr<LocalRegion> Engine::register_memory(void* ptr, uint64_t len, MemKind kind, int device,
                                                    bool internal, std::shared_ptr<void> owner) {
  if (closed_) throw TransportError("engine is closed");
  if (ptr == nullptr && len > 0) throw UsageError("cannot register a null buffer of " + std::to_string(len) + " bytes");
  auto region = std::make_shared<LocalRegion>();
  region->id = next_region_++;
  region->ptr = ptr;
  region->len = len;
  region->kind = kind;
  region->device = device;
  region->regs.resize(workers_.size());
  region->fabric_nics = fabric_nics_;
  // Tests: host memory kept off the NICs, written through the landing ring like GPU memory without FI_HMEM.
  const bool land_host = hooks_.land_host_regions && !internal && kind == MemKind::kHost;
  size_t done = 0;
  try {
    for (; done < workers_.size(); ++done) {
      MemRegistration* slot = &region->regs[done];
      if (hooks_.stage_host_sources && !internal && kind == MemKind::kHost && static_cast<int>(done) != cuda_lane_) {
        region->on_fabric = false;
        region->fabric_error = "host sources are staged (stage_host_sources, for tests)";
        continue;
      }
      if (land_host && static_cast<int>(done) != cuda_lane_) {
        region->on_fabric = false;
        region->fabric_error = "host regions are written through the landing ring (land_host_regions, for tests)";
        continue;
      }
      try {
        workers_[done]->call([=](Lane& t) { *slot = t.register_memory(ptr, len, kind, device); },
                             kCommandTimeoutS);
      } catch (const TransportError& e) {
        // GPU memory a fabric NIC cannot register stays usable through the cuda lane.
        if (kind != MemKind::kCuda || static_cast<int>(done) == cuda_lane_) throw;
        region->on_fabric = false;
        region->fabric_error = e.what();
      }
    }
    if (!region->on_fabric && !internal && ((kind == MemKind::kCuda && cuda_lane_ >= 0) || land_host)) {
      // Fabric peers can still write into it: through the landing ring.
      if (!fabric_tagged_) {
        if (land_host) throw TransportError("land_host_regions: provider " + cfg_.provider + " sends no tagged messages");
        region->fabric_error += "; no landing ring either (provider " + cfg_.provider + " sends no tagged messages)";
      } else {
        try {
          make_landing(*region);
        } catch (const TransportError& e) {
          if (land_host) throw;
          region->fabric_error += std::string("; landing ring unavailable: ") + e.what();
        }
      }
    }
  } catch (...) {
    // Undo the registrations that succeeded before the failure.
    for (size_t i = 0; i < done; ++i) {
      MemRegistration reg = region->regs[i];
      workers_[i]->post_command([reg](Lane& t) { t.deregister(reg); });
    }
    region->regs.clear();
    retire_landing(region->landing, region->id, false);
    throw;
  }
  {
    std::lock_guard<std::mutex> lock(regions_mu_);
    live_regions_[region->id] = region->regs;
  }
  region->engine = shared_from_this();
  auto hold = std::make_shared<RegistrationHold>();
  hold->engine = region->engine;
  hold->id = region->id;
  hold->regs = region->regs;
  hold->landing = region->landing;
  hold->owner = std::move(owner);
  region->hold = std::move(hold);
  if (cuda_lane_ >= 0 && !region->regs[cuda_lane_].blob.empty()) {
    // Exported to same-host peers: they may copy into it from now until it is deregistered.
    workers_[cuda_lane_]->lane().set_region_live(region->id, true);
  }
  if (!region->on_fabric && (cuda_lane_ >= 0 || hooks_.stage_host_sources || land_host)) {
    // It can still be a source towards fabric peers, through the staging slots.
    try {
      ensure_staging();
    } catch (const TransportError& e) {
      region->fabric_error += std::string("; staging unavailable: ") + e.what();
    }
  }
  return region;
}

LocalCopies* Engine::local_copies() { return cuda_lane_ < 0 ? nullptr : workers_[cuda_lane_]->lane().local_copies(); }

void Engine::deregister(const std::shared_ptr<LocalRegion>& region) {
  region->valid = false;
  std::shared_ptr<RegistrationHold> hold;
  {
    std::lock_guard<std::mutex> lock(region->hold_mu);
    hold.swap(region->hold);
  }
  if (!hold) return;  // already deregistered
  // Peers must not write into it any more: the cuda lane's writers check the live table before every
  // copy; fabric writers find its MRs closed (below, or once the last local write reading from it ends).
  if (cuda_lane_ >= 0) {
    std::lock_guard<std::mutex> lock(regions_mu_);  // close() clears the workers under this lock
    if (!closed_) workers_[cuda_lane_]->lane().set_region_live(region->id, false);
  }
  if (region->landing >= 0) {
    // Messages for it are dropped from now on, and copies into it are over before this returns. Its
    // guard MRs close now too (local writes reading from the region never use them: the NICs cannot
    // read it, they are staged), so that writers learn of it at once.
    retire_landing(region->landing, region->id, true);
    std::vector<MemRegistration> guards;
    {
      std::lock_guard<std::mutex> lock(regions_mu_);
      auto it = closed_ ? live_regions_.end() : live_regions_.find(region->id);
      if (it != live_regions_.end()) {
        for (size_t i = 0; i < fabric_nics_ && i < it->second.size(); ++i) {
          guards.push_back(it->second[i]);
          it->second[i] = MemRegistration{};
        }
      }
    }
    for (size_t i = 0; i < fabric_nics_ && i < hold->regs.size(); ++i) hold->regs[i] = MemRegistration{};
    for (size_t i = 0; i < guards.size(); ++i) {
      MemRegistration reg = guards[i];
      try {
        workers_[i]->call([reg](Lane& t) { t.deregister(reg); }, kCommandTimeoutS);
      } catch (const TransportError&) {
        // The engine closed meanwhile: close() released it.
      }
    }
  }
  if (hold.use_count() > 1) return;  // writes reading from it are in flight: the last one releases it
  // Nobody else can take a pin now (the region's hold is gone): close the registrations before
  // returning, so that the caller may free the memory at once.
  std::vector<MemRegistration> regs = std::move(hold->regs);
  hold->regs.clear();
  {
    std::lock_guard<std::mutex> lock(regions_mu_);
    if (closed_ || live_regions_.erase(region->id) == 0) return;
  }
  for (size_t i = 0; i < regs.size() && i < workers_.size(); ++i) {
    MemRegistration reg = regs[i];
    try {
      workers_[i]->call([reg](Lane& t) { t.deregister(reg); }, kCommandTimeoutS);
    } catch (const TransportError&) {
      // The engine closed meanwhile: close() released it.
    }
  }
}

void Engine::release_region(uint64_t id, std::vector<MemRegistration> regs, int landing,
                            std::shared_ptr<void> owner) {
  // Possibly on the cuda lane's own thread (a piece's pin): no waiting for its landing copies here.
  retire_landing(landing, id, false);
  std::lock_guard<std::mutex> lock(regions_mu_);
  if (closed_) return;  // close() deregisters whatever is still live
  if (live_regions_.erase(id) == 0) return;
  if (cuda_lane_ >= 0) workers_[cuda_lane_]->lane().set_region_live(id, false);
  for (size_t i = 0; i < regs.size() && i < workers_.size(); ++i) {
    MemRegistration reg = regs[i];
    // Every command holds the memory's owner: it is released once the last of them ran (or the
    // worker dropped it unrun, stopping).
    workers_[i]->post_command([reg, owner](Lane& t) { t.deregister(reg); });
  }
}

std::shared_ptr<Peer> Engine::connect(const std::string& uid, const std::string& provider,
                                      const std::vector<std::string>& addresses, const std::string& cuda_address,
                                      const std::vector<uint64_t>& doorbell_base,
                                      const std::vector<uint64_t>& doorbell_key) {
  if (closed_) throw TransportError("engine is closed");
  if (provider != cfg_.provider) {
    throw TransportError("peer " + uid + " uses provider '" + provider + "' but this engine uses '" +
                         cfg_.provider + "'");
  }
  if (addresses.empty()) throw TransportError("peer " + uid + " has no NIC address");
  auto peer = std::make_shared<Peer>();
  peer->id = next_peer_++;
  peer->uid = uid;
  peer->remote_nics = addresses.size();
  peer->paths.resize(workers_.size());
  peer->remote_nic.resize(workers_.size());
  peer->path_failed.reset(new std::atomic<bool>[workers_.size()]);
  peer->path_progress_ns.reset(new std::atomic<int64_t>[workers_.size()]);
  peer->nic_load.reset(new std::atomic<int64_t>[workers_.size()]);
  for (size_t i = 0; i < workers_.size(); ++i) {
    peer->path_progress_ns[i] = 0;
    peer->nic_load[i] = 0;
  }
  peer->doorbell_base = doorbell_base;
  peer->doorbell_key = doorbell_key;
  if (doorbell_base.size() != addresses.size() || doorbell_key.size() != addresses.size()) {
    throw TransportError("peer " + uid + ": malformed address (doorbell does not match its NICs)");
  }
  std::string label = "peer " + uid.substr(0, 8) + " (";
  peer->nic_paths = fabric_nics_;
  for (size_t i = 0; i < fabric_nics_; ++i) {
    peer->path_failed[i] = false;
    const int rn = static_cast<int>(i % addresses.size());
    peer->remote_nic[i] = rn;
    uint64_t* slot = &peer->paths[i];
    const std::string& addr = addresses[rn];
    workers_[i]->call([=](Lane& t) { *slot = t.insert_peer(addr); }, kCommandTimeoutS);
    if (i < addresses.size()) {
      label += (i ? ", " : "") + workers_[i]->lane().describe_address(addr);
    }
  }
  if (cuda_lane_ >= 0) {
    peer->path_failed[cuda_lane_] = true;
    if (!cuda_address.empty() && cfg_.cuda_peers) {
      try {
        uint64_t* slot = &peer->paths[cuda_lane_];
        bool* imm = &peer->cuda_imm;
        workers_[cuda_lane_]->call([=](Lane& t) {
          *slot = t.insert_peer(cuda_address);
          *imm = t.delivers_imm(*slot);
        }, kCommandTimeoutS);
        peer->cuda = true;
        label += ", " + workers_[cuda_lane_]->lane().describe_address(cuda_address);
      } catch (const TransportError&) {
        // Another host: the fabric NICs carry everything.
      }
    }
  }
  peer->label = label + ")";
  return peer;
}

std::shared_ptr<RemoteRegion> Engine::import_region(const std::shared_ptr<Peer>& peer, uint64_t id,
                                                    uint64_t len, const std::vector<uint64_t>& base,
                                                    const std::vector<uint64_t>& key, const std::string& cuda_blob,
                                                    int landing, uint64_t slot_bytes) {
  if (base.size() != peer->remote_nics || key.size() != peer->remote_nics) {
    throw UsageError("descriptor of region " + std::to_string(id) + " lists " + std::to_string(base.size()) +
                     " NICs but " + peer->label + " has " + std::to_string(peer->remote_nics));
  }
  auto rr = std::make_shared<RemoteRegion>();
  rr->peer = peer;
  rr->id = id;
  rr->len = len;
  rr->base = base;
  rr->key = key;
  if (landing >= 0) {
    // Offsets travel in the low 48 bits of a message's tag: a larger region would alias other indices.
    if (landing >= int(kLandingIndices) || slot_bytes == 0 || len > (1ull << kLandingOffsetBits)) {
      throw UsageError("descriptor of region " + std::to_string(id) + " of " + peer->label +
                       " has a malformed landing index or slot size");
    }
    rr->landing = landing;
    rr->slot_bytes = slot_bytes;
  }
  if (peer->cuda && !cuda_blob.empty()) {
    uint64_t* slot = &rr->cuda_addr;
    workers_[cuda_lane_]->call([=](Lane& t) { *slot = t.import_remote(cuda_blob); }, kCommandTimeoutS);
  }
  return rr;
}

PieceRule Engine::piece_rule() const {
  return PieceRule{std::max<uint64_t>(fabric_nics_, 1), cfg_.stripe_threshold, cfg_.max_piece};
}

uint64_t Engine::piece_size(uint64_t nbytes) const { return piece_rule().piece_size(nbytes); }

uint64_t Engine::imm_count(uint64_t nbytes, bool has_imm, uint64_t rows) const {
  return piece_rule().imm_count(nbytes, has_imm, rows);
}

int Engine::pick_nic(Peer& peer, uint64_t hint) {
  const size_t n = fabric_nics_;
  for (size_t k = 0; k < n; ++k) {
    size_t i = (hint + k) % n;
    if (!peer.path_failed[i].load()) return static_cast<int>(i);
  }
  return -1;
}

int Engine::place(Piece* p, uint64_t hint) {
  Peer& peer = *p->dst->peer;
  const size_t n = fabric_nics_;
  int best = -1;
  int64_t best_load = 0;
  for (size_t k = 0; k < n; ++k) {
    const size_t i = (hint + k) % n;
    if (peer.path_failed[i].load()) continue;
    const int64_t load = peer.nic_load[i].load(std::memory_order_relaxed);
    if (best < 0 || load < best_load) {
      best = static_cast<int>(i);
      best_load = load;
    }
  }
  if (best >= 0) {
    const uint64_t bytes = std::max<uint64_t>(p->len, 1) * (p->rows > 1 ? p->rows : 1);
    peer.nic_load[best].fetch_add(static_cast<int64_t>(bytes), std::memory_order_relaxed);
    p->load_nic = best;
    p->load_bytes = bytes;
  }
  return best;
}

void Engine::unload(Piece* p) {
  if (p->load_nic < 0) return;
  p->dst->peer->nic_load[p->load_nic].fetch_sub(static_cast<int64_t>(p->load_bytes), std::memory_order_relaxed);
  p->load_nic = -1;
  p->load_bytes = 0;
}

namespace {

// Whether [off, off + (rows - 1) * pitch + len) fits in `size` bytes, without overflowing.
bool extent_fits(uint64_t off, uint64_t rows, uint64_t pitch, uint64_t len, uint64_t size) {
  using u128 = unsigned __int128;
  return u128(off) + u128(rows - 1) * u128(pitch) + u128(len) <= u128(size);
}

std::string extent_str(uint64_t off, uint64_t rows, uint64_t pitch, uint64_t len) {
  if (rows <= 1) return "bytes [" + std::to_string(off) + ", " + std::to_string(off + len) + ")";
  return std::to_string(rows) + " rows of " + std::to_string(len) + " bytes from offset " + std::to_string(off) +
         " with pitch " + std::to_string(pitch);
}

}  // namespace

std::shared_ptr<TransferState> Engine::write(const std::vector<std::shared_ptr<LocalRegion>>& srcs,
                                             const std::vector<std::shared_ptr<RemoteRegion>>& dsts,
                                             const WriteOp* ops, size_t n, bool has_imm) {
  Checked checked = check_ops(srcs, dsts, ops, n, has_imm);
  auto transfer = std::make_shared<TransferState>(0, checked.imms, checked.bytes, checked.what);
  post_ops(transfer, checked, srcs, dsts, ops, n, has_imm);
  return transfer;
}

Engine::Checked Engine::check_ops(const std::vector<std::shared_ptr<LocalRegion>>& srcs,
                                  const std::vector<std::shared_ptr<RemoteRegion>>& dsts, const WriteOp* ops,
                                  size_t n, bool has_imm) {
  if (closed_) throw TransportError("engine is closed");
  // Validate everything first: a bad op must not leave half of a batch posted. Pins taken here keep the
  // sources' registrations alive until their pieces are done, even if deregistered meanwhile.
  Checked out;
  std::vector<std::shared_ptr<RegistrationHold>>& pins = out.pins;
  pins.resize(srcs.size());
  uint64_t imms = 0, bytes = 0;
  for (size_t i = 0; i < n; ++i) {
    const WriteOp& op = ops[i];
    std::string where = n > 1 ? "write " + std::to_string(i) + " of the batch: " : "";
    if (op.src >= srcs.size() || !srcs[op.src]) throw UsageError(where + "source region index out of range");
    if (op.dst >= dsts.size() || !dsts[op.dst]) throw UsageError(where + "destination descriptor index out of range");
    LocalRegion& s = *srcs[op.src];
    const RemoteRegion& d = *dsts[op.dst];
    if (s.engine.get() != this) {
      throw UsageError(where + "source region " + std::to_string(s.id) + " is registered with another engine");
    }
    if (!pins[op.src]) pins[op.src] = s.pin();
    if (!pins[op.src]) throw UsageError(where + "source region " + std::to_string(s.id) + " was deregistered");
    if (op.rows == 0) throw UsageError(where + "a write needs at least one row (rows=0)");
    const uint64_t sp = op.rows > 1 && op.src_pitch ? op.src_pitch : op.len;
    const uint64_t dp = op.rows > 1 && op.dst_pitch ? op.dst_pitch : op.len;
    if (sp < op.len || dp < op.len) {
      throw UsageError(where + "rows of " + std::to_string(op.len) + " bytes do not fit a pitch of " +
                       std::to_string(std::min(sp, dp)) + " bytes (" + (sp < op.len ? "source" : "destination") +
                       " side of a write to region " + std::to_string(d.id) + " of " + d.peer->label + ")");
    }
    if (!extent_fits(op.src_off, op.rows, sp, op.len, s.len)) {
      throw UsageError(where + "reads " + extent_str(op.src_off, op.rows, sp, op.len) + " outside source region " +
                       std::to_string(s.id) + " of " + std::to_string(s.len) + " bytes");
    }
    if (!extent_fits(op.dst_off, op.rows, dp, op.len, d.len)) {
      throw UsageError(where + "writes " + extent_str(op.dst_off, op.rows, dp, op.len) +
                       " past the end of remote region " + std::to_string(d.id) + " of " + d.peer->label + " (" +
                       std::to_string(d.len) + " bytes)");
    }
    const bool by_copy = d.cuda_addr != 0;
    if (!by_copy && !s.on_fabric && !staging_ready_) {
      throw UsageError(where + "source region " + std::to_string(s.id) + " is GPU memory the fabric NICs " +
                       "could not register, and " + d.peer->label + " is not reachable through CUDA IPC (" +
                       s.fabric_error + ")");
    }
    if (!by_copy && pick_nic(*d.peer, 0) < 0) {
      std::lock_guard<std::mutex> lock(d.peer->mu);
      throw TransportError(where + d.peer->label + " is unreachable on every NIC: " + d.peer->last_error);
    }
    if (!by_copy && d.landing >= 0 && !fabric_tagged_) {
      throw UsageError(where + "region " + std::to_string(d.id) + " of " + d.peer->label + " is GPU memory its " +
                       "NICs cannot register (a landing region), and provider " + cfg_.provider +
                       " here sends no tagged messages to reach it");
    }
    if (!by_copy && d.landing >= 0 && has_imm && !fabric_sends_ordered_ && !fabric_delivery_complete_) {
      throw UsageError(where + "provider " + cfg_.provider + " neither keeps messages in order nor completes " +
                       "them at delivery, so an immediate into landing region " + std::to_string(d.id) +
                       " could be counted before its bytes land");
    }
    if (!by_copy && d.landing < 0 && op.rows > 1 && has_imm && !fabric_delivery_complete_ && !fabric_ordered_) {
      throw UsageError(where + "provider " + cfg_.provider + " can neither complete a write at delivery nor " +
                       "keeps writes in order, so the immediate of a 2-D write could overtake its rows");
    }
    imms += imm_count(op.len, has_imm, op.rows);
    bytes += op.len * op.rows;
  }
  out.what = n == 1 ? "write of " + std::to_string(bytes) + " bytes to " + dsts[ops[0].dst]->peer->label +
                          " region " + std::to_string(dsts[ops[0].dst]->id)
                    : "batch of " + std::to_string(n) + " writes (" + std::to_string(bytes) + " bytes)";
  out.imms = imms;
  out.bytes = bytes;
  return out;
}

void Engine::post_ops(const std::shared_ptr<TransferState>& transfer, const Checked& checked,
                      const std::vector<std::shared_ptr<LocalRegion>>& srcs,
                      const std::vector<std::shared_ptr<RemoteRegion>>& dsts, const WriteOp* ops, size_t n,
                      bool has_imm) {
  // Past the workers: pieces with no NIC left, then pieces to stage first.
  std::vector<std::vector<Piece*>> per_nic(workers_.size() + 2);
  bool copies_only = n > 0;
  for (size_t i = 0; i < n; ++i) {
    const WriteOp& op = ops[i];
    make_pieces(op, transfer, srcs[op.src], checked.pins[op.src], dsts[op.dst], has_imm, per_nic);
    copies_only = copies_only && dsts[op.dst]->cuda_addr != 0;
  }
  if (copies_only) transfer->set_wait_spin(cfg_.cuda_spin_us);
  // Messages into a landing region that was deregistered are dropped by its engine, and a message's
  // local completion says nothing about that. So each transfer also writes one byte into every landing
  // region's guard (host bytes its engine registers with the region and closes when it deregisters
  // it), completing at delivery where the provider can: the remote's refusal then fails the transfer.
  std::vector<const RemoteRegion*> guarded;
  for (size_t i = 0; i < n; ++i) {
    const auto& d = dsts[ops[i].dst];
    if (d->cuda_addr != 0 || d->landing < 0) continue;
    if (std::find(guarded.begin(), guarded.end(), d.get()) != guarded.end()) continue;
    guarded.push_back(d.get());
    Piece* g = new Piece();
    g->transfer = transfer;
    g->src = doorbell_;
    g->pin = doorbell_->pin();
    g->dst = d;
    g->len = 1;
    g->delivery = fabric_delivery_complete_;
    const int nic = pick_nic(*d->peer, rr_++);
    g->nic = nic;
    per_nic[nic < 0 ? workers_.size() : static_cast<size_t>(nic)].push_back(g);
  }
  uint64_t pieces = 0;
  for (const auto& v : per_nic) pieces += v.size();
  // Counted before any piece can complete: nothing is submitted yet.
  transfer->add_pending(pieces);
  for (Piece* p : per_nic[workers_.size()]) piece_failed(p, p->dst->peer->label + " became unreachable on every NIC");
  for (size_t i = 0; i < workers_.size(); ++i) {
    if (!per_nic[i].empty()) workers_[i]->submit(std::move(per_nic[i]));
  }
  if (!per_nic.back().empty()) stage(std::move(per_nic.back()));
}

std::pair<uint64_t, std::shared_ptr<TransferState>> Engine::forward(
    uint32_t imm, uint64_t count, const std::vector<std::shared_ptr<LocalRegion>>& srcs,
    const std::vector<std::shared_ptr<RemoteRegion>>& dsts, const WriteOp* ops, size_t n, bool has_imm) {
  // Bad input is refused now, where the caller can see it; the pins are dropped (taken again on firing).
  Checked checked = check_ops(srcs, dsts, ops, n, has_imm);
  auto t = std::make_shared<Trigger>();
  t->id = next_trigger_++;
  t->imm = imm;
  t->count = count;
  t->srcs = srcs;
  t->dsts = dsts;
  t->ops.assign(ops, ops + n);
  t->has_imm = has_imm;
  t->transfer = std::make_shared<TransferState>(
      1, checked.imms, checked.bytes,
      "forward (on " + std::to_string(count) + " immediates " + std::to_string(imm) + ") of " + checked.what);
  bool now = false;
  {
    // The total is read under the trigger lock: an immediate counted before it is seen here, one
    // counted after it finds the trigger (on_immediate takes this lock after counting).
    std::lock_guard<std::mutex> lock(triggers_mu_);
    if (closed_) throw TransportError("engine is closed");
    now = counters_.total(imm) >= count;
    if (!now) {
      triggers_.emplace(imm, t);
      trigger_count_++;
    }
  }
  if (now) fire(t);
  return {t->id, t->transfer};
}

void Engine::on_immediate(uint32_t imm, uint64_t total) {
  if (trigger_count_.load() == 0) return;
  std::vector<std::shared_ptr<Trigger>> ready;
  {
    std::lock_guard<std::mutex> lock(triggers_mu_);
    auto range = triggers_.equal_range(imm);
    for (auto it = range.first; it != range.second;) {
      if (it->second->count <= total) {
        ready.push_back(std::move(it->second));
        it = triggers_.erase(it);
        trigger_count_--;
      } else {
        ++it;
      }
    }
  }
  for (const auto& t : ready) fire(t);
}

void Engine::fire(const std::shared_ptr<Trigger>& t) {
  // On a worker thread (or the caller's, when already due): nothing may escape.
  try {
    Checked checked = check_ops(t->srcs, t->dsts, t->ops.data(), t->ops.size(), t->has_imm);
    post_ops(t->transfer, checked, t->srcs, t->dsts, t->ops.data(), t->ops.size(), t->has_imm);
    t->transfer->piece_done();  // "not fired yet" is over; the pieces now hold the transfer open
  } catch (const std::exception& e) {
    t->transfer->fail(t->transfer->what() + " failed when it fired: " + e.what());
  }
}

size_t Engine::cancel_forwards(uint64_t id, bool by_imm, uint32_t imm) {
  std::vector<std::shared_ptr<Trigger>> gone;
  {
    std::lock_guard<std::mutex> lock(triggers_mu_);
    for (auto it = triggers_.begin(); it != triggers_.end();) {
      const Trigger& t = *it->second;
      if ((id != 0 && t.id == id) || (id == 0 && (!by_imm || t.imm == imm))) {
        gone.push_back(std::move(it->second));
        it = triggers_.erase(it);
        trigger_count_--;
      } else {
        ++it;
      }
    }
  }
  for (const auto& t : gone) t->transfer->fail(t->transfer->what() + " was cancelled before it fired");
  return gone.size();
}

size_t Engine::pending_forwards() { return trigger_count_.load(); }

bool Engine::forward_pending(uint64_t id) {
  std::lock_guard<std::mutex> lock(triggers_mu_);
  for (const auto& [imm, t] : triggers_) {
    if (t->id == id) return true;
  }
  return false;
}

void Engine::piece_done(Piece* p, int nic) {
  unload(p);
  if (p->stage == 1) {
    send_staged(p);  // in its slot now: on to a NIC
    return;
  }
  if (p->stage_slot >= 0) release_slot(p);
  if (nic == cuda_lane_ && p->signals > 0) {
    send_signals(p);
  } else {
    p->transfer->piece_done();
  }
  if (p->group) group_member_done(p, true);
  delete p;
}

void Engine::send_signals(Piece* copy) {
  auto bell = std::make_shared<RemoteRegion>();
  bell->peer = copy->dst->peer;
  bell->len = 64;
  bell->base = copy->dst->peer->doorbell_base;
  bell->key = copy->dst->peer->doorbell_key;
  // The copy's place in the transfer passes to its signals: one for each immediate it owes.
  if (copy->signals > 1) copy->transfer->add_pending(copy->signals - 1);
  std::vector<std::vector<Piece*>> per_nic(workers_.size());
  for (uint64_t k = 0; k < copy->signals; ++k) {
    Piece* s = new Piece();
    s->transfer = copy->transfer;
    s->src = doorbell_;
    s->dst = bell;
    s->has_imm = true;
    s->imm = copy->imm;
    s->delivery = fabric_delivery_complete_;
    int nic = pick_nic(*bell->peer, rr_++);
    if (nic < 0) {
      piece_failed(s, bell->peer->label + " is unreachable on every NIC to deliver a copy's completion");
      continue;
    }
    s->nic = nic;
    per_nic[nic].push_back(s);
  }
  for (size_t i = 0; i < per_nic.size(); ++i) {
    if (!per_nic[i].empty()) workers_[i]->submit(std::move(per_nic[i]));
  }
}

void Engine::piece_failed(Piece* p, const std::string& why) {
  unload(p);
  if (p->stage_slot >= 0) release_slot(p);
  p->transfer->piece_failed(p->transfer->what() + " failed: " + why);
  if (p->group) group_member_done(p, false);
  delete p;
}

void Engine::abandon(Piece* p, const std::string& why) {
  unload(p);
  p->transfer->piece_failed(p->transfer->what() + " failed: " + why);
  if (p->group) group_member_done(p, false);
  p->stale = true;
}

void Engine::release_abandoned(Piece* p) {
  if (p->stage_slot >= 0) release_slot(p);
  delete p;
}

void Engine::reroute(Piece* p, int failed_nic, const std::string& why) {
  Peer& peer = *p->dst->peer;
  {
    std::lock_guard<std::mutex> lock(peer.mu);
    peer.last_error = "NIC " + workers_[failed_nic]->lane().nic_name() + ": " + why;
  }
  if (closed_) {
    piece_failed(p, "engine closed");
    return;
  }
  if (announces_ && p->has_imm && p->tagged && p->dst->landing >= 0 && (p->data_done || p->len == 0)) {
    // A landing piece's announce is counted by the ring of the NIC it arrives on, in that ring's
    // order, so only behind its bytes on their own NIC: moved to another NIC it could be counted before
    // the first NIC's ring has copied them. The write fails instead (never counted early; if the first
    // announce did arrive, it is counted once, after its bytes).
    piece_failed(p, "its immediate must follow its bytes through the landing ring of NIC " +
                        workers_[failed_nic]->lane().nic_name() + ", and that path failed (" + why + ")");
    return;
  }
  unload(p);
  int nic = place(p, static_cast<uint64_t>(failed_nic) + 1);
  if (nic < 0) {
    piece_failed(p, peer.label + " is unreachable on every NIC (last: " + why + ")");
    return;
  }
  p->nic = nic;
  workers_[nic]->submit({p});
}

void Engine::close() {
  {
    // Under the trigger lock, so that forward() cannot register after the triggers are failed below.
    std::lock_guard<std::mutex> lock(triggers_mu_);
    if (closed_.exchange(true)) return;
  }
  std::unordered_multimap<uint32_t, std::shared_ptr<Trigger>> triggers;
  {
    std::lock_guard<std::mutex> lock(triggers_mu_);
    triggers.swap(triggers_);
    trigger_count_ = 0;
  }
  for (auto& [imm, t] : triggers) t->transfer->fail(t->transfer->what() + ": engine closed before it fired");
  counters_.close();
  for (auto& w : workers_) w->stop();
  std::unordered_map<uint64_t, std::vector<MemRegistration>> live;
  {
    std::lock_guard<std::mutex> lock(regions_mu_);
    live.swap(live_regions_);
  }
  // Workers are joined: this thread may now touch the lanes directly.
  {
    std::lock_guard<std::mutex> lock(landing_mu_);
    for (auto& e : landing_) {
      if (!e) continue;
      std::lock_guard<std::mutex> elock(e->mu);
      e->valid = false;
    }
    landing_.clear();
  }
  if (cuda_lane_ >= 0) {
    // Landing copies still queued read from the ring: done before it goes (their buffers were posted
    // for the last time, and nobody waits for their immediates any more).
    for (void* job : local_copies()->drain_landing()) delete static_cast<LandingJob*>(job);
  }
  for (auto& [id, regs] : live) {
    for (size_t i = 0; i < regs.size() && i < workers_.size(); ++i) workers_[i]->lane().deregister(regs[i]);
  }
  if (staging_) {
    pump_staging();  // fails what still waits for a slot
    if (staging_->pinned) {
      local_copies()->free_pinned(staging_->base);
    } else {
      std::free(staging_->base);
    }
    staging_->base = nullptr;
  }
  // Taken out under the lock that deregister() and release_region() check closed_ under; destroyed
  // outside it, because the pieces they free release their registrations through that lock.
  std::vector<std::unique_ptr<LaneWorker>> workers;
  {
    std::lock_guard<std::mutex> lock(regions_mu_);
    workers.swap(workers_);
  }
  // The fabric endpoints go first: receives are posted into the landing ring until they are closed.
  // Then the ring (page-locked memory goes back through the cuda lane's context), then the cuda lane.
  for (size_t i = 0; i < fabric_nics_ && i < workers.size(); ++i) workers[i].reset();
  if (landing_base_ != nullptr) {
    if (landing_pinned_) {
      workers[cuda_lane_]->lane().local_copies()->free_pinned(landing_base_);
    } else {
      std::free(landing_base_);
    }
    landing_base_ = nullptr;
  }
  workers.clear();
}

}  // namespace weightsync
