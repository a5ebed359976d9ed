"""Two NICs: two namespaces joined by two rate-limited veth pairs, one engine process in each."""

from __future__ import annotations

import time

import pytest

from tests import netns
from tests.peer import PeerProcess, digest, random_bytes

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
