"""weightsync: push RL trainer weights into inference engines, one-sided, over every NIC.

Three layers: the control plane (``Group``, ``Source``, ``Destination``, ``push``; Ray), the planner
(``weightsync.layout``, ``weightsync.plan``; pure Python) and the data plane (``TransferEngine``;
C++ in cpp/, bound as ``weightsync._ext``).
"""

from weightsync.errors import LayoutError, PlanError, TimeoutError, TransportError, WeightSyncError  # noqa: A004
from weightsync.layout import Fused, Placed, Sharded, describe_tensors
from weightsync.plan import Plan, plan

__all__ = [
    "Destination",
    "Fused",
    "Group",
    "ImmCounter",
    "LayoutError",
    "Placed",
    "Plan",
    "PlanError",
    "PushStats",
    "Sharded",
    "Source",
    "TimeoutError",
    "Transfer",
    "TransferEngine",
    "TransportError",
    "WeightSyncError",
    "describe_tensors",
    "plan",
    "push",
]

_LAZY = {
    "TransferEngine": "weightsync.engine",
    "Transfer": "weightsync.engine",
    "ImmCounter": "weightsync.engine",
    "Group": "weightsync.group",
    "Source": "weightsync.group",
    "Destination": "weightsync.group",
    "PushStats": "weightsync.group",
    "push": "weightsync.group",
}


def __getattr__(name: str) -> object:
    # The engine and Ray load on first use, so planning and simulation import without them.
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'weightsync' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)
