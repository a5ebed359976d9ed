"""Two test hosts in network namespaces, joined by rate-limited veth pairs: "NICs" for the engine.

Only the project's own namespaces are touched: names carry this process's id, and ``remove`` deletes
exactly what ``create`` made. Addresses come from 198.18.0.0/15, the range set aside for benchmarking
network devices (RFC 2544); they exist only inside these namespaces.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from dataclasses import dataclass


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True, timeout=30)


def available() -> str | None:
    """None when namespaces can be made here, else why not."""
    if os.geteuid() != 0:
        return "needs root for network namespaces"
    if shutil.which("ip") is None or shutil.which("tc") is None:
        return "needs iproute2 (ip, tc)"
    return None


_serial = [0]  # several host pairs in one process get names of their own


@dataclass
class TwoHosts:
    """Namespaces ``a`` and ``b``; NIC i is ``{prefix}{i}`` on both sides, 198.18.i.1 (a) and 198.18.i.2
    (b), limited by ``tbf`` to ``rates_mbit[i]`` (default: ``nics`` links of ``rate_mbit``) on both ends."""

    nics: int = 2
    rate_mbit: int = 400
    rates_mbit: list[int] | None = None
    prefix: str = "ws"
    latency_ms: int = 200  # how much traffic tbf queues before it drops
    a: str = ""
    b: str = ""

    def __post_init__(self) -> None:
        if self.rates_mbit is None:
            self.rates_mbit = [self.rate_mbit] * self.nics
        self.nics = len(self.rates_mbit)
        _serial[0] += 1
        tag = f"{os.getpid()}x{_serial[0]}"
        self.a = self.a or f"{self.prefix}A{tag}"
        self.b = self.b or f"{self.prefix}B{tag}"

    @property
    def nic_names(self) -> list[str]:
        return [f"{self.prefix}{i}" for i in range(self.nics)]

    def create(self) -> TwoHosts:
        assert self.rates_mbit is not None
        try:
            for ns in (self.a, self.b):
                _ip("netns", "add", ns)
                _ip("-n", ns, "link", "set", "lo", "up")
            for i, (nic, rate) in enumerate(zip(self.nic_names, self.rates_mbit, strict=True)):
                _ip("link", "add", nic, "netns", self.a, "type", "veth", "peer", "name", nic, "netns", self.b)
                for ns, host in ((self.a, 1), (self.b, 2)):
                    _ip("-n", ns, "addr", "add", f"198.18.{i}.{host}/24", "dev", nic)
                    _ip("-n", ns, "link", "set", nic, "up")
                    subprocess.run(
                        ["tc", "-n", ns, "qdisc", "add", "dev", nic, "root", "tbf", "rate",
                         f"{rate}mbit", "burst", "256kb", "latency", f"{self.latency_ms}ms"],
                        check=True, capture_output=True, text=True, timeout=30,
                    )
            self.wait_up()
        except BaseException:
            self.remove()
            raise
        return self

    def wait_up(self, nic: int | None = None, timeout: float = 15.0) -> None:
        """Waits for the veth ends of ``nic`` (default: all) to have their carrier: libfabric lists only
        running interfaces, and a veth pair reports ``state UP`` a moment after both ends were set up
        (an engine started in that moment found no NIC ``ws0``)."""
        deadline = time.monotonic() + timeout
        names = self.nic_names if nic is None else [self.nic_names[nic]]
        for ns in (self.a, self.b):
            for name in names:
                while True:
                    out = subprocess.run(["ip", "-n", ns, "-o", "link", "show", "dev", name],
                                         capture_output=True, text=True, timeout=10).stdout
                    if "state UP" in out and "LOWER_UP" in out:
                        break
                    if time.monotonic() > deadline:
                        raise RuntimeError(f"{name} in namespace {ns} not up after {timeout} s: "
                                           f"{out.strip()}")
                    time.sleep(0.02)

    def set_link(self, nic: int, up: bool) -> None:
        _ip("-n", self.a, "link", "set", self.nic_names[nic], "up" if up else "down")
        if up:
            self.wait_up(nic)

    def remove(self) -> None:
        for ns in (self.a, self.b):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)

    def __enter__(self) -> TwoHosts:
        return self.create()

    def __exit__(self, *exc: object) -> None:
        self.remove()
