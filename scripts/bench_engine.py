#!/usr/bin/env python
"""Transfer-engine benchmark: two processes over libfabric, against the bound of the machine.

Sections, all in one run so that the ratios compare like with like:

* socket copy (before and after the engine runs): a plain single-stream TCP copy over loopback into a
  preallocated buffer in a child process, the bound for anything that moves bytes between two processes
  through the kernel's TCP stack;
* write sizes 4 KiB .. 1 GiB: the source engine in this process, the destination engine in a
  ``tests.support.peer.PeerProcess``. Every timing runs from submit until the destination's counter has
  seen every immediate (landed bytes, not posted ones), and every size is checked with a digest of the
  landed bytes;
* 4 KiB latency: ping-pong, each side writing 4 KiB with an immediate that the other side's counter waits
  for; one-way is half the round trip;
* 1 NIC vs 2 NICs: two network namespaces joined by rate-limited veth pairs
  (``tests.support.netns.TwoHosts``), a striped write over one link and over two (needs root; skipped
  with the reason otherwise).

Prints a table and ends with one JSON line of every figure (``--json PATH`` writes it to a file too).
GB/s here are 10^9 bytes per second.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)  # run as a script: the test helpers (tests/support/) live at the root

from tests.support import netns  # noqa: E402
from tests.support.peer import PeerProcess, digest, random_bytes  # noqa: E402

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30
GB = 1e9
TIMEOUT = 300.0  # generous: a wait that fails must still fail, never hang the run

FULL = {
    "sizes": [4 * KiB, 64 * KiB, MiB, 16 * MiB, 256 * MiB, GiB],
    # 2 shared cores make single rounds noisy (+-30 %): several short rounds and their median, each size
    # near 1 s (1 GiB: one write a round, ~2 s).
    "round_s": 0.2,
    "rounds": 5,
    "socket_bytes": GiB,
    "socket_reps": 3,  # before the engine runs and again after: 6 in all
    "latency_samples": 2000,
    "netns_bytes": 64 * MiB,
    "netns_reps": 2,
}
QUICK = {
    "sizes": [4 * KiB, MiB, 16 * MiB],
    "round_s": 0.05,
    "rounds": 1,
    "socket_bytes": 64 * MiB,
    "socket_reps": 1,
    "latency_samples": 100,
    "netns_bytes": 8 * MiB,
    "netns_reps": 1,
}
RATE_MBIT = 400


def human(nbytes: int) -> str:
    for unit, scale in (("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if nbytes >= scale and nbytes % scale == 0:
            return f"{nbytes // scale} {unit}"
    return f"{nbytes} B"


# --- the bound: a plain TCP socket copy ---------------------------------------------------------------


def socket_sink(port: int, nbytes: int, reps: int) -> None:
    """Child side of the socket copy: receives ``reps`` x ``nbytes`` into one preallocated buffer."""
    reps += 1  # the uncounted warm-up rep, see socket_copy
    buf = np.ones(nbytes, dtype=np.uint8)  # touched now, so page faults are not part of the copy
    view = memoryview(buf)
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.sendall(b"R")
        for _ in range(reps):
            got = 0
            while got < nbytes:
                n = sock.recv_into(view[got:])
                if n == 0:
                    raise SystemExit("sender closed early")
                got += n
            sock.sendall(b"A")  # the sender stops its clock on this: bytes are in the receiver's buffer


def socket_copy(nbytes: int, reps: int) -> dict[str, Any]:
    src = np.ones(nbytes, dtype=np.uint8)
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(1)
        port = server.getsockname()[1]
        child = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--socket-sink",
                                  f"{port},{nbytes},{reps}"])
        seconds: list[float] = []
        try:
            server.settimeout(60)
            conn, _ = server.accept()
            with conn:
                conn.settimeout(TIMEOUT)
                if conn.recv(1) != b"R":
                    raise RuntimeError("socket sink did not start")
                # Rep 0 is a warm-up, as the engine's probe rounds are: in this VM the first pass over fresh
                # memory and a cold connection run up to 1.5x slower than the rest.
                for _ in range(reps + 1):
                    t0 = time.monotonic()
                    conn.sendall(memoryview(src))
                    if conn.recv(1) != b"A":
                        raise RuntimeError("socket sink did not acknowledge")
                    seconds.append(time.monotonic() - t0)
                seconds = seconds[1:]
            if child.wait(60) != 0:
                raise RuntimeError(f"socket sink exited with {child.returncode}")
        finally:
            if child.poll() is None:
                child.kill()
                child.wait(10)
    return {"bytes": nbytes, "reps": reps, "seconds": seconds,
            "gbps_each": [nbytes / x / GB for x in seconds], "gbps": nbytes / statistics.median(seconds) / GB}


# --- engine, two processes over loopback --------------------------------------------------------------


class Loopback:
    """Source engine here, destination engine in a PeerProcess, one big region on each side."""

    def __init__(self, capacity: int, cq_data_immediates: bool = False) -> None:
        from weightsync.engine import TransferEngine

        self.capacity = capacity
        # cq_data_immediates: the source's immediates ride on its writes as remote CQ data (no announces,
        # no de-duplication at the destination), to measure what exactly-once immediates cost.
        self.engine = (TransferEngine._for_tests(cq_data_immediates=True) if cq_data_immediates
                       else TransferEngine())
        self.dst = PeerProcess()
        self.dst_address = self.dst.call("engine")
        self.src_buf = random_bytes(capacity, seed=2026)
        self.src = self.engine.register(self.src_buf, name="bench-src")
        self.dst_id, self.dst_desc = self.dst.call("alloc", size=capacity)
        self.peer = self.engine.connect(self.dst_address)
        self.imm = 1000  # a fresh immediate per measurement: no credit of one can satisfy another
        # One pass over both regions before anything is timed: no measured write is the first to touch a page
        # or to use the connection.
        self.round(min(capacity, 16 * MiB), max(1, capacity // (16 * MiB)), capacity)

    def close(self) -> None:
        self.dst.close()
        self.engine.close()

    def next_imm(self) -> int:
        self.imm += 1
        return self.imm

    def round(self, size: int, count: int, span: int) -> dict[str, float]:
        """``count`` writes of ``size`` in one batch, cycling over ``[0, span)`` on both sides."""
        offs = (np.arange(count, dtype=np.uint64) * size) % span
        zeros = np.zeros(count, dtype=np.uint32)
        imm = self.next_imm()
        expected = count * self.engine.imm_count(size)
        key = self.dst.call("counter_watch", imm=imm, n=expected, timeout=TIMEOUT)
        t0 = time.monotonic()
        t = self.engine.write_batch([self.src], [(self.peer, self.dst_desc)], zeros, offs, zeros, offs,
                                    np.full(count, size, dtype=np.uint64), imm=imm)
        t.wait(TIMEOUT)
        posted = time.monotonic() - t0
        landed = self.dst.call("joined", key=key, timeout=TIMEOUT) - t0
        return {"landed_s": landed, "src_complete_s": posted}

    def verify(self, nbytes: int) -> None:
        """Everything written so far in ``[0, nbytes)`` must equal the source, byte for byte."""
        with ThreadPoolExecutor(1) as pool:  # hashing releases the GIL: both sides hash at once (1 GiB: ~1 s)
            mine = pool.submit(digest, self.src_buf[:nbytes])
            got = self.dst.call("digest", region=self.dst_id, off=0, size=nbytes)
        if got != mine.result():
            raise SystemExit(f"destination bytes differ from the source in [0, {nbytes}): not a valid run")

    def size_run(self, size: int, round_s: float, rounds: int) -> dict[str, Any]:
        # Small writes cycle over 64 MiB, more than the CPU caches hold, so that no size is flattered by
        # cache-resident buffers; larger writes each cover their own size.
        span = min(self.capacity, max(size, 64 * MiB))
        # Earlier sizes wrote the same bytes here: poison first, or the digest could not tell whether this
        # size's writes landed.
        self.dst.call("poison", region=self.dst_id, off=0, size=span)
        # Calibrate on a short round, which also brings the poisoned pages back into use.
        count0 = max(1, 16 * MiB // size)
        probe = self.round(size, count0, span) if size <= 64 * MiB else None
        count = 1 if probe is None else max(1, round(count0 * round_s / probe["landed_s"]))
        results = [self.round(size, count, span) for _ in range(rounds)]
        self.verify(min(span, max(count0, count) * size))
        landed = statistics.median(r["landed_s"] for r in results)
        posted = statistics.median(r["src_complete_s"] for r in results)
        return {
            "size": size,
            "writes_per_round": count,
            "rounds": rounds,
            "imm_per_write": self.engine.imm_count(size),
            "landed_s": landed,
            "gbps": count * size / landed / GB,
            "writes_per_s": count / landed,
            "src_complete_gbps": count * size / posted / GB,
            "gbps_rounds": [count * size / r["landed_s"] / GB for r in results],  # spread behind the median
            "verified": True,
        }

    def latency(self, samples: int, size: int = 4 * KiB) -> dict[str, Any]:
        """Ping-pong: this side writes ``size`` with an immediate; the peer's thread waits for it on its
        counter and writes ``size`` back with another immediate, which this side's counter waits for."""
        back = np.zeros(size, dtype=np.uint8)
        back_region = self.engine.register(back, name="bench-pong")
        pong_src, _ = self.dst.call("alloc", size=size, seed=7)
        to_me = self.dst.call("connect", address=self.engine.address)
        self.dst.call("poison", region=self.dst_id, off=0, size=size)
        ping, pong = self.next_imm(), self.next_imm()
        warmup = 20  # the first exchanges set up the connection back to this engine
        key = self.dst.call("pong", region=pong_src, peer=to_me, descriptor=back_region.descriptor,
                            size=size, n=samples + warmup, imm_in=ping, imm_out=pong, timeout=TIMEOUT)
        counter = self.engine.counter(pong)
        rtt, posted = [], []
        for i in range(samples + warmup):
            t0 = time.monotonic()
            t = self.engine.write(self.src, 0, self.peer, self.dst_desc, 0, size, imm=ping)
            t.wait(TIMEOUT)  # completion seen by the source: the one-way figure a sender can observe
            t1 = time.monotonic()
            counter.wait(1, TIMEOUT)
            t2 = time.monotonic()
            if i >= warmup:
                rtt.append(t2 - t0)
                posted.append(t1 - t0)
        self.dst.call("joined", key=key, timeout=TIMEOUT)
        if not np.array_equal(back, random_bytes(size, seed=7)):
            raise SystemExit("pong bytes differ from the peer's source: not a valid run")
        self.verify(size)
        rtt_us = sorted(x * 1e6 for x in rtt)
        return {
            "size": size,
            "samples": samples,
            "rtt_us_median": statistics.median(rtt_us),
            "rtt_us_p99": rtt_us[min(len(rtt_us) - 1, int(0.99 * len(rtt_us)))],
            "one_way_us": statistics.median(rtt_us) / 2,
            "src_complete_us_median": statistics.median(posted) * 1e6,
        }


# --- 1 NIC vs 2 NICs in network namespaces ------------------------------------------------------------


class StripedPair:
    """A source engine in namespace ``a`` and a destination engine in ``b``, both opened on ``nics``."""

    def __init__(self, hosts: netns.TwoHosts, nics: list[str], size: int) -> None:
        self.nics, self.size = nics, size
        self.src, self.dst = PeerProcess(netns=hosts.a), PeerProcess(netns=hosts.b)
        self.imm = 1

    def setup(self) -> None:
        self.src.call("engine", nics=self.nics)
        self.peer = self.src.call("connect", address=self.dst.call("engine", nics=self.nics))
        self.s_id, _ = self.src.call("alloc", size=self.size, seed=self.size)
        self.d_id, self.d_desc = self.dst.call("alloc", size=self.size)
        self.write(2 * MiB)  # warm-up: a striped write, so it opens the connection on every NIC

    def write(self, nbytes: int) -> tuple[float, float]:
        """Seconds from submit until the destination's counter has every immediate; and until the source
        saw the write complete."""
        self.imm += 1
        n = self.src.call("imm_count", nbytes=nbytes)
        key = self.dst.call("counter_watch", imm=self.imm, n=n, timeout=TIMEOUT)
        t0 = time.monotonic()
        _, posted = self.src.call("write", region=self.s_id, src_off=0, peer=self.peer,
                                  descriptor=self.d_desc, dst_off=0, size=nbytes, imm=self.imm,
                                  timeout=TIMEOUT)
        return self.dst.call("joined", key=key, timeout=TIMEOUT) - t0, posted

    def measure(self, reps: int) -> dict[str, Any]:
        before = [s["bytes"] for s in self.src.call("stats")]
        runs = [self.write(self.size) for _ in range(reps)]
        per_nic = [s["bytes"] - b for s, b in zip(self.src.call("stats"), before, strict=True)]
        expected = digest(random_bytes(self.size, seed=self.size))
        if self.dst.call("digest", region=self.d_id, off=0, size=self.size) != expected:
            raise SystemExit(f"striped write over {self.nics}: destination bytes differ: not a valid run")
        landed = statistics.median(r[0] for r in runs)
        return {
            "nics": self.nics,
            "bytes": self.size,
            "reps": reps,
            "landed_s": landed,
            "gbps": self.size / landed / GB,
            "src_complete_gbps": self.size / statistics.median(r[1] for r in runs) / GB,
            "gbps_reps": [self.size / r[0] / GB for r in runs],
            "per_nic_bytes": per_nic,
            "link_bound_gbps": RATE_MBIT * 1e6 / 8 * len(self.nics) / GB,
            "verified": True,
        }


def nic_scaling(size: int, reps: int) -> dict[str, Any]:
    why_not = netns.available()
    if why_not:
        print(f"1 NIC vs 2 NICs: skipped ({why_not})")
        return {"skipped": why_not}
    with netns.TwoHosts(nics=2, rate_mbit=RATE_MBIT) as hosts:  # removes the namespaces on any exit
        pairs: list[StripedPair] = []
        try:
            for nics in (hosts.nic_names[:1], hosts.nic_names):
                pairs.append(StripedPair(hosts, nics, size))
            # Both pairs start at once: four interpreters importing torch cost seconds each on 2 cores, and
            # an idle pair takes no CPU from the one being measured (its engine threads sleep in the CQ).
            with ThreadPoolExecutor(len(pairs)) as pool:
                list(pool.map(StripedPair.setup, pairs))
            one, two = (pair.measure(reps) for pair in pairs)
        finally:
            # Concurrently too: each interpreter takes about a second to exit once torch is loaded.
            with ThreadPoolExecutor(4) as pool:
                list(pool.map(PeerProcess.close, [proc for pair in pairs for proc in (pair.src, pair.dst)]))
    return {"rate_mbit": RATE_MBIT, "one_nic": one, "two_nics": two, "ratio": two["gbps"] / one["gbps"],
            "goal_ratio": 1.8}


# --- report -------------------------------------------------------------------------------------------


def machine() -> dict[str, Any]:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    except OSError:
        pass
    try:
        fabric = subprocess.run(["fi_info", "--version"], capture_output=True, text=True, timeout=10).stdout
        versions = [ln.split(":", 1)[1].strip() for ln in fabric.splitlines() if ln.startswith("libfabric:")]
        libfabric = versions[0] if versions else "unknown"
    except (OSError, subprocess.SubprocessError):
        libfabric = "unknown"
    # The load average at the start tells a reader whether other work shared the CPUs with this run.
    return {"cpus": os.cpu_count(), "cpu": cpu, "kernel": platform.release(), "libfabric": libfabric,
            "python": platform.python_version(), "loadavg_1m_before": os.getloadavg()[0]}


def engine_build() -> dict[str, Any]:
    """Which engine build this run measured: others may rebuild the shared tree's engine at any time."""
    from weightsync._ext import _core

    with open(_core.__file__, "rb") as f:
        sha = hashlib.sha256(f.read()).hexdigest()[:12]
    built = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(os.path.getmtime(_core.__file__)))

    def git(*args: str) -> str:
        try:
            return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=10).stdout
        except (OSError, subprocess.SubprocessError):
            return ""

    return {"ext_sha256": sha, "ext_built": built, "commit": git("rev-parse", "--short", "HEAD").strip(),
            "cpp_uncommitted_changes": bool(git("status", "--porcelain", "--", "cpp").strip())}


def timed(label: str, fn: Callable[[], Any]) -> Any:
    t0 = time.monotonic()
    out = fn()
    print(f"  [{label}: {time.monotonic() - t0:.1f} s]", file=sys.stderr)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer sizes and repetitions (smoke test)")
    ap.add_argument("--json", metavar="PATH", help="also write the figures to this file")
    ap.add_argument("--socket-sink", help=argparse.SUPPRESS)  # internal: the socket copy's child
    ap.add_argument("--cq-data-immediates", action="store_true",
                    help="the source engine sends immediates as remote CQ data of its writes instead of "
                         "announces (the engine before exactly-once immediates), for comparison")
    ap.add_argument("--transport", choices=["fabric", "cuda"], default="fabric",
                    help="cuda: the copy-engine lane between Ray GPU actors (scripts/bench_cuda.py)")
    args, rest = ap.parse_known_args(argv)
    if args.transport == "cuda":
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        import bench_cuda

        sys.argv = [sys.argv[0], *rest] + (["--json", args.json] if args.json else [])
        bench_cuda.main()
        return 0
    if rest:
        ap.error(f"unrecognized arguments: {' '.join(rest)}")
    if args.socket_sink:
        port, nbytes, reps = (int(x) for x in args.socket_sink.split(","))
        socket_sink(port, nbytes, reps)
        return 0

    cfg = QUICK if args.quick else FULL
    started = time.monotonic()
    result: dict[str, Any] = {
        "bench": "engine",
        "quick": args.quick,
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "machine": machine(),
        "engine_build": engine_build(),
        "immediates": "cq_data" if args.cq_data_immediates else "announce",
    }

    # The bound is measured before and after the engine sections: on a shared 2-core VM the load drifts, and
    # the median of both halves is fairer to the engine than either half alone.
    before = timed("socket copy", lambda: socket_copy(cfg["socket_bytes"], cfg["socket_reps"]))

    loop = Loopback(max(cfg["sizes"] + [64 * MiB]), cq_data_immediates=args.cq_data_immediates)
    try:
        result["provider"] = loop.engine.provider
        result["sizes"] = [timed(human(s), lambda s=s: loop.size_run(s, cfg["round_s"], cfg["rounds"]))
                           for s in cfg["sizes"]]
        result["latency_4k"] = timed("latency", lambda: loop.latency(cfg["latency_samples"]))
    finally:
        loop.close()
    after = timed("socket copy", lambda: socket_copy(cfg["socket_bytes"], cfg["socket_reps"]))
    each = before["gbps_each"] + after["gbps_each"]
    sock = result["socket_copy"] = {
        "bytes": before["bytes"],
        "reps": len(each),
        "gbps_each": each,
        "gbps_before": before["gbps"],
        "gbps_after": after["gbps"],
        "gbps": statistics.median(each),
    }
    for row in result["sizes"]:
        row["vs_socket"] = row["gbps"] / sock["gbps"]

    result["netns"] = timed("netns", lambda: nic_scaling(cfg["netns_bytes"], cfg["netns_reps"]))
    result["wall_s"] = time.monotonic() - started
    result["machine"]["loadavg_1m_after"] = os.getloadavg()[0]  # includes this run's own 2-3 busy threads

    report(result)
    line = json.dumps(result, sort_keys=True)
    if args.json:
        with open(args.json, "w") as f:
            f.write(line + "\n")
    print(line)
    return 0


def report(r: dict[str, Any]) -> None:
    m, sock = r["machine"], r["socket_copy"]
    print(f"\nweightsync engine benchmark  {r['date']}  {m['cpus']} CPUs ({m['cpu']}), "
          f"libfabric {m['libfabric']}, {r['provider']} over loopback")
    print(f"bound: TCP socket copy, one stream, {human(sock['bytes'])} x {sock['reps']}: median "
          f"{sock['gbps']:.2f} GB/s (before the engine runs {sock['gbps_before']:.2f}, after "
          f"{sock['gbps_after']:.2f})\n")
    print(f"{'size':>8} {'writes/round':>12} {'rounds':>6} {'landed s':>9} {'GB/s':>7} {'min-max':>11} "
          f"{'writes/s':>10} {'vs socket':>9} {'src-complete GB/s':>17}")
    for row in r["sizes"]:
        print(f"{human(row['size']):>8} {row['writes_per_round']:>12} {row['rounds']:>6} "
              f"{row['landed_s']:>9.3f} {row['gbps']:>7.3f} "
              f"{min(row['gbps_rounds']):>5.2f}-{max(row['gbps_rounds']):<5.2f} {row['writes_per_s']:>10.0f} "
              f"{row['vs_socket']:>9.2f} {row['src_complete_gbps']:>17.3f}")
    lat = r["latency_4k"]
    print(f"\n4 KiB + counter, ping-pong over {lat['samples']} samples: round trip median "
          f"{lat['rtt_us_median']:.0f} us (p99 {lat['rtt_us_p99']:.0f} us), "
          f"one-way {lat['one_way_us']:.0f} us; source-side completion of a lone write "
          f"{lat['src_complete_us_median']:.0f} us")
    ns = r["netns"]
    if "skipped" not in ns:
        print(f"\nstriped {human(ns['one_nic']['bytes'])} write, veth links at {ns['rate_mbit']} Mbit/s "
              "each (MB/s = 10^6 B/s):")
        for key in ("one_nic", "two_nics"):
            row = ns[key]
            bound = row["link_bound_gbps"]
            print(f"  {len(row['nics'])} NIC(s): {row['gbps'] * 1000:.1f} MB/s = "
                  f"{row['gbps'] / bound:.2f} x link bound {bound * 1000:.0f} MB/s; "
                  f"source-side completion {row['src_complete_gbps'] * 1000:.1f} MB/s; "
                  f"per-NIC bytes {row['per_nic_bytes']}")
        print(f"  2 NICs / 1 NIC = {ns['ratio']:.2f} (goal >= {ns['goal_ratio']})")
    print(f"\nwall {r['wall_s']:.1f} s; load average (1 min) before {m['loadavg_1m_before']:.2f}, "
          f"after {m['loadavg_1m_after']:.2f}")


if __name__ == "__main__":
    sys.exit(main())
