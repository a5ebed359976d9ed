"""The data plane as Python sees it (the C++ engine in cpp/, bound as ``weightsync._ext._core``).

* ``engine``: ``TransferEngine``, its registered ``Region``s, ``Peer``s, ``Transfer``s, ``ImmCounter``s
  and ``Forward``s (the immediate-count rule is documented there);
* ``arguments``: what callers hand the engine (buffers, offsets, batch columns, immediates), checked;
* ``descriptors``: engine addresses and region descriptors, serialized in one place with their
  versions and checksums;
* ``imm_counts``: the engine's own immediate-count rule, vectorised, for planners.
"""

from weightsync._ext import imm_counts
from weightsync.engine.descriptors import Address, Descriptor
from weightsync.engine.engine import Forward, ImmCounter, Peer, Region, Transfer, TransferEngine

__all__ = [
    "Address",
    "Descriptor",
    "Forward",
    "ImmCounter",
    "Peer",
    "Region",
    "Transfer",
    "TransferEngine",
    "imm_counts",
]
