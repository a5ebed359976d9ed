// How a write becomes pieces: cut by the piece rule (core/pieces.hpp) and spread over the NICs, or one
// copy on the cuda lane, or messages into a landing region; the pieces of a write that share one
// immediate (a PieceGroup) and the trailer that carries it once they are all done.
#include <algorithm>

#include "core/engine.hpp"
#include "core/lane_worker.hpp"

namespace weightsync {

Piece* Engine::new_piece(const WriteOp& op, const std::shared_ptr<TransferState>& transfer,
                         const std::shared_ptr<LocalRegion>& src, const std::shared_ptr<RegistrationHold>& pin,
                         const std::shared_ptr<RemoteRegion>& dst, uint64_t src_off, uint64_t dst_off,
                         uint64_t len) {
  Piece* p = new Piece();
  p->transfer = transfer;
  p->src = src;
  p->pin = pin;
  p->dst = dst;
  p->src_off = src_off;
  p->dst_off = dst_off;
  p->len = len;
  p->imm = op.imm;
  return p;
}

Piece* Engine::trailer_piece(const WriteOp& op, const std::shared_ptr<TransferState>& transfer,
                             const std::shared_ptr<RemoteRegion>& dst, uint64_t dst_off) {
  return new_piece(op, transfer, doorbell_, doorbell_->pin(), dst, 0, dst_off, 0);
}

void Engine::make_pieces(const WriteOp& op, const std::shared_ptr<TransferState>& transfer,
                         const std::shared_ptr<LocalRegion>& src, const std::shared_ptr<RegistrationHold>& pin,
                         const std::shared_ptr<RemoteRegion>& dst, bool has_imm,
                         std::vector<std::vector<Piece*>>& per_nic) {
  const bool by_copy = dst->cuda_addr != 0;
  const bool two_d = op.rows > 1;
  const uint64_t sp = two_d && op.src_pitch ? op.src_pitch : op.len;
  const uint64_t dp = two_d && op.dst_pitch ? op.dst_pitch : op.len;
  // Rows back to back on both sides are one contiguous span: cut it like a 1-D write.
  const bool span = !two_d || (sp == op.len && dp == op.len);
  const uint64_t total = op.len * op.rows;
  const uint64_t imms = imm_count(op.len, has_imm, op.rows);
  std::vector<Piece*> data;
  auto piece = [&](uint64_t src_off, uint64_t dst_off, uint64_t len) {
    Piece* p = new_piece(op, transfer, src, pin, dst, src_off, dst_off, len);
    data.push_back(p);
    return p;
  };

  if (by_copy) {
    // Copy engines: copies of cuda_piece bytes (or whole rows of a 2-D block) spread over the lane's
    // streams. The write's immediates (its count by the rule above, so both lanes agree) go into the
    // peer's shared-memory ring once every copy is done, or (no ring) follow over a fabric NIC.
    const uint64_t step = cfg_.cuda_piece ? cfg_.cuda_piece : std::max<uint64_t>(total, 1);
    if (span) {
      for (uint64_t o = 0; o < total; o += step) piece(op.src_off + o, op.dst_off + o, std::min(step, total - o));
    } else {
      const uint64_t rows_per = std::max<uint64_t>(1, op.len ? step / op.len : op.rows);
      for (uint64_t r = 0; r < op.rows; r += rows_per) {
        Piece* p = piece(op.src_off + r * sp, op.dst_off + r * dp, op.len);
        p->rows = std::min(rows_per, op.rows - r);
        p->src_pitch = sp;
        p->dst_pitch = dp;
      }
    }
    const bool ring = dst->peer->cuda_imm;
    auto carry = [&](Piece* p) {
      p->has_imm = ring;
      p->imm_repeat = static_cast<uint32_t>(imms);
      p->signals = ring ? 0 : imms;
    };
    if (imms > 0 && data.size() <= 1) {
      if (data.empty()) piece(op.src_off, op.dst_off, 0);
      carry(data[0]);
    } else if (imms > 0) {
      auto group = std::make_shared<PieceGroup>(data.size());
      Piece* t = trailer_piece(op, transfer, dst, op.dst_off);
      t->nic = cuda_lane_;
      carry(t);
      group->trailer = t;
      for (Piece* p : data) p->group = group;
      transfer->add_pending(1);  // the trailer
    }
    for (Piece* p : data) {
      p->nic = cuda_lane_;
      per_nic[cuda_lane_].push_back(p);
    }
    return;
  }

  if (dst->landing >= 0) {
    make_landing_pieces(op, transfer, src, pin, dst, has_imm, per_nic);
    return;
  }

  // Fabric NICs.
  if (!two_d) {
    const uint64_t step = piece_size(op.len);
    if (op.len == 0 && has_imm) piece(op.src_off, op.dst_off, 0);
    for (uint64_t o = 0; o < op.len; o += step) piece(op.src_off + o, op.dst_off + o, std::min(step, op.len - o));
    for (Piece* p : data) p->has_imm = has_imm;
  } else if (span) {
    const uint64_t step = piece_size(total);
    for (uint64_t o = 0; o < total; o += step) piece(op.src_off + o, op.dst_off + o, std::min(step, total - o));
  } else {
    // Rows as separate RMA writes (a one-sided write cannot scatter); long rows striped like 1-D writes.
    const uint64_t step = piece_size(op.len);
    for (uint64_t r = 0; r < op.rows; ++r) {
      for (uint64_t o = 0; o < op.len; o += step) {
        piece(op.src_off + r * sp + o, op.dst_off + r * dp + o, std::min(step, op.len - o));
      }
    }
  }
  const uint64_t start = rr_.fetch_add(std::max<size_t>(data.size(), 1));
  int fixed_nic = -1;
  if (two_d && has_imm) {
    // One immediate for all rows, posted once every row completed locally. Local completion must mean
    // "placed at the target" (FI_DELIVERY_COMPLETE), or the trailer, racing on another NIC, could be
    // counted before the rows land. A provider without it but with ordered writes gets everything on
    // one NIC instead (a NIC failure that moves rows elsewhere then loses that guarantee).
    if (!fabric_delivery_complete_) fixed_nic = pick_nic(*dst->peer, start);
    Piece* t = trailer_piece(op, transfer, dst, op.dst_off);
    t->has_imm = true;
    t->nic = fixed_nic;
    t->delivery = fabric_delivery_complete_;
    if (data.empty()) {
      data.push_back(t);
    } else {
      auto group = std::make_shared<PieceGroup>(data.size());
      group->trailer = t;
      for (Piece* p : data) {
        p->group = group;
        p->delivery = fabric_delivery_complete_;
      }
      transfer->add_pending(1);  // the trailer
    }
  }
  for (uint64_t k = 0; k < data.size(); ++k) {
    Piece* p = data[k];
    // Every fabric write completes only once placed at the target: a write lost with its connection
    // (a peer that dropped it after refusing another write, a link cut with bytes in a socket buffer)
    // then comes back as an error and is retried, instead of completing locally as if it had landed.
    p->delivery = p->delivery || fabric_delivery_complete_;
    if (!src->on_fabric && p->src == src) {
      // The NICs cannot read this source: the piece goes through a staging slot, its NIC picked then.
      p->stage = 1;
      per_nic.back().push_back(p);
      continue;
    }
    const int nic = fixed_nic >= 0 ? fixed_nic : place(p, start + k);
    p->nic = nic;
    per_nic[nic < 0 ? workers_.size() : static_cast<size_t>(nic)].push_back(p);
  }
}

PieceGroup::~PieceGroup() { delete trailer; }

void Engine::group_member_done(Piece* p, bool ok) {
  std::shared_ptr<PieceGroup> group = std::move(p->group);
  if (!ok) group->failed = true;
  if (group->remaining.fetch_sub(1) != 1) return;
  if (group->failed) return;  // the transfer already failed; the trailer goes with the group
  Piece* t = group->trailer;
  group->trailer = nullptr;
  post_trailer(t);
}

void Engine::post_trailer(Piece* t) {
  if (t->nic == cuda_lane_ && cuda_lane_ >= 0) {
    workers_[cuda_lane_]->submit({t});
    return;
  }
  const bool landing = announces_ && t->tagged && t->dst->landing >= 0 && t->nic >= 0;
  if (landing && t->dst->peer->path_failed[t->nic].load()) {
    // Its announce must follow its bytes through their NIC's landing ring (see reroute).
    piece_failed(t, "its immediate must follow its bytes through the landing ring of NIC " +
                        workers_[t->nic]->lane().nic_name() + ", whose path failed");
    return;
  }
  int nic = t->nic >= 0 && !t->dst->peer->path_failed[t->nic].load() ? t->nic : pick_nic(*t->dst->peer, rr_++);
  if (nic < 0) {
    piece_failed(t, t->dst->peer->label + " became unreachable on every NIC before the immediate was sent");
    return;
  }
  t->nic = nic;
  workers_[nic]->submit({t});
}

}  // namespace weightsync
