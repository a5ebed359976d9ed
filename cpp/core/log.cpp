#include "core/log.hpp"

#include <deque>
#include <mutex>

namespace weightsync {

namespace {

struct LogQueue {
  std::mutex mu;
  std::deque<std::pair<int, std::string>> records;
  uint64_t dropped = 0;
};

LogQueue& queue() {
  static LogQueue* q = new LogQueue();  // never destroyed: workers may log during static destruction
  return *q;
}

}  // namespace

void log(LogLevel level, std::string message) {
  LogQueue& q = queue();
  std::lock_guard<std::mutex> lock(q.mu);
  if (q.records.size() >= kLogCapacity) {
    q.records.pop_front();
    q.dropped++;
  }
  q.records.emplace_back(static_cast<int>(level), "weightsync: " + std::move(message));
}

std::vector<std::pair<int, std::string>> drain_log() {
  LogQueue& q = queue();
  std::vector<std::pair<int, std::string>> out;
  std::lock_guard<std::mutex> lock(q.mu);
  if (q.dropped > 0) {
    out.emplace_back(static_cast<int>(LogLevel::kWarning),
                     "weightsync: " + std::to_string(q.dropped) + " engine log records were dropped (queue full)");
    q.dropped = 0;
  }
  for (auto& r : q.records) out.push_back(std::move(r));
  q.records.clear();
  return out;
}

}  // namespace weightsync
