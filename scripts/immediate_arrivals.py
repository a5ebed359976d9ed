#!/usr/bin/env python
"""When each write's immediate arrives, against when its bytes could have (docs/BENCHMARKS.md, "Relay over
the emulated hosts"): two engines in two network namespaces joined by ``--nics`` veth NICs limited to
``--rate-mbit`` each; after a warm-up write, ``--writes`` writes of ``--mib`` MiB are submitted together,
each with an immediate of its own, and the destination notes when each immediate arrives. Printed beside
the time each write's last byte could arrive at the links' rate. Needs root (namespaces) and iproute2;
the namespaces are removed at exit.

    sudo .venv/bin/python scripts/immediate_arrivals.py --nics 2 --rate-mbit 100 --writes 16 --mib 1
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.support import netns
from tests.support.peer import PeerProcess, digest, random_bytes

MiB = 1 << 20


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nics", type=int, default=2)
    ap.add_argument("--rate-mbit", type=int, default=100)
    ap.add_argument("--writes", type=int, default=16)
    ap.add_argument("--mib", type=int, default=1, help="MiB per write")
    ap.add_argument("--window-mib", type=int, default=None, help="the sender engine's window_bytes")
    a = ap.parse_args(argv)
    why_not = netns.available()
    if why_not:
        print(f"cannot run: {why_not}")
        return 2
    size = a.writes * a.mib * MiB
    with netns.TwoHosts(nics=a.nics, rate_mbit=a.rate_mbit) as h:
        src, dst = PeerProcess(netns=h.a), PeerProcess(netns=h.b)
        try:
            extra = {} if a.window_mib is None else {"window_bytes": a.window_mib * MiB}
            src.call("engine", nics=h.nic_names, stall_timeout=5.0, **extra)
            address = dst.call("engine", nics=h.nic_names, stall_timeout=5.0)
            peer = src.call("connect", address=address)
            s_id, _ = src.call("alloc", size=size, seed=3)
            d_id, d_desc = dst.call("alloc", size=size)
            warm = src.call("write_async", region=s_id, src_off=0, peer=peer, descriptor=d_desc, dst_off=0,
                            size=min(size, 8 * MiB), imm=99)
            src.call("wait", transfer=warm, timeout=120)
            step = a.mib * MiB
            start = time.monotonic()
            transfers = [src.call("write_async", region=s_id, src_off=k * step, peer=peer, descriptor=d_desc,
                                  dst_off=k * step, size=step, imm=100 + k) for k in range(a.writes)]
            arrived = []
            for k in range(a.writes):
                dst.call("counter_wait", imm=100 + k, n=1, timeout=120)
                arrived.append(time.monotonic() - start)
            for t in transfers:
                src.call("wait", transfer=t, timeout=120)
            ok = dst.call("digest", region=d_id, off=0, size=size) == digest(random_bytes(size, 3))
        finally:
            src.kill()
            dst.kill()
    rate = a.nics * a.rate_mbit * 1e6 / 8
    print("immediate arrived (s):  ", " ".join(f"{x:.2f}" for x in arrived))
    print("last byte at link rate: ", " ".join(f"{(k + 1) * step / rate:.2f}" for k in range(a.writes)))
    print(f"bytes checked: {'ok' if ok else 'WRONG'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
