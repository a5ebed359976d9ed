// Authentication of fabric connections (issue 16, docs/design/engine_auth.md): a peer gets an endpoint
// that can write into this engine's memory only after proving, in its connection request, that it holds
// the group's engine key K (HMAC-SHA256 of the group secret, derived in Python: the secret itself never
// reaches the engine). The server answers with a proof of its own, checked by the client, so that a
// process squatting on a stale engine address learns no weights. Only connection set-up pays for this.
#pragma once

#include <array>
#include <chrono>
#include <cstdint>
#include <deque>
#include <string>
#include <unordered_set>

namespace weightsync {

// The connection data a client sends (56 bytes: it also fits the private data of InfiniBand's rdma_cm).
struct ConnRequest {
  static constexpr size_t kSize = 56;
  static constexpr uint8_t kVersion = 1;
  // flags: the connection carries a path's control messages (announces) beside its data connection
  // (fabric/msg_lane.hpp). Covered by the proof like every other field; other bits are refused.
  static constexpr uint8_t kControlConn = 1;
  static constexpr uint8_t kKnownFlags = kControlConn;
  uint8_t version = kVersion;
  uint8_t flags = 0;
  uint16_t nic = 0;
  uint32_t unix_time = 0;
  std::array<uint8_t, 16> client_id{};
  std::array<uint8_t, 16> nonce{};
  std::array<uint8_t, 16> mac{};
  std::string pack() const;
  static bool unpack(const void* data, size_t len, ConnRequest* out);
};

// Why a connection request was refused (the one byte of reject data, and the per-reason counters).
// kNoDataConn: a control connection (ConnRequest::kControlConn) whose client has no data connection here:
// a control connection only ever accompanies an accepted data connection of the same client.
enum class AuthRefusal : uint8_t {
  kMalformed = 1, kStale = 2, kReplayed = 3, kBadProof = 4, kBusy = 5, kNoDataConn = 6
};
const char* refusal_name(AuthRefusal r);

class PeerAuth {
 public:
  // `key`: the engine key K (raw bytes; empty: the engine was given none, and every peer that also has
  // none is accepted: a standalone engine, not a group member). Throws TransportError where no HMAC
  // implementation (libcrypto) can be loaded.
  explicit PeerAuth(std::string key);
  bool keyed() const { return !key_.empty(); }
  void set_key(std::string key) { key_ = std::move(key); }

  // Client: the request for a connection to the server whose lane id and listening address are given.
  ConnRequest make_request(uint16_t nic, const std::array<uint8_t, 16>& client_id,
                           const std::array<uint8_t, 16>& server_id, const std::string& server_addr,
                           uint8_t flags = 0) const;
  // Server: 0 when `req` proves the key for this server (and is fresh and not seen before), else why not.
  // Remembers the nonce of an accepted request.
  int check_request(const ConnRequest& req, const std::array<uint8_t, 16>& server_id,
                    const std::string& server_addr);
  // The server's answer (16 bytes), carried in fi_accept's data; the client checks it.
  std::string server_proof(const ConnRequest& req, const std::array<uint8_t, 16>& server_id) const;
  bool check_server_proof(const ConnRequest& req, const std::array<uint8_t, 16>& server_id,
                          const void* data, size_t len) const;

  static constexpr int kWindowS = 30;     // |now - unix_time| allowed (clock skew plus connect time)
  static constexpr size_t kMaxNonces = 1u << 16;  // replay cache bound; beyond it new requests wait

 private:
  std::array<uint8_t, 16> mac_c2s(const ConnRequest& req, const std::array<uint8_t, 16>& server_id,
                                  const std::string& server_addr) const;
  std::string key_;
  // Nonces of requests accepted within the last 2 windows, oldest first (a replay inside the time window
  // finds its nonce here; one outside it is stale).
  std::deque<std::pair<std::chrono::steady_clock::time_point, std::string>> nonce_order_;
  std::unordered_set<std::string> nonces_;
};

// 16 random bytes from the kernel (getrandom).
std::array<uint8_t, 16> random_id();
}  // namespace weightsync
