// The engine's log: conditions worth telling that are no caller's error (a landing message dropped, a
// ring buffer that could not be posted again), mostly seen on worker threads. They are queued here and
// never printed: Python drains the queue (weightsync._ext._core.drain_log) into the logging logger
// "weightsync.engine" at its next call into the engine, so no worker thread ever calls into Python.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace weightsync {

enum class LogLevel : int { kDebug = 10, kInfo = 20, kWarning = 30, kError = 40 };  // Python's levels

// Queues a record (any thread). The queue keeps the most recent kLogCapacity records and counts those
// it had to drop, which the next drain reports.
void log(LogLevel level, std::string message);
inline void log_warning(std::string message) { log(LogLevel::kWarning, std::move(message)); }
inline void log_info(std::string message) { log(LogLevel::kInfo, std::move(message)); }

constexpr size_t kLogCapacity = 1024;

// Takes every queued record, oldest first (levels as ints, Python's numbering).
std::vector<std::pair<int, std::string>> drain_log();

}  // namespace weightsync
