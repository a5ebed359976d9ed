"""Two NICs: two namespaces joined by two rate-limited veth pairs, one engine process in each."""

from __future__ import annotations

import time

import pytest

from tests.support import netns
from tests.support.peer import PeerProcess, digest, random_bytes, rows_digest

pytestmark = pytest.mark.netns
MiB = 1 << 20

why_not = netns.available()
if why_not:
    pytest.skip(why_not, allow_module_level=True)


@pytest.fixture()
def hosts():
    with netns.TwoHosts(nics=2, rate_mbit=400) as h:
        src = PeerProcess(netns=h.a)
        dst = PeerProcess(netns=h.b)
        try:
            src.call("engine", nics=h.nic_names, stall_timeout=2.0)
            dst_addr = dst.call("engine", nics=h.nic_names, stall_timeout=2.0)
            src.peer = src.call("connect", address=dst_addr)
            yield h, src, dst
        finally:
            src.kill()
            dst.kill()


def test_striped_write_uses_both_nics(hosts) -> None:
    _h, src, dst = hosts
    size = 48 * MiB + 12345
    s_id, _ = src.call("alloc", size=size, seed=21)
    d_id, d_desc = dst.call("alloc", size=size + 7)
    imm_count, seconds = src.call("write", region=s_id, src_off=0, peer=src.peer, descriptor=d_desc,
                                  dst_off=7, size=size, imm=1)
    dst.call("counter_wait", imm=1, n=imm_count, timeout=30)
    assert dst.call("digest", region=d_id, off=7, size=size) == digest(random_bytes(size, 21))
    assert dst.call("poisoned_outside", region=d_id, off=7, size=size)
    per_nic = [s["bytes"] for s in src.call("stats")]
    print(f"{size} bytes in {seconds:.2f} s over 2 NICs; per-NIC bytes {per_nic}")
    assert len(per_nic) == 2 and sum(per_nic) == size
    assert min(per_nic) > 0.3 * size  # both links carried a real share


def test_whole_pieces_split_a_peers_bytes_evenly_over_its_nics(hosts) -> None:
    """Writes up to the stripe threshold go whole to one NIC. Submitted together, 1 MiB writes each
    followed by a 4 KiB one: a NIC picked by a counter that every write turns put all the large ones on
    one NIC (16 MiB against 64 KiB); the least loaded NIC of the peer gets each, so both carry about
    half, every byte right."""
    _h, src, dst = hosts
    big, small, pairs = MiB, 4096, 16
    stride = big + small
    s_id, _ = src.call("alloc", size=pairs * stride, seed=24)
    d_id, d_desc = dst.call("alloc", size=pairs * stride)
    before = [s["bytes"] for s in src.call("stats")]
    transfers = []
    for k in range(pairs):
        for off, n in ((k * stride, big), (k * stride + big, small)):
            transfers.append(src.call("write_async", region=s_id, src_off=off, peer=src.peer,
                                      descriptor=d_desc, dst_off=off, size=n, imm=5))
    total = 0
    for t in transfers:
        imm_count, _seconds = src.call("wait", transfer=t, timeout=60)
        total += imm_count
    dst.call("counter_wait", imm=5, n=total, timeout=30)
    want = digest(random_bytes(pairs * stride, 24))
    assert dst.call("digest", region=d_id, off=0, size=pairs * stride) == want
    per_nic = [s["bytes"] - b for s, b in zip(src.call("stats"), before, strict=True)]
    print(f"per-NIC bytes {per_nic}")
    assert sum(per_nic) == pairs * stride
    assert min(per_nic) > 0.4 * pairs * stride, per_nic


@pytest.fixture()
def slow_hosts():
    """Two NICs of 50 Mbit/s each: 1 MiB takes about 84 ms per NIC, so queueing shows in hundreds of ms."""
    with netns.TwoHosts(nics=2, rate_mbit=50) as h:
        src = PeerProcess(netns=h.a)
        dst = PeerProcess(netns=h.b)
        try:
            src.call("engine", nics=h.nic_names, stall_timeout=5.0)
            dst_addr = dst.call("engine", nics=h.nic_names, stall_timeout=5.0)
            src.peer = src.call("connect", address=dst_addr)
            yield h, src, dst
        finally:
            src.kill()
            dst.kill()


def test_immediates_arrive_as_their_writes_land_not_behind_later_data(slow_hosts) -> None:
    """A write's immediate goes as an announce once its bytes are placed. On the connection that carries
    the data it waited behind every byte posted there after them: 24 writes of 1 MiB submitted together
    (2 s of bytes at 2 x 50 Mbit/s) had all their immediates arrive with the last byte. On the path's
    control connection (LaneCaps::control_queue) the first arrives while most bytes are still on their
    way, and each write's bytes are in place when its immediate is counted."""
    h, src, dst = slow_hosts
    n = 24
    s_id, _ = src.call("alloc", size=n * MiB, seed=26)
    d_id, d_desc = dst.call("alloc", size=n * MiB)
    warm = src.call("write_async", region=s_id, src_off=0, peer=src.peer, descriptor=d_desc, dst_off=0,
                    size=4 * MiB, imm=7)  # both paths connected (data and control) before the clock starts
    src.call("wait", transfer=warm, timeout=60)
    dst.call("counter_wait", imm=7, n=1, timeout=60)
    dst.call("poison", region=d_id, off=0, size=n * MiB)
    want = random_bytes(n * MiB, 26)
    watches = [dst.call("digest_watch", imm=300 + k, n=1, region=d_id, off=k * MiB, size=MiB, timeout=60)
               for k in range(n)]
    start = time.monotonic()
    transfers = [src.call("write_async", region=s_id, src_off=k * MiB, peer=src.peer, descriptor=d_desc,
                          dst_off=k * MiB, size=MiB, imm=300 + k) for k in range(n)]
    for t in transfers:
        src.call("wait", transfer=t, timeout=60)
    arrived = []
    for k, key in enumerate(watches):
        at, got = dst.call("joined", key=key, timeout=60)
        assert got == digest(want[k * MiB : (k + 1) * MiB]), f"write {k}: immediate before its bytes"
        arrived.append(at - start)
    assert dst.call("digest", region=d_id, off=0, size=n * MiB) == digest(want)
    link_s = n * MiB * 8 / (sum(h.rates_mbit) * 1e6)  # the last byte cannot arrive sooner
    print(f"immediates arrived at {' '.join(f'{a:.2f}' for a in arrived)} s; the bytes take {link_s:.2f} s")
    assert max(arrived) > 0.8 * link_s, "the links were not as slow as set: the test shows nothing"
    assert arrived[0] < 0.4 * link_s, arrived  # write 0's bytes need 1/24 of it


def test_link_down_mid_transfer_still_delivers(hosts) -> None:
    h, src, dst = hosts
    size = 96 * MiB
    s_id, _ = src.call("alloc", size=size, seed=22)
    d_id, d_desc = dst.call("alloc", size=size)
    t = src.call("write_async", region=s_id, src_off=0, peer=src.peer, descriptor=d_desc, dst_off=0,
                 size=size, imm=2)
    time.sleep(0.4)  # both links busy: ~96 MiB needs about a second at 2 x 400 Mbit/s
    h.set_link(1, up=False)
    imm_count, seconds = src.call("wait", transfer=t, timeout=60)
    dst.call("counter_wait", imm=2, n=imm_count, timeout=30)
    assert dst.call("digest", region=d_id, off=0, size=size) == digest(random_bytes(size, 22))
    stats = src.call("stats")
    print(f"delivered in {seconds:.2f} s with NIC 1 down mid-transfer; stats {stats}")
    assert src.call("failed_paths", peer=src.peer) == [False, True]
    assert stats[1]["rerouted"] > 0


def test_2d_write_rows_spread_over_both_nics_one_immediate(hosts) -> None:
    """A 2-D write's rows go over both NICs, each completing at delivery; its single immediate follows
    on either NIC and must not be counted before every row landed.

    Three rows of 2 MiB: rows 0 and 2 share one NIC, row 1 and the immediate the other, so the immediate
    could arrive a whole row's time (about 40 ms at 400 Mbit/s) before row 2 if the rows' local
    completions only meant "sent" (they sit in socket buffers and qdisc queues here)."""
    _h, src, dst = hosts
    rows, row, src_pitch, dst_pitch = 3, 2 * MiB + 3, 2 * MiB + 4096, 2 * MiB + 11
    size = 5 + (rows - 1) * src_pitch + row
    dst_size = 7 + (rows - 1) * dst_pitch + row + 99
    s_id, _ = src.call("alloc", size=size, seed=23)
    d_id, d_desc = dst.call("alloc", size=dst_size)
    want = rows_digest(random_bytes(size, 23), 5, rows, row, src_pitch)
    for k in range(4):
        key = dst.call("rows_digest_on", imm=30 + k, n=1, region=d_id, off=7, rows=rows, row_bytes=row,
                       pitch=dst_pitch, timeout=30)
        imm_count, _seconds = src.call("write", region=s_id, src_off=5, peer=src.peer, descriptor=d_desc,
                                       dst_off=7, size=row, imm=30 + k, rows=rows, src_pitch=src_pitch,
                                       dst_pitch=dst_pitch)
        assert imm_count == 1
        assert dst.call("joined", key=key, timeout=30) == want, f"write {k}: immediate before its rows"
        assert dst.call("poisoned_outside_rows", region=d_id, off=7, rows=rows, row_bytes=row,
                        pitch=dst_pitch)
        dst.call("poison", region=d_id, off=0, size=dst_size)
    per_nic = [s["bytes"] for s in src.call("stats")]
    print(f"2-D writes of {rows} rows over 2 NICs; per-NIC bytes {per_nic}")
    assert min(per_nic) > 0.3 * sum(per_nic)
    time.sleep(0.2)
    assert dst.call("counter_total", imm=30) == 1
