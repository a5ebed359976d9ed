"""The wire protocol between participants, in one place: immediate tags, the two mailbox records, and
the rule for how many immediates a write delivers.

Immediates (32 bits) are counted per value by the receiving engine (``TransferEngine.counter``). Their
top bits say what they are, so that no two kinds can collide:

=============  ==========================================  ==================================
tag (bits)     value                                       meaning
=============  ==========================================  ==================================
``0b0``        ``epoch & 0x7F << 24 | version & 0xFFFFFF``  data of ``version`` into a destination
``0b100``      ``epoch & 0x1F << 24 | version``             FP8 tile rows into a source's receive buffer
``0b101``      ``epoch & 0x1F << 24 | version & 0xFF << 16  relay chunk ``chunk`` of ``version`` (forwarded as
               | chunk & 0xFFFF``                            it is)
``0b110``      ``epoch & 0x1F << 24 | version``             a gatherer has used its provider's rows
``0b1110``     ``epoch & 0xF << 24 | version & 0xFFFFFF``   a delta header landed in a destination's inbox
``0b1111``     ``version & 0xFF << 10 | sender``            a grant of ``version`` landed in ``sender``'s
               (below ``0xF0040000``)                       grant slot (:func:`grant_imm`)
``0b11111``    ``header << 26 | part << 23 | epoch & 0x7    an early part of a delta push (its header, or a
               << 20 | version & 0xFFFFF``                  piece of its payload) landed
                                                           (:func:`delta_part_imm`)
``0xFFFFFFFF``                                             an announce landed in a destination's mailbox
``0xFFFFFFFE``                                             an ack landed in a source's mailbox
=============  ==========================================  ==================================

Mailboxes: every participant registers an array of fixed-size slots, one per peer of the other role
(indexed by that peer's rank), followed by grant slots (:func:`grant_slot`). A push is
``announce -> grant -> data -> ack``:

* a source writes an :data:`ANNOUNCE_RECORD` (epoch, version) into each destination's mailbox;
* the destination decides whether it takes that version (newer than the one it holds, of the plan it
  holds) and into which shadow, raises ``updating``, then writes one :data:`GRANT_RECORD` into each of its
  writers' grant slots (its sources; in a relay chain also its predecessor, which forwards into it),
  each write with the immediate :func:`grant_imm` of that slot and version; a writer reads a slot only
  once that immediate has arrived. Refusals go to the announcing source only. The destination is the
  authority: sources keep no shadow or version state of their own, and no data byte is written before
  the grant;
* the source writes its data into the granted shadow;
* the destination writes an :data:`ACK_RECORD` into each source's mailbox once the version is complete.

Records have their own field names but the same size, because a peer addresses a slot as
``slot * SLOT_BYTES``.

Immediate counts: a destination expects exactly the immediates its sources' writes deliver. The rule
is the engine's (cpp/core/pieces.hpp), exposed by the binding; :func:`imm_counts` calls
it, so the planner never re-derives it.
"""

from __future__ import annotations

import numpy as np

ANNOUNCE = 0xFFFFFFFF
ACK = 0xFFFFFFFE

# A source's announce into a destination's mailbox: the plan epoch and version it is about to write.
# ``buffer`` is no longer read (the destination picks the shadow and says so in its grant); kept 0.
ANNOUNCE_RECORD = np.dtype([("epoch", "<i8"), ("version", "<i8"), ("buffer", "<i8")])
# A destination's ack into a source's mailbox: the version now complete there. ``next_buffer`` says which
# shadow the destination will grant next (for logs and tools only: the grant is what sources obey).
ACK_RECORD = np.dtype([("version", "<i8"), ("next_buffer", "<i8"), ("reserved", "<i8")])
# A destination's answer to an announce, in a writer's grant slot: the version the destination holds, its
# plan epoch, the shadow it receives this version into (0 inplace), whether it takes the version (GRANTED)
# or why not, and last the version it answers (writers match grants by it). A writer reads a slot only
# once the immediate of the write that placed the record there has arrived (grant_imm names the slot and
# the version): nothing orders a write's bytes as they are placed (EFA SRD and multipath place packets
# out of order) nor, on a weakly ordered CPU (aarch64), a reader's loads of a slot still being written,
# so a slot that already shows the version may still hold the last grant's shadow, held version or
# status beside it. Only the immediate, counted once every byte of its write is placed, says it is whole.
GRANT_RECORD = np.dtype([("held", "<i8"), ("epoch", "<i4"), ("shadow", "<i2"), ("status", "<i2"),
                         ("version", "<i8")])
GRANTED = 0
REFUSED_NOT_NEWER = 1  # the version is not newer than the one the destination holds
REFUSED_BUSY = 2  # the destination is landing a newer version
REFUSED_EPOCH = 3  # announced under a plan epoch the destination does not hold
SLOT_BYTES = ANNOUNCE_RECORD.itemsize
assert ACK_RECORD.itemsize == GRANT_RECORD.itemsize == SLOT_BYTES
MAX_SLOTS = 1024  # mailbox slots per participant: peers of the other role, by rank
EMPTY = -1  # every field of a slot nothing has been written into (0 would read as version 0)


GRANT_VERSIONS = 256  # grant immediates repeat every this many versions (8 version bits)


def grant_imm(sender: int, version: int) -> int:
    """The immediate of a grant record of ``version`` written into the grant slot of ``sender``
    (:func:`grant_slot`): tag 0b1111 in the top bits, the version's low 8 bits, the sender's index
    (below :data:`MAX_SLOTS`, 10 bits); 0xF003FFFF at most, so never equal to ANNOUNCE, ACK or any other
    kind.

    It names the slot so that a writer learns *which* record is whole: with one immediate value for all
    grants, k immediates counted beside k + 1 slots that show the version would leave unknown which one
    is still being written. The version bits keep a late grant of an earlier version into the same slot
    (same parity) from counting for this one, for 256 versions. Each (sender, version bits) is one
    counter at the writer: at most 256 per peer."""
    return 0xF0000000 | ((version & (GRANT_VERSIONS - 1)) << 10) | (sender & (MAX_SLOTS - 1))


def grant_slot(sender: int, version: int) -> int:
    """The mailbox slot a grant of ``version`` from ``sender`` lands in: past the announce/ack slots, two
    per sender (a destination's rank in a source's mailbox; 0 for a relay member's successor), by the
    version's parity, so that a late grant of the previous version cannot overwrite this one's."""
    return MAX_SLOTS + 2 * sender + (version & 1)


RELAY_MAX_CHUNKS = 1 << 16  # chunk index bits of a relay immediate
RELAY_VERSIONS = 256  # relay immediates repeat every this many versions (8 version bits)


def data_imm(epoch: int, version: int) -> int:
    """The immediate of every data write of ``version`` under plan ``epoch`` (top bit 0)."""
    return ((epoch & 0x7F) << 24) | (version & 0xFFFFFF)


def gather_imm(epoch: int, version: int) -> int:
    """Rows of FP8 tiles written into a source's receive buffer (never equal to a data immediate,
    ANNOUNCE or ACK)."""
    return 0x80000000 | ((epoch & 0x1F) << 24) | (version & 0xFFFFFF)


def relay_imm(epoch: int, chunk: int, version: int = 0) -> int:
    """The immediate of relay chunk ``chunk`` of ``version``: tag 0b101 in the top bits, so never equal to
    a data immediate (top bit 0), a gather (0b100), gathered (0b110), a grant (0b1111), ANNOUNCE or
    ACK.

    The version's low 8 bits make every version count on counters of its own: pieces of an abandoned
    version that arrive late (a slow or stopped chain member completes it after all) can never count
    for the next one. Plans carry the immediates of version bits 0; a push ORs in
    :func:`relay_version_bits`."""
    return 0xA0000000 | ((epoch & 0x1F) << 24) | relay_version_bits(version) | (chunk & 0xFFFF)


def relay_version_bits(version: int) -> int:
    """What a push of ``version`` ORs into its plan's relay immediates."""
    return (version & 0xFF) << 16


def gathered_imm(epoch: int, version: int) -> int:
    """A gatherer tells its provider it has used the rows of this version."""
    return 0xC0000000 | ((epoch & 0x1F) << 24) | (version & 0xFFFFFF)


def delta_header_imm(epoch: int, version: int) -> int:
    """A source's delta header of ``version`` landed in a destination's delta inbox
    (weightsync.delta.sender): top bits 0b1110, never equal to any other kind (0xEFFFFFFF at most)."""
    return 0xE0000000 | ((epoch & 0xF) << 24) | (version & 0xFFFFFF)


DELTA_PARTS_MAX = 7  # early parts of a delta push at most (part 7 of a header could equal ANNOUNCE)


def delta_part_imm(epoch: int, version: int, part: int, header: bool) -> int:
    """Early part ``part`` of a delta push of ``version`` (weightsync.delta.sender): its header landed
    (``header``) or a piece of its payload did. Top bits 0b11111, so above every grant immediate
    (0xF003FFFF at most) and, with ``part`` below :data:`DELTA_PARTS_MAX`, below ACK and ANNOUNCE
    (0xFF7FFFFF at most). The version's low 20 bits and the epoch's low 3: every part of every version
    counts on counters of its own."""
    if not 0 <= part < DELTA_PARTS_MAX:
        raise ValueError(f"delta part {part} out of range [0, {DELTA_PARTS_MAX})")
    return (0xF8000000 | (int(header) << 26) | (part << 23) | ((epoch & 0x7) << 20)
            | (version & 0xFFFFF))


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
