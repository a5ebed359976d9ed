#include "weightsync/engine.hpp"

#include <algorithm>
#include <cstdio>
#include <random>
#include <sstream>

#include "weightsync/errors.hpp"
#include "weightsync/cuda_transport.hpp"
#include "weightsync/fabric_transport.hpp"

namespace weightsync {

namespace {

constexpr double kCommandTimeoutS = 30.0;

std::string random_uid() {
  std::random_device rd;
  char buf[33];
  for (int i = 0; i < 4; ++i) std::snprintf(buf + 8 * i, 9, "%08x", rd());
  return std::string(buf, 32);
}

uint64_t ceil_div(uint64_t a, uint64_t b) { return (a + b - 1) / b; }

}  // namespace

LocalRegion::~LocalRegion() {
  if (engine) engine->release_region(id, std::move(regs));
}

std::shared_ptr<Engine> Engine::create(const EngineConfig& cfg) {
  std::shared_ptr<Engine> engine(new Engine(cfg));
  engine->start();
  return engine;
}

Engine::Engine(const EngineConfig& cfg) : cfg_(cfg), uid_(random_uid()) {
  if (cfg_.transport != "fabric") {
    throw TransportError("transport '" + cfg_.transport + "' is not available in this build (have: fabric)");
  }
  if (cfg_.max_piece == 0) throw TransportError("max_piece must be positive");
  cfg_.stripe_threshold = std::min(cfg_.stripe_threshold, cfg_.max_piece);
  if (cfg_.provider.empty()) cfg_.provider = FabricTransport::pick_provider();
  if (cfg_.nics.empty()) {
    for (const auto& nic : FabricTransport::discover(cfg_.provider)) cfg_.nics.push_back(nic.domain);
    if (cfg_.nics.empty()) throw TransportError("libfabric provider '" + cfg_.provider + "' offers no NIC here");
  }
  for (size_t i = 0; i < cfg_.nics.size(); ++i) {
    auto transport = std::make_unique<FabricTransport>(cfg_.provider, cfg_.nics[i]);
    cfg_.max_piece = std::min<uint64_t>(cfg_.max_piece, transport->max_write());
    workers_.push_back(std::make_unique<NicWorker>(this, static_cast<int>(i), std::move(transport), cfg_));
  }
  fabric_nics_ = workers_.size();
  cfg_.stripe_threshold = std::min(cfg_.stripe_threshold, cfg_.max_piece);
  if (cfg_.cuda_device >= 0) {
    cuda_lane_ = static_cast<int>(workers_.size());
    workers_.push_back(std::make_unique<NicWorker>(this, cuda_lane_,
                                                   std::make_unique<CudaTransport>(cfg_.cuda_device), cfg_));
  }
}

void Engine::start() {
  for (auto& w : workers_) w->start();
  // The doorbell: copy-engine completions reach peers as zero-length writes into it. It must not hold
  // the engine alive (the engine owns it), and close() deregisters it with everything else.
  doorbell_ = register_memory(doorbell_mem_.data(), doorbell_mem_.size(), MemKind::kHost, -1);
  doorbell_->engine.reset();
}

std::string Engine::cuda_address() const {
  return cuda_lane_ < 0 ? std::string() : workers_[cuda_lane_]->transport().address();
}

std::string Engine::cuda_name() const {
  return cuda_lane_ < 0 ? std::string() : workers_[cuda_lane_]->transport().nic_name();
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

std::string Engine::provider() const { return cfg_.provider; }
std::string Engine::transport_kind() const { return cfg_.transport; }

std::vector<std::string> Engine::nic_names() const {
  std::vector<std::string> out;
  for (size_t i = 0; i < fabric_nics_ && i < workers_.size(); ++i) out.push_back(workers_[i]->transport().nic_name());
  return out;
}

std::vector<std::string> Engine::nic_addresses() const {
  std::vector<std::string> out;
  for (size_t i = 0; i < fabric_nics_ && i < workers_.size(); ++i) out.push_back(workers_[i]->transport().address());
  return out;
}

std::shared_ptr<LocalRegion> Engine::register_memory(void* ptr, uint64_t len, MemKind kind, int device) {
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
  size_t done = 0;
  try {
    for (; done < workers_.size(); ++done) {
      MemRegistration* slot = &region->regs[done];
      try {
        workers_[done]->call([=](Transport& t) { *slot = t.register_memory(ptr, len, kind, device); },
                             kCommandTimeoutS);
      } catch (const TransportError& e) {
        // GPU memory a fabric NIC cannot register stays usable through the cuda lane.
        if (kind != MemKind::kCuda || static_cast<int>(done) == cuda_lane_) throw;
        region->on_fabric = false;
        region->fabric_error = e.what();
      }
    }
  } catch (...) {
    // Undo the registrations that succeeded before the failure.
    for (size_t i = 0; i < done; ++i) {
      MemRegistration reg = region->regs[i];
      workers_[i]->post_command([reg](Transport& t) { t.deregister(reg); });
    }
    region->regs.clear();
    throw;
  }
  {
    std::lock_guard<std::mutex> lock(regions_mu_);
    live_regions_[region->id] = region->regs;
  }
  region->engine = shared_from_this();
  return region;
}

void Engine::deregister(const std::shared_ptr<LocalRegion>& region) {
  // Writes already in flight keep the registration alive through their pieces; new ones are refused.
  region->valid = false;
}

void Engine::release_region(uint64_t id, std::vector<MemRegistration> regs) {
  std::lock_guard<std::mutex> lock(regions_mu_);
  if (closed_) return;  // close() deregisters whatever is still live
  if (live_regions_.erase(id) == 0) return;
  for (size_t i = 0; i < regs.size() && i < workers_.size(); ++i) {
    MemRegistration reg = regs[i];
    workers_[i]->post_command([reg](Transport& t) { t.deregister(reg); });
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
  peer->doorbell_base = doorbell_base;
  peer->doorbell_key = doorbell_key;
  if (doorbell_base.size() != addresses.size() || doorbell_key.size() != addresses.size()) {
    throw TransportError("peer " + uid + ": malformed address (doorbell does not match its NICs)");
  }
  std::string label = "peer " + uid.substr(0, 8) + " (";
  for (size_t i = 0; i < fabric_nics_; ++i) {
    peer->path_failed[i] = false;
    const int rn = static_cast<int>(i % addresses.size());
    peer->remote_nic[i] = rn;
    uint64_t* slot = &peer->paths[i];
    const std::string& addr = addresses[rn];
    workers_[i]->call([=](Transport& t) { *slot = t.insert_peer(addr); }, kCommandTimeoutS);
    if (i < addresses.size()) {
      label += (i ? ", " : "") + workers_[i]->transport().describe_address(addr);
    }
  }
  if (cuda_lane_ >= 0) {
    peer->path_failed[cuda_lane_] = true;
    if (!cuda_address.empty()) {
      try {
        uint64_t* slot = &peer->paths[cuda_lane_];
        bool* imm = &peer->cuda_imm;
        workers_[cuda_lane_]->call([=](Transport& t) {
          *slot = t.insert_peer(cuda_address);
          *imm = t.delivers_imm(*slot);
        }, kCommandTimeoutS);
        peer->cuda = true;
        label += ", " + workers_[cuda_lane_]->transport().describe_address(cuda_address);
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
                                                    const std::vector<uint64_t>& key, const std::string& cuda_blob) {
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
  if (peer->cuda && !cuda_blob.empty()) {
    uint64_t* slot = &rr->cuda_addr;
    workers_[cuda_lane_]->call([=](Transport& t) { *slot = t.import_remote(cuda_blob); }, kCommandTimeoutS);
  }
  return rr;
}

uint64_t Engine::piece_size(uint64_t nbytes) const {
  if (nbytes <= cfg_.stripe_threshold) return std::max<uint64_t>(nbytes, 1);
  // Above the threshold: a multiple of the NIC count of equal pieces (so every NIC carries the same
  // share), 4 KiB aligned, none larger than max_piece.
  const uint64_t nics = std::max<size_t>(fabric_nics_, 1);
  const uint64_t count = nics * ceil_div(nbytes, nics * cfg_.max_piece);
  return std::min(ceil_div(ceil_div(nbytes, count), 4096) * 4096, cfg_.max_piece);
}

uint64_t Engine::imm_count(uint64_t nbytes, bool has_imm) const {
  if (!has_imm) return 0;
  if (nbytes == 0) return 1;  // a zero-length write still delivers its immediate
  return ceil_div(nbytes, piece_size(nbytes));
}

int Engine::pick_nic(Peer& peer, uint64_t hint) {
  const size_t n = fabric_nics_;
  for (size_t k = 0; k < n; ++k) {
    size_t i = (hint + k) % n;
    if (!peer.path_failed[i].load()) return static_cast<int>(i);
  }
  return -1;
}

std::shared_ptr<TransferState> Engine::write(const std::vector<std::shared_ptr<LocalRegion>>& srcs,
                                             const std::vector<std::shared_ptr<RemoteRegion>>& dsts,
                                             const WriteOp* ops, size_t n, bool has_imm) {
  if (closed_) throw TransportError("engine is closed");
  // Validate everything first: a bad op must not leave half of a batch posted.
  uint64_t pieces = 0, imms = 0, bytes = 0;
  for (size_t i = 0; i < n; ++i) {
    const WriteOp& op = ops[i];
    std::string where = n > 1 ? "write " + std::to_string(i) + " of the batch: " : "";
    if (op.src >= srcs.size() || !srcs[op.src]) throw UsageError(where + "source region index out of range");
    if (op.dst >= dsts.size() || !dsts[op.dst]) throw UsageError(where + "destination descriptor index out of range");
    const LocalRegion& s = *srcs[op.src];
    const RemoteRegion& d = *dsts[op.dst];
    if (!s.valid || s.engine.get() != this) {
      throw UsageError(where + "source region " + std::to_string(s.id) +
                       (s.valid ? " is registered with another engine" : " was deregistered"));
    }
    if (op.src_off > s.len || op.len > s.len - op.src_off) {
      throw UsageError(where + "reads bytes [" + std::to_string(op.src_off) + ", " +
                       std::to_string(op.src_off + op.len) + ") outside source region " + std::to_string(s.id) +
                       " of " + std::to_string(s.len) + " bytes");
    }
    if (op.dst_off > d.len || op.len > d.len - op.dst_off) {
      throw UsageError(where + "writes bytes [" + std::to_string(op.dst_off) + ", " +
                       std::to_string(op.dst_off + op.len) + ") past the end of remote region " +
                       std::to_string(d.id) + " of " + d.peer->label + " (" + std::to_string(d.len) + " bytes)");
    }
    const bool by_copy = d.cuda_addr != 0;
    if (!by_copy && !s.on_fabric) {
      throw UsageError(where + "source region " + std::to_string(s.id) + " is GPU memory the fabric NICs " +
                       "could not register, and " + d.peer->label + " is not reachable through CUDA IPC (" +
                       s.fabric_error + ")");
    }
    if (!by_copy && pick_nic(*d.peer, 0) < 0) {
      std::lock_guard<std::mutex> lock(d.peer->mu);
      throw TransportError(where + d.peer->label + " is unreachable on every NIC: " + d.peer->last_error);
    }
    pieces += op.len == 0 ? (has_imm ? 1 : 0) : ceil_div(op.len, piece_size(op.len));
    imms += imm_count(op.len, has_imm);
    bytes += op.len;
  }
  std::string what = n == 1 ? "write of " + std::to_string(bytes) + " bytes to " + dsts[ops[0].dst]->peer->label +
                                  " region " + std::to_string(dsts[ops[0].dst]->id)
                            : "batch of " + std::to_string(n) + " writes (" + std::to_string(bytes) + " bytes)";
  auto transfer = std::make_shared<TransferState>(pieces, imms, bytes, what);
  if (pieces == 0) return transfer;

  std::vector<std::vector<Piece*>> per_nic(workers_.size());
  for (size_t i = 0; i < n; ++i) {
    const WriteOp& op = ops[i];
    if (op.len == 0 && !has_imm) continue;
    const uint64_t step = piece_size(op.len);
    const uint64_t count = op.len == 0 ? 1 : ceil_div(op.len, step);
    const bool by_copy = dsts[op.dst]->cuda_addr != 0;
    const uint64_t start = by_copy ? 0 : rr_.fetch_add(count);
    for (uint64_t k = 0; k < count; ++k) {
      Piece* p = new Piece();
      p->transfer = transfer;
      p->src = srcs[op.src];
      p->dst = dsts[op.dst];
      p->src_off = op.src_off + k * step;
      p->dst_off = op.dst_off + k * step;
      p->len = op.len == 0 ? 0 : std::min(step, op.len - k * step);
      p->imm = op.imm;
      p->has_imm = has_imm;
      if (by_copy) {
        // The same pieces as over the NICs, each a copy-engine copy. Its immediate goes into the peer's
        // shared-memory ring when that copy is done, or (no ring) follows over a fabric NIC.
        const bool ring = p->dst->peer->cuda_imm;
        p->has_imm = has_imm && ring;
        p->signals = has_imm && !ring ? 1 : 0;
        p->nic = cuda_lane_;
        per_nic[cuda_lane_].push_back(p);
        continue;
      }
      int nic = pick_nic(*p->dst->peer, start + k);
      if (nic < 0) {
        piece_failed(p, p->dst->peer->label + " became unreachable on every NIC");
        continue;
      }
      p->nic = nic;
      per_nic[nic].push_back(p);
    }
  }
  for (size_t i = 0; i < workers_.size(); ++i) {
    if (!per_nic[i].empty()) workers_[i]->submit(std::move(per_nic[i]));
  }
  return transfer;
}

void Engine::piece_done(Piece* p, int nic) {
  if (nic == cuda_lane_ && p->signals > 0) {
    send_signals(p);
  } else {
    p->transfer->piece_done();
  }
  delete p;
}

void Engine::send_signals(Piece* copy) {
  auto bell = std::make_shared<RemoteRegion>();
  bell->peer = copy->dst->peer;
  bell->len = 64;
  bell->base = copy->dst->peer->doorbell_base;
  bell->key = copy->dst->peer->doorbell_key;
  std::vector<std::vector<Piece*>> per_nic(workers_.size());
  for (uint64_t k = 0; k < copy->signals; ++k) {
    Piece* s = new Piece();
    s->transfer = copy->transfer;
    s->src = doorbell_;
    s->dst = bell;
    s->has_imm = true;
    s->imm = copy->imm;
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
  p->transfer->piece_failed(p->transfer->what() + " failed: " + why);
  delete p;
}

void Engine::reroute(Piece* p, int failed_nic, const std::string& why) {
  Peer& peer = *p->dst->peer;
  {
    std::lock_guard<std::mutex> lock(peer.mu);
    peer.last_error = "NIC " + workers_[failed_nic]->transport().nic_name() + ": " + why;
  }
  peer.path_failed[failed_nic] = true;
  if (closed_) {
    piece_failed(p, "engine closed");
    return;
  }
  int nic = pick_nic(peer, static_cast<uint64_t>(failed_nic) + 1);
  if (nic < 0) {
    piece_failed(p, peer.label + " is unreachable on every NIC (last: " + why + ")");
    return;
  }
  p->nic = nic;
  workers_[nic]->submit({p});
}

std::vector<NicStats> Engine::stats() {
  std::vector<NicStats> out;
  for (auto& w : workers_) out.push_back(w->stats());
  return out;
}

void Engine::close() {
  if (closed_.exchange(true)) return;
  counters_.close();
  for (auto& w : workers_) w->stop();
  std::unordered_map<uint64_t, std::vector<MemRegistration>> live;
  {
    std::lock_guard<std::mutex> lock(regions_mu_);
    live.swap(live_regions_);
  }
  // Workers are joined: this thread may now touch the transports directly.
  for (auto& [id, regs] : live) {
    for (size_t i = 0; i < regs.size() && i < workers_.size(); ++i) workers_[i]->transport().deregister(regs[i]);
  }
  workers_.clear();
}

}  // namespace weightsync
