#include "fabric/msg_lane.hpp"

#include <arpa/inet.h>
#include <dirent.h>
#include <linux/sockios.h>
#include <linux/tcp.h>  // the kernel's tcp_info (glibc's lacks tcpi_snd_wnd)
#include <netinet/in.h>
#include <rdma/fi_errno.h>
#include <sys/ioctl.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstddef>
#include <cstring>
#include <random>

#include "core/errors.hpp"
#include "core/log.hpp"

namespace weightsync {

namespace {

using Clock = std::chrono::steady_clock;
constexpr uint32_t kFiVersion = FI_VERSION(1, 14);
constexpr size_t kIdBytes = 16;
// A connection not made within this long is given up (posts are refused meanwhile, so the worker's own
// stall timeout, shorter, usually fails the path first).
constexpr auto kConnectTimeout = std::chrono::seconds(30);
// After a connection attempt found nobody listening, the next waits this long.
constexpr auto kReconnectPause = std::chrono::milliseconds(100);
// While unauthenticated connections are watched, they are looked at again this often.
constexpr auto kGuardScanEvery = std::chrono::milliseconds(100);
// Refused requests logged one by one (then every kLogEvery-th): an attacker must not flood the log.
constexpr uint64_t kLogFirst = 8, kLogEvery = 1000;

fi_info* make_hints(const std::string& domain) {
  fi_info* hints = fi_allocinfo();
  if (hints == nullptr) throw TransportError("fi_allocinfo failed: out of memory");
  // FI_TAGGED with FI_SEND | FI_RECV: landing messages; tcp offers tags on MSG endpoints only with a
  // shared receive context, which is also what keeps those receives to authenticated endpoints.
  hints->caps = FI_RMA | FI_WRITE | FI_REMOTE_WRITE | FI_TAGGED | FI_SEND | FI_RECV;
  hints->mode = FI_CONTEXT | FI_CONTEXT2 | FI_RX_CQ_DATA;
  hints->ep_attr->type = FI_EP_MSG;
  hints->ep_attr->rx_ctx_cnt = FI_SHARED_CONTEXT;
  hints->domain_attr->mr_mode = FI_MR_LOCAL | FI_MR_VIRT_ADDR | FI_MR_ALLOCATED | FI_MR_PROV_KEY;
  hints->domain_attr->threading = FI_THREAD_DOMAIN;  // one worker thread owns each domain
  hints->domain_attr->cq_data_size = 4;
  hints->fabric_attr->prov_name = strdup(FabricMsgLane::kProvider);
  if (!domain.empty()) hints->domain_attr->name = strdup(domain.c_str());
  return hints;
}

std::string fi_error(int rc) { return std::string(fi_strerror(rc < 0 ? -rc : rc)); }

uint64_t random_u64() {
  static thread_local std::mt19937_64 gen{std::random_device{}()};
  return gen();
}

std::string sockaddr_text(const void* sa, size_t len) {
  if (sa == nullptr || len < sizeof(sa_family_t)) return "?";
  char host[INET6_ADDRSTRLEN] = "?";
  const auto family = static_cast<const sockaddr*>(sa)->sa_family;
  if (family == AF_INET && len >= sizeof(sockaddr_in)) {
    const auto* in = static_cast<const sockaddr_in*>(sa);
    inet_ntop(AF_INET, &in->sin_addr, host, sizeof(host));
    return std::string(host) + ":" + std::to_string(ntohs(in->sin_port));
  }
  if (family == AF_INET6 && len >= sizeof(sockaddr_in6)) {
    const auto* in = static_cast<const sockaddr_in6*>(sa);
    inet_ntop(AF_INET6, &in->sin6_addr, host, sizeof(host));
    return "[" + std::string(host) + "]:" + std::to_string(ntohs(in->sin6_port));
  }
  return "?";
}

// A peer lane's address: its listening sockaddr, then its 16-byte lane id.
bool split_address(const std::string& address, std::string* sockaddr_bytes, std::array<uint8_t, 16>* id) {
  if (address.size() <= kIdBytes + sizeof(sa_family_t)) return false;
  *sockaddr_bytes = address.substr(0, address.size() - kIdBytes);
  std::memcpy(id->data(), address.data() + sockaddr_bytes->size(), kIdBytes);
  return true;
}

bool same_socket_address(const sockaddr_storage& a, const void* b, size_t blen) {
  if (a.ss_family == AF_INET && blen >= sizeof(sockaddr_in)) {
    const auto& x = reinterpret_cast<const sockaddr_in&>(a);
    const auto* y = static_cast<const sockaddr_in*>(b);
    return y->sin_family == AF_INET && x.sin_port == y->sin_port && x.sin_addr.s_addr == y->sin_addr.s_addr;
  }
  if (a.ss_family == AF_INET6 && blen >= sizeof(sockaddr_in6)) {
    const auto& x = reinterpret_cast<const sockaddr_in6&>(a);
    const auto* y = static_cast<const sockaddr_in6*>(b);
    return y->sin6_family == AF_INET6 && x.sin6_port == y->sin6_port &&
           std::memcmp(&x.sin6_addr, &y->sin6_addr, sizeof(in6_addr)) == 0;
  }
  return false;
}

}  // namespace

std::vector<FabricNicInfo> FabricMsgLane::discover() {
  std::vector<FabricNicInfo> out;
  fi_info* hints = make_hints("");
  fi_info* info = nullptr;
  const int rc = fi_getinfo(kFiVersion, nullptr, nullptr, 0, hints, &info);
  fi_freeinfo(hints);
  if (rc != 0) return out;
  for (fi_info* cur = info; cur != nullptr; cur = cur->next) {
    FabricNicInfo nic{kProvider, cur->domain_attr->name ? cur->domain_attr->name : "",
                      cur->fabric_attr->name ? cur->fabric_attr->name : ""};
    bool seen = false;
    for (const auto& n : out) seen |= n.domain == nic.domain;
    if (!seen) out.push_back(nic);
  }
  fi_freeinfo(info);
  return out;
}

FabricMsgLane::FabricMsgLane(const std::string& domain, const std::string& key)
    : domain_(domain), auth_(key), lane_id_(random_id()) {
  {
    fi_info* hints = make_hints(domain);
    fi_info* list = nullptr;
    const int rc = fi_getinfo(kFiVersion, nullptr, nullptr, 0, hints, &list);
    fi_freeinfo(hints);
    fi_info* pick = nullptr;
    for (fi_info* cur = rc == 0 ? list : nullptr; cur != nullptr; cur = cur->next) {
      const char* name = cur->domain_attr->name;
      if (!domain.empty() && (name == nullptr || domain != name)) continue;
      // IPv4 first where a NIC has both (as the RDM lane).
      if (pick == nullptr || (cur->addr_format == FI_SOCKADDR_IN && pick->addr_format != FI_SOCKADDR_IN)) pick = cur;
    }
    info_ = pick ? fi_dupinfo(pick) : nullptr;
    if (list) fi_freeinfo(list);
    if (info_ == nullptr) {
      throw TransportError("libfabric provider 'tcp' has no NIC named '" + domain +
                           "' with MSG endpoints, RMA, remote CQ data and shared tagged receives" +
                           (rc ? ": " + fi_error(rc) : std::string()));
    }
  }
  if (info_->domain_attr->name) domain_ = info_->domain_attr->name;
  max_msg_size_ = info_->ep_attr->max_msg_size ? info_->ep_attr->max_msg_size : (1ull << 30);
  tx_size_ = info_->tx_attr->size ? info_->tx_attr->size : 256;
  eq_buf_.resize(sizeof(fi_eq_cm_entry) + 512);
  {
    // A write whose immediate travels separately (2-D writes, trailers) may only be announced once its
    // bytes are placed: ask whether tcp completes writes at delivery (it acknowledges them then).
    fi_info* dc_hints = make_hints(domain_);
    dc_hints->tx_attr->op_flags = FI_DELIVERY_COMPLETE;
    fi_info* dc = nullptr;
    if (fi_getinfo(kFiVersion, nullptr, nullptr, 0, dc_hints, &dc) == 0) {
      delivery_complete_ = dc != nullptr;
      fi_freeinfo(dc);
    }
    fi_freeinfo(dc_hints);
  }
  try {
    check(fi_fabric(info_->fabric_attr, &fabric_, nullptr), "fi_fabric");
    check(fi_domain(fabric_, info_, &domain_fid_, nullptr), "fi_domain");
    fi_eq_attr eq_attr{};
    eq_attr.size = 256;
    eq_attr.wait_obj = FI_WAIT_NONE;  // read by the worker on every turn (poll), never blocked on
    check(fi_eq_open(fabric_, &eq_attr, &eq_, nullptr), "fi_eq_open");

    check(cq_.open(domain_fid_), "fi_cq_open");

    // The shared receive context: landing receives, consumable only through the endpoints bound to it,
    // which are ours and those we accepted.
    check(fi_srx_context(domain_fid_, info_->rx_attr, &srx_, nullptr), "fi_srx_context");
    check(fi_ep_bind(srx_, cq_.queue_fid(), FI_RECV), "fi_ep_bind(srx, cq)");

    check(fi_passive_ep(fabric_, info_, &pep_, nullptr), "fi_passive_ep");
    check(fi_pep_bind(pep_, &eq_->fid, 0), "fi_pep_bind(eq)");
    check(fi_listen(pep_), "fi_listen");
    size_t opt_len = sizeof(cm_data_size_);
    if (fi_getopt(&pep_->fid, FI_OPT_ENDPOINT, FI_OPT_CM_DATA_SIZE, &cm_data_size_, &opt_len) != 0) {
      cm_data_size_ = ConnRequest::kSize;  // not told: what we send is all we need
    }
    if (cm_data_size_ < ConnRequest::kSize) {
      throw TransportError("tcp on NIC " + domain_ + " carries only " + std::to_string(cm_data_size_) +
                           " bytes of connection data; the authentication request needs " +
                           std::to_string(ConnRequest::kSize));
    }
    char name[128];
    size_t name_len = sizeof(name);
    check(fi_getname(&pep_->fid, name, &name_len), "fi_getname(pep)");
    listen_addr_.assign(name, name_len);
    address_ = listen_addr_;
    address_.append(reinterpret_cast<const char*>(lane_id_.data()), lane_id_.size());
    guard_ = std::make_unique<ListenerGuard>(domain_, listen_addr_);
  } catch (...) {
    close_all();
    throw;
  }
}

FabricMsgLane::~FabricMsgLane() { close_all(); }

void FabricMsgLane::close_all() {
  // Endpoints first (their queued operations are flushed into the CQ, which still exists), then the
  // shared receive context, the listener, and the objects they were bound to.
  for (auto& [h, c] : conns_) {
    if (c.ep) fi_close(&c.ep->fid);
    if (c.ctl_ep) fi_close(&c.ctl_ep->fid);
    c.ep = nullptr;
    c.ctl_ep = nullptr;
  }
  for (auto& [f, who] : accepted_) fi_close(f);
  accepted_.clear();
  conn_by_fid_.clear();
  if (srx_) fi_close(&srx_->fid);
  if (pep_) fi_close(&pep_->fid);
  cq_.close();
  if (eq_) fi_close(&eq_->fid);
  if (domain_fid_) fi_close(&domain_fid_->fid);
  if (fabric_) fi_close(&fabric_->fid);
  if (info_) fi_freeinfo(info_);
  srx_ = nullptr;
  pep_ = nullptr;
  eq_ = nullptr;
  domain_fid_ = nullptr;
  fabric_ = nullptr;
  info_ = nullptr;
}

void FabricMsgLane::check(int rc, const char* what) const {
  if (rc != 0) throw TransportError(std::string(what) + " failed on tcp NIC " + domain_ + ": " + fi_error(rc));
}

std::string FabricMsgLane::describe_address(const std::string& address) const {
  std::string sa;
  std::array<uint8_t, 16> id{};
  if (!split_address(address, &sa, &id)) return "?";
  return "tcp://" + sockaddr_text(sa.data(), sa.size());
}

void FabricMsgLane::set_auth_key(const std::string& key) { auth_.set_key(key); }

MemRegistration FabricMsgLane::register_memory(void* ptr, size_t len, MemKind kind, int device) {
  (void)device;
  if (kind != MemKind::kHost) {
    // tcp reaches host memory only; the engine keeps GPU regions on its staging and landing paths.
    throw TransportError("provider tcp on NIC " + domain_ + " cannot register GPU memory (no FI_HMEM)");
  }
  const uint64_t mr_mode = info_->domain_attr->mr_mode;
  const size_t key_size = info_->domain_attr->mr_key_size ? info_->domain_attr->mr_key_size : 8;
  static char empty_byte;  // a zero-length buffer still needs a valid address
  void* base = len ? ptr : &empty_byte;
  const size_t reg_len = len ? len : 1;
  fid_mr* mr = nullptr;
  int rc = 0;
  for (int attempt = 0; attempt < 8; ++attempt) {
    uint64_t requested = 0;
    if (!(mr_mode & FI_MR_PROV_KEY)) {
      // Random keys, as on the RDM lane; here a key is also useless without an authenticated endpoint.
      requested = random_u64();
      if (key_size < 8) requested &= ((1ull << (8 * key_size)) - 1);
    }
    rc = fi_mr_reg(domain_fid_, base, reg_len, FI_WRITE | FI_REMOTE_WRITE | FI_READ | FI_REMOTE_READ, 0,
                   requested, 0, &mr, nullptr);
    if (rc != -FI_ENOKEY) break;
  }
  check(rc, "fi_mr_reg");
  MemRegistration reg;
  reg.handle = mr;
  reg.local_desc = fi_mr_desc(mr);
  reg.key = fi_mr_key(mr);
  reg.remote_base = (mr_mode & FI_MR_VIRT_ADDR) ? reinterpret_cast<uint64_t>(base) : 0;
  return reg;
}

void FabricMsgLane::deregister(const MemRegistration& reg) {
  if (reg.handle) fi_close(&static_cast<fid_mr*>(reg.handle)->fid);
}

uint64_t FabricMsgLane::insert_peer(const std::string& address) {
  std::string sa;
  std::array<uint8_t, 16> id{};
  if (!split_address(address, &sa, &id)) {
    throw TransportError("peer address for tcp NIC " + domain_ + " is malformed (" +
                         std::to_string(address.size()) + " bytes)");
  }
  // Connected lazily, on the first post (as rxm does): a peer nobody writes to costs no connection.
  const uint64_t handle = next_handle_++;
  conns_[handle].address = address;
  conns_[handle].handle = handle;
  return handle;
}

void FabricMsgLane::close_ep(fid_ep* ep) {
  if (ep == nullptr) return;
  conn_by_fid_.erase(&ep->fid);
  // Operations still queued on it complete with errors (FI_ECANCELED) in the CQ, which outlives it.
  const int rc = fi_close(&ep->fid);
  if (rc != 0) log_warning("tcp NIC " + domain_ + ": closing an endpoint failed: " + fi_error(rc));
}

void FabricMsgLane::drop_conn(Conn& c, Conn::State state, int error, int queued_error, const std::string& why) {
  // Both connections of the path: a control connection never outlives its data connection (nor the
  // other way round), so a path is failed, reset or reconnected as one.
  close_ep(c.ep);
  close_ep(c.ctl_ep);
  c.ep = nullptr;
  c.ctl_ep = nullptr;
  c.state = state;
  c.ctl_state = Conn::kCtlNone;
  c.error = error;
  for (auto* queue : {&c.queued, &c.ctl_queued}) {
    for (const WriteRequest& req : *queue) {
      Completion f;
      f.kind = Completion::kLocalError;
      f.context = req.context;
      f.error = queued_error;
      f.message = error_string(queued_error) + " (" + why + ")";
      failed_.push_back(std::move(f));
    }
    queue->clear();
  }
}

void FabricMsgLane::flush_held(Conn& c, bool control) {
  std::deque<WriteRequest>& queue = control ? c.ctl_queued : c.queued;
  while ((control ? c.ctl_state == Conn::kCtlUp : c.state == Conn::kUp) && !queue.empty()) {
    // A held write goes through post_up: a control message held behind data writes (posted before the
    // data connection was up) goes on to the control connection from there.
    const ssize_t rc = control ? post_on(c.ctl_ep, queue.front()) : post_up(c, queue.front());
    if (rc == -FI_EAGAIN) return;  // the provider's queue is full: the rest go with the next poll
    if (rc != 0) {
      Completion f;
      f.kind = Completion::kLocalError;
      f.context = queue.front().context;
      f.error = static_cast<int>(rc < 0 ? -rc : rc);
      f.message = std::string("posting ") + (control ? "a control message" : "a write") +
                  " queued while connecting failed: " + fi_error(static_cast<int>(rc));
      failed_.push_back(std::move(f));
    }
    queue.pop_front();
  }
}

ssize_t FabricMsgLane::post_up(Conn& c, const WriteRequest& req) {
  if (!req.control) return post_on(c.ep, req);
  if (c.ctl_state == Conn::kCtlNone) {
    const int rc = start_control_connect(c);
    if (rc != 0) return rc;
  }
  if (c.ctl_state == Conn::kCtlUp && c.ctl_queued.empty()) return post_on(c.ctl_ep, req);
  if (c.ctl_queued.size() >= tx_size_) return -FI_EAGAIN;
  c.ctl_queued.push_back(req);  // sent in order once the control connection is up (or failed with it)
  return 0;
}

int FabricMsgLane::start_control_connect(Conn& c) {
  std::string sa;
  std::array<uint8_t, 16> server_id{};
  split_address(c.address, &sa, &server_id);  // checked by insert_peer
  fid_ep* ep = nullptr;
  int rc = open_endpoint(info_, &ep);
  if (rc == 0) {
    // The same proof as the data connection's, flagged: the server takes it only beside that one.
    c.ctl_request = auth_.make_request(0, lane_id_, server_id, sa, ConnRequest::kControlConn);
    const std::string data = c.ctl_request.pack();
    rc = fi_connect(ep, sa.data(), data.data(), data.size());
  }
  if (rc != 0) {
    if (ep) fi_close(&ep->fid);
    log_warning("tcp NIC " + domain_ + ": opening the control connection to " + describe_address(c.address) +
                " failed: " + fi_error(rc));
    return rc < 0 ? rc : -rc;
  }
  c.ctl_ep = ep;
  c.ctl_state = Conn::kCtlConnecting;
  conn_by_fid_[&ep->fid] = c.handle;
  return 0;
}

uint64_t FabricMsgLane::reset_path(uint64_t peer) {
  auto it = conns_.find(peer);
  if (it == conns_.end()) return peer;
  // A fresh connection on the next post; the same handle (no address vector to re-insert into).
  drop_conn(it->second, Conn::kIdle, 0);
  it->second.since = Clock::time_point{};
  return peer;
}

int FabricMsgLane::open_endpoint(fi_info* info, fid_ep** ep) {
  *ep = nullptr;
  int rc = fi_endpoint(domain_fid_, info, ep, nullptr);
  if (rc == 0) rc = fi_ep_bind(*ep, &eq_->fid, 0);
  if (rc == 0) rc = fi_ep_bind(*ep, cq_.queue_fid(), FI_TRANSMIT | FI_RECV);
  if (rc == 0) rc = fi_ep_bind(*ep, &srx_->fid, 0);
  if (rc == 0) rc = fi_enable(*ep);
  return rc;
}

void FabricMsgLane::start_connect(uint64_t handle, Conn& c) {
  std::string sa;
  std::array<uint8_t, 16> server_id{};
  split_address(c.address, &sa, &server_id);  // checked by insert_peer
  fid_ep* ep = nullptr;
  int rc = open_endpoint(info_, &ep);
  if (rc == 0) {
    c.request = auth_.make_request(0, lane_id_, server_id, sa);
    const std::string data = c.request.pack();
    rc = fi_connect(ep, sa.data(), data.data(), data.size());
  }
  if (rc != 0) {
    if (ep) fi_close(&ep->fid);
    log_warning("tcp NIC " + domain_ + ": connecting to " + describe_address(c.address) +
                " failed: " + fi_error(rc));
    c.state = Conn::kFailed;
    c.error = rc < 0 ? -rc : rc;
    return;
  }
  c.ep = ep;
  c.state = Conn::kConnecting;
  c.since = Clock::now();
  conn_by_fid_[&ep->fid] = handle;
}

void FabricMsgLane::refuse(fi_info* info, AuthRefusal why) {
  const uint64_t n = ++refused_;
  if (n <= kLogFirst || n % kLogEvery == 0) {
    log_warning("tcp NIC " + domain_ + ": refused a connection from " +
                sockaddr_text(info->dest_addr, info->dest_addr ? info->dest_addrlen : 0) + ": " +
                refusal_name(why) + " (" + std::to_string(n) + " refused so far)");
  }
  const uint8_t reason = static_cast<uint8_t>(why);
  const int rc = fi_reject(pep_, info->handle, &reason, 1);
  if (rc != 0) log_warning("tcp NIC " + domain_ + ": fi_reject failed: " + fi_error(rc));
}

bool FabricMsgLane::has_data_conn(const std::array<uint8_t, 16>& client_id) const {
  for (const auto& [f, who] : accepted_) {
    if (!who.control && who.client_id == client_id) return true;
  }
  return false;
}

void FabricMsgLane::on_connreq(fi_eq_cm_entry* entry, size_t len) {
  fi_info* info = entry->info;
  ConnRequest req;
  const size_t data_len = len > sizeof(fi_eq_cm_entry) ? len - sizeof(fi_eq_cm_entry) : 0;
  if (!ConnRequest::unpack(entry->data, data_len, &req)) {
    refuse(info, AuthRefusal::kMalformed);
  } else if (const int why = auth_.check_request(req, lane_id_, listen_addr_); why != 0) {
    refuse(info, static_cast<AuthRefusal>(why));
  } else if ((req.flags & ConnRequest::kControlConn) != 0 && !has_data_conn(req.client_id)) {
    // A control connection comes only beside a data connection of the same (authenticated) client,
    // which that client makes first: alone it is nobody's path.
    refuse(info, AuthRefusal::kNoDataConn);
  } else {
    // Authenticated: only now does the peer get an endpoint, bound to the shared receives.
    fid_ep* ep = nullptr;
    int rc = open_endpoint(info, &ep);
    if (rc == 0) {
      const std::string proof = auth_.server_proof(req, lane_id_);
      rc = fi_accept(ep, proof.data(), proof.size());
    }
    if (rc != 0) {
      log_warning("tcp NIC " + domain_ + ": accepting an authenticated connection failed: " + fi_error(rc));
      if (ep) fi_close(&ep->fid);
      const uint8_t reason = 0;
      if (fi_reject(pep_, info->handle, &reason, 1) != 0) {
        log_warning("tcp NIC " + domain_ + ": fi_reject after a failed accept failed too");
      }
    } else {
      accepted_[&ep->fid] = Accepted{req.client_id, (req.flags & ConnRequest::kControlConn) != 0};
    }
  }
  fi_freeinfo(info);
}

void FabricMsgLane::on_connect_error(Conn& c, bool control, const fi_eq_err_entry& err) {
  const char* which = control ? "control connection" : "connection";
  const int reason = err.err == FI_ECONNREFUSED && err.err_data_size > 0
                         ? static_cast<const uint8_t*>(err.err_data)[0]
                         : -1;
  if (reason == static_cast<int>(AuthRefusal::kNoDataConn)) {
    // Our data connection is gone at the server's end already (its shutdown not yet seen here): the
    // path connects afresh, both connections.
    drop_conn(c, Conn::kIdle, 0, FI_ECONNABORTED, "the peer had no data connection of ours");
    c.since = Clock::now() + kReconnectPause;
  } else if (reason >= 0) {
    // The server answered with reject data: it refused our proof (a different key or a clock too far
    // off). Trying again cannot help; the path fails with it.
    log_warning("tcp NIC " + domain_ + ": " + describe_address(c.address) + " refused our " + which +
                " request (reason " + std::to_string(reason) +
                ": is it in another group, or was it given another engine key?)");
    drop_conn(c, Conn::kFailed, FI_EACCES, FI_EACCES, "the peer refused our connection request");
  } else {
    // Nobody listening (any more), or the network: the writes waiting for this path fail (the path
    // with them); posts are refused for a moment, then a new connection is tried.
    const int why = err.err ? err.err : FI_ECONNREFUSED;
    drop_conn(c, Conn::kIdle, 0, why, std::string("connecting the ") + which + " to " +
                                           describe_address(c.address) + " failed");
    c.since = Clock::now() + kReconnectPause;
  }
}

void FabricMsgLane::on_connected(Conn& c, bool control, const fi_eq_cm_entry* entry, size_t len) {
  std::string sa;
  std::array<uint8_t, 16> server_id{};
  split_address(c.address, &sa, &server_id);
  const size_t data_len = len > sizeof(fi_eq_cm_entry) ? len - sizeof(fi_eq_cm_entry) : 0;
  if (!auth_.check_server_proof(control ? c.ctl_request : c.request, server_id, entry->data, data_len)) {
    // Whoever listens there now is not the engine we were given (or has another key): write nothing.
    log_warning("tcp NIC " + domain_ + ": " + describe_address(c.address) +
                " accepted our connection without proving the engine key; dropped it");
    drop_conn(c, Conn::kFailed, FI_EACCES, FI_EACCES, "the listener did not prove the engine key");
    return;
  }
  if (control) {
    c.ctl_state = Conn::kCtlUp;
  } else {
    c.state = Conn::kUp;
  }
  flush_held(c, control);
}

void FabricMsgLane::progress_cm() {
  read_cm_events();
  if (!guard_) return;
  // The provider accepts one queued connection per read of the events: while connections wait in the
  // listener's queue, read again, so that a member's request is not served only after every stranger's
  // socket queued before it; every so often (and at the end) cut the sockets that never authenticate.
  const auto now = Clock::now();
  int accepts = 0;
  while (accepts < ListenerGuard::kAcceptsPerTurn && guard_->queue_waiting(now)) {
    read_cm_events();
    if (++accepts % 32 == 0) guard_->bound(member_peers(), now);
  }
  if (accepts > 0 || (guard_->watching() && now >= next_guard_scan_)) {
    guard_->bound(member_peers(), now);
    next_guard_scan_ = now + kGuardScanEvery;
  }
}

std::vector<sockaddr_storage> FabricMsgLane::member_peers() const {
  std::vector<sockaddr_storage> out;
  out.reserve(accepted_.size());
  for (const auto& [f, who] : accepted_) {
    sockaddr_storage a{};
    size_t len = sizeof(a);
    // An endpoint's fid is the first member of its fid_ep.
    if (fi_getpeer(reinterpret_cast<fid_ep*>(f), &a, &len) == 0) out.push_back(a);
  }
  return out;
}

void FabricMsgLane::read_cm_events() {
  // Connection events: requests to our listener, our connections made or refused, either side's ends.
  for (int i = 0; i < 64; ++i) {
    uint32_t event = 0;
    const ssize_t n = fi_eq_read(eq_, &event, eq_buf_.data(), eq_buf_.size(), 0);
    if (n == -FI_EAGAIN) return;
    if (n == -FI_EAVAIL) {
      fi_eq_err_entry err{};
      if (fi_eq_readerr(eq_, &err, 0) < 0) return;
      auto it = err.fid ? conn_by_fid_.find(err.fid) : conn_by_fid_.end();
      if (it != conn_by_fid_.end()) {
        Conn& c = conns_[it->second];
        on_connect_error(c, c.ctl_ep != nullptr && err.fid == &c.ctl_ep->fid, err);
        continue;
      }
      if (err.fid && accepted_.erase(err.fid)) fi_close(err.fid);
      continue;
    }
    if (n < 0) {
      log_warning("tcp NIC " + domain_ + ": fi_eq_read failed: " + fi_error(static_cast<int>(n)));
      return;
    }
    auto* entry = reinterpret_cast<fi_eq_cm_entry*>(eq_buf_.data());
    const size_t len = static_cast<size_t>(n);
    if (event == FI_CONNREQ) {
      on_connreq(entry, len);
    } else if (event == FI_CONNECTED) {
      auto it = conn_by_fid_.find(entry->fid);
      if (it == conn_by_fid_.end()) continue;  // one we accepted: nothing to do until it ends
      Conn& c = conns_[it->second];
      on_connected(c, c.ctl_ep != nullptr && entry->fid == &c.ctl_ep->fid, entry, len);
    } else if (event == FI_SHUTDOWN) {
      auto it = conn_by_fid_.find(entry->fid);
      if (it != conn_by_fid_.end()) {
        // One of our connections ended (the peer closed, or abort_path reset it): its queued writes were
        // already flushed as errors; the path's other connection goes with it; the next post connects
        // again.
        Conn& c = conns_[it->second];
        drop_conn(c, Conn::kIdle, 0);
        c.since = Clock::time_point{};
      } else if (accepted_.erase(entry->fid)) {
        fi_close(entry->fid);
      }
    }
  }
}

int FabricMsgLane::post_recv(void* buf, size_t len, void* desc, void* context, uint64_t tag, uint64_t ignore) {
  // On the shared receive context: matched (tag under `ignore`, posting order) by accepted endpoints only.
  const ssize_t rc = fi_trecv(srx_, buf, len, desc, FI_ADDR_UNSPEC, tag, ignore, context);
  if (rc == -FI_EAGAIN) return -EAGAIN;
  if (rc == 0) posted_recvs_.insert(context);
  return static_cast<int>(rc);
}

int FabricMsgLane::post_write(const WriteRequest& req) {
  auto it = conns_.find(req.peer);
  if (it == conns_.end()) return -FI_EINVAL;
  Conn& c = it->second;
  if (c.state != Conn::kUp || !c.queued.empty()) {
    progress_cm();
    const auto now = Clock::now();
    if (c.state == Conn::kIdle) {
      if (now < c.since) return -EAGAIN;  // a connection was refused a moment ago: not yet again
      start_connect(req.peer, c);
    }
    if (c.state == Conn::kConnecting && now - c.since > kConnectTimeout) {
      drop_conn(c, Conn::kFailed, FI_ETIMEDOUT, FI_ETIMEDOUT, "no connection within the connect timeout");
    }
    if (c.state == Conn::kFailed) return -(c.error ? c.error : FI_EIO);  // reset_path starts over
    if (c.state == Conn::kUp) flush_held(c, false);
    if (c.state != Conn::kUp || !c.queued.empty()) {
      // Held until the connection is up (behind the writes held before it): the path keeps its order.
      if (c.queued.size() >= tx_size_) return -EAGAIN;
      c.queued.push_back(req);
      return 0;
    }
  }
  const ssize_t rc = post_up(c, req);
  if (rc == -FI_EAGAIN) return -EAGAIN;
  return static_cast<int>(rc);
}

ssize_t FabricMsgLane::post_on(fid_ep* ep, const WriteRequest& req) {
  ssize_t rc;
  if (req.tagged.tagged) {
    if (req.delivery_complete) {
      iovec iov{const_cast<void*>(req.src), req.len};
      void* desc = req.src_desc;
      fi_msg_tagged msg{};
      msg.msg_iov = &iov;
      msg.desc = &desc;
      msg.iov_count = 1;
      msg.tag = req.tagged.tag;
      msg.context = req.context;
      msg.data = req.imm;
      rc = fi_tsendmsg(ep, &msg, FI_DELIVERY_COMPLETE | FI_COMPLETION | (req.has_imm ? FI_REMOTE_CQ_DATA : 0));
    } else if (req.has_imm) {
      rc = fi_tsenddata(ep, req.src, req.len, req.src_desc, req.imm, 0, req.tagged.tag, req.context);
    } else {
      rc = fi_tsend(ep, req.src, req.len, req.src_desc, 0, req.tagged.tag, req.context);
    }
  } else if (req.delivery_complete) {
    // fi_writemsg is the only call that takes per-operation completion flags.
    iovec iov{const_cast<void*>(req.src), req.len};
    void* desc = req.src_desc;
    fi_rma_iov rma{req.remote_addr, req.len, req.key};
    fi_msg_rma msg{};
    msg.msg_iov = &iov;
    msg.desc = &desc;
    msg.iov_count = 1;
    msg.rma_iov = &rma;
    msg.rma_iov_count = 1;
    msg.context = req.context;
    msg.data = req.imm;
    rc = fi_writemsg(ep, &msg, FI_DELIVERY_COMPLETE | FI_COMPLETION | (req.has_imm ? FI_REMOTE_CQ_DATA : 0));
  } else if (req.has_imm) {
    rc = fi_writedata(ep, req.src, req.len, req.src_desc, req.imm, 0, req.remote_addr, req.key, req.context);
  } else {
    rc = fi_write(ep, req.src, req.len, req.src_desc, 0, req.remote_addr, req.key, req.context);
  }
  return rc;
}

size_t FabricMsgLane::poll(std::vector<Completion>& out, size_t max) {
  progress_cm();
  for (auto& [handle, conn] : conns_) {
    if (!conn.queued.empty()) flush_held(conn, false);
    if (!conn.ctl_queued.empty()) flush_held(conn, true);
  }
  size_t got = 0;
  // Writes that failed before reaching the provider (their connection was refused or dropped).
  while (!failed_.empty() && got < max) {
    out.push_back(std::move(failed_.back()));
    failed_.pop_back();
    ++got;
  }
  auto on_entry = [&](const fi_cq_tagged_entry& e, Completion& c) {
    if (e.op_context != nullptr && posted_recvs_.erase(e.op_context) != 0) {
      c.kind = Completion::kRecv;  // a landing message arrived in one of the shared receives
      c.context = e.op_context;
      c.len = e.len;
      c.tag = e.tag;
      c.has_imm = (e.flags & FI_REMOTE_CQ_DATA) != 0;
      c.imm = static_cast<uint32_t>(e.data);
    } else if (e.flags & FI_REMOTE_CQ_DATA) {
      // Only an accepted (authenticated) endpoint can have carried it: there are no others.
      c.kind = Completion::kRemoteImm;
      c.imm = static_cast<uint32_t>(e.data);
    } else if (e.flags & (FI_RECV | FI_REMOTE_WRITE)) {
      return false;  // an incoming operation with nothing for us
    } else {
      c.kind = Completion::kLocalDone;
      c.context = e.op_context;
    }
    return true;
  };
  auto on_error = [&](const fi_cq_err_entry& err, Completion& c) {
    if (err.op_context != nullptr && posted_recvs_.erase(err.op_context) != 0) {
      // A landing receive that failed (truncated, or cancelled at close): the engine drops it.
      c.kind = Completion::kRecv;
      c.len = err.len;
      c.tag = err.tag;
      return true;
    }
    // A failed incoming operation: nothing of ours waits on it.
    return !(err.op_context == nullptr || (err.flags & (FI_REMOTE_CQ_DATA | FI_RECV | FI_REMOTE_WRITE)));
  };
  return got + cq_.read(out, max - got, on_entry, on_error);
}

void FabricMsgLane::wait(int timeout_ms) {
  // Connection requests do not wake the CQ: waits stay short while none is ours to make, so a request
  // is answered within the worker's idle wait (tens of milliseconds) at worst.
  cq_.wait(timeout_ms);
}

void FabricMsgLane::signal() { cq_.signal(); }

std::string FabricMsgLane::error_string(int err) const {
  if (err == FI_EACCES) return "the peer's engine key proof failed (" + fi_error(err) + ")";
  return fi_error(err);
}

std::vector<int> FabricMsgLane::conn_sockets(const Conn& c) const {
  // Both connections of the path, where up: the provider keeps its sockets private, so they are found
  // among the process's descriptors by each endpoint's exact local and peer addresses.
  struct Ends {
    char local[128], remote[128];
    size_t llen = sizeof(local), rlen = sizeof(remote);
  };
  std::vector<Ends> ends;
  for (fid_ep* ep : {c.state == Conn::kUp ? c.ep : nullptr, c.ctl_state == Conn::kCtlUp ? c.ctl_ep : nullptr}) {
    if (ep == nullptr) continue;
    Ends e;
    if (fi_getname(&ep->fid, e.local, &e.llen) == 0 && fi_getpeer(ep, e.remote, &e.rlen) == 0) ends.push_back(e);
  }
  std::vector<int> out;
  if (ends.empty()) return out;
  DIR* dir = opendir("/proc/self/fd");
  if (dir == nullptr) return out;
  const int dir_fd = dirfd(dir);
  while (dirent* e = readdir(dir)) {
    char* end = nullptr;
    const long fd = std::strtol(e->d_name, &end, 10);
    if (end == e->d_name || *end != '\0' || fd == dir_fd) continue;
    sockaddr_storage a{}, b{};
    socklen_t len = sizeof(a);
    if (getsockname(static_cast<int>(fd), reinterpret_cast<sockaddr*>(&a), &len) != 0) continue;
    len = sizeof(b);
    if (getpeername(static_cast<int>(fd), reinterpret_cast<sockaddr*>(&b), &len) != 0) continue;
    for (const Ends& x : ends) {
      if (same_socket_address(a, x.local, x.llen) && same_socket_address(b, x.remote, x.rlen)) {
        out.push_back(static_cast<int>(fd));
        break;
      }
    }
  }
  closedir(dir);
  return out;
}

Lane::PathState FabricMsgLane::path_state(uint64_t peer, double window_s) {
  auto it = conns_.find(peer);
  if (it == conns_.end()) return PathState::kUnknown;
  constexpr uint8_t kEstablished = 1;  // TCP_ESTABLISHED
  const auto window_ms = static_cast<uint32_t>(window_s * 1000.0);
  bool dead = false;
  for (int fd : conn_sockets(it->second)) {
    tcp_info info{};
    socklen_t len = sizeof(info);
    if (getsockopt(fd, IPPROTO_TCP, TCP_INFO, &info, &len) != 0 || info.tcpi_state != kEstablished) continue;
    int queued = 0;  // bytes the kernel still holds for the peer: none, and the socket has nothing to say
    if (ioctl(fd, SIOCOUTQ, &queued) != 0 || queued <= 0) continue;
    const bool has_window = len >= offsetof(tcp_info, tcpi_snd_wnd) + sizeof(info.tcpi_snd_wnd);
    if (has_window && info.tcpi_snd_wnd == 0) return PathState::kAlive;  // peer's buffer full: back-pressure
    if (info.tcpi_last_ack_recv < window_ms) return PathState::kAlive;   // acknowledged lately: slow
    dead = true;
  }
  return dead ? PathState::kDead : PathState::kUnknown;
}

bool FabricMsgLane::abort_path(uint64_t peer) {
  auto it = conns_.find(peer);
  if (it == conns_.end()) return false;
  if (it->second.state == Conn::kConnecting) {
    // Nothing was sent yet: the held writes fail now (they never reached the peer), and so does the
    // connection attempt; the next post starts a new one.
    drop_conn(it->second, Conn::kIdle, 0, FI_ECONNABORTED, "the path was aborted while connecting");
    it->second.since = Clock::time_point{};
    return true;
  }
  bool aborted = false;
  for (int fd : conn_sockets(it->second)) {  // data and control connection alike
    // As on the RDM lane: a reset instead of a graceful close drops what the kernel still holds, and
    // the provider's next use of the socket fails the writes posted on it. Unlike rxm, a peer that
    // missed the reset needs no knock: our next connection is a new request, not a duplicate.
    linger lg{1, 0};
    if (setsockopt(fd, SOL_SOCKET, SO_LINGER, &lg, sizeof(lg)) != 0) continue;
    sockaddr unspec{};
    unspec.sa_family = AF_UNSPEC;
    if (connect(fd, &unspec, sizeof(unspec)) != 0) continue;
    shutdown(fd, SHUT_RDWR);
    aborted = true;
  }
  return aborted;
}

bool FabricMsgLane::close_path(uint64_t& peer) {
  auto it = conns_.find(peer);
  if (it == conns_.end()) return false;
  Conn& c = it->second;
  // A zero linger on its sockets first, data and control (where abort_path has not disconnected them
  // already): closing the endpoints then resets the connections and the kernel drops what it still held instead of sending it
  // after link-up. The provider fails every write still posted on the endpoint as it closes it (errors
  // in the CQ, which outlives it); the same handle connects afresh on the next post.
  for (int fd : conn_sockets(c)) {
    linger lg{1, 0};
    setsockopt(fd, SOL_SOCKET, SO_LINGER, &lg, sizeof(lg));
  }
  drop_conn(c, Conn::kIdle, 0, FI_ECANCELED, "the path's connection was closed");
  c.since = Clock::time_point{};
  return true;
}

LaneCaps FabricMsgLane::caps() const {
  LaneCaps c;
  c.is_nic = true;
  c.writes_host = true;
  c.rma_keys = true;
  c.own_imm = true;  // remote CQ data
  c.tagged = true;
  c.orders_sends = (info_->tx_attr->msg_order & FI_ORDER_SAS) != 0;
  c.delivery_complete = delivery_complete_;
  c.orders_writes = (info_->tx_attr->msg_order & FI_ORDER_WAW) != 0;
  c.control_queue = true;  // announces on each path's control connection
  return c;
}

}  // namespace weightsync
