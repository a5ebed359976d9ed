// The fabric lane, one per NIC: libfabric RDM, FI_RMA writes with remote CQ data (fi_writedata). The same code runs on EFA,
// on verbs;ofi_rxm and on tcp;ofi_rxm; everything provider-specific is read from fi_info and honoured.
//
// No control queue (LaneCaps::control_queue is false): an announce (WriteRequest::control) goes on the
// one RDM endpoint like the data, so on tcp;ofi_rxm and verbs;ofi_rxm (one connection or queue pair per
// peer pair) it waits behind every byte posted to that peer before it, and an immediate arrives with
// the last of them. A second RDM endpoint per NIC
// would give it a queue of its own, at the price of a second address per NIC in the engine's address,
// announce receives posted on the second endpoint as well, and this lane's close/abort/knock handling
// of connections doubled, for a lane kept for RDMA NICs, where the default tcp lane does not run. Not
// done: on this lane a relay's next hop learns of a chunk only once everything posted before its
// announce has gone.
#pragma once

#include <rdma/fabric.h>
#include <rdma/fi_cm.h>
#include <rdma/fi_domain.h>
#include <rdma/fi_endpoint.h>
#include <rdma/fi_eq.h>
#include <rdma/fi_rma.h>
#include <rdma/fi_tagged.h>

#include <sys/socket.h>

#include <memory>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "core/lane.hpp"
#include "fabric/completion_queue.hpp"

namespace weightsync {

struct FabricNicInfo {
  std::string provider;
  std::string domain;
  std::string fabric;
};

class FabricLane final : public Lane {
 public:
  // NICs usable with RMA writes + remote CQ data for `provider` (empty: any provider).
  static std::vector<FabricNicInfo> discover(const std::string& provider);
  // First of efa, verbs;ofi_rxm, tcp;ofi_rxm that offers RMA with remote CQ data here.
  static std::string pick_provider();

  FabricLane(const std::string& provider, const std::string& domain);
  ~FabricLane() override;
  FabricLane(const FabricLane&) = delete;
  FabricLane& operator=(const FabricLane&) = delete;

  std::string kind() const override { return "fabric"; }
  std::string provider() const override { return provider_; }
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

  int post_write(const WriteRequest& req) override;
  int post(const WriteRequest& req);  // post_write without claiming a connection it may open
  // reset_path's work: false where the handle is unknown or the provider kept the address.
  bool reopen(uint64_t& peer);
  size_t poll(std::vector<Completion>& out, size_t max) override;
  void wait(int timeout_ms) override;
  void signal() override;

  LaneCaps caps() const override;
  bool hmem() const { return hmem_; }
  int post_recv(void* buf, size_t len, void* desc, void* context, uint64_t tag, uint64_t ignore) override;
  uint64_t max_write() const override { return max_msg_size_; }
  size_t max_outstanding() const override { return tx_size_; }
  std::string error_string(int err) const override;

 private:
  void post_rx_buffers();
  void close_all();
  // tcp;ofi_rxm, before the endpoint closes: resets every connection of this lane and lets the provider
  // see them end (see close_all).
  void abort_connections();
  void check(int rc, const char* what) const;
  // tcp;ofi_rxm: the kernel sockets of the connection(s) between our endpoint and `peer`'s. The
  // provider keeps them private, so they are found among the process's descriptors by their addresses
  // (ours and the peer's listening address; either side may have connected). A connection we opened
  // looks the same as one another lane of this process on the same address opened to the same peer, so
  // those count only when this lane claimed them (see claim_connection), or when no other lane of the
  // process shares our address. Empty elsewhere.
  std::vector<int> path_sockets(uint64_t peer) const;
  // Sockets that look like a connection we opened to `peer` (our address, any port -> its listening
  // address), by inode; with `accepted`, whether one it opened to our listening address exists.
  std::vector<std::pair<int, uint64_t>> opened_sockets(uint64_t peer, bool* accepted) const;
  // Peer handles whose connection this lane has not claimed yet (inserted, reset or aborted since):
  // the next posts to them look for the socket they open and claim it for this lane.
  std::unordered_map<uint64_t, int> unclaimed_;
  std::string ip_key() const;  // our listening IP, as raw bytes (ProcessSockets::lanes)
  // Makes the peer drop its side of connections we aborted to `address` (see abort_path), before a
  // new connection is made to it.
  void reset_peer_side(const std::string& address);
  // Connections aborted per peer address: (our address and port, the peer's), and how many times
  // reset_peer_side has knocked for them (it stops after kMaxKnocks: a peer that stayed away that long
  // has timed its side out or is gone).
  std::unordered_map<std::string, std::vector<std::pair<sockaddr_storage, sockaddr_storage>>> aborted_;
  std::unordered_map<std::string, int> knocks_;
  static constexpr int kMaxKnocks = 16;

  std::string provider_;
  std::string domain_;
  bool tcp_ = false;  // tcp;ofi_rxm: connections are kernel sockets (abort_path, claims)
  fi_info* info_ = nullptr;
  fid_fabric* fabric_ = nullptr;
  fid_domain* domain_fid_ = nullptr;
  CompletionQueue cq_;
  fid_av* av_ = nullptr;
  fid_ep* ep_ = nullptr;
  std::string address_;
  uint64_t mr_mode_ = 0;
  size_t key_size_ = 8;
  bool rx_cq_data_ = false;  // provider needs a posted receive per incoming remote CQ data
  uint64_t max_msg_size_ = 0;
  size_t tx_size_ = 0;
  bool delivery_complete_ = false;  // the provider accepts FI_DELIVERY_COMPLETE on a write
  bool hmem_ = false;               // opened with FI_HMEM: GPU memory registers like host memory
  bool orders_writes_ = false;      // FI_ORDER_WAW: writes on one path land in posting order
  bool tagged_ = false;             // opened with FI_TAGGED (landing regions, see Engine)
  bool orders_sends_ = false;       // FI_ORDER_SAS: sends on one path are matched in posting order
  // Contexts of the tagged receives posted now: their completions (and errors) are told apart from
  // those of our sends and of the zero-length receives for remote CQ data by this set, not by flags.
  std::unordered_set<void*> posted_recvs_;
  // The address behind every peer handle inserted (reset_path inserts it again).
  std::unordered_map<uint64_t, std::string> peer_addresses_;
  // Receive contexts for providers with FI_RX_CQ_DATA.
  std::vector<LaneContext> rx_ctx_;
};

// The "fabric" lane type: configure picks the provider and NICs, open makes one lane per NIC.
LaneType fabric_lane_type();

}  // namespace weightsync
