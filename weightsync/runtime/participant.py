"""What sources and destinations share: the engine, the mailbox and outbox of wire records, the join and
the fetch of a plan part through the control client, and closing everything at interpreter exit."""

from __future__ import annotations

import atexit
import logging
from collections.abc import Mapping
from typing import Any, ClassVar
from weakref import WeakSet

import numpy as np

from weightsync.control.client import ControlClient
from weightsync.engine import TransferEngine
from weightsync.errors import LayoutError
from weightsync.plan.parts import EngineInfo, Part, PlanFailure
from weightsync.runtime.describe import describe_tensors
from weightsync.wire import EMPTY, GRANT_RECORD, MAX_SLOTS

log = logging.getLogger("weightsync")


def group_logger(name: str) -> logging.LoggerAdapter:
    return logging.LoggerAdapter(log, {"group": name})


def contiguous(t: Any, key: str) -> Any:
    if hasattr(t, "is_contiguous") and not t.is_contiguous():
        raise LayoutError(f"tensor {key!r} must be contiguous to be registered")
    return t


class Participant:
    """A source or destination: its tensors' layout, engine, mailbox (peers of the other role write
    records of ``inbox_record`` into it, one slot per peer rank), grant slots after it (``grant_slots``
    records of ``GRANT_RECORD``: weightsync.wire.grant_slot) and outbox (records of ``outbox_record`` it
    writes to peers from; grants go out from ``GRANT_OUT`` on)."""

    role: ClassVar[str]
    inbox_record: ClassVar[np.dtype]
    outbox_record: ClassVar[np.dtype]
    grant_slots: ClassVar[int]

    def __init__(self, group: str, rank: int, tensors: Mapping[str, Any], timeout: float,
                 engine: TransferEngine | None, secret: str | None) -> None:
        if not tensors:
            raise LayoutError(f"group {group!r}: {self.role} rank {rank} gave no tensors")
        self.group = group
        self.rank = int(rank)
        self.log = group_logger(group)
        self._timeout = timeout
        self._control = ControlClient(group, self.role, self.rank, secret)
        # The engine demands the group's engine key of every peer that connects to it (tcp), and proves
        # it when it connects: given at construction, so no connection is ever taken without it.
        key = self._control.engine_key()
        if engine is None:
            engine = TransferEngine(auth_key=key)
        else:
            engine.set_auth_key(key)
        self.engine = engine
        self.tensors = dict(tensors)
        self.layout = describe_tensors(self.tensors)
        self.epoch = 0
        # -1 (EMPTY): nothing received. Zeros would read as an announce, ack or grant of version 0.
        inbox = np.full(MAX_SLOTS + self.grant_slots, EMPTY, dtype=self.inbox_record)
        self._mailbox = inbox[:MAX_SLOTS]
        self._grant_box = inbox[MAX_SLOTS:].view(GRANT_RECORD)  # indexed by grant_slot() - MAX_SLOTS
        self._mailbox_region = self.engine.register(inbox, name=f"{self.role} {rank} mailbox")
        self._outbox = np.zeros(MAX_SLOTS, dtype=self.outbox_record)
        self._grant_out = self._outbox.view(GRANT_RECORD)
        self._outbox_region = self.engine.register(self._outbox, name=f"{self.role} {rank} outbox")
        self._peers: dict[bytes, Any] = {}
        _LIVE.add(self)

    def _local_tensor(self, key: str) -> Any:
        value = self.tensors[key]
        if hasattr(value, "local_tensor"):  # Sharded, Fused, Placed
            return value.local_tensor
        if hasattr(value, "to_local"):  # DTensor
            return value.to_local()
        return value

    def _join(self, descriptors: dict[str, list[bytes]], rejoin: bool = False) -> None:
        """Joins the group (``rejoin``: again, after the coordinator dropped this process) and fetches the
        first part of a plan newer than the join."""
        self.epoch = self._control.join(self.layout.to_msgpack(), self.engine.address, self._engine_info(),
                                        descriptors, self._mailbox_region.descriptor, self._timeout, rejoin)
        self._fetch_part(self._timeout)

    def _engine_info(self) -> EngineInfo:
        # How this engine cuts writes: the coordinator counts the immediates they deliver by it.
        return EngineInfo(nics=len(self.engine.nics), stripe_threshold=int(self.engine.stripe_threshold),
                          max_piece=int(self.engine.max_piece))

    def _fetch_part(self, timeout: float) -> Part:
        part = self._control.fetch_part(self.epoch, timeout)
        taken, self.epoch = self.epoch, part.epoch
        if isinstance(part, PlanFailure):
            raise part.error(f"group {self.group!r} ({self.role} rank {self.rank} sees it)")
        try:
            self._apply_part(part)
        except BaseException:
            # The epoch is taken only with its part: a part refused half applied is fetched and applied
            # again by the next push (or announce), never run as it is.
            self.epoch = taken
            raise
        return part

    def _apply_part(self, part: Any) -> None:
        raise NotImplementedError

    def _peer(self, address: bytes) -> Any:
        peer = self._peers.get(address)
        if peer is None:
            peer = self._peers[address] = self.engine.connect(address)
        return peer

    def close(self) -> None:
        """Stops this participant and closes its engine (its registrations and connections)."""
        self.engine.close()


_LIVE: WeakSet[Participant] = WeakSet()


@atexit.register
def _close_all() -> None:
    """Stops receiving threads and engines before the interpreter finalizes: a daemon thread still
    inside a native wait when Python tears down is ended by a forced unwind through the binding's
    GIL guard, which aborts the process (seen when Ray ends a worker that holds a Destination)."""
    for participant in list(_LIVE):
        try:
            participant.close()
        except Exception:  # exiting anyway: one participant's failure must not stop the others
            pass
