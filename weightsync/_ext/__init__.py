"""The compiled engine (cpp/, bound in binding.cpp). Import names from here, not from ``_core``."""

from weightsync._ext._core import (
    Engine,
    ImmRing,
    Peer,
    Region,
    RemoteRegion,
    Transfer,
    cuda_device_count,
    cuda_unavailable_reason,
    discover,
    host_identity,
    pick_provider,
)

__all__ = [
    "Engine",
    "ImmRing",
    "Peer",
    "Region",
    "RemoteRegion",
    "Transfer",
    "cuda_device_count",
    "cuda_unavailable_reason",
    "discover",
    "host_identity",
    "pick_provider",
]
