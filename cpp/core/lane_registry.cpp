// The registry of lane types (core/lane.hpp). The built-in types come from cpp/lanes.cpp.
#include <mutex>

#include "core/errors.hpp"
#include "core/lane.hpp"

namespace weightsync {

std::vector<LaneType> builtin_lane_types();  // cpp/lanes.cpp

namespace {

std::mutex& registry_mu() {
  static std::mutex mu;
  return mu;
}

std::vector<LaneType>& registry() {
  static std::vector<LaneType> types = builtin_lane_types();
  return types;
}

}  // namespace

const std::vector<LaneType>& lane_types() {
  std::lock_guard<std::mutex> lock(registry_mu());
  return registry();
}

void register_lane_type(LaneType type) {
  std::lock_guard<std::mutex> lock(registry_mu());
  for (const auto& t : registry()) {
    if (t.name == type.name) throw TransportError("lane type '" + type.name + "' is registered already");
  }
  registry().push_back(std::move(type));
}

}  // namespace weightsync
