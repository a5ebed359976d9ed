#include "fabric/fabric_lane.hpp"

#include <dirent.h>
#include <netinet/in.h>
#include <linux/tcp.h>  // the kernel's tcp_info (glibc's lacks tcpi_snd_wnd)
#include <rdma/fi_errno.h>
#include <linux/sockios.h>
#include <sys/ioctl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstddef>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <random>
#include <unordered_set>
#include <sstream>

#include "core/engine.hpp"
#include "core/errors.hpp"
#include "core/hex.hpp"
#include "fabric/msg_lane.hpp"

namespace weightsync {

namespace {

constexpr uint32_t kFiVersion = FI_VERSION(1, 14);
constexpr size_t kRxBuffers = 256;

// The mr_mode bits we can work with; the provider answers with the subset it needs.
constexpr uint64_t kMrModeHints =
    FI_MR_LOCAL | FI_MR_VIRT_ADDR | FI_MR_ALLOCATED | FI_MR_PROV_KEY | FI_MR_ENDPOINT;

// hmem: also ask for device memory (FI_HMEM), which the provider then registers like host memory.
// tagged: also tagged messages (FI_TAGGED with FI_SEND | FI_RECV: the direction bits above restrict
// FI_RMA to writes, so without them no message capability would be implied), which carry writes into
// landing regions (memory a NIC without FI_HMEM cannot register). efa, verbs;ofi_rxm and tcp;ofi_rxm
// all offer them; a provider that does not is opened without, and cannot write into landing regions.
fi_info* make_hints(const std::string& provider, const std::string& domain, bool hmem = false,
                    bool tagged = false) {
  fi_info* hints = fi_allocinfo();
  if (hints == nullptr) throw TransportError("fi_allocinfo failed: out of memory");
  hints->caps = FI_RMA | FI_WRITE | FI_REMOTE_WRITE | (hmem ? FI_HMEM : 0) |
                (tagged ? FI_TAGGED | FI_SEND | FI_RECV : 0);
  hints->mode = FI_CONTEXT | FI_CONTEXT2 | FI_RX_CQ_DATA;
  hints->ep_attr->type = FI_EP_RDM;
  hints->domain_attr->mr_mode = kMrModeHints | (hmem ? FI_MR_HMEM : 0);
  hints->domain_attr->threading = FI_THREAD_DOMAIN;  // one worker thread owns each domain
  hints->domain_attr->cq_data_size = 4;
  if (!provider.empty()) hints->fabric_attr->prov_name = strdup(provider.c_str());
  if (!domain.empty()) hints->domain_attr->name = strdup(domain.c_str());
  return hints;
}

std::string fi_error(int rc) { return std::string(fi_strerror(rc < 0 ? -rc : rc)); }

// The sockets of tcp;ofi_rxm connections that lanes of this process opened, by inode: several engines
// of one process on one NIC all open connections from the same address to the same peers, and only
// this tells whose a socket is (an abort must reset only its own lane's). Lanes per address, too.
struct ProcessSockets {
  std::mutex mu;
  std::unordered_map<uint64_t, const void*> owner;  // socket inode -> the lane that opened it
  std::unordered_map<std::string, int> lanes;       // our listening IP (raw bytes) -> lanes on it
};

ProcessSockets& process_sockets() {
  static ProcessSockets* s = new ProcessSockets();  // never destroyed: lanes may close at exit
  return *s;
}

uint64_t inode_of(int fd) {
  struct stat st{};
  return fstat(fd, &st) == 0 ? static_cast<uint64_t>(st.st_ino) : 0;
}

uint64_t random_u64() {
  static thread_local std::mt19937_64 gen{std::random_device{}()};
  return gen();
}

}  // namespace

std::vector<FabricNicInfo> FabricLane::discover(const std::string& provider) {
  if (provider == FabricMsgLane::kProvider) return FabricMsgLane::discover();  // MSG endpoints, not RDM
  std::vector<FabricNicInfo> out;
  fi_info* hints = make_hints(provider, "");
  fi_info* info = nullptr;
  int rc = fi_getinfo(kFiVersion, nullptr, nullptr, 0, hints, &info);
  fi_freeinfo(hints);
  if (rc != 0) return out;
  for (fi_info* cur = info; cur != nullptr; cur = cur->next) {
    FabricNicInfo nic{cur->fabric_attr->prov_name ? cur->fabric_attr->prov_name : "",
                      cur->domain_attr->name ? cur->domain_attr->name : "",
                      cur->fabric_attr->name ? cur->fabric_attr->name : ""};
    bool seen = false;
    for (const auto& n : out) seen |= (n.provider == nic.provider && n.domain == nic.domain);
    if (!seen) out.push_back(nic);
  }
  fi_freeinfo(info);
  return out;
}

std::string FabricLane::pick_provider() {
  for (const char* p : {"efa", "verbs;ofi_rxm"}) {
    if (!discover(p).empty()) return p;
  }
  // On TCP the authenticated MSG lane (fabric/msg_lane.hpp); tcp;ofi_rxm only where it is missing.
  if (!FabricMsgLane::discover().empty()) return FabricMsgLane::kProvider;
  if (!discover("tcp;ofi_rxm").empty()) return "tcp;ofi_rxm";
  throw TransportError(
      "no libfabric provider offers RMA writes with remote CQ data here (tried efa, verbs;ofi_rxm, "
      "tcp;ofi_rxm); check `fi_info -p tcp` and that libfabric is installed");
}

FabricLane::FabricLane(const std::string& provider, const std::string& domain)
    : provider_(provider), domain_(domain), tcp_(provider.find("tcp") != std::string::npos) {
  // Several entries can name the same domain (IPv4 and IPv6 on tcp): prefer IPv4, then the first.
  // Layered providers do not always filter on the domain name, so match it here.
  auto find = [&](bool hmem, bool tagged, int* rc_out) -> fi_info* {
    fi_info* hints = make_hints(provider, domain, hmem, tagged);
    fi_info* list = nullptr;
    int rc = fi_getinfo(kFiVersion, nullptr, nullptr, 0, hints, &list);
    fi_freeinfo(hints);
    if (rc_out) *rc_out = rc;
    if (rc != 0 || list == nullptr) return nullptr;
    fi_info* pick = nullptr;
    for (fi_info* cur = list; cur != nullptr; cur = cur->next) {
      const char* name = cur->domain_attr->name;
      if (!domain.empty() && (name == nullptr || domain != name)) continue;
      if (pick == nullptr || (cur->addr_format == FI_SOCKADDR_IN && pick->addr_format != FI_SOCKADDR_IN)) pick = cur;
    }
    fi_info* out = pick ? fi_dupinfo(pick) : nullptr;
    fi_freeinfo(list);
    return out;
  };
  // GPU memory straight on the NIC (GPUDirect RDMA on EFA or verbs) where the provider offers FI_HMEM;
  // WEIGHTSYNC_FABRIC_HMEM=0 turns the attempt off. Otherwise GPU memory stays off the fabric lane.
  const char* env = std::getenv("WEIGHTSYNC_FABRIC_HMEM");
  // Tagged messages are asked for first either way, and dropped only where the provider lacks them.
  const bool try_hmem = env == nullptr || std::string(env) != "0";
  int rc = 0;
  for (bool hmem : {true, false}) {
    if (hmem && !try_hmem) continue;
    for (bool tagged : {true, false}) {
      if (info_ == nullptr) {
        info_ = find(hmem, tagged, hmem ? nullptr : &rc);
        hmem_ = hmem && info_ != nullptr;
        tagged_ = tagged && info_ != nullptr;
      }
    }
  }
  if (info_ == nullptr) {
    throw TransportError("libfabric provider '" + provider + "' has no NIC named '" + domain +
                         "' with RMA and remote CQ data" + (rc ? ": " + fi_error(rc) : std::string()));
  }
  if (info_->domain_attr->name) domain_ = info_->domain_attr->name;

  mr_mode_ = info_->domain_attr->mr_mode;
  key_size_ = info_->domain_attr->mr_key_size ? info_->domain_attr->mr_key_size : 8;
  rx_cq_data_ = (info_->mode & FI_RX_CQ_DATA) != 0;
  max_msg_size_ = info_->ep_attr->max_msg_size ? info_->ep_attr->max_msg_size : (1ull << 30);
  orders_writes_ = (info_->tx_attr->msg_order & FI_ORDER_WAW) != 0;
  orders_sends_ = tagged_ && (info_->tx_attr->msg_order & FI_ORDER_SAS) != 0;
  {
    // A write whose immediate travels separately (2-D writes: one immediate after all rows) may only be
    // announced once its bytes are placed at the target; local completion by default only means
    // "sent". Ask whether this provider can complete a write at delivery instead.
    fi_info* dc_hints = make_hints(provider, domain_, hmem_, tagged_);
    dc_hints->tx_attr->op_flags = FI_DELIVERY_COMPLETE;
    fi_info* dc = nullptr;
    if (fi_getinfo(kFiVersion, nullptr, nullptr, 0, dc_hints, &dc) == 0) {
      for (fi_info* cur = dc; cur != nullptr; cur = cur->next) {
        const char* name = cur->domain_attr->name;
        if (name != nullptr && domain_ == name) delivery_complete_ = true;
      }
      fi_freeinfo(dc);
    }
    fi_freeinfo(dc_hints);
  }
  tx_size_ = info_->tx_attr->size ? info_->tx_attr->size : 256;

  try {
    check(fi_fabric(info_->fabric_attr, &fabric_, nullptr), "fi_fabric");
    check(fi_domain(fabric_, info_, &domain_fid_, nullptr), "fi_domain");

    check(cq_.open(domain_fid_), "fi_cq_open");

    fi_av_attr av_attr{};
    av_attr.type = FI_AV_TABLE;
    check(fi_av_open(domain_fid_, &av_attr, &av_, nullptr), "fi_av_open");

    check(fi_endpoint(domain_fid_, info_, &ep_, nullptr), "fi_endpoint");
    check(fi_ep_bind(ep_, &av_->fid, 0), "fi_ep_bind(av)");
    check(fi_ep_bind(ep_, cq_.queue_fid(), FI_TRANSMIT | FI_RECV), "fi_ep_bind(cq)");
    check(fi_enable(ep_), "fi_enable");

    char name[256];
    size_t name_len = sizeof(name);
    check(fi_getname(&ep_->fid, name, &name_len), "fi_getname");
    address_.assign(name, name_len);
    {
      std::lock_guard<std::mutex> lock(process_sockets().mu);
      process_sockets().lanes[ip_key()]++;
    }
    if (rx_cq_data_) post_rx_buffers();
  } catch (...) {
    close_all();
    throw;
  }
}

FabricLane::~FabricLane() {
  close_all();
  if (!address_.empty()) {
    ProcessSockets& ps = process_sockets();
    std::lock_guard<std::mutex> lock(ps.mu);
    if (--ps.lanes[ip_key()] <= 0) ps.lanes.erase(ip_key());
    for (auto it = ps.owner.begin(); it != ps.owner.end();) {
      it = it->second == this ? ps.owner.erase(it) : std::next(it);
    }
  }
}

void FabricLane::close_all() {
  if (ep_) abort_connections();
  if (ep_) fi_close(&ep_->fid);
  if (av_) fi_close(&av_->fid);
  cq_.close();
  if (domain_fid_) fi_close(&domain_fid_->fid);
  if (fabric_) fi_close(&fabric_->fid);
  if (info_) fi_freeinfo(info_);
  ep_ = nullptr;
  av_ = nullptr;
  domain_fid_ = nullptr;
  fabric_ = nullptr;
  info_ = nullptr;
}

void FabricLane::check(int rc, const char* what) const {
  if (rc != 0) {
    throw TransportError(std::string(what) + " failed on " + provider_ + " NIC " + domain_ + ": " +
                         fi_error(rc));
  }
}

void FabricLane::post_rx_buffers() {
  rx_ctx_.resize(kRxBuffers);
  for (auto& ctx : rx_ctx_) {
    check(static_cast<int>(fi_recv(ep_, nullptr, 0, nullptr, FI_ADDR_UNSPEC, &ctx)), "fi_recv");
  }
}

std::string FabricLane::describe_address(const std::string& address) const {
  char buf[128];
  size_t len = sizeof(buf);
  fi_av_straddr(av_, address.data(), buf, &len);
  return std::string(buf);
}

MemRegistration FabricLane::register_memory(void* ptr, size_t len, MemKind kind, int device) {
  if (kind != MemKind::kHost && !hmem_) {
    // Without FI_HMEM the NIC cannot reach GPU memory; the engine keeps such regions on the cuda lane
    // (same-host peers) and refuses fabric writes from or into them.
    throw TransportError("provider " + provider_ + " on NIC " + domain_ +
                         " cannot register GPU memory (no FI_HMEM)");
  }
  MemRegistration reg;
  fid_mr* mr = nullptr;
  const uint64_t access = FI_WRITE | FI_REMOTE_WRITE | FI_READ | FI_REMOTE_READ;
  int rc = 0;
  // A zero-length buffer still needs a valid address for some providers.
  static char empty_byte;
  void* base = len ? ptr : &empty_byte;
  size_t reg_len = len ? len : 1;
  for (int attempt = 0; attempt < 8; ++attempt) {
    uint64_t requested = 0;
    if (!(mr_mode_ & FI_MR_PROV_KEY)) {
      // We choose the key: random, so that a stranger cannot guess it (keys are per-domain unique).
      requested = random_u64();
      if (key_size_ < 8) requested &= ((1ull << (8 * key_size_)) - 1);
    }
    if (kind == MemKind::kCuda) {
      // Device memory: the provider is told which GPU it lives on (the process-local ordinal).
      iovec iov{base, reg_len};
      fi_mr_attr attr{};
      attr.mr_iov = &iov;
      attr.iov_count = 1;
      attr.access = access;
      attr.requested_key = requested;
      attr.iface = FI_HMEM_CUDA;
      attr.device.cuda = device;
      rc = fi_mr_regattr(domain_fid_, &attr, 0, &mr);
    } else {
      rc = fi_mr_reg(domain_fid_, base, reg_len, access, 0, requested, 0, &mr, nullptr);
    }
    if (rc != -FI_ENOKEY) break;
  }
  check(rc, "fi_mr_reg");
  if (mr_mode_ & FI_MR_ENDPOINT) {
    int brc = fi_mr_bind(mr, &ep_->fid, 0);
    if (brc == 0) brc = fi_mr_enable(mr);
    if (brc != 0) {
      fi_close(&mr->fid);
      check(brc, "fi_mr_bind/enable");
    }
  }
  reg.handle = mr;
  reg.local_desc = fi_mr_desc(mr);
  reg.key = fi_mr_key(mr);
  reg.remote_base = (mr_mode_ & FI_MR_VIRT_ADDR) ? reinterpret_cast<uint64_t>(base) : 0;
  return reg;
}

void FabricLane::deregister(const MemRegistration& reg) {
  if (reg.handle) fi_close(&static_cast<fid_mr*>(reg.handle)->fid);
}

uint64_t FabricLane::insert_peer(const std::string& address) {
  fi_addr_t addr = FI_ADDR_UNSPEC;
  int rc = fi_av_insert(av_, address.data(), 1, &addr, 0, nullptr);
  if (rc != 1) {
    throw TransportError("fi_av_insert of peer " + describe_address(address) + " failed on NIC " +
                         domain_ + ": " + fi_error(rc < 0 ? rc : -FI_EINVAL));
  }
  peer_addresses_[addr] = address;
  if (tcp_) unclaimed_[addr] = 0;
  return addr;
}

uint64_t FabricLane::reset_path(uint64_t peer) {
  reopen(peer);
  return peer;
}

bool FabricLane::reopen(uint64_t& peer) {
  auto it = peer_addresses_.find(peer);
  if (it == peer_addresses_.end()) return false;
  const std::string address = it->second;
  reset_peer_side(address);
  // Removing the address closes rxm's connection to it (ops still on it complete with errors); the
  // address inserted again connects afresh on the next post.
  fi_addr_t old = peer;
  if (fi_av_remove(av_, &old, 1, 0) != 0) return false;
  peer_addresses_.erase(it);
  unclaimed_.erase(peer);
  try {
    peer = insert_peer(address);
  } catch (const TransportError&) {
    // not reachable any more: posting to the old handle fails, and the path with it
  }
  return true;
}

bool FabricLane::close_path(uint64_t& peer) {
  // Only rxm runs over connections of its own: tcp;ofi_rxm's are kernel sockets, verbs;ofi_rxm's
  // reliable-connected QPs (a QP destroyed with its connection sends nothing more, not even
  // retransmissions). Other RDM providers (efa) have none: their writes stay with the provider.
  if (provider_.find("ofi_rxm") == std::string::npos) return false;
  // Reset first, as abort_path does (zero linger, disconnected under the provider): rxm does not close
  // its connection on fi_av_remove at once, and a socket closed later without the reset went on
  // delivering what it held after link-up (seen: bytes of a retried write landed over the next version).
  if (tcp_) abort_path(peer);
  return reopen(peer);
}

namespace {

// An endpoint address of tcp;ofi_rxm (fi_getname: the listening sockaddr) or of a kernel socket.
bool same_ip(const sockaddr_storage& a, const sockaddr_storage& b) {
  if (a.ss_family != b.ss_family) return false;
  if (a.ss_family == AF_INET) {
    return reinterpret_cast<const sockaddr_in&>(a).sin_addr.s_addr ==
           reinterpret_cast<const sockaddr_in&>(b).sin_addr.s_addr;
  }
  if (a.ss_family == AF_INET6) {
    return std::memcmp(&reinterpret_cast<const sockaddr_in6&>(a).sin6_addr,
                       &reinterpret_cast<const sockaddr_in6&>(b).sin6_addr, sizeof(in6_addr)) == 0;
  }
  return false;
}

uint16_t port_of(const sockaddr_storage& a) {
  if (a.ss_family == AF_INET) return reinterpret_cast<const sockaddr_in&>(a).sin_port;
  if (a.ss_family == AF_INET6) return reinterpret_cast<const sockaddr_in6&>(a).sin6_port;
  return 0;
}

bool same_endpoint(const sockaddr_storage& a, const sockaddr_storage& b) {
  return same_ip(a, b) && port_of(a) == port_of(b);
}

bool as_sockaddr(const std::string& raw, sockaddr_storage* out) {
  if (raw.size() < sizeof(sa_family_t) || raw.size() > sizeof(sockaddr_storage)) return false;
  std::memset(out, 0, sizeof(*out));
  std::memcpy(out, raw.data(), raw.size());
  return out->ss_family == AF_INET || out->ss_family == AF_INET6;
}

}  // namespace

std::string FabricLane::ip_key() const {
  sockaddr_storage self{};
  if (!as_sockaddr(address_, &self)) return address_;
  if (self.ss_family == AF_INET) {
    const auto& a = reinterpret_cast<const sockaddr_in&>(self).sin_addr;
    return std::string(reinterpret_cast<const char*>(&a), sizeof(a));
  }
  const auto& a = reinterpret_cast<const sockaddr_in6&>(self).sin6_addr;
  return std::string(reinterpret_cast<const char*>(&a), sizeof(a));
}

namespace {

// Calls fn(fd, local, remote) for every connected socket of this process.
template <typename Fn>
void for_each_socket(Fn&& fn) {
  DIR* dir = opendir("/proc/self/fd");
  if (dir == nullptr) return;
  const int dir_fd = dirfd(dir);
  while (dirent* e = readdir(dir)) {
    char* end = nullptr;
    const long fd = std::strtol(e->d_name, &end, 10);
    if (end == e->d_name || *end != '\0' || fd == dir_fd) continue;
    sockaddr_storage local{}, other{};
    socklen_t len = sizeof(local);
    if (getsockname(static_cast<int>(fd), reinterpret_cast<sockaddr*>(&local), &len) != 0) continue;
    len = sizeof(other);
    if (getpeername(static_cast<int>(fd), reinterpret_cast<sockaddr*>(&other), &len) != 0) continue;
    fn(static_cast<int>(fd), local, other);
  }
  closedir(dir);
}

}  // namespace

std::vector<std::pair<int, uint64_t>> FabricLane::opened_sockets(uint64_t peer, bool* accepted) const {
  std::vector<std::pair<int, uint64_t>> out;
  auto it = peer_addresses_.find(peer);
  sockaddr_storage self{}, remote{};
  if (it == peer_addresses_.end() || !as_sockaddr(address_, &self) || !as_sockaddr(it->second, &remote)) {
    return out;
  }
  for_each_socket([&](int fd, const sockaddr_storage& local, const sockaddr_storage& other) {
    if (same_ip(local, self) && !same_endpoint(local, self) && same_endpoint(other, remote)) {
      out.emplace_back(fd, inode_of(fd));
    } else if (accepted != nullptr && same_endpoint(local, self) && same_ip(other, remote)) {
      *accepted = true;
    }
  });
  return out;
}

std::vector<int> FabricLane::path_sockets(uint64_t peer) const {
  std::vector<int> out;
  if (provider_.find("tcp") == std::string::npos) return out;
  auto it = peer_addresses_.find(peer);
  sockaddr_storage self{}, remote{};
  if (it == peer_addresses_.end() || !as_sockaddr(address_, &self) || !as_sockaddr(it->second, &remote)) {
    return out;
  }
  ProcessSockets& ps = process_sockets();
  std::lock_guard<std::mutex> lock(ps.mu);
  // Other lanes of this process on our address could have opened the same kind of connection to the
  // same peer (several engines sharing a NIC): then only the sockets this lane claimed are ours.
  auto lanes = ps.lanes.find(ip_key());
  const bool shared = lanes != ps.lanes.end() && lanes->second > 1;
  std::unordered_set<uint64_t> live;
  for_each_socket([&](int fd, const sockaddr_storage& local, const sockaddr_storage& other) {
    const uint64_t ino = inode_of(fd);
    live.insert(ino);
    // The peer connected to our listening address: ours alone (no other endpoint listens there).
    if (same_endpoint(local, self) && same_ip(other, remote)) {
      out.push_back(fd);
      return;
    }
    if (!same_ip(local, self) || !same_endpoint(other, remote)) return;
    auto owner = ps.owner.find(ino);
    if (owner != ps.owner.end() ? owner->second == this : !shared) out.push_back(fd);
  });
  // Forget sockets that are gone (their inode may be reused by another lane's next socket).
  for (auto o = ps.owner.begin(); o != ps.owner.end();) o = live.count(o->first) ? std::next(o) : ps.owner.erase(o);
  return out;
}

Lane::PathState FabricLane::path_state(uint64_t peer, double window_s) {
  constexpr uint8_t kEstablished = 1;  // TCP_ESTABLISHED
  const auto window_ms = static_cast<uint32_t>(window_s * 1000.0);
  bool dead = false;
  for (int fd : path_sockets(peer)) {
    tcp_info info{};
    socklen_t len = sizeof(info);
    if (getsockopt(fd, IPPROTO_TCP, TCP_INFO, &info, &len) != 0 || info.tcpi_state != kEstablished) continue;
    // Bytes the kernel holds for the peer, sent or not (a link that went down shows them unsent, in
    // the probe timer, not as packets in flight). None: the connection has nothing to say about it.
    int queued = 0;
    if (ioctl(fd, SIOCOUTQ, &queued) != 0 || queued <= 0) continue;
    const bool has_window = len >= offsetof(tcp_info, tcpi_snd_wnd) + sizeof(info.tcpi_snd_wnd);
    // The peer's receive buffer is full: it is alive and does not read (paused, slow): back-pressure.
    if (has_window && info.tcpi_snd_wnd == 0) return PathState::kAlive;
    if (info.tcpi_last_ack_recv < window_ms) return PathState::kAlive;  // acknowledged lately: slow, not dead
    dead = true;
  }
  return dead ? PathState::kDead : PathState::kUnknown;
}

bool FabricLane::abort_path(uint64_t peer) {
  bool aborted = false;
  auto addr = peer_addresses_.find(peer);
  for (int fd : path_sockets(peer)) {
    sockaddr_storage local{}, remote{};
    socklen_t len = sizeof(local);
    const bool named = getsockname(fd, reinterpret_cast<sockaddr*>(&local), &len) == 0 &&
                       (len = sizeof(remote), getpeername(fd, reinterpret_cast<sockaddr*>(&remote), &len) == 0);
    // An abortive close: with a zero linger a close resets the connection and drops the send queue
    // (a graceful close would go on delivering it, possibly after a retry of the same bytes and after
    // later writes), and disconnecting (connect with AF_UNSPEC) does that now, under the provider,
    // whose next use of the socket fails and fails the ops still posted on it.
    linger lg{1, 0};
    setsockopt(fd, SOL_SOCKET, SO_LINGER, &lg, sizeof(lg));
    sockaddr unspec{};
    unspec.sa_family = AF_UNSPEC;
    if (connect(fd, &unspec, sizeof(unspec)) != 0) continue;
    // The disconnected socket only fails the provider's sends; shut down, its reads see the end of the
    // stream too, and the provider closes the connection (a later post connects afresh).
    shutdown(fd, SHUT_RDWR);
    aborted = true;
    if (named && addr != peer_addresses_.end()) aborted_[addr->second].push_back({local, remote});
  }
  // The provider opens a new connection on the next post: claimed as this lane's then.
  if (aborted && tcp_) unclaimed_[peer] = 0;
  return aborted;
}

void FabricLane::abort_connections() {
  if (provider_.find("tcp") == std::string::npos) return;
  sockaddr_storage self{};
  if (!as_sockaddr(address_, &self)) return;
  // libfabric 1.17 (tcp;ofi_rxm) crashes in fi_close of an endpoint that holds a connection stopped
  // in the middle of a message (a link cut under a large write, its peer killed or the link still
  // down). Reset first, the way abort_path does: every connection a peer opened to our listening
  // address, and every one this lane opened; then let the provider read the resets (its progress
  // runs in fi_cq_read), so that it tears each connection down on its error path, before the close.
  std::unordered_set<int> fds;
  for (const auto& [handle, address] : peer_addresses_) {
    for (int fd : path_sockets(handle)) fds.insert(fd);
  }
  for_each_socket([&](int fd, const sockaddr_storage& local, const sockaddr_storage&) {
    if (same_endpoint(local, self)) fds.insert(fd);
  });
  if (fds.empty()) return;
  for (int fd : fds) {
    linger lg{1, 0};
    setsockopt(fd, SOL_SOCKET, SO_LINGER, &lg, sizeof(lg));
    sockaddr unspec{};
    unspec.sa_family = AF_UNSPEC;
    connect(fd, &unspec, sizeof(unspec));
    shutdown(fd, SHUT_RDWR);
  }
  fi_cq_tagged_entry entries[64];
  for (int round = 0; round < 20; ++round) {
    ssize_t n = fi_cq_read(cq_.cq(), entries, 64);
    while (n == -FI_EAVAIL) {
      fi_cq_err_entry err{};
      if (fi_cq_readerr(cq_.cq(), &err, 0) < 0) break;
      n = fi_cq_read(cq_.cq(), entries, 64);
    }
    if (n == -FI_EAGAIN) {
      struct timespec ts{0, 2 * 1000 * 1000};
      nanosleep(&ts, nullptr);
    }
  }
}

void FabricLane::reset_peer_side(const std::string& address) {
  auto it = aborted_.find(address);
  if (it == aborted_.end()) return;
  // The reset sent when a connection was aborted is lost if the link was down then, and the peer's
  // provider keeps its side open and refuses our new connection as a duplicate. A SYN from the old
  // connection's own address and port makes the peer's kernel answer on the old connection (a
  // challenge ACK), which ours, with no socket there any more, answers with a reset that the peer
  // accepts: its provider sees the connection end and takes the new one. Harmless where the old
  // connection is already gone (a handshake we never complete).
  for (const auto& [local, remote] : it->second) {
    const int fd = socket(local.ss_family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    if (fd < 0) continue;
    const int one = 1;
    setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
    const socklen_t len = local.ss_family == AF_INET ? sizeof(sockaddr_in) : sizeof(sockaddr_in6);
    if (bind(fd, reinterpret_cast<const sockaddr*>(&local), len) == 0) {
      connect(fd, reinterpret_cast<const sockaddr*>(&remote), len);  // sends the SYN (EINPROGRESS)
    }
    linger lg{1, 0};
    setsockopt(fd, SOL_SOCKET, SO_LINGER, &lg, sizeof(lg));
    close(fd);
  }
  if (++knocks_[address] >= kMaxKnocks) {
    aborted_.erase(it);
    knocks_.erase(address);
  }
}

int FabricLane::post_recv(void* buf, size_t len, void* desc, void* context, uint64_t tag, uint64_t ignore) {
  if (!tagged_) return -ENOSYS;
  ssize_t rc = fi_trecv(ep_, buf, len, desc, FI_ADDR_UNSPEC, tag, ignore, context);
  if (rc == -FI_EAGAIN) return -EAGAIN;
  if (rc == 0) posted_recvs_.insert(context);
  return static_cast<int>(rc);
}

int FabricLane::post_write(const WriteRequest& req) {
  if (unclaimed_.empty() || !tcp_) return post(req);
  auto it = unclaimed_.find(req.peer);
  if (it == unclaimed_.end()) return post(req);
  // The provider opens a connection inside the first post to a peer (in this thread): the socket that
  // appears across this call is ours. Under the process-wide lock, so that no other lane's first post
  // opens one in the same moment (a connection the provider reopens by itself, outside any first post,
  // stays unclaimed: see path_sockets).
  ProcessSockets& ps = process_sockets();
  std::lock_guard<std::mutex> lock(ps.mu);
  bool accepted = false;
  std::unordered_set<uint64_t> before;
  for (const auto& [fd, ino] : opened_sockets(req.peer, &accepted)) before.insert(ino);
  const int rc = post(req);
  bool claimed = false;
  for (const auto& [fd, ino] : opened_sockets(req.peer, &accepted)) {
    if (before.count(ino) == 0 && ps.owner.count(ino) == 0) {
      ps.owner[ino] = this;
      claimed = true;
    }
  }
  // Claimed; or the peer's connection to us carries it (no socket of ours needed); or, after a few
  // posts that opened nothing, the connection is there already: stop looking.
  if (claimed || accepted || ++it->second >= 8) unclaimed_.erase(it);
  return rc;
}

int FabricLane::post(const WriteRequest& req) {
  ssize_t rc;
  if (req.tagged.tagged) {
    if (!tagged_) return -FI_EOPNOTSUPP;
    if (req.delivery_complete) {
      if (!delivery_complete_) return -FI_EOPNOTSUPP;
      iovec iov{const_cast<void*>(req.src), req.len};
      void* desc = req.src_desc;
      fi_msg_tagged msg{};
      msg.msg_iov = &iov;
      msg.desc = &desc;
      msg.iov_count = 1;
      msg.addr = req.peer;
      msg.tag = req.tagged.tag;
      msg.ignore = 0;
      msg.context = req.context;
      msg.data = req.imm;
      uint64_t flags = FI_DELIVERY_COMPLETE | FI_COMPLETION | (req.has_imm ? FI_REMOTE_CQ_DATA : 0);
      rc = fi_tsendmsg(ep_, &msg, flags);
    } else if (req.has_imm) {
      rc = fi_tsenddata(ep_, req.src, req.len, req.src_desc, req.imm, req.peer, req.tagged.tag, req.context);
    } else {
      rc = fi_tsend(ep_, req.src, req.len, req.src_desc, req.peer, req.tagged.tag, req.context);
    }
  } else if (req.delivery_complete) {
    if (!delivery_complete_) return -FI_EOPNOTSUPP;
    // fi_writemsg is the only call that takes per-operation completion flags.
    iovec iov{const_cast<void*>(req.src), req.len};
    void* desc = req.src_desc;
    fi_rma_iov rma{req.remote_addr, req.len, req.key};
    fi_msg_rma msg{};
    msg.msg_iov = &iov;
    msg.desc = &desc;
    msg.iov_count = 1;
    msg.addr = req.peer;
    msg.rma_iov = &rma;
    msg.rma_iov_count = 1;
    msg.context = req.context;
    msg.data = req.imm;
    uint64_t flags = FI_DELIVERY_COMPLETE | FI_COMPLETION | (req.has_imm ? FI_REMOTE_CQ_DATA : 0);
    rc = fi_writemsg(ep_, &msg, flags);
  } else if (req.has_imm) {
    rc = fi_writedata(ep_, req.src, req.len, req.src_desc, req.imm, req.peer, req.remote_addr, req.key,
                      req.context);
  } else {
    rc = fi_write(ep_, req.src, req.len, req.src_desc, req.peer, req.remote_addr, req.key, req.context);
  }
  if (rc == -FI_EAGAIN) return -EAGAIN;
  return static_cast<int>(rc);
}

size_t FabricLane::poll(std::vector<Completion>& out, size_t max) {
  auto on_entry = [&](const fi_cq_tagged_entry& e, Completion& c) {
    if (e.op_context != nullptr && posted_recvs_.erase(e.op_context) != 0) {
      // One of the tagged receives: a message for a landing region arrived in its buffer.
      c.kind = Completion::kRecv;
      c.context = e.op_context;
      c.len = e.len;
      c.tag = e.tag;
      c.has_imm = (e.flags & FI_REMOTE_CQ_DATA) != 0;
      c.imm = static_cast<uint32_t>(e.data);
    } else if (e.flags & FI_REMOTE_CQ_DATA) {
      c.kind = Completion::kRemoteImm;
      c.imm = static_cast<uint32_t>(e.data);
      // With FI_RX_CQ_DATA each immediate consumed one posted receive: give it back.
      if (rx_cq_data_ && e.op_context) fi_recv(ep_, nullptr, 0, nullptr, FI_ADDR_UNSPEC, e.op_context);
    } else if (e.flags & FI_RECV) {
      if (rx_cq_data_ && e.op_context) fi_recv(ep_, nullptr, 0, nullptr, FI_ADDR_UNSPEC, e.op_context);
      return false;
    } else {
      c.kind = Completion::kLocalDone;
      c.context = e.op_context;
    }
    return true;
  };
  auto on_error = [&](const fi_cq_err_entry& err, Completion& c) {
    if (err.op_context != nullptr && posted_recvs_.erase(err.op_context) != 0) {
      // A tagged receive that failed (a message larger than the buffer: FI_ETRUNC): the engine drops
      // the message, counts it and posts the buffer again.
      c.kind = Completion::kRecv;
      c.len = err.len;
      c.tag = err.tag;
      return true;
    }
    if (err.flags & FI_REMOTE_CQ_DATA || err.flags & FI_RECV) {
      // A failed incoming operation: nothing of ours is waiting on it; repost and report nothing.
      if (rx_cq_data_ && err.op_context) fi_recv(ep_, nullptr, 0, nullptr, FI_ADDR_UNSPEC, err.op_context);
      return false;
    }
    return true;
  };
  return cq_.read(out, max, on_entry, on_error);
}

void FabricLane::wait(int timeout_ms) { cq_.wait(timeout_ms); }

void FabricLane::signal() { cq_.signal(); }

std::string FabricLane::error_string(int err) const { return fi_error(err); }

LaneCaps FabricLane::caps() const {
  LaneCaps c;
  c.is_nic = true;
  c.writes_host = true;
  c.writes_cuda = hmem_;
  c.rma_keys = true;
  c.own_imm = true;  // remote CQ data
  c.tagged = tagged_;
  c.orders_sends = orders_sends_;
  c.delivery_complete = delivery_complete_;
  c.orders_writes = orders_writes_;
  return c;
}

LaneType fabric_lane_type() {
  LaneType t;
  t.name = "fabric";
  t.configure = [](EngineConfig& cfg) {
    if (cfg.provider.empty()) cfg.provider = FabricLane::pick_provider();
    if (cfg.nics.empty()) {
      for (const auto& nic : FabricLane::discover(cfg.provider)) cfg.nics.push_back(nic.domain);
      if (cfg.nics.empty()) throw TransportError("libfabric provider '" + cfg.provider + "' offers no NIC here");
    }
  };
  t.open = [](const EngineConfig& cfg) {
    std::vector<std::unique_ptr<Lane>> lanes;
    // Core tcp: connections authenticated with the engine key (MSG endpoints); the other providers keep
    // the RDM lane (efa's and verbs' remote keys are the provider's; rxm cannot authenticate peers).
    const std::string key = unhex(cfg.auth_key);
    for (const auto& nic : cfg.nics) {
      if (cfg.provider == FabricMsgLane::kProvider) {
        lanes.push_back(std::make_unique<FabricMsgLane>(nic, key));
      } else {
        lanes.push_back(std::make_unique<FabricLane>(cfg.provider, nic));
      }
    }
    return lanes;
  };
  return t;
}

}  // namespace weightsync
