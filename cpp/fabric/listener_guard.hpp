// What a stranger can hold of a tcp lane's listener. The provider accepts one socket from the listener's
// queue per read of the connection events, and keeps each accepted socket, with no deadline, until a
// connection request arrives on it; only then does the lane see it (FI_CONNREQ) and check its proof. So a
// process that opens connections and sends nothing would fill the queue in front of a member's request
// and hold a descriptor each. The guard makes the lane drain the queue at once, and cuts the sockets
// that have not become an authenticated endpoint: those past a deadline, and the oldest beyond a limit.
// The provider keeps those sockets to itself; they are found among the process's descriptors by their
// local address (the listener's) and cut with a disconnect, which the provider then takes as a failed
// request and closes.
#pragma once

#include <sys/socket.h>

#include <chrono>
#include <cstdint>
#include <string>
#include <unordered_map>
#include <vector>

namespace weightsync {

class ListenerGuard {
 public:
  using Clock = std::chrono::steady_clock;
  // Unauthenticated connections kept at most (the oldest are cut first), and how long each may take to
  // send its request (a member sends it as soon as its connection is up).
  static constexpr size_t kMaxWaiting = 64;
  static constexpr auto kDeadline = std::chrono::seconds(5);
  // Reads of the connection events (one accept each) per worker turn while the queue is not empty, and
  // how often the queue is looked at.
  static constexpr int kAcceptsPerTurn = 256;
  static constexpr auto kCheckEvery = std::chrono::milliseconds(1);

  // `listen_addr`: the listener's sockaddr (fi_getname of the passive endpoint, after fi_listen).
  ListenerGuard(const std::string& nic, const std::string& listen_addr);

  // Whether connections wait in the listener's queue; false between checks (kCheckEvery).
  bool queue_waiting(Clock::time_point now);
  // Whether sockets accepted but not yet authenticated are being watched (to be looked at again).
  bool watching() const { return !waiting_.empty(); }
  // Finds the sockets accepted on the listener that are no authenticated endpoint (`members`: the peer
  // addresses of the endpoints the lane accepted) and cuts those past the deadline, then the oldest
  // beyond the limit.
  void bound(const std::vector<sockaddr_storage>& members, Clock::time_point now);

 private:
  struct Waiting {
    int fd = -1;
    Clock::time_point since{};
    bool cut = false;  // disconnected; the provider closes it on its next read of the events
  };
  std::string nic_;
  std::string listen_addr_;
  int listen_fd_ = -1;  // the provider's listening socket (-1: not found; the queue is then not drained)
  Clock::time_point next_check_{};
  std::unordered_map<uint64_t, Waiting> waiting_;  // by socket inode (a descriptor number is reused)
  uint64_t cut_total_ = 0;
  Clock::time_point next_log_{};
};

}  // namespace weightsync
