// The authenticated fabric lane for TCP (issue 16): core `tcp` FI_EP_MSG endpoints, one connection per
// peer we write to, instead of tcp;ofi_rxm's RDM endpoint. rxm accepts any connection request and takes
// the peer's source port from the peer's own connection data, so nothing on rxm can tell a member from
// another process on its host; and by the time a completion could be filtered an RMA write has already
// landed. Here a peer must prove the engine key in its connection request (fabric/peer_auth.hpp) before
// it has an endpoint at all: refused requests get fi_reject and never an endpoint, so they can neither
// write, nor raise immediates, nor consume landing receives. The writes themselves are the same libfabric
// calls as the RDM lane's, over the connected endpoint; only connection set-up pays for authentication.
//
// Landing messages: tcp MSG endpoints offer tagged messages with a shared receive context. The ring's
// receives are posted there, and only accepted (authenticated) endpoints are bound to it.
//
// Control connections (LaneCaps::control_queue): a path is two connections, one for data and one for
// announces. An announce goes only after its piece's bytes were placed (delivery complete), so it needs
// no order with the data; on the data connection it would wait behind every byte posted there after the
// piece (a relay's next hop then learns of its chunks only when the whole transfer is in). The control
// connection is made once the data connection is up, with a request authenticated exactly as the data
// connection's (same key, nonce, time window and server proof) and flagged ConnRequest::kControlConn
// (covered by the proof); the server accepts it only from a client with a data connection accepted here
// already, else refuses it (AuthRefusal::kNoDataConn). The two live and die together: whatever ends or
// fails one (a refusal, a shutdown, reset_path, close_path) closes both and fails what both held.
#pragma once

#include <rdma/fabric.h>
#include <rdma/fi_cm.h>
#include <rdma/fi_domain.h>
#include <rdma/fi_endpoint.h>
#include <rdma/fi_eq.h>
#include <rdma/fi_rma.h>
#include <rdma/fi_tagged.h>

#include <array>
#include <atomic>
#include <chrono>
#include <deque>
#include <memory>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "core/lane.hpp"
#include "fabric/fabric_lane.hpp"
#include "fabric/listener_guard.hpp"
#include "fabric/peer_auth.hpp"

namespace weightsync {

class FabricMsgLane final : public Lane {
 public:
  static constexpr const char* kProvider = "tcp";
  // NICs (tcp domains: interfaces) that offer MSG endpoints with RMA, remote CQ data and tagged messages
  // over a shared receive context.
  static std::vector<FabricNicInfo> discover();

  // `key`: the engine key K (raw bytes; empty: accept peers that have none either).
  FabricMsgLane(const std::string& domain, const std::string& key);
  ~FabricMsgLane() override;
  FabricMsgLane(const FabricMsgLane&) = delete;
  FabricMsgLane& operator=(const FabricMsgLane&) = delete;

  std::string kind() const override { return "fabric"; }
  std::string provider() const override { return kProvider; }
  std::string nic_name() const override { return domain_; }
  std::string address() const override { return address_; }
  std::string describe_address(const std::string& address) const override;

  MemRegistration register_memory(void* ptr, size_t len, MemKind kind, int device) override;
  void deregister(const MemRegistration& reg) override;
  uint64_t insert_peer(const std::string& address) override;
  uint64_t reset_path(uint64_t peer) override;
  PathState path_state(uint64_t peer, double window_s) override;
  bool abort_path(uint64_t peer) override;
  bool close_path(uint64_t& peer) override;
  void set_auth_key(const std::string& key) override;
  uint64_t auth_refused() const override { return refused_.load(); }

  int post_write(const WriteRequest& req) override;
  size_t poll(std::vector<Completion>& out, size_t max) override;
  void wait(int timeout_ms) override;
  void signal() override;

  LaneCaps caps() const override;
  int post_recv(void* buf, size_t len, void* desc, void* context, uint64_t tag, uint64_t ignore) override;
  uint64_t max_write() const override { return max_msg_size_; }
  size_t max_outstanding() const override { return tx_size_; }
  std::string error_string(int err) const override;

 private:
  // One connection we write over (a peer handle from insert_peer), and its control connection.
  struct Conn {
    uint64_t handle = 0;  // its key in conns_
    std::string address;  // the peer lane's address: its listening sockaddr, then its 16-byte lane id
    fid_ep* ep = nullptr;
    enum State { kIdle, kConnecting, kUp, kFailed } state = kIdle;
    int error = 0;  // kFailed: the positive FI_E* code posts are refused with
    std::chrono::steady_clock::time_point since{};     // kConnecting: when; kIdle: no attempt before
    ConnRequest request;  // kConnecting: what was sent (the server's proof answers its nonce)
    // Writes posted while the connection is being made, posted in order once it is up, or failed with
    // it (as rxm defers them): a post never waits for a connection, and a probe is not lost to one.
    std::deque<WriteRequest> queued;
    // The control connection (WriteRequest::control: announces), made on the first control message once
    // the data connection is up; ended with it (drop_conn).
    fid_ep* ctl_ep = nullptr;
    enum CtlState { kCtlNone, kCtlConnecting, kCtlUp } ctl_state = kCtlNone;
    ConnRequest ctl_request;  // kCtlConnecting: what was sent
    std::deque<WriteRequest> ctl_queued;  // control messages posted before it was up, sent in order then
  };
  // An endpoint we accepted: whose (the client's authenticated lane id), and which of its connections.
  struct Accepted {
    std::array<uint8_t, 16> client_id{};
    bool control = false;
  };
  // Reads the connection events, drains the listener's queue and bounds what strangers hold of it
  // (fabric/listener_guard.hpp).
  void progress_cm();
  void read_cm_events();
  // The peer addresses of the endpoints we accepted (authenticated).
  std::vector<sockaddr_storage> member_peers() const;
  void on_connreq(fi_eq_cm_entry* entry, size_t len);
  void refuse(fi_info* info, AuthRefusal why);
  void start_connect(uint64_t handle, Conn& c);
  // An endpoint for `info` (ours to connect, or a peer's request to accept), bound to the event queue,
  // the completion queue and the shared receives, and enabled. 0 or a libfabric error; *ep is set when
  // one was made (the caller closes it on error).
  int open_endpoint(fi_info* info, fid_ep** ep);
  // Closes the connection's endpoint (its posted writes come back as errors from the provider) and fails
  // the writes still queued for it with `queued_error` (an FI_E* code) and `why`.
  void drop_conn(Conn& c, Conn::State state, int error, int queued_error = FI_ECANCELED,
                 const std::string& why = "connection closed before it was made");
  // Posts the requests held while a connection of the path was being made (`control`: the control
  // connection's queue, else the data connection's), in order, while that connection is up, until done
  // or the provider refuses (EAGAIN). A request the provider refuses otherwise fails alone.
  void flush_held(Conn& c, bool control);
  // Where a request goes once the data connection is up: control messages to the control connection
  // (connecting it first, holding them meanwhile), the rest to the data endpoint. 0, -FI_EAGAIN or an
  // FI error for this request alone (the connections stay as they are).
  ssize_t post_up(Conn& c, const WriteRequest& req);
  int start_control_connect(Conn& c);
  // Events of our connections (data or control endpoint `fid` of `c`).
  void on_connect_error(Conn& c, bool control, const fi_eq_err_entry& err);
  void on_connected(Conn& c, bool control, const fi_eq_cm_entry* entry, size_t len);
  bool has_data_conn(const std::array<uint8_t, 16>& client_id) const;
  ssize_t post_on(fid_ep* ep, const WriteRequest& req);
  void close_ep(fid_ep* ep);
  std::vector<int> conn_sockets(const Conn& c) const;
  void check(int rc, const char* what) const;
  void close_all();

  std::string domain_;
  PeerAuth auth_;
  std::array<uint8_t, 16> lane_id_{};  // in our address; both proofs name it
  fi_info* info_ = nullptr;
  fid_fabric* fabric_ = nullptr;
  fid_domain* domain_fid_ = nullptr;
  fid_eq* eq_ = nullptr;
  CompletionQueue cq_;
  fid_pep* pep_ = nullptr;
  fid_ep* srx_ = nullptr;
  std::string listen_addr_;  // our pep's sockaddr (the first part of address_)
  std::unique_ptr<ListenerGuard> guard_;
  std::chrono::steady_clock::time_point next_guard_scan_{};
  std::string address_;
  bool delivery_complete_ = false;  // the provider accepts FI_DELIVERY_COMPLETE on a write
  uint64_t max_msg_size_ = 0;
  size_t tx_size_ = 0;
  size_t cm_data_size_ = 0;
  std::unordered_map<uint64_t, Conn> conns_;          // by peer handle
  std::unordered_map<fid_t, uint64_t> conn_by_fid_;   // our connecting/connected endpoints
  std::unordered_map<fid_t, Accepted> accepted_;      // endpoints we accepted (authenticated peers)
  uint64_t next_handle_ = 1;
  std::atomic<uint64_t> refused_{0};  // connection requests refused (read from other threads: stats)
  std::unordered_set<void*> posted_recvs_;
  std::vector<uint8_t> eq_buf_;
  std::vector<Completion> failed_;  // errors of writes that never reached the provider, for poll()
};

}  // namespace weightsync
