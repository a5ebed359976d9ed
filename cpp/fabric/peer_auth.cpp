#include "fabric/peer_auth.hpp"

#include <dlfcn.h>
#include <sys/random.h>

#include <cerrno>
#include <cstring>
#include <ctime>
#include <mutex>

#include "core/errors.hpp"

namespace weightsync {

namespace {

// libcrypto is loaded at run time (like libcuda): no OpenSSL headers or link dependency at build time,
// and Python's own hashlib has already loaded it in every process that runs an engine.
struct Crypto {
  using Md = const void* (*)();
  using Hmac = unsigned char* (*)(const void* md, const void* key, int key_len, const unsigned char* d,
                                  size_t n, unsigned char* md_out, unsigned int* md_len);
  using MemCmp = int (*)(const void* a, const void* b, size_t len);
  Md sha256 = nullptr;
  Hmac hmac = nullptr;
  MemCmp memcmp = nullptr;
  std::string error;
};

const Crypto& crypto() {
  static Crypto c;
  static std::once_flag once;
  std::call_once(once, [] {
    void* lib = nullptr;
    for (const char* name : {"libcrypto.so.3", "libcrypto.so.1.1", "libcrypto.so"}) {
      lib = dlopen(name, RTLD_NOW | RTLD_LOCAL);
      if (lib != nullptr) break;
    }
    if (lib == nullptr) {
      c.error = "libcrypto (OpenSSL) not found: it computes the engine's connection proofs";
      return;
    }
    c.sha256 = reinterpret_cast<Crypto::Md>(dlsym(lib, "EVP_sha256"));
    c.hmac = reinterpret_cast<Crypto::Hmac>(dlsym(lib, "HMAC"));
    c.memcmp = reinterpret_cast<Crypto::MemCmp>(dlsym(lib, "CRYPTO_memcmp"));
    if (!c.sha256 || !c.hmac || !c.memcmp) c.error = "libcrypto lacks EVP_sha256, HMAC or CRYPTO_memcmp";
  });
  return c;
}

std::array<uint8_t, 32> hmac_sha256(const std::string& key, const std::string& msg) {
  const Crypto& c = crypto();
  std::array<uint8_t, 32> out{};
  unsigned int len = 0;
  // HMAC with an empty key is well defined; libcrypto wants a non-null pointer for it.
  static const char empty = 0;
  if (c.hmac(c.sha256(), key.empty() ? &empty : key.data(), static_cast<int>(key.size()),
             reinterpret_cast<const unsigned char*>(msg.data()), msg.size(), out.data(), &len) == nullptr ||
      len != out.size()) {
    throw TransportError("HMAC-SHA256 failed in libcrypto");
  }
  return out;
}

void put_u16(std::string& s, uint16_t v) { s.push_back(char(v >> 8)), s.push_back(char(v)); }
void put_u32(std::string& s, uint32_t v) {
  for (int shift = 24; shift >= 0; shift -= 8) s.push_back(char(v >> shift));
}
template <size_t N>
void put(std::string& s, const std::array<uint8_t, N>& a) {
  s.append(reinterpret_cast<const char*>(a.data()), N);
}

uint32_t unix_now() { return static_cast<uint32_t>(std::time(nullptr)); }

}  // namespace

std::string ConnRequest::pack() const {
  std::string s;
  s.reserve(kSize);
  s.push_back(char(version));
  s.push_back(char(flags));
  put_u16(s, nic);
  put_u32(s, unix_time);
  put(s, client_id);
  put(s, nonce);
  put(s, mac);
  return s;
}

bool ConnRequest::unpack(const void* data, size_t len, ConnRequest* out) {
  // The provider may hand over more bytes than were sent (its CM data size): only the prefix counts.
  if (data == nullptr || len < kSize) return false;
  const auto* b = static_cast<const uint8_t*>(data);
  out->version = b[0];
  out->flags = b[1];
  out->nic = uint16_t(b[2] << 8 | b[3]);
  out->unix_time = uint32_t(b[4]) << 24 | uint32_t(b[5]) << 16 | uint32_t(b[6]) << 8 | uint32_t(b[7]);
  std::memcpy(out->client_id.data(), b + 8, 16);
  std::memcpy(out->nonce.data(), b + 24, 16);
  std::memcpy(out->mac.data(), b + 40, 16);
  return true;
}

const char* refusal_name(AuthRefusal r) {
  switch (r) {
    case AuthRefusal::kMalformed: return "malformed request";
    case AuthRefusal::kStale: return "timestamp outside the window";
    case AuthRefusal::kReplayed: return "replayed nonce";
    case AuthRefusal::kBadProof: return "wrong key proof";
    case AuthRefusal::kBusy: return "replay cache full";
    case AuthRefusal::kNoDataConn: return "control connection without a data connection";
  }
  return "unknown";
}

PeerAuth::PeerAuth(std::string key) : key_(std::move(key)) {
  if (!crypto().error.empty()) throw TransportError(crypto().error);
}

std::array<uint8_t, 16> PeerAuth::mac_c2s(const ConnRequest& req, const std::array<uint8_t, 16>& server_id,
                                          const std::string& server_addr) const {
  // Everything the request says, plus whom it is for: a request captured on the way to one engine is
  // useless against another (its id and listening address differ).
  ConnRequest body = req;
  body.mac = {};
  std::string msg = "weightsync c2s v1";
  msg += body.pack().substr(0, ConnRequest::kSize - 16);
  put(msg, server_id);
  msg += server_addr;
  const auto full = hmac_sha256(key_, msg);
  std::array<uint8_t, 16> out{};
  std::memcpy(out.data(), full.data(), out.size());
  return out;
}

ConnRequest PeerAuth::make_request(uint16_t nic, const std::array<uint8_t, 16>& client_id,
                                   const std::array<uint8_t, 16>& server_id,
                                   const std::string& server_addr, uint8_t flags) const {
  ConnRequest req;
  req.flags = flags;
  req.nic = nic;
  req.unix_time = unix_now();
  req.client_id = client_id;
  req.nonce = random_id();
  req.mac = mac_c2s(req, server_id, server_addr);
  return req;
}

int PeerAuth::check_request(const ConnRequest& req, const std::array<uint8_t, 16>& server_id,
                            const std::string& server_addr) {
  if (req.version != ConnRequest::kVersion || (req.flags & ~ConnRequest::kKnownFlags) != 0) {
    return int(AuthRefusal::kMalformed);
  }
  const int64_t skew = int64_t(unix_now()) - int64_t(req.unix_time);
  if (skew > kWindowS || skew < -kWindowS) return int(AuthRefusal::kStale);
  const auto expected = mac_c2s(req, server_id, server_addr);
  if (crypto().memcmp(expected.data(), req.mac.data(), expected.size()) != 0) return int(AuthRefusal::kBadProof);
  // Nonces older than two windows cannot come back (their timestamp is stale by then): forget them.
  const auto now = std::chrono::steady_clock::now();
  while (!nonce_order_.empty() && now - nonce_order_.front().first > std::chrono::seconds(2 * kWindowS)) {
    nonces_.erase(nonce_order_.front().second);
    nonce_order_.pop_front();
  }
  std::string nonce(reinterpret_cast<const char*>(req.nonce.data()), req.nonce.size());
  if (nonces_.count(nonce)) return int(AuthRefusal::kReplayed);
  // Full: refuse rather than forget a nonce still inside the window (that would let its replay in).
  if (nonces_.size() >= kMaxNonces) return int(AuthRefusal::kBusy);
  nonces_.insert(nonce);
  nonce_order_.emplace_back(now, std::move(nonce));
  return 0;
}

std::string PeerAuth::server_proof(const ConnRequest& req, const std::array<uint8_t, 16>& server_id) const {
  std::string msg = "weightsync s2c v1";
  put(msg, req.nonce);
  put(msg, req.client_id);
  put(msg, server_id);
  const auto full = hmac_sha256(key_, msg);
  return std::string(reinterpret_cast<const char*>(full.data()), 16);
}

bool PeerAuth::check_server_proof(const ConnRequest& req, const std::array<uint8_t, 16>& server_id,
                                  const void* data, size_t len) const {
  if (data == nullptr || len < 16) return false;
  const std::string expected = server_proof(req, server_id);
  return crypto().memcmp(expected.data(), data, 16) == 0;
}

std::array<uint8_t, 16> random_id() {
  std::array<uint8_t, 16> out{};
  size_t got = 0;
  while (got < out.size()) {
    const ssize_t n = getrandom(out.data() + got, out.size() - got, 0);
    if (n < 0) {
      if (errno == EINTR) continue;
      throw TransportError(std::string("getrandom failed: ") + std::strerror(errno));
    }
    got += static_cast<size_t>(n);
  }
  return out;
}

}  // namespace weightsync
