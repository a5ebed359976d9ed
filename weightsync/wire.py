"""The wire protocol between participants, in one place: immediate tags, the two mailbox records, and
the rule for how many immediates a write delivers.

Immediates (32 bits) are counted per value by the receiving engine (``TransferEngine.counter``). Their
top bits say what they are, so that no two kinds can collide:

=============  ==========================================  ==================================
tag (bits)     value                                       meaning
=============  ==========================================  ==================================
``0b0``        ``epoch & 0x7F << 24 | version & 0xFFFFFF``  data of ``version`` into a destination
``0b100``      ``epoch & 0x1F << 24 | version``             FP8 tile rows into a source's receive buffer
``0b101``      ``epoch & 0x1F << 24 | chunk & 0xFFFFFF``    relay chunk ``chunk`` (forwarded as it is)
``0b110``      ``epoch & 0x1F << 24 | version``             a gatherer has used its provider's rows
``0xFFFFFFFF``                                             an announce landed in a destination's mailbox
``0xFFFFFFFE``                                             an ack landed in a source's mailbox
=============  ==========================================  ==================================

Mailboxes: every participant registers an array of fixed-size slots, one per peer of the other role
(indexed by that peer's rank). A source writes an :data:`ANNOUNCE_RECORD` into each destination's
mailbox before its data; a destination writes an :data:`ACK_RECORD` into each source's mailbox once the
version is complete. The two records have their own field names but the same size, because a peer
addresses a slot as ``rank * SLOT_BYTES``.

Immediate counts: a destination expects exactly the immediates its sources' writes deliver. The rule
is the engine's (cpp/core/pieces.hpp), exposed by the binding; :func:`imm_counts` calls
it, so the planner never re-derives it.
"""

from __future__ import annotations

import numpy as np

ANNOUNCE = 0xFFFFFFFF
ACK = 0xFFFFFFFE

# A source's announce into a destination's mailbox: the plan epoch and version it writes, and the shadow
# buffers it writes into (bit 0: the destination's own; bit 1, relay: the successor's).
ANNOUNCE_RECORD = np.dtype([("epoch", "<i8"), ("version", "<i8"), ("buffer", "<i8")])
# A destination's ack into a source's mailbox: the version now complete there and the shadow the next
# push must write (staged mode; 0 inplace). ``reserved`` keeps both records one slot size.
ACK_RECORD = np.dtype([("version", "<i8"), ("next_buffer", "<i8"), ("reserved", "<i8")])
SLOT_BYTES = ANNOUNCE_RECORD.itemsize
assert ACK_RECORD.itemsize == SLOT_BYTES
MAX_SLOTS = 1024  # mailbox slots per participant: peers of the other role, by rank
EMPTY = -1  # every field of a slot nothing has been written into (0 would read as version 0)

RELAY_MAX_CHUNKS = 1 << 24  # chunk index bits of a relay immediate


def data_imm(epoch: int, version: int) -> int:
    """The immediate of every data write of ``version`` under plan ``epoch`` (top bit 0)."""
    return ((epoch & 0x7F) << 24) | (version & 0xFFFFFF)


def gather_imm(epoch: int, version: int) -> int:
    """Rows of FP8 tiles written into a source's receive buffer (never equal to a data immediate,
    ANNOUNCE or ACK)."""
    return 0x80000000 | ((epoch & 0x1F) << 24) | (version & 0xFFFFFF)


def relay_imm(epoch: int, chunk: int) -> int:
    """The immediate of relay chunk ``chunk``: tag 0b101 in the top bits, so never equal to a data
    immediate (top bit 0), a gather (0b100), gathered (0b110), ANNOUNCE or ACK (0xFF...)."""
    return 0xA0000000 | ((epoch & 0x1F) << 24) | (chunk & 0xFFFFFF)


def gathered_imm(epoch: int, version: int) -> int:
    """A gatherer tells its provider it has used the rows of this version."""
    return 0xC0000000 | ((epoch & 0x1F) << 24) | (version & 0xFFFFFF)


def imm_counts(nbytes: np.ndarray, rows: np.ndarray, nics: int, stripe_threshold: int,
               max_piece: int) -> np.ndarray:
    """Immediates each write delivers from an engine with ``nics`` NICs, ``stripe_threshold`` and
    ``max_piece`` (the sending engine's ``TransferEngine.stripe_threshold`` / ``.max_piece``).

    ``nbytes`` counts all bytes of a 1-D write; a write with ``rows > 1`` is 2-D and delivers exactly
    one immediate. Evaluated by the engine's own rule (``weightsync._ext._core.imm_counts``)."""
    from weightsync._ext import _core

    n = np.ascontiguousarray(nbytes, dtype=np.int64)
    r = np.ascontiguousarray(np.broadcast_to(np.maximum(np.asarray(rows, dtype=np.int64), 1), n.shape))
    if len(n) == 0:
        return np.zeros(0, np.int64)
    return np.asarray(_core.imm_counts(n, r, max(int(nics), 1), int(stripe_threshold), int(max_piece)),
                      dtype=np.int64)
