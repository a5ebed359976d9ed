"""A participant's view of its peers for one plan epoch: the plan's description of the peer plus the
connected engine peer and, for destinations, the shadow buffer the next push writes."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from weightsync.plan.lower import DestinationBatch
from weightsync.plan.parts import PeerInfo, Target


@dataclass
class DestinationLink:
    """A destination this source announces to and writes into. ``buffer``: the shadow the next push
    writes (staged destinations name it in their ack); ``descs``: this push's descriptor table (one
    per key of ``batch.dkeys``, in the chosen buffer); ``ordered``: the peer's lane runs writes as one
    queue in posting order (weightsync.runtime.source.keeps_posting_order)."""

    target: Target
    peer: Any
    batch: DestinationBatch
    buffer: int = 0
    descs: list[tuple[Any, bytes]] | None = None
    ordered: bool = False

    def descriptors(self) -> list[tuple[Any, bytes]]:
        """The (peer, descriptor) table of ``batch.dkeys`` in the current buffer."""
        return [(self.peer, self.target.descriptors[k][self.buffer]) for k in self.batch.dkeys]


@dataclass(frozen=True)
class PeerLink:
    """A peer this participant signals (mailbox writes, immediates): its plan entry and engine peer."""

    info: PeerInfo
    peer: Any

    @property
    def mailbox(self) -> bytes:
        return self.info.mailbox
