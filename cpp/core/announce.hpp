// Exactly-once immediates over the fabric NICs (issue 15, case 7).
//
// A fabric piece that carries an immediate is written in two steps: its bytes (an RMA write, or a
// tagged message into a landing ring) posted without remote CQ data and completing only once placed at
// the target (FI_DELIVERY_COMPLETE), then an *announce*: a small tagged message on a path to the same
// peer whose remote CQ data is the immediate and whose payload names the piece. Lanes with a control
// queue (LaneCaps::control_queue: the tcp lane's second connection per path) send it there, so it does
// not wait behind the data posted on the path after the piece; it needs no order with that data. A
// piece the writer retries (its acknowledgement lost with a link that died after it landed) sends its
// announce again with the same name; the receiver counts a name once. So the counter gets each piece's
// immediate exactly once, and only after its bytes are in place, whatever is retried on which NIC.
//
// Wire format (every engine of this build; an engine whose NICs lack tagged messages or delivery
// completion falls back to remote CQ data on the write itself, with no de-duplication):
//
//   Tag of a tagged message (64 bits):
//     bit 63 = 1            an announce for an RMA piece, matched by the receiver's announce ring
//                           (every other bit 0);
//     bit 63 = 0            a landing-ring message: bits 61..48 the landing index (14 bits), and
//       bit 62 = 0            data: bits 47..0 the byte offset in the landing region;
//       bit 62 = 1            an announce of a landing piece (no data; bits 47..0 the offset of its
//                             piece's first byte). It travels on the NIC its piece's bytes went on, so
//                             the landing ring (which hands buffers over in matching order) counts it
//                             after those bytes are copied.
//   Remote CQ data (32 bits): the user's immediate.
//   Payload of an announce, kAnnounceBytes = 40 bytes, little-endian:
//     [0, 16)   the writer engine's uid (128 random bits)
//     [16, 24)  the id of the writer's Peer object for the receiver (Peer::id, per writer engine)
//     [24, 32)  the piece id: 1, 2, 3, ... per (writer uid, Peer id) in the order announces are first
//               posted, kept by the piece across every retry
//     [32, 40)  landing pieces: the bytes its piece spans from that offset (the receiver drops the
//               announce of a piece one of whose messages it dropped as the writer's mistake); else 0
//   So a piece is named by (uid, peer id, piece id) and two pieces never share a name: uids differ
//   between engines (128 random bits), Peer ids within one engine, and piece ids within one Peer.
#pragma once

#include <cstdint>
#include <cstring>
#include <iterator>
#include <list>
#include <map>
#include <mutex>
#include <unordered_map>

namespace weightsync {

constexpr uint64_t kAnnounceTag = 1ull << 63;          // announce ring (RMA pieces)
constexpr uint64_t kLandingAnnounceBit = 1ull << 62;    // landing ring: an announce, not data
constexpr uint64_t kTagKindMask = 1ull << 63;          // receives match on this bit alone
constexpr int kLandingIndexBits = 14;
constexpr int kLandingOffsetBits = 48;
constexpr size_t kAnnounceBytes = 40;

// Who sent a piece, and which piece: the announce's payload.
struct AnnounceName {
  uint64_t uid_hi = 0, uid_lo = 0;  // the writer engine
  uint64_t peer = 0;                // the writer's Peer object for us
  uint64_t piece = 0;               // 1, 2, 3, ... per (writer, peer)
  uint64_t span = 0;                // landing pieces: bytes from the tag's offset (not part of the name)

  void write(unsigned char* out) const {
    std::memcpy(out, &uid_hi, 8);
    std::memcpy(out + 8, &uid_lo, 8);
    std::memcpy(out + 16, &peer, 8);
    std::memcpy(out + 24, &piece, 8);
    std::memcpy(out + 32, &span, 8);
  }
  static AnnounceName read(const unsigned char* in) {
    AnnounceName n;
    std::memcpy(&n.uid_hi, in, 8);
    std::memcpy(&n.uid_lo, in + 8, 8);
    std::memcpy(&n.peer, in + 16, 8);
    std::memcpy(&n.piece, in + 24, 8);
    std::memcpy(&n.span, in + 32, 8);
    return n;
  }
};

// The receiver's memory of the pieces it counted, per writer (uid, peer id): the set of piece ids seen,
// kept as disjoint intervals [first, last]. Ids are dense per writer and nearly all arrive, so the set is
// a handful of intervals: one per id never announced (a piece whose write failed for good) or still
// on its way. Nothing is forgotten while it can still matter: a duplicate is recognised however late it
// comes. Bounds, for memory only: a writer whose set exceeds kMaxIntervals has its two oldest intervals
// joined (the ids between them, missing for that many gaps since, are taken as seen), and beyond
// kMaxWriters writers the one idle longest is forgotten.
class AnnounceDedup {
 public:
  static constexpr size_t kMaxIntervals = 4096;
  static constexpr size_t kMaxWriters = 4096;

  // True the first time a name is seen (count its immediate), false for a repeat (drop it).
  bool first(const AnnounceName& n) {
    if (n.piece == 0) return false;  // never sent by a writer: malformed
    std::lock_guard<std::mutex> lock(mu_);
    const Key key{n.uid_hi, n.uid_lo, n.peer};
    auto it = writers_.find(key);
    if (it == writers_.end()) {
      if (writers_.size() >= kMaxWriters) {
        writers_.erase(lru_.back());
        lru_.pop_back();
      }
      lru_.push_front(key);
      it = writers_.emplace(key, Writer{}).first;
      it->second.lru = lru_.begin();
    } else {
      lru_.splice(lru_.begin(), lru_, it->second.lru);
    }
    return insert(it->second.seen, n.piece);
  }

  size_t writers() {
    std::lock_guard<std::mutex> lock(mu_);
    return writers_.size();
  }

 private:
  struct Key {
    uint64_t hi, lo, peer;
    bool operator==(const Key& o) const { return hi == o.hi && lo == o.lo && peer == o.peer; }
  };
  struct KeyHash {
    size_t operator()(const Key& k) const { return k.hi ^ (k.lo * 0x9E3779B97F4A7C15ull) ^ (k.peer << 1); }
  };
  struct Writer {
    std::map<uint64_t, uint64_t> seen;  // first id -> last id of each interval, disjoint, not adjacent
    std::list<Key>::iterator lru;
  };

  // Adds `id` to the intervals; false if it was there already.
  static bool insert(std::map<uint64_t, uint64_t>& seen, uint64_t id) {
    auto next = seen.upper_bound(id);  // first interval starting after id
    if (next != seen.begin()) {
      auto prev = std::prev(next);
      if (id <= prev->second) return false;  // inside [prev.first, prev.last]
      if (prev->second + 1 == id) {
        prev->second = id;
        if (next != seen.end() && next->first == id + 1) {
          prev->second = next->second;
          seen.erase(next);
        }
        return true;
      }
    }
    if (next != seen.end() && next->first == id + 1) {
      const uint64_t last = next->second;
      seen.erase(next);
      seen.emplace(id, last);
    } else {
      seen.emplace(id, id);
    }
    if (seen.size() > kMaxIntervals) {
      auto a = seen.begin();
      auto b = std::next(a);
      a->second = b->second;
      seen.erase(b);
    }
    return true;
  }

  std::mutex mu_;
  std::unordered_map<Key, Writer, KeyHash> writers_;
  std::list<Key> lru_;  // most recently heard first
};

}  // namespace weightsync
