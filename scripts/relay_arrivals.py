#!/usr/bin/env python
"""A relay chain at the engine level, without Ray or the runtime (docs/BENCHMARKS.md, "Relay over the
emulated hosts"): when each chunk reaches the chain's head and when its tail. Hosts of a
``tests.support.netns.Cluster`` (``--nics`` NICs of ``--rate-mbit`` each, ``--queue-ms`` of tbf queue):
``--sources`` of them write ``--mib`` MiB in chunks of ``--chunk-mib`` into the head, taking turns, each
chunk with an immediate of its own; the head forwards every chunk to the tail as soon as its immediate
arrives (``TransferEngine.forward``), as a relay member does. Printed per run: when the sources' writes
completed (the head holds every byte), when the head and the tail had 1, n/8, n/4, n/2, 3n/4 and n
chunks, and how long each chunk took from the head's immediate to the tail's. The store-and-forward
model (``simulate_relay``) has the head receive at an even rate and each hop take one chunk's time.
Needs root (namespaces) and iproute2; the namespaces are removed at exit.

    sudo .venv/bin/python scripts/relay_arrivals.py --chunk-mib 0.25
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
    ap.add_argument("--queue-ms", type=int, default=200, help="tbf queue per NIC, ms of its rate")
    ap.add_argument("--port-queue", choices=("priority", "fifo"), default="priority",
                    help="how a shaped port queues (netns.Cluster.port_queue): small first, or one FIFO")
    ap.add_argument("--mib", type=int, default=16, help="MiB the sources push into the head")
    ap.add_argument("--chunk-mib", type=float, default=1.0, help="bytes per chunk (one write each), MiB")
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--sources", type=int, default=2, help="hosts writing into the head")
    ap.add_argument("--source-rate-mbit", type=int, default=None,
                    help="the sources' NICs' rate (default --rate-mbit): below the head's share, its ingress "
                         "queue stays empty")
    a = ap.parse_args(argv)
    why_not = netns.available()
    if why_not:
        print(f"cannot run: {why_not}")
        return 2
    size, chunk = a.mib * MiB, int(a.chunk_mib * MiB)
    n = size // chunk
    if n < 1 or n * chunk != size:
        print("--mib must be a whole number of chunks")
        return 2
    ok = True
    src_rate = a.source_rate_mbit or a.rate_mbit
    rates = [[src_rate] * a.nics] * a.sources + [[a.rate_mbit] * a.nics] * 2
    with netns.Cluster(hosts=a.sources + 2, nics=a.nics, rates_mbit=rates, latency_ms=a.queue_ms,
                       port_queue=a.port_queue, mgmt=False, prefix="wr") as c:
        procs = [PeerProcess(netns=ns) for ns in c.names]
        try:
            addresses = [p.call("engine", nics=c.nic_names, stall_timeout=5.0) for p in procs]
            sources, head, tail = procs[:-2], procs[-2], procs[-1]
            src_regions = [s.call("alloc", size=size, seed=5)[0] for s in sources]
            h_id, h_desc = head.call("alloc", size=size)
            t_id, t_desc = tail.call("alloc", size=size)
            to_head = [s.call("connect", address=addresses[-2]) for s in sources]
            to_tail = head.call("connect", address=addresses[-1])
            for run in range(a.runs):
                base = 10000 * (run + 1)
                # Every connection (data and control) is up before the clock starts.
                for s, r, p in zip(sources, src_regions, to_head, strict=True):
                    t = s.call("write_async", region=r, src_off=0, peer=p, descriptor=h_desc, dst_off=0,
                               size=chunk, imm=base + 9000)
                    s.call("wait", transfer=t, timeout=60)
                head.call("counter_wait", imm=base + 9000, n=len(sources), timeout=60)
                warm = head.call("write_async", region=h_id, src_off=0, peer=to_tail, descriptor=t_desc,
                                 dst_off=0, size=chunk, imm=base + 9001)
                head.call("wait", transfer=warm, timeout=60)
                tail.call("counter_wait", imm=base + 9001, n=1, timeout=60)
                head.call("poison", region=h_id, off=0, size=size)
                tail.call("poison", region=t_id, off=0, size=size)
                at_head_keys, at_tail_keys = [], []
                for k in range(n):
                    head.call("forward", on_imm=base + k, count=1, region=h_id, src_off=k * chunk,
                              peer=to_tail, descriptor=t_desc, dst_off=k * chunk, size=chunk,
                              imm=base + 5000 + k)
                    # A forward fires on the counter's total: this waiter consumes nothing it needs.
                    at_head_keys.append(head.call("counter_watch", imm=base + k, n=1, timeout=60))
                    at_tail_keys.append(tail.call("counter_watch", imm=base + 5000 + k, n=1, timeout=60))
                start = time.monotonic()
                writes = []
                for k in range(n):
                    i = k % len(sources)
                    writes.append((sources[i], sources[i].call(
                        "write_async", region=src_regions[i], src_off=k * chunk, peer=to_head[i],
                        descriptor=h_desc, dst_off=k * chunk, size=chunk, imm=base + k)))
                for s, t in writes:
                    s.call("wait", transfer=t, timeout=60)
                sources_done = time.monotonic() - start
                at_head = [head.call("joined", key=key, timeout=60) - start for key in at_head_keys]
                at_tail = [tail.call("joined", key=key, timeout=60) - start for key in at_tail_keys]
                right = tail.call("digest", region=t_id, off=0, size=size) == digest(random_bytes(size, 5))
                ok = ok and right
                marks = sorted({0, n // 8, n // 4, n // 2, 3 * n // 4, n - 1})
                head_sorted, tail_sorted = sorted(at_head), sorted(at_tail)
                lag = sorted(t - h for h, t in zip(at_head, at_tail, strict=True))
                print(f"run {run}: {n} chunks of {chunk} B; sources' writes done {sources_done:.3f} s, "
                      f"tail has all {tail_sorted[-1]:.3f} s; bytes {'ok' if right else 'WRONG'}")
                print("  head has chunks:", " ".join(f"{i + 1}@{head_sorted[i]:.3f}" for i in marks))
                print("  tail has chunks:", " ".join(f"{i + 1}@{tail_sorted[i]:.3f}" for i in marks))
                print(f"  head->tail per chunk: min {lag[0]:.3f} median {lag[n // 2]:.3f} "
                      f"max {lag[-1]:.3f} s")
        finally:
            for p in procs:
                p.kill()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
