#include "fabric/listener_guard.hpp"

#include <dirent.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>

#include "core/log.hpp"

namespace weightsync {

namespace {

bool same_address(const sockaddr_storage& a, const void* b, size_t blen) {
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

// Calls fn(fd) for every descriptor of this process.
template <class Fn>
void each_fd(Fn&& fn) {
  DIR* dir = opendir("/proc/self/fd");
  if (dir == nullptr) return;
  const int dir_fd = dirfd(dir);
  while (dirent* e = readdir(dir)) {
    char* end = nullptr;
    const long fd = std::strtol(e->d_name, &end, 10);
    if (end == e->d_name || *end != '\0' || fd == dir_fd) continue;
    fn(static_cast<int>(fd));
  }
  closedir(dir);
}

bool is_listener(int fd) {
  int on = 0;
  socklen_t len = sizeof(on);
  return getsockopt(fd, SOL_SOCKET, SO_ACCEPTCONN, &on, &len) == 0 && on != 0;
}

}  // namespace

ListenerGuard::ListenerGuard(const std::string& nic, const std::string& listen_addr)
    : nic_(nic), listen_addr_(listen_addr) {
  each_fd([&](int fd) {
    sockaddr_storage a{};
    socklen_t len = sizeof(a);
    if (listen_fd_ < 0 && getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len) == 0 &&
        same_address(a, listen_addr_.data(), listen_addr_.size()) && is_listener(fd)) {
      listen_fd_ = fd;
    }
  });
  if (listen_fd_ < 0) {
    log_warning("tcp NIC " + nic_ + ": its listening socket was not found; connections that send no request "
                "are not bounded");
  }
}

bool ListenerGuard::queue_waiting(Clock::time_point now) {
  if (listen_fd_ < 0 || now < next_check_) return false;
  pollfd p{listen_fd_, POLLIN, 0};
  if (poll(&p, 1, 0) > 0 && (p.revents & POLLIN)) return true;
  next_check_ = now + kCheckEvery;
  return false;
}

void ListenerGuard::bound(const std::vector<sockaddr_storage>& members, Clock::time_point now) {
  if (listen_fd_ < 0) return;
  std::unordered_map<uint64_t, Waiting> seen;
  each_fd([&](int fd) {
    if (fd == listen_fd_) return;
    sockaddr_storage local{}, peer{};
    socklen_t len = sizeof(local);
    if (getsockname(fd, reinterpret_cast<sockaddr*>(&local), &len) != 0) return;  // not a socket
    if (!same_address(local, listen_addr_.data(), listen_addr_.size())) return;
    len = sizeof(peer);
    if (getpeername(fd, reinterpret_cast<sockaddr*>(&peer), &len) != 0) return;  // cut, or not connected
    for (const auto& m : members) {
      if (same_address(peer, &m, sizeof(m))) return;  // an authenticated endpoint's
    }
    struct stat st {};
    if (fstat(fd, &st) != 0) return;
    auto it = waiting_.find(st.st_ino);
    Waiting w = it != waiting_.end() ? it->second : Waiting{fd, now, false};
    w.fd = fd;
    seen.emplace(st.st_ino, w);
  });
  waiting_.swap(seen);  // those no longer there were authenticated, or closed

  std::vector<std::pair<Clock::time_point, uint64_t>> live;  // not cut yet, by age
  for (const auto& [ino, w] : waiting_) {
    if (!w.cut) live.emplace_back(w.since, ino);
  }
  std::sort(live.begin(), live.end());
  const size_t over = live.size() > kMaxWaiting ? live.size() - kMaxWaiting : 0;
  uint64_t cut = 0;
  for (size_t i = 0; i < live.size(); ++i) {
    if (i >= over && now - live[i].first < kDeadline) continue;
    Waiting& w = waiting_[live[i].second];
    // A disconnect resets the connection (the stranger learns at once) and leaves the socket with an
    // error, which the provider's next read of it takes as a failed request: it closes the socket.
    sockaddr unspec{};
    unspec.sa_family = AF_UNSPEC;
    connect(w.fd, &unspec, sizeof(unspec));
    w.cut = true;
    ++cut;
  }
  cut_total_ += cut;
  if (cut > 0 && now >= next_log_) {
    next_log_ = now + std::chrono::seconds(10);
    log_warning("tcp NIC " + nic_ + ": cut " + std::to_string(cut_total_) +
                " connections so far that sent no connection request within " +
                std::to_string(std::chrono::duration_cast<std::chrono::seconds>(kDeadline).count()) +
                " s or beyond " + std::to_string(kMaxWaiting) + " waiting (a port flood?)");
  }
}

}  // namespace weightsync
