"""A participant's view of its peers for one plan epoch: the plan's description of the peer plus the
connected engine peer."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from weightsync.plan.lower import DestinationBatch
from weightsync.plan.parts import PeerInfo, Target


@dataclass
class DestinationLink:
    """A destination this source announces to and writes into. ``descs``: this push's descriptor table
    (one per key of ``batch.dkeys``, in the shadow the destination granted; a source keeps no shadow
    of its own); ``ordered``: the peer's lane runs writes as one queue in posting order
    (weightsync.runtime.push.keeps_posting_order)."""

    target: Target
    peer: Any
    batch: DestinationBatch
    descs: list[tuple[Any, bytes]] | None = None
    ordered: bool = False

    def descriptors(self, shadow: int) -> list[tuple[Any, bytes]]:
        """The (peer, descriptor) table of ``batch.dkeys`` in shadow ``shadow``."""
        return [(self.peer, self.target.descriptors[k][shadow]) for k in self.batch.dkeys]


@dataclass(frozen=True)
class PeerLink:
    """A peer this participant signals (mailbox writes, immediates): its plan entry and engine peer."""

    info: PeerInfo
    peer: Any

    @property
    def mailbox(self) -> bytes:
        return self.info.mailbox
