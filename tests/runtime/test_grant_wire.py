"""The grant records, grant immediates and version-scoped relay immediates of the push protocol (announce
-> grant -> data -> ack), without Ray or an engine: slots never collide, each grant slot and version has an
immediate of its own in the grant tag, and relay immediates of different versions differ while staying in
the relay tag. That a grant is read only once its immediate is in: test_grant_immediate.py."""

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
    box[1:2]["version"], box[1:2]["held"], box[1:2]["epoch"], box[1:2]["shadow"] = 41, 40, 7, 1
    box[1:2]["status"] = wire.GRANTED
    assert (int(box["version"][1]), int(box["held"][1]), int(box["epoch"][1]), int(box["shadow"][1]),
            int(box["status"][1])) == (41, 40, 7, 1, wire.GRANTED)
    assert len({wire.GRANTED, wire.REFUSED_NOT_NEWER, wire.REFUSED_BUSY, wire.REFUSED_EPOCH}) == 4


def test_a_grant_slot_that_shows_the_version_holds_the_whole_record() -> None:
    # Writers read a grant slot only once the grant's immediate is in (test_grant_immediate.py); the
    # version stays the record's last field, filled last, so that where a write is placed in order (a
    # prefix of the new record over the old one) a slot that shows the new version also shows the new
    # held version, epoch, shadow and status: a second line of defence, not the one relied on.
    def record(version: int, held: int, epoch: int, shadow: int, status: int) -> np.ndarray:
        r = np.zeros(1, wire.GRANT_RECORD)
        r["version"], r["held"], r["epoch"], r["shadow"], r["status"] = version, held, epoch, shadow, status
        return r

    old = record(41, 40, 7, 0, wire.GRANTED)  # the grant of version 41 (this slot: versions of one parity)
    new = record(43, 42, 7, 1, wire.REFUSED_BUSY)
    for cut in range(wire.SLOT_BYTES + 1):
        slot = old.copy()
        slot.view(np.uint8)[:cut] = new.view(np.uint8)[:cut]
        if int(slot["version"][0]) == 43:
            assert slot.tobytes() == new.tobytes(), f"the version landed before byte {cut} of the record"


def test_grant_immediates_name_the_slot_and_version_and_no_other_kind() -> None:
    senders = (0, 1, 2, 511, wire.MAX_SLOTS - 1)
    imms = {(s, v): wire.grant_imm(s, v) for s in senders for v in range(wire.GRANT_VERSIONS)}
    # one counter per grant slot and version: a writer knows which record is whole, and a late grant of
    # an earlier version into the same slot (same parity) does not count for this one
    assert len(set(imms.values())) == len(imms)
    assert wire.grant_imm(3, 10) != wire.grant_imm(3, 12) and wire.grant_imm(3, 10) != wire.grant_imm(4, 10)
    assert wire.grant_imm(3, 10) == wire.grant_imm(3, 10 + wire.GRANT_VERSIONS)  # 8 version bits wrap
    for imm in imms.values():
        assert imm >> 28 == 0xF  # the grant tag: no data, gather, relay, gathered or delta header immediate
        assert imm not in (wire.ANNOUNCE, wire.ACK)
    assert max(imms.values()) == 0xF003FFFF


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
