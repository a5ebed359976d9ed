"""The compiled engine (cpp/, bound in binding.cpp). Import names from here, not from ``_core``."""

import os

# libfabric's PSM provider links libinfinipath, whose load-time constructor takes over SIGINT, SIGTERM and
# the crash signals of the whole process: SIGINT and SIGTERM then call exit() inside its handler, which
# runs static destructors under live threads (a crash, or a process that never ends) instead of Python's
# KeyboardInterrupt or the default end. Its own switch keeps the handlers off; set before libfabric loads.
os.environ.setdefault("IPATH_NO_BACKTRACE", "1")

from weightsync._ext._core import (
    Engine,
    EngineConfig,
    ImmRing,
    LaneCaps,
    Peer,
    Region,
    RemoteRegion,
    TestHooks,
    Transfer,
    cuda_device_count,
    cuda_unavailable_reason,
    discover,
    drain_log,
    host_identity,
    imm_counts,
    lane_types,
    pick_provider,
)

__all__ = [
    "Engine",
    "EngineConfig",
    "ImmRing",
    "LaneCaps",
    "Peer",
    "Region",
    "RemoteRegion",
    "TestHooks",
    "Transfer",
    "cuda_device_count",
    "cuda_unavailable_reason",
    "discover",
    "drain_log",
    "host_identity",
    "imm_counts",
    "lane_types",
    "pick_provider",
]
