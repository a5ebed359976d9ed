// Exceptions thrown by the engine. The binding maps each to the weightsync.errors class of the same name,
// so every failure reaches Python as a WeightSyncError subclass with its context in the message.
#pragma once

#include <stdexcept>
#include <string>

namespace weightsync {

class TransportError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

class TimeoutError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// Bad arguments from the caller (out-of-range offsets, a deregistered region, a foreign descriptor).
// Reported as TransportError in Python too: they are data-plane errors, named by region and peer.
class UsageError : public TransportError {
 public:
  using TransportError::TransportError;
};

}  // namespace weightsync
