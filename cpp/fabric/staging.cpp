// Host staging: sources the NICs cannot read (GPU memory without FI_HMEM) reach fabric peers through a
// pool of page-locked host slots (Engine members; see EngineConfig::staging_slots). The copy lane copies a
// piece into its slot, a NIC lane sends it from there, and the slot goes back once the send completed.
#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <string>

#include "core/engine.hpp"
#include "core/lane_worker.hpp"
#include "core/errors.hpp"
#include "core/log.hpp"

namespace weightsync {

std::shared_ptr<LocalRegion> Engine::register_host_buffer(uint64_t bytes, const char* what, char** base,
                                                          bool* pinned) {
  *pinned = local_copies() != nullptr;
  if (*pinned) {
    // Page-locked: the copy lane's copies into and out of it are then true DMA, asynchronous to the host.
    workers_[cuda_lane_]->call([&](Lane& t) { *base = static_cast<char*>(t.local_copies()->alloc_pinned(bytes)); },
                               kCommandTimeoutS);
  } else {
    *base = static_cast<char*>(std::malloc(bytes));
    if (*base == nullptr) throw TransportError("cannot allocate " + std::to_string(bytes) + " " + what + " bytes");
  }
  std::shared_ptr<LocalRegion> region;
  try {
    region = register_memory(*base, bytes, MemKind::kHost, -1, true);
  } catch (...) {
    char* b = *base;
    if (*pinned) {
      workers_[cuda_lane_]->call([b](Lane& t) { t.local_copies()->free_pinned(b); }, kCommandTimeoutS);
    } else {
      std::free(b);
    }
    *base = nullptr;
    throw;
  }
  region->engine.reset();  // the engine owns the buffer: its region must not hold the engine alive
  return region;
}

void Engine::ensure_staging() {
  std::lock_guard<std::mutex> lock(staging_init_mu_);
  if (staging_) return;
  auto pool = std::make_unique<StagingPool>();
  const uint64_t slots = std::max<uint64_t>(cfg_.staging_slots, 1);
  pool->slot_bytes = cfg_.max_piece;
  pool->region = register_host_buffer(slots * pool->slot_bytes, "staging", &pool->base, &pool->pinned);
  pool->pin = pool->region->pin();
  for (uint64_t i = 0; i < slots; ++i) pool->free.push_back(static_cast<int>(slots - 1 - i));
  staging_ = std::move(pool);
  staging_ready_ = true;
}

void Engine::stage(std::vector<Piece*> pieces) {
  {
    std::lock_guard<std::mutex> lock(staging_->mu);
    for (Piece* p : pieces) staging_->waiting.push_back(p);
  }
  pump_staging();
}

void Engine::pump_staging() {
  // Pieces wait for a free slot in submission order; each slot goes back when its write completed.
  std::vector<Piece*> go, dead;
  {
    std::lock_guard<std::mutex> lock(staging_->mu);
    while (!staging_->waiting.empty() && (closed_ || !staging_->free.empty())) {
      Piece* p = staging_->waiting.front();
      staging_->waiting.pop_front();
      if (closed_) {
        dead.push_back(p);
        continue;
      }
      p->stage_slot = staging_->free.back();
      staging_->free.pop_back();
      p->stage_ptr = staging_->base + uint64_t(p->stage_slot) * staging_->slot_bytes;
      go.push_back(p);
    }
  }
  for (Piece* p : dead) piece_failed(p, "engine closed with the write queued for staging");
  for (Piece* p : go) {
    if (p->transfer->failed()) {
      piece_failed(p, p->transfer->error());
    } else if (p->src->kind == MemKind::kCuda && cuda_lane_ >= 0) {
      // Device to host on the copy engines; completion comes back through piece_done (stage 1).
      p->nic = cuda_lane_;
      workers_[cuda_lane_]->submit({p});
    } else {
      std::memcpy(p->stage_ptr, static_cast<const char*>(p->src->ptr) + p->src_off, p->len);
      send_staged(p);
    }
  }
}

void Engine::send_staged(Piece* p) {
  p->stage = 2;
  p->src = staging_->region;
  p->pin = staging_->pin;
  p->src_off = uint64_t(p->stage_slot) * staging_->slot_bytes;
  const int nic = p->fixed_nic >= 0 && !p->dst->peer->path_failed[p->fixed_nic].load() ? p->fixed_nic
                                                                                      : place(p, rr_++);
  if (nic < 0) {
    piece_failed(p, p->dst->peer->label + " became unreachable on every NIC");
    return;
  }
  p->nic = nic;
  workers_[nic]->submit({p});
}

void Engine::release_slot(Piece* p) {
  {
    std::lock_guard<std::mutex> lock(staging_->mu);
    staging_->free.push_back(p->stage_slot);
  }
  p->stage_slot = -1;
  pump_staging();
}

}  // namespace weightsync
