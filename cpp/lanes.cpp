// The lane types every engine can open, in the order an engine opens them (NIC lanes first). A new lane
// lives in a folder of its own (cpp/<name>/: its Lane subclass and its LaneType) and is added here.
#include "core/lane.hpp"
#include "cuda/cuda_lane.hpp"
#include "fabric/fabric_lane.hpp"

namespace weightsync {

std::vector<LaneType> builtin_lane_types() { return {fabric_lane_type(), cuda_lane_type()}; }

}  // namespace weightsync
