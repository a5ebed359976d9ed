"""Landing regions over tcp;ofi_rxm: memory the NICs cannot register (GPU memory without FI_HMEM) written
by fabric peers through a ring of receive buffers. ``land_host_regions`` makes host regions take that path,
so the whole protocol (tagged messages, ring order, copy, immediate, repost) runs here without a GPU."""

from __future__ import annotations

import time
import zlib

import msgpack
import numpy as np
import pytest

import weightsync as ws
from tests.support.peer import POISON, PeerProcess, digest, random_bytes, rows_digest
from weightsync.engine import TransferEngine

KiB, MiB = 1 << 10, 1 << 20
SLOT = 64 * KiB  # small slots: writes of a few hundred KiB already take many messages
SLOTS = 4
LANDING = {"land_host_regions": True, "landing_slots": SLOTS, "landing_slot_bytes": SLOT,
           "stall_timeout": 2.0}


@pytest.fixture()
def lander():
    """The destination: another process whose host regions are landing regions."""
    peer = PeerProcess()
    peer.address = peer.call("engine", **LANDING)
    yield peer
    peer.close()


@pytest.fixture(params=["direct", "staged"])
def writer(request):
    """The source: an ordinary engine (host sources straight from their MR), or one whose sources are
    staged like GPU memory without FI_HMEM (land_host_regions stages host sources too)."""
    kwargs = {"stall_timeout": 2.0, "max_piece": MiB, "stripe_threshold": 256 * KiB}
    if request.param == "staged":
        kwargs.update(land_host_regions=True, staging_slots=2)
    eng = TransferEngine._for_tests(**kwargs)
    yield eng
    eng.close()


def _landed(peer: PeerProcess) -> tuple[int, int, int]:
    stats = peer.call("stats")
    return (sum(s["landed"] for s in stats), sum(s["landed_bytes"] for s in stats),
            sum(s["landing_dropped"] for s in stats))


def _forge(descriptor: bytes, **changes: int) -> bytes:
    """A descriptor with some fields changed and a valid checksum: what a buggy or stale writer holds."""
    body = msgpack.unpackb(descriptor)[:-1]
    index = {"len": 3, "landing": 8, "slot_bytes": 9}
    for name, value in changes.items():
        body[index[name]] = value
    return msgpack.packb([*body, zlib.crc32(msgpack.packb(body, use_bin_type=True))], use_bin_type=True)


def test_landing_region_descriptor() -> None:
    eng = TransferEngine._for_tests(**LANDING)
    try:
        region = eng.register(np.zeros(100, dtype=np.uint8))
        assert not region.on_fabric
        assert region.landing >= 0 and region.landing_slot_bytes == SLOT
        other = eng.register(np.zeros(100, dtype=np.uint8))
        assert other.landing != region.landing
        plain = TransferEngine(cuda_peers=False)  # accepted without a cuda lane too (nothing to keep off)
        try:
            assert plain.register(np.zeros(100, dtype=np.uint8)).landing == -1
            assert not plain.cuda_peers
        finally:
            plain.close()
    finally:
        eng.close()


def test_sizes_and_odd_offsets_land_byte_exact(writer: TransferEngine, lander: PeerProcess) -> None:
    """1 B to many slots (and several of the writer's pieces), at odd offsets; every write into a freshly
    poisoned destination; the immediates are exactly the writer's imm_count, each counted once its bytes
    are in place."""
    peer = writer.connect(lander.address)
    sizes = [1, 7, 4095, SLOT - 1, SLOT, SLOT + 1, 4 * SLOT + 123, 3 * MiB + 5]
    src_off, dst_off, pad = 3, 4097, 513
    src = random_bytes(max(sizes) + src_off + 5, seed=1)
    region = writer.register(src)
    d_id, d_desc = lander.call("alloc", size=max(sizes) + dst_off + pad)
    landed0 = _landed(lander)
    expected_bytes = 0
    for k, size in enumerate(sizes):
        lander.call("poison", region=d_id, off=0, size=max(sizes) + dst_off + pad)
        imm = 100 + k
        watch = lander.call("rows_digest_on", imm=imm, n=writer.imm_count(size), region=d_id, off=dst_off,
                            rows=1, row_bytes=size, pitch=size)
        t = writer.write(region, src_off, peer, d_desc, dst_off, size, imm=imm)
        assert t.imm_count == writer.imm_count(size)
        t.wait(30)
        # The digest taken the moment the last immediate was counted already shows every byte.
        assert lander.call("joined", key=watch, timeout=30) == digest(src[src_off : src_off + size]), size
        assert lander.call("poisoned_outside", region=d_id, off=dst_off, size=size), size
        expected_bytes += size
        time.sleep(0.05)
        assert lander.call("counter_total", imm=imm) == t.imm_count, size
    landed = _landed(lander)
    assert landed[1] - landed0[1] == expected_bytes
    assert landed[0] - landed0[0] >= sum(-(-s // SLOT) for s in sizes)  # at least one message per slot
    assert landed[2] == 0


def test_zero_length_write_delivers_its_immediate(lander: PeerProcess) -> None:
    eng = TransferEngine(stall_timeout=2.0)
    try:
        region = eng.register(random_bytes(16, seed=2))
        d_id, d_desc = lander.call("alloc", size=16)
        t = eng.write(region, 0, eng.connect(lander.address), d_desc, 16, 0, imm=9)
        t.wait(10)
        assert t.imm_count == 1
        lander.call("counter_wait", imm=9, n=1, timeout=10)
        assert lander.call("poisoned_outside", region=d_id, off=0, size=0)
    finally:
        eng.close()


def test_batch_of_many_writes(writer: TransferEngine, lander: PeerProcess) -> None:
    rng = np.random.default_rng(3)
    n = 2000
    sizes = rng.integers(1, 3 * SLOT, n)
    sizes[::50] = rng.integers(1, 16, n // 50)  # many eager-sized messages among the large ones
    dst_offs = np.concatenate([[0], np.cumsum(sizes + 3)[:-1]]) + 1  # 3 poisoned bytes between writes
    src_offs = np.concatenate([[0], np.cumsum(sizes)[:-1]]) + 5
    total = int(dst_offs[-1] + sizes[-1]) + 7
    src = random_bytes(int(src_offs[-1] + sizes[-1]) + 1, seed=4)
    region = writer.register(src)
    d_id, d_desc = lander.call("alloc", size=total)
    peer = writer.connect(lander.address)
    order = rng.permutation(n)
    t = writer.write_batch([region], [(peer, d_desc)], np.zeros(n), src_offs[order], np.zeros(n),
                           dst_offs[order], sizes[order], imm=21)
    expected = sum(writer.imm_count(int(s)) for s in sizes)
    assert t.imm_count == expected
    t.wait(120)
    lander.call("counter_wait", imm=21, n=expected, timeout=60)
    time.sleep(0.1)
    assert lander.call("counter_total", imm=21) == expected
    want = np.full(total, POISON, dtype=np.uint8)
    for s_off, d_off, size in zip(src_offs, dst_offs, sizes, strict=True):
        want[d_off : d_off + size] = src[s_off : s_off + size]
    assert lander.call("digest", region=d_id, off=0, size=total) == digest(want)


# (rows, row bytes, source pitch, destination pitch): strided both sides at odd sizes, rows of several
# slots, rows back to back (one span cut into slots), empty rows, many tiny rows.
TWO_D = [
    (7, 100, 1000, 333),
    (3, 3 * SLOT + 5, 4 * SLOT, 3 * SLOT + 17),
    (16, 3000, 3000, 3000),
    (5, 0, 64, 64),
    (500, 7, 13, 11),
]


@pytest.mark.parametrize(("rows", "row_bytes", "src_pitch", "dst_pitch"), TWO_D)
def test_2d_writes_deliver_one_immediate_after_every_row(
    writer: TransferEngine, lander: PeerProcess, rows: int, row_bytes: int, src_pitch: int, dst_pitch: int
) -> None:
    src_off, dst_off = 3, 4097
    src = random_bytes(src_off + rows * src_pitch + 5, seed=rows + row_bytes)
    region = writer.register(src)
    d_id, d_desc = lander.call("alloc", size=dst_off + (rows - 1) * dst_pitch + row_bytes + 99)
    peer = writer.connect(lander.address)
    want = rows_digest(src, src_off, rows, row_bytes, src_pitch)
    for rep in range(2):
        imm = 300 + rep
        watch = lander.call("rows_digest_on", imm=imm, n=1, region=d_id, off=dst_off, rows=rows,
                            row_bytes=row_bytes, pitch=dst_pitch)
        t = writer.write(region, src_off, peer, d_desc, dst_off, row_bytes, imm=imm, rows=rows,
                         src_pitch=src_pitch, dst_pitch=dst_pitch)
        assert t.imm_count == 1
        t.wait(30)
        # What the immediate announces is in place when it is counted: every row.
        assert lander.call("joined", key=watch, timeout=30) == want
        time.sleep(0.05)
        assert lander.call("counter_total", imm=imm) == 1
        assert lander.call("poisoned_outside_rows", region=d_id, off=dst_off, rows=rows, row_bytes=row_bytes,
                           pitch=dst_pitch)
        lander.call("poison", region=d_id, off=0, size=dst_off + (rows - 1) * dst_pitch + row_bytes + 99)


def test_sender_outrunning_the_receiver_is_slowed_not_failed(lander: PeerProcess) -> None:
    """Far more bytes in flight than the ring holds (K x S = 256 KiB against 96 MiB submitted at once):
    large messages wait for a posted buffer (rxm rendezvous), small ones are buffered by the provider;
    nothing fails, nothing is dropped, every byte lands."""
    eng = TransferEngine(stall_timeout=2.0, window_bytes=256 * MiB, window_ops=1024)
    try:
        size = 12 * MiB + 3
        src = random_bytes(size, seed=5)
        region = eng.register(src)
        peer = eng.connect(lander.address)
        dsts = [lander.call("alloc", size=size) for _ in range(8)]
        start = time.monotonic()
        transfers = [eng.write(region, 0, peer, desc, 0, size, imm=40) for _id, desc in dsts]
        small = eng.write_batch([region], [(peer, dsts[0][1])], np.zeros(3000), np.arange(3000) * 7,
                                np.zeros(3000), np.arange(3000) * 7, np.full(3000, 7), imm=41)
        for t in transfers:
            t.wait(120)
        small.wait(120)
        expected = sum(t.imm_count for t in transfers)
        lander.call("counter_wait", imm=40, n=expected, timeout=60)
        lander.call("counter_wait", imm=41, n=3000, timeout=60)
        elapsed = time.monotonic() - start
        print(f"{8 * size / MiB:.0f} MiB through a ring of {SLOTS} x {SLOT // KiB} KiB in {elapsed:.2f} s")
        # The small batch overwrote the first 21000 bytes of dsts[0] with the same bytes.
        for d_id, _desc in dsts:
            assert lander.call("digest", region=d_id, off=0, size=size) == digest(src)
        assert not any(peer.failed_paths), peer.last_error
        assert _landed(lander)[2] == 0
        assert sum(s["errors"] for s in eng.stats()) == 0
    finally:
        eng.close()


def test_bad_messages_are_dropped_counted_and_the_ring_keeps_working(lander: PeerProcess) -> None:
    """Writes the destination cannot take (past the region's end, an index nobody holds, a message larger
    than the slots) are dropped and counted, never written; their buffers go back into the ring."""
    eng = TransferEngine(stall_timeout=2.0)
    try:
        src = random_bytes(4 * SLOT, seed=6)
        region = eng.register(src)
        peer = eng.connect(lander.address)
        a_id, a_desc = lander.call("alloc", size=1000)
        b_id, b_desc = lander.call("alloc", size=1000)  # a neighbour: no stray bytes there either
        dropped0 = _landed(lander)[2]

        # The writer believes the region is larger than it is: the message for [900, 1400) is dropped.
        eng.write(region, 0, peer, _forge(a_desc, len=4096), 900, 500, imm=50).wait(10)
        # An index that no region holds.
        eng.write(region, 0, peer, _forge(a_desc, landing=16383), 0, 100, imm=50).wait(10)
        # Messages larger than the receive buffers (the provider truncates them: an error completion).
        # tcp's MSG endpoints also end the connection over one: the write is sent once more, alone on a
        # fresh connection, truncated again, and then fails at the writer (rxm keeps the connection and
        # completes the send); the destination drops and counts every truncated message.
        msg_lane = eng.provider == "tcp"
        for size in (SLOT + 1, 3 * SLOT):
            t = eng.write(region, 0, peer, _forge(a_desc, slot_bytes=4 * SLOT, len=4 * SLOT), 0, size, imm=50)
            if msg_lane:
                with pytest.raises(ws.TransportError, match="dropped the connection"):
                    t.wait(10)
            else:
                t.wait(10)
        # rxm: each of the 4 bad writes drops its message and its piece's announce (which carries the
        # immediate: never counted for bytes that did not land). tcp: the 2 writes past the region's end
        # or to no region the same; each oversized write's message twice (its connection ends there,
        # taking the announce behind it along). 8 either way.
        expected = 8

        deadline = time.monotonic() + 10
        while _landed(lander)[2] - dropped0 < expected and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _landed(lander)[2] - dropped0 == expected
        assert lander.call("counter_total", imm=50) == 0
        assert lander.call("poisoned_outside", region=a_id, off=0, size=0)
        assert lander.call("poisoned_outside", region=b_id, off=0, size=0)

        # The ring is whole: more messages than it has buffers still land, byte-exact.
        for k in range(3 * SLOTS):
            t = eng.write(region, k, peer, b_desc, 0, 1000, imm=51)
            t.wait(10)
            lander.call("counter_wait", imm=51, n=1, timeout=10)
            assert lander.call("digest", region=b_id, off=0, size=1000) == digest(src[k : k + 1000])
        assert not any(peer.failed_paths), peer.last_error
    finally:
        eng.close()


def test_write_into_deregistered_landing_region_fails_at_the_writer(lander: PeerProcess) -> None:
    """Deregistered: messages for it are dropped (and counted), and its guard MR is closed, so the writer's
    transfer fails within its timeout with an error naming the peer; both engines keep serving others."""
    eng = TransferEngine(stall_timeout=2.0)
    try:
        src = random_bytes(MiB, seed=7)
        region = eng.register(src)
        peer = eng.connect(lander.address)
        d_id, d_desc = lander.call("alloc", size=MiB)
        h_id, h_desc = lander.call("alloc", size=MiB)
        t = eng.write(region, 0, peer, d_desc, 0, MiB, imm=60)
        t.wait(10)
        lander.call("counter_wait", imm=60, n=t.imm_count, timeout=10)
        dropped0 = _landed(lander)[2]

        lander.call("deregister", region=d_id)
        lander.call("poison", region=d_id, off=0, size=MiB)
        start = time.monotonic()
        with pytest.raises(ws.TransportError, match=r"write of \d+ bytes to peer [0-9a-f]{8}"):
            for _ in range(3):
                eng.write(region, 0, peer, d_desc, 0, 1000, imm=61).wait(timeout=15)
        assert time.monotonic() - start < 30
        assert lander.call("poisoned_outside", region=d_id, off=0, size=0)
        assert lander.call("poisoned_outside", region=h_id, off=0, size=0)
        assert lander.call("counter_total", imm=61) == 0
        # The data message went ahead of the guard on the same connection: it arrived and was dropped.
        deadline = time.monotonic() + 5
        while _landed(lander)[2] == dropped0 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _landed(lander)[2] > dropped0

        # The destination keeps serving its other region (to a new writer: rxm closed this connection)...
        fresh = TransferEngine(stall_timeout=2.0)
        try:
            f_region = fresh.register(src)
            t = fresh.write(f_region, 0, fresh.connect(lander.address), h_desc, 0, MiB, imm=62)
            t.wait(10)
            lander.call("counter_wait", imm=62, n=t.imm_count, timeout=10)
            assert lander.call("digest", region=h_id, off=0, size=MiB) == digest(src)
        finally:
            fresh.close()
        # ... and the writer keeps serving other peers.
        other = PeerProcess()
        try:
            o_addr = other.call("engine", **LANDING)
            o_id, o_desc = other.call("alloc", size=MiB)
            t = eng.write(region, 0, eng.connect(o_addr), o_desc, 0, MiB, imm=63)
            t.wait(10)
            other.call("counter_wait", imm=63, n=t.imm_count, timeout=10)
            assert other.call("digest", region=o_id, off=0, size=MiB) == digest(src)
        finally:
            other.close()
    finally:
        eng.close()


def test_write_to_landing_region_of_exited_engine_fails_within_timeout() -> None:
    eng = TransferEngine(stall_timeout=2.0)
    dying = PeerProcess()
    try:
        addr = dying.call("engine", **LANDING)
        _d_id, d_desc = dying.call("alloc", size=MiB)
        src = random_bytes(MiB, seed=8)
        region = eng.register(src)
        peer = eng.connect(addr)
        eng.write(region, 0, peer, d_desc, 0, MiB, imm=1).wait(10)
        dying.kill()
        start = time.monotonic()
        with pytest.raises(ws.TransportError, match="unreachable"):
            for _ in range(3):
                eng.write(region, 0, peer, d_desc, 0, MiB, imm=1).wait(timeout=15)
        assert time.monotonic() - start < 30
    finally:
        dying.kill()
        eng.close()


def test_landing_needs_no_peer_process_loopback() -> None:
    """One engine writing into its own landing region (loopback), staged source to landing destination:
    the CPU image of a GPU-to-GPU write on a provider without FI_HMEM."""
    eng = TransferEngine._for_tests(**LANDING)
    try:
        src = random_bytes(5 * SLOT + 11, seed=9)
        dst = np.full(5 * SLOT + 64, POISON, dtype=np.uint8)
        s_region, d_region = eng.register(src), eng.register(dst)
        me = eng.connect(eng.address)
        t = eng.write(s_region, 11, me, d_region.descriptor, 13, 5 * SLOT, imm=3)
        t.wait(10)
        eng.counter(3).wait(t.imm_count, timeout=10)
        assert np.array_equal(dst[13 : 13 + 5 * SLOT], src[11:])
        assert (dst[:13] == POISON).all() and (dst[13 + 5 * SLOT :] == POISON).all()
        eng.deregister(d_region)
        with pytest.raises(ws.TransportError):
            for _ in range(3):
                eng.write(s_region, 0, me, d_region.descriptor, 0, 100, imm=4).wait(10)
    finally:
        eng.close()


def test_forward_fires_on_landed_immediates_into_another_landing_region() -> None:
    """A relay on landing regions: the immediates of a write landed through the ring fire a triggered
    write (from the NIC worker that landed them) out of that region into another landing region."""
    eng = TransferEngine._for_tests(**LANDING)
    try:
        me = eng.connect(eng.address)
        size = 3 * SLOT + 17
        src = random_bytes(size, seed=10)
        mid = np.full(size, POISON, dtype=np.uint8)
        out = np.full(size + 8, POISON, dtype=np.uint8)
        s_region, m_region, o_region = eng.register(src), eng.register(mid), eng.register(out)
        fwd = eng.forward(11, eng.imm_count(size), m_region, 0, me, o_region.descriptor, 8, size, imm=12)
        assert not fwd.fired
        eng.write(s_region, 0, me, m_region.descriptor, 0, size, imm=11).wait(10)
        fwd.transfer.wait(10)
        eng.counter(12).wait(fwd.transfer.imm_count, timeout=10)
        assert np.array_equal(mid, src) and np.array_equal(out[8:], src) and (out[:8] == POISON).all()
    finally:
        eng.close()
