"""Transfer engine over tcp;ofi_rxm on loopback: one engine here, the other in a separate process."""

from __future__ import annotations

import gc
import os
import time

import numpy as np
import pytest

import weightsync as ws
from tests.support.peer import POISON, PeerError, PeerProcess, digest, random_bytes, rows_digest
from weightsync.engine import TransferEngine

MiB = 1 << 20
GiB = 1 << 30


@pytest.mark.parametrize("size", [0, 1, 4095, 4096, 64 * MiB, GiB])
def test_write_sizes_at_odd_offsets(engine: TransferEngine, remote: PeerProcess, size: int) -> None:
    src_off, dst_off, pad = 3, 4097, 8191
    src = random_bytes(size + src_off + 5, seed=size)
    region = engine.register(src)
    dst_id, dst_desc = remote.call("alloc", size=size + dst_off + pad)
    peer = engine.connect(remote.address)

    t = engine.write(region, src_off, peer, dst_desc, dst_off, size, imm=41)
    t.wait(timeout=120)
    remote.call("counter_wait", imm=41, n=t.imm_count, timeout=30)

    assert t.imm_count == engine.imm_count(size)
    expected = digest(src[src_off : src_off + size])
    assert remote.call("digest", region=dst_id, off=dst_off, size=size) == expected
    assert remote.call("poisoned_outside", region=dst_id, off=dst_off, size=size)


def test_ten_thousand_small_writes_in_flight(engine: TransferEngine, remote: PeerProcess) -> None:
    n, size = 10_000, 61  # odd size: every write lands at an unaligned offset
    src = random_bytes(n * size, seed=7)
    region = engine.register(src)
    dst_id, dst_desc = remote.call("alloc", size=n * size + 1)
    peer = engine.connect(remote.address)

    offs = np.arange(n, dtype=np.uint64) * size
    order = np.random.default_rng(1).permutation(n)  # submission order unrelated to placement
    t = engine.write_batch(
        [region], [(peer, dst_desc)], np.zeros(n), offs[order], np.zeros(n), offs[order] + 1,
        np.full(n, size), imm=5,
    )
    assert t.imm_count == n
    t.wait(timeout=60)
    remote.call("counter_wait", imm=5, n=n, timeout=30)
    assert remote.call("digest", region=dst_id, off=1, size=n * size) == digest(src)
    assert remote.call("poisoned_outside", region=dst_id, off=1, size=n * size)

    # The same count, posted one call at a time: each call returns a future at once.
    transfers = [engine.write(region, i * size, peer, dst_desc, i * size + 1, size, imm=6) for i in range(n)]
    for t in transfers:
        t.wait(timeout=60)
    remote.call("counter_wait", imm=6, n=n, timeout=30)


def test_batch_naming_a_few_entries_of_large_tables(engine: TransferEngine, remote: PeerProcess) -> None:
    # A plan round reads a few of a source's many tensors into a few of a destination's: write_batch hands
    # the engine only the entries the batch names, renumbered; the bytes must land as the columns say.
    size, nsrc, ndst = 97, 300, 40
    srcs = [random_bytes(size, seed=100 + i) for i in range(nsrc)]
    regions = [engine.register(s) for s in srcs]
    peer = engine.connect(remote.address)
    dsts = [remote.call("alloc", size=2 * size) for _ in range(ndst)]
    table = [(peer, desc) for _, desc in dsts]
    # out of order, one source read twice, most entries of both tables unused
    si = np.array([250, 3, 77, 3, 299, 140], dtype=np.uint32)
    di = np.array([39, 0, 17, 5, 17, 22], dtype=np.uint32)
    do = np.array([0, size, size, 0, 0, 1], dtype=np.uint64)
    t = engine.write_batch(regions, table, si, np.zeros(len(si)), di, do, np.full(len(si), size), imm=13)
    t.wait(timeout=30)
    remote.call("counter_wait", imm=13, n=len(si), timeout=30)
    for s, d, o in zip(si.tolist(), di.tolist(), do.tolist(), strict=True):
        assert remote.call("digest", region=dsts[d][0], off=o, size=size) == digest(srcs[s]), (s, d, o)
    # The same table object again, one entry replaced in place: the write goes where the entry now says.
    extra_id, extra_desc = remote.call("alloc", size=size)
    table[17] = (peer, extra_desc)
    t = engine.write_batch(regions, table, [42], [0], [17], [0], [size], imm=14)
    t.wait(timeout=30)
    remote.call("counter_wait", imm=14, n=1, timeout=30)
    assert remote.call("digest", region=extra_id, off=0, size=size) == digest(srcs[42])
    # An index out of range is still the engine's error, naming the write.
    with pytest.raises(ws.TransportError, match="write 1 of the batch: source region index out of range"):
        engine.write_batch(regions, table, [5, nsrc], [0, 0], [1, 2], [0, 0], [size, size], imm=13)
    with pytest.raises(ws.TransportError, match="write 0 of the batch: destination descriptor index out of"):
        engine.write_batch(regions, table, [5, 6], [0, 0], [ndst, 2], [0, 0], [size, size], imm=13)
    # Columns of another type are still checked value by value (those of the column's own type need not).
    with pytest.raises(ws.TransportError, match=r"write 1 of the batch: source offset -1 is outside 0\.\."):
        engine.write_batch(regions, table, [5, 6], np.array([0, -1]), [1, 2], [0, 0], [size, size], imm=13)
    with pytest.raises(ws.TransportError, match=r"write 0 of the batch: source index 4294967296 is outside"):
        engine.write_batch(regions, table, np.array([1 << 32], np.uint64), [0], [1], [0], [size], imm=13)
    # A value with a fraction is refused, not cut to its integer part (integral floats are integers).
    with pytest.raises(ws.TransportError, match=r"write 1 of the batch: source offset 1\.5 is not an int"):
        engine.write_batch(regions, table, [5, 6], np.array([0.0, 1.5]), [1, 2], [0, 0], [size, size], imm=13)


def test_immediates_before_wait_are_kept_and_consumed(engine: TransferEngine, remote: PeerProcess) -> None:
    src = random_bytes(8 * MiB, seed=3)
    region = engine.register(src)
    _dst_id, dst_desc = remote.call("alloc", size=8 * MiB)
    peer = engine.connect(remote.address)

    expected = 0
    for _ in range(3):
        t = engine.write(region, 0, peer, dst_desc, 0, 8 * MiB, imm=77)
        t.wait(timeout=30)
        expected += t.imm_count
    deadline = time.time() + 10
    while remote.call("counter_value", imm=77) < expected and time.time() < deadline:
        time.sleep(0.01)
    assert remote.call("counter_value", imm=77) == expected  # all arrived before anyone waited

    remote.call("counter_wait", imm=77, n=expected - 1, timeout=5)
    assert remote.call("counter_value", imm=77) == 1
    remote.call("counter_wait", imm=77, n=1, timeout=5)
    with pytest.raises(PeerError, match="TimeoutError: counter 77: 0 of 1"):
        remote.call("counter_wait", imm=77, n=1, timeout=0.2)


def test_local_counter_credit_semantics(engine: TransferEngine) -> None:
    # Loopback to itself: the same engine is source and destination.
    buf = random_bytes(4 * MiB, seed=9)
    dst = np.full(4 * MiB, POISON, dtype=np.uint8)
    src_region, dst_region = engine.register(buf), engine.register(dst)
    me = engine.connect(engine.address)
    t = engine.write(src_region, 0, me, dst_region.descriptor, 0, 4 * MiB, imm=123)
    t.wait(10)
    engine.counter(123).wait(t.imm_count, timeout=10)
    assert np.array_equal(buf, dst)
    start = time.monotonic()
    with pytest.raises(ws.TimeoutError):
        engine.counter(123).wait(1, timeout=0.3)
    assert time.monotonic() - start < 5


def test_bad_input_is_refused_and_engine_keeps_working(engine: TransferEngine, remote: PeerProcess) -> None:
    src = random_bytes(MiB, seed=11)
    region = engine.register(src, name="weights")
    dst_id, dst_desc = remote.call("alloc", size=MiB)
    peer = engine.connect(remote.address)

    with pytest.raises(ws.TransportError, match=r"past the end of remote region .* peer"):
        engine.write(region, 0, peer, dst_desc, 1, MiB)
    with pytest.raises(ws.TransportError, match=r"outside source region"):
        engine.write(region, 10, peer, dst_desc, 0, MiB)
    with pytest.raises(ws.TransportError, match="must be a Region"):
        engine.write(src, 0, peer, dst_desc, 0, 16)  # unregistered memory
    gone = engine.register(random_bytes(4096, seed=1))
    engine.deregister(gone)
    with pytest.raises(ws.TransportError, match="deregistered"):
        engine.write(gone, 0, peer, dst_desc, 0, 16)
    corrupted = bytearray(dst_desc)
    corrupted[len(corrupted) // 2] ^= 0x40
    with pytest.raises(ws.TransportError, match="corrupted region descriptor"):
        engine.write(region, 0, peer, bytes(corrupted), 0, 16)
    with pytest.raises(ws.TransportError, match="corrupted"):
        engine.write(region, 0, peer, b"\x00garbage", 0, 16)
    foreign = TransferEngine()
    try:
        foreign_desc = foreign.register(np.zeros(64, dtype=np.uint8)).descriptor
        with pytest.raises(ws.TransportError, match="belongs to engine"):
            engine.write(region, 0, peer, foreign_desc, 0, 16)
    finally:
        foreign.close()
    with pytest.raises(ws.TransportError, match="32 bits"):
        engine.write(region, 0, peer, dst_desc, 0, 16, imm=1 << 32)

    # Nothing above moved a byte, and the engine still works.
    remote_digest = remote.call("digest", region=dst_id, off=0, size=MiB)
    assert remote_digest == digest(np.full(MiB, POISON, dtype=np.uint8))
    engine.write(region, 0, peer, dst_desc, 0, MiB, imm=2).wait(10)
    remote.call("counter_wait", imm=2, n=engine.imm_count(MiB), timeout=10)
    assert remote.call("digest", region=dst_id, off=0, size=MiB) == digest(src)


def test_write_to_exited_peer_fails_within_timeout(engine: TransferEngine) -> None:
    src = random_bytes(4 * MiB, seed=12)
    region = engine.register(src)
    dying, healthy = PeerProcess(), PeerProcess()
    try:
        dying_addr = dying.call("engine", stall_timeout=2.0)
        healthy_addr = healthy.call("engine", stall_timeout=2.0)
        _, dying_desc = dying.call("alloc", size=4 * MiB)
        h_id, healthy_desc = healthy.call("alloc", size=4 * MiB)
        p_dying, p_healthy = engine.connect(dying_addr), engine.connect(healthy_addr)
        engine.write(region, 0, p_dying, dying_desc, 0, 4 * MiB, imm=1).wait(10)  # connection is up
        dying.kill()

        start = time.monotonic()
        with pytest.raises(ws.TransportError, match="unreachable"):
            for _ in range(3):  # the first write after the death may still be absorbed by the socket
                engine.write(region, 0, p_dying, dying_desc, 0, 4 * MiB, imm=1).wait(timeout=15)
        assert time.monotonic() - start < 30

        # Other peers are unaffected.
        t = engine.write(region, 0, p_healthy, healthy_desc, 0, 4 * MiB, imm=3)
        t.wait(10)
        healthy.call("counter_wait", imm=3, n=t.imm_count, timeout=10)
        assert healthy.call("digest", region=h_id, off=0, size=4 * MiB) == digest(src)
    finally:
        dying.kill()
        healthy.close()


def test_close_with_writes_in_flight(remote: PeerProcess) -> None:
    engine = TransferEngine()
    src = random_bytes(64 * MiB, seed=13)
    region = engine.register(src)
    _dst_id, dst_desc = remote.call("alloc", size=64 * MiB)
    peer = engine.connect(remote.address)
    transfers = [engine.write(region, 0, peer, dst_desc, 0, 64 * MiB, imm=9) for _ in range(8)]
    engine.close()
    outcomes = []
    for t in transfers:
        try:
            t.wait(timeout=10)
            outcomes.append("done")
        except ws.TransportError as exc:
            assert "engine closed" in str(exc)
            outcomes.append("failed")
    assert "failed" in outcomes
    with pytest.raises(ws.TransportError, match="closed"):
        engine.write(region, 0, peer, dst_desc, 0, 16)
    # The remote engine is unharmed by the abrupt close.
    assert remote.call("pid") > 0


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / MiB


def test_register_write_deregister_cycles_do_not_leak(engine: TransferEngine, remote: PeerProcess) -> None:
    _dst_id, dst_desc = remote.call("alloc", size=64 * 1024)
    peer = engine.connect(remote.address)

    def cycle(i: int) -> None:
        buf = random_bytes(64 * 1024, seed=i)
        region = engine.register(buf)
        engine.write(region, 0, peer, dst_desc, 0, buf.nbytes, imm=4).wait(10)
        engine.deregister(region)

    for i in range(50):  # warm-up: allocator pools and the connection settle
        cycle(i)
    gc.collect()
    fds0, rss0 = _open_fds(), _rss_mib()
    for i in range(1000):
        cycle(i)
    gc.collect()
    time.sleep(0.2)
    fds1, rss1 = _open_fds(), _rss_mib()
    print(f"open fds {fds0} -> {fds1}; RSS {rss0:.1f} -> {rss1:.1f} MiB over 1000 cycles")
    remote.call("counter_wait", imm=4, n=1050, timeout=30)
    assert fds1 <= fds0 + 2
    assert rss1 - rss0 < 32


def test_registered_buffer_is_referenced_until_its_writes_are_released(
    engine: TransferEngine, remote: PeerProcess
) -> None:
    """The engine, not the caller, keeps a registered buffer alive while writes read from it, and lets go
    of it afterwards: the buffer survives dropping the region and the transfer, and is freed (not leaked)
    once the write completed and the region is gone, whether deregistered or only dropped."""
    import weakref

    _dst_id, dst_desc = remote.call("alloc", size=MiB)
    peer = engine.connect(remote.address)
    for deregister in (False, True):
        buf = random_bytes(MiB, seed=7)
        alive = weakref.ref(buf)
        region = engine.register(buf)
        t = engine.write(region, 0, peer, dst_desc, 0, MiB, imm=6)
        if deregister:
            engine.deregister(region)
        del buf, region
        gc.collect()
        t.wait(10)
        remote.call("counter_wait", imm=6, n=t.imm_count, timeout=10)
        del t
        deadline = time.monotonic() + 5
        while alive() is not None and time.monotonic() < deadline:
            engine.stats()  # a call into the engine releases what its threads let go of
            gc.collect()
            time.sleep(0.01)
        assert alive() is None, f"deregister={deregister}: the engine still references the buffer"


# --- 2-D writes -------------------------------------------------------------------------------------------

# (rows, row bytes, source pitch, destination pitch): strided on both sides at odd sizes, on one side
# only, rows back to back (one span), rows larger than the stripe threshold (each striped), empty rows.
TWO_D_CASES = [
    (7, 100, 1000, 333),
    (64, 61, 61, 4099),
    (33, 4095, 8191, 4095),
    (16, 3000, 3000, 3000),
    (3, (1 << 20) + 4097, 3 << 20, (2 << 20) + 5),
    (5, 0, 64, 64),
    (1000, 7, 13, 11),
]


@pytest.mark.parametrize(("rows", "row_bytes", "src_pitch", "dst_pitch"), TWO_D_CASES)
def test_2d_writes_land_byte_exact_with_one_immediate(
    engine: TransferEngine, remote: PeerProcess, rows: int, row_bytes: int, src_pitch: int, dst_pitch: int
) -> None:
    src_off, dst_off, pad = 3, 4097, 777
    src = random_bytes(src_off + rows * src_pitch + 5, seed=rows * 31 + row_bytes)
    region = engine.register(src)
    dst_size = dst_off + (rows - 1) * dst_pitch + row_bytes + pad
    dst_id, dst_desc = remote.call("alloc", size=dst_size)
    peer = engine.connect(remote.address)

    imm = 300 + rows
    transfers = [
        engine.write(region, src_off, peer, dst_desc, dst_off, row_bytes, imm=imm, rows=rows,
                     src_pitch=src_pitch, dst_pitch=dst_pitch)
        for _ in range(2)  # the same block twice: two immediates, not 2 x rows
    ]
    for t in transfers:
        t.wait(timeout=60)
        assert t.imm_count == 1
        assert t.nbytes == rows * row_bytes
    assert engine.imm_count(row_bytes, rows=rows) == 1
    remote.call("counter_wait", imm=imm, n=2, timeout=30)
    time.sleep(0.2)  # a stray extra immediate would have arrived by now
    assert remote.call("counter_total", imm=imm) == 2
    assert remote.call("counter_value", imm=imm) == 0

    want = rows_digest(src, src_off, rows, row_bytes, src_pitch)
    assert remote.call("rows_digest", region=dst_id, off=dst_off, rows=rows, row_bytes=row_bytes,
                       pitch=dst_pitch) == want
    assert remote.call("poisoned_outside_rows", region=dst_id, off=dst_off, rows=rows, row_bytes=row_bytes,
                       pitch=dst_pitch)


def test_2d_and_1d_writes_in_one_batch(engine: TransferEngine, remote: PeerProcess) -> None:
    rng = np.random.default_rng(5)
    n = 200
    rows = rng.integers(1, 9, n)
    row_bytes = rng.integers(1, 3000, n)
    src_pitch = row_bytes + rng.integers(0, 50, n)
    dst_pitch = row_bytes + rng.integers(0, 50, n)
    src_off = np.concatenate([[0], np.cumsum(rows * src_pitch)[:-1]]) + 1
    dst_off = np.concatenate([[0], np.cumsum(rows * dst_pitch)[:-1]]) + 3
    src = random_bytes(int(src_off[-1] + rows[-1] * src_pitch[-1]) + 1, seed=8)
    region = engine.register(src)
    dst_size = int(dst_off[-1] + rows[-1] * dst_pitch[-1]) + 9
    dst_id, dst_desc = remote.call("alloc", size=dst_size)
    peer = engine.connect(remote.address)

    t = engine.write_batch([region], [(peer, dst_desc)], np.zeros(n), src_off, np.zeros(n), dst_off,
                           row_bytes, imm=12, rows=rows, src_pitch=src_pitch, dst_pitch=dst_pitch)
    expected = sum(engine.imm_count(int(b), rows=int(r)) for b, r in zip(row_bytes, rows, strict=True))
    assert t.imm_count == expected
    t.wait(timeout=60)
    remote.call("counter_wait", imm=12, n=expected, timeout=30)
    time.sleep(0.2)
    assert remote.call("counter_total", imm=12) == expected
    for i in range(0, n, 17):
        want = rows_digest(src, int(src_off[i]), int(rows[i]), int(row_bytes[i]), int(src_pitch[i]))
        got = remote.call("rows_digest", region=dst_id, off=int(dst_off[i]), rows=int(rows[i]),
                          row_bytes=int(row_bytes[i]), pitch=int(dst_pitch[i]))
        assert got == want, f"write {i}"


def test_2d_bad_geometry_is_refused(engine: TransferEngine, remote: PeerProcess) -> None:
    src = random_bytes(64 * 1024, seed=14)
    region = engine.register(src, name="weights")
    dst_id, dst_desc = remote.call("alloc", size=64 * 1024)
    peer = engine.connect(remote.address)
    with pytest.raises(ws.TransportError, match=r"do not fit a pitch .*destination side .*region .* peer"):
        engine.write(region, 0, peer, dst_desc, 0, 100, imm=1, rows=4, src_pitch=100, dst_pitch=99)
    with pytest.raises(ws.TransportError, match=r"do not fit a pitch .*source side"):
        engine.write(region, 0, peer, dst_desc, 0, 100, imm=1, rows=4, src_pitch=50, dst_pitch=100)
    with pytest.raises(ws.TransportError, match=r"10 rows of 100 bytes .* past the end of remote .*peer"):
        engine.write(region, 0, peer, dst_desc, 1, 100, imm=1, rows=10, dst_pitch=64 * 1024 // 9)
    with pytest.raises(ws.TransportError, match=r"rows of 100 bytes .* outside source region"):
        engine.write(region, 0, peer, dst_desc, 0, 100, imm=1, rows=700, src_pitch=100)
    with pytest.raises(ws.TransportError, match=r"at least one row"):
        engine.write(region, 0, peer, dst_desc, 0, 100, imm=1, rows=0)
    with pytest.raises(ws.TransportError, match=r"write 1 of the batch: .* past the end"):
        engine.write_batch([region], [(peer, dst_desc)], np.zeros(2), np.zeros(2), np.zeros(2), [0, 1000],
                           [8, 8], imm=1, rows=[2, 2], dst_pitch=[16, 64 * 1024])
    assert remote.call("digest", region=dst_id, off=0, size=64 * 1024) == digest(
        np.full(64 * 1024, POISON, dtype=np.uint8))
    # Overflowing geometry is refused, not wrapped around.
    with pytest.raises(ws.TransportError, match="outside source region"):
        engine.write(region, 0, peer, dst_desc, 0, 8, imm=1, rows=1 << 62, src_pitch=8, dst_pitch=1 << 62)
    with pytest.raises(ws.TransportError, match="past the end"):
        engine.write(region, 0, peer, dst_desc, 0, 8, imm=1, rows=2, src_pitch=8, dst_pitch=(1 << 64) - 4)


# --- writes into memory the destination gave up ----------------------------------------------------------


@pytest.mark.parametrize("shape", ["1-D", "2-D"])
def test_write_into_deregistered_region_fails_and_lands_nowhere(
    engine: TransferEngine, remote: PeerProcess, shape: str
) -> None:
    """Deregistering closes the region's MRs before it returns: later writes into it are refused by the
    destination's NIC, so the writer gets an error and the (possibly reused) memory stays untouched."""
    src = random_bytes(MiB, seed=15)
    region = engine.register(src)
    d_id, d_desc = remote.call("alloc", size=MiB)
    h_id, _ = remote.call("alloc", size=MiB)  # a neighbour region: no stray bytes there either
    peer = engine.connect(remote.address)
    geometry = {"rows": 4, "dst_pitch": 1000} if shape == "2-D" else {}
    nbytes = 512 if shape == "2-D" else MiB
    t = engine.write(region, 0, peer, d_desc, 0, nbytes, imm=1, **geometry)
    t.wait(10)
    remote.call("counter_wait", imm=1, n=t.imm_count, timeout=10)

    remote.call("deregister", region=d_id)
    remote.call("poison", region=d_id, off=0, size=MiB)  # the buffer itself is still there to look at
    start = time.monotonic()
    with pytest.raises(ws.TransportError, match=r"write of .* peer"):
        # A 2-D write's rows complete at delivery, so it fails itself; a plain write only completes at
        # sending and the refusal shows from the next one on (the provider drops the connection).
        for _ in range(3):
            engine.write(region, 0, peer, d_desc, 0, nbytes, imm=2, **geometry).wait(timeout=15)
    assert time.monotonic() - start < 30
    assert remote.call("poisoned_outside", region=d_id, off=0, size=0)
    assert remote.call("digest", region=h_id, off=0, size=MiB) == digest(np.full(MiB, POISON, dtype=np.uint8))
    assert remote.call("counter_total", imm=2) == 0

    # Writing from the region the destination gave up still works towards other engines.
    other = PeerProcess()
    try:
        o_addr = other.call("engine", stall_timeout=2.0)
        o_id, o_desc = other.call("alloc", size=MiB)
        t = engine.write(region, 0, engine.connect(o_addr), o_desc, 0, MiB, imm=3)
        t.wait(10)
        other.call("counter_wait", imm=3, n=t.imm_count, timeout=10)
        assert other.call("digest", region=o_id, off=0, size=MiB) == digest(src)
    finally:
        other.close()


def test_live_table_in_the_immediate_ring() -> None:
    """The cuda lane's guard against writing into freed GPU memory, without a GPU: the owner marks its
    exported regions live or dead in its ring's shared memory, and a writer's mapping sees it at once."""
    from weightsync import _ext

    owner = _ext.ImmRing.create()
    writer = _ext.ImmRing.open(os.getpid(), owner.fd)  # a second mapping of the memfd, as a peer has
    n = _ext.ImmRing.live_slots
    ids = [1, 2, 3, 1 + n, 1 + 2 * n, 5 * n - 1]  # 1, 1 + n and 1 + 2n share a probe sequence
    for i in ids:
        assert owner.set_live(i, True)
    assert all(writer.is_live(i) for i in ids)
    assert not writer.is_live(4) and not writer.is_live(1 + 3 * n) and not writer.is_live(0)
    owner.set_live(1 + n, False)
    assert not writer.is_live(1 + n)
    assert writer.is_live(1 + 2 * n) and writer.is_live(1)  # found past the freed slot
    # Freed slots are reused: far more registrations than slots over time never fill the table.
    for i in range(10, 10 + 3 * n):
        assert owner.set_live(i, True)
        assert writer.is_live(i)
        owner.set_live(i, False)
    assert not writer.is_live(10 + n)
    assert owner.set_live(7 * n + 3, True) and writer.is_live(7 * n + 3)
    assert all(writer.is_live(i) for i in ids if i != 1 + n)


# --- triggered writes (relays) ----------------------------------------------------------------------------


def test_relay_chain_forwards_each_chunk_when_it_lands() -> None:
    """A -> B -> C: A writes chunks into B; B's engine forwards each chunk to C from its own worker
    thread as soon as that chunk's immediates are in (B's Python sits blocked reading its pipe)."""
    a = TransferEngine(stall_timeout=2.0)
    b, c = PeerProcess(), PeerProcess()
    try:
        b_addr = b.call("engine", stall_timeout=2.0)
        c_addr = c.call("engine", stall_timeout=2.0)
        sizes = [1, 4095, 61 * 1024 + 7, 3 * MiB + 5, 777, 2 * MiB, 4 * 1000]
        offs = [int(o) + 3 for o in np.concatenate([[0], np.cumsum(sizes)[:-1]])]
        total = int(offs[-1] + sizes[-1])
        src = random_bytes(total + 11, seed=21)
        a_region = a.register(src)
        b_id, b_desc = b.call("alloc", size=total + 5)
        c_id, c_desc = c.call("alloc", size=total + 64 + 100)
        b_to_c = b.call("connect", address=c_addr)
        a_to_b = a.connect(b_addr)

        # The last chunk goes on as a 2-D write: 4 rows of 1000 bytes, 1016 bytes apart on C.
        last = len(sizes) - 1
        forwards, expected_at_c = [], 0
        for k, (off, size) in enumerate(zip(offs, sizes, strict=True)):
            rows = {"rows": 4, "dst_pitch": 1016} if k == last else {}
            nbytes = size // 4 if k == last else size
            fid = b.call("forward", on_imm=100 + k, count=a.imm_count(size), region=b_id, src_off=int(off),
                         peer=b_to_c, descriptor=c_desc, dst_off=int(off) + 64, size=nbytes, imm=200, **rows)
            forwards.append(fid)
            expected_at_c += b.call("imm_count", nbytes=nbytes, rows=rows.get("rows", 1))
        assert b.call("pending_forwards") == len(sizes)
        assert c.call("counter_total", imm=200) == 0  # nothing moves before the chunks land at B

        order = np.random.default_rng(3).permutation(len(sizes))
        for k in order:
            a.write(a_region, int(offs[k]), a_to_b, b_desc, int(offs[k]), sizes[k], imm=100 + int(k)).wait(30)
        c.call("counter_wait", imm=200, n=expected_at_c, timeout=30)
        assert b.call("pending_forwards") == 0
        for fid in forwards:
            b.call("forward_wait", forward=fid, timeout=10)

        body, first = offs[last], offs[0]
        assert c.call("digest", region=c_id, off=64 + first, size=body - first) == digest(src[first:body])
        row = sizes[last] // 4
        assert c.call("rows_digest", region=c_id, off=body + 64, rows=4, row_bytes=row, pitch=1016) == digest(
            src[body : body + 4 * row])
        assert c.call("poisoned_outside", region=c_id, off=64 + first, size=body - first + 3 * 1016 + row)
        time.sleep(0.2)
        assert c.call("counter_total", imm=200) == expected_at_c  # each trigger fired exactly once
    finally:
        b.close()
        c.close()
        a.close()


def test_forward_semantics(engine: TransferEngine) -> None:
    """Loopback to itself: due triggers fire at once, consumed credits still count, cancel and
    deregistration fail the trigger's transfer with a reason, and close fails the ones left."""
    me = engine.connect(engine.address)
    src = random_bytes(64 * 1024, seed=30)
    landing = np.full(64 * 1024, POISON, dtype=np.uint8)
    out = np.full(64 * 1024, POISON, dtype=np.uint8)
    s_region, l_region, o_region = engine.register(src), engine.register(landing), engine.register(out)

    def land(imm: int, off: int, size: int) -> None:
        engine.write(s_region, off, me, l_region.descriptor, off, size, imm=imm).wait(10)

    # Counts the total, not credits: a local waiter consuming the first immediate does not delay it.
    fwd = engine.forward(1, 2, l_region, 0, me, o_region.descriptor, 0, 1000, imm=50)
    land(1, 0, 1000)
    engine.counter(1).wait(1, timeout=5)  # consumes
    assert not fwd.fired
    land(1, 0, 1000)
    fwd.transfer.wait(10)
    engine.counter(50).wait(1, timeout=5)
    assert np.array_equal(out[:1000], src[:1000]) and (out[1000:] == POISON).all()

    # Already due: fires at once.
    due = engine.forward(1, 1, l_region, 0, me, o_region.descriptor, 2000, 10, imm=51)
    due.transfer.wait(10)
    engine.counter(51).wait(1, timeout=5)
    assert np.array_equal(out[2000:2010], src[:10])

    # Cancelled: its transfer fails and nothing is written when the immediates come.
    gone = engine.forward(2, 1, l_region, 0, me, o_region.descriptor, 4000, 10, imm=52)
    also = engine.forward(2, 5, l_region, 0, me, o_region.descriptor, 4000, 10, imm=52)
    assert gone.cancel() and not gone.cancel()
    assert engine.cancel_forwards(2) == 1 and engine.pending_forwards == 0
    with pytest.raises(ws.TransportError, match="cancelled before it fired"):
        gone.transfer.wait(5)
    with pytest.raises(ws.TransportError, match="cancelled"):
        also.transfer.wait(5)
    land(2, 0, 10)
    time.sleep(0.1)
    assert engine.counter(52).total == 0 and (out[4000:4010] == POISON).all()

    # Bad input is refused when registering; a source deregistered before it fires fails it then.
    with pytest.raises(ws.TransportError, match="outside source region"):
        engine.forward(3, 1, l_region, 64 * 1024 - 5, me, o_region.descriptor, 0, 10, imm=53)
    spare = engine.register(random_bytes(4096, seed=31))
    orphan = engine.forward(3, 1, spare, 0, me, o_region.descriptor, 6000, 10, imm=53)
    engine.deregister(spare)
    land(3, 0, 10)
    with pytest.raises(ws.TransportError, match=r"failed when it fired: .*deregistered"):
        orphan.transfer.wait(5)

    # Close fails what is still pending.
    left = engine.forward(4, 1, l_region, 0, me, o_region.descriptor, 0, 10, imm=54)
    engine.close()
    with pytest.raises(ws.TransportError, match="engine closed before it fired"):
        left.transfer.wait(5)


# --- staged sources (GPU memory the NICs cannot register) ------------------------------------------------


def test_staged_source_pipeline_reaches_fabric_peers(remote: PeerProcess) -> None:
    """GPU sources without FI_HMEM go through page-locked slots (copy in, write out, slot back). The same
    pipeline with host memory and memcpy (stage_host_sources): two slots cycled many times, concurrent
    writes, a 2-D write and a batch, all byte-exact with the engine's immediate counts."""
    eng = TransferEngine._for_tests(stall_timeout=2.0, max_piece=MiB, stripe_threshold=256 * 1024,
                                    staging_slots=2, stage_host_sources=True)
    try:
        size = 13 * MiB + 12345
        src = random_bytes(size + 7, seed=40)
        region = eng.register(src)
        assert not region.on_fabric
        d_id, d_desc = remote.call("alloc", size=size + 4096 + 3)
        peer = eng.connect(remote.address)
        transfers = [eng.write(region, 7, peer, d_desc, 4096, size, imm=70) for _ in range(3)]
        for t in transfers:
            t.wait(60)
            assert t.imm_count == eng.imm_count(size)
        remote.call("counter_wait", imm=70, n=3 * eng.imm_count(size), timeout=30)
        assert remote.call("digest", region=d_id, off=4096, size=size) == digest(src[7 : 7 + size])
        assert remote.call("poisoned_outside", region=d_id, off=4096, size=size)

        remote.call("poison", region=d_id, off=0, size=size + 4096 + 3)
        rows, row, src_pitch, dst_pitch = 5, 300_001, 310_000, 300_017
        t = eng.write(region, 3, peer, d_desc, 11, row, imm=71, rows=rows, src_pitch=src_pitch,
                      dst_pitch=dst_pitch)
        t.wait(60)
        remote.call("counter_wait", imm=71, n=1, timeout=30)
        assert remote.call("rows_digest", region=d_id, off=11, rows=rows, row_bytes=row,
                           pitch=dst_pitch) == rows_digest(src, 3, rows, row, src_pitch)
        assert remote.call("poisoned_outside_rows", region=d_id, off=11, rows=rows, row_bytes=row,
                           pitch=dst_pitch)

        n = 300
        offs = np.arange(n, dtype=np.uint64) * 4099
        t = eng.write_batch([region], [(peer, d_desc)], np.zeros(n), offs, np.zeros(n), offs,
                            np.full(n, 4099), imm=72)
        t.wait(60)
        remote.call("counter_wait", imm=72, n=n, timeout=30)
        assert remote.call("digest", region=d_id, off=0, size=n * 4099) == digest(src[: n * 4099])
    finally:
        eng.close()
