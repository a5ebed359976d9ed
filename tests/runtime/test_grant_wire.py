"""The grant records and version-scoped relay immediates of the push protocol (announce -> grant -> data
-> ack), without Ray or an engine: slots never collide, and relay immediates of different versions differ
while staying in the relay tag."""

from __future__ import annotations

import numpy as np

from weightsync import wire


def test_grant_slots_are_past_the_mailbox_and_distinct_per_sender_and_parity() -> None:
    slots = {(s, v & 1): wire.grant_slot(s, v) for s in range(wire.MAX_SLOTS) for v in (6, 7)}
    assert len(set(slots.values())) == 2 * wire.MAX_SLOTS
    assert min(slots.values()) == wire.MAX_SLOTS  # never an announce or ack slot
    assert max(slots.values()) == 3 * wire.MAX_SLOTS - 1
    # consecutive versions use different slots (a late grant of v cannot overwrite v + 1's); v and v + 2 share
    assert wire.grant_slot(3, 10) != wire.grant_slot(3, 11)
    assert wire.grant_slot(3, 10) == wire.grant_slot(3, 12)


def test_grant_record_is_one_slot_and_reads_back() -> None:
    assert wire.GRANT_RECORD.itemsize == wire.SLOT_BYTES
    box = np.full(2, wire.EMPTY, wire.ACK_RECORD).view(wire.GRANT_RECORD)
    assert int(box["version"][0]) == wire.EMPTY and int(box["status"][0]) == wire.EMPTY  # nothing granted
    box[1] = (41, 40, 7, 1, wire.GRANTED)
    assert (int(box["version"][1]), int(box["held"][1]), int(box["epoch"][1]), int(box["shadow"][1]),
            int(box["status"][1])) == (41, 40, 7, 1, wire.GRANTED)
    assert len({wire.GRANTED, wire.REFUSED_NOT_NEWER, wire.REFUSED_BUSY, wire.REFUSED_EPOCH}) == 4


def test_relay_immediates_are_scoped_by_version() -> None:
    chunks = range(0, wire.RELAY_MAX_CHUNKS, 4099)
    for epoch in (0, 5, 31):
        by_version = [{wire.relay_imm(epoch, c, v) for c in chunks} for v in range(wire.RELAY_VERSIONS)]
        assert len(set().union(*by_version)) == wire.RELAY_VERSIONS * len(chunks)  # no two versions share one
        for v in (0, 1, 255, 256, 1000):
            base = wire.relay_imm(epoch, 123)
            assert wire.relay_imm(epoch, 123, v) == base | wire.relay_version_bits(v)  # what a push ORs in
            assert wire.relay_imm(epoch, 123, v) >> 29 == 0b101  # still the relay tag
    assert wire.relay_imm(3, 9, 7) == wire.relay_imm(3, 9, 7 + wire.RELAY_VERSIONS)  # 8 version bits wrap
    assert wire.GRANT not in (wire.ANNOUNCE, wire.ACK) and wire.GRANT >> 29 == 0b111
