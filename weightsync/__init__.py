"""weightsync: push RL trainer weights into inference engines, one-sided, over every NIC."""

from weightsync.errors import LayoutError, PlanError, TimeoutError, TransportError, WeightSyncError

__all__ = ["LayoutError", "PlanError", "TimeoutError", "TransportError", "WeightSyncError"]
