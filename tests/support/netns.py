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
from dataclasses import dataclass, field


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


def available() -> str | None:
    """None when namespaces can be made here, else why not."""
    if os.geteuid() != 0:
        return "needs root for network namespaces"
    if shutil.which("ip") is None or shutil.which("tc") is None:
        return "needs iproute2 (ip, tc)"
    return None


@dataclass
class TwoHosts:
    """Namespaces ``a`` and ``b``; NIC i is ``ws{i}`` on both sides, 198.18.i.1 (a) and 198.18.i.2 (b)."""

    nics: int = 2
    rate_mbit: int = 400
    a: str = field(default_factory=lambda: f"wsA{os.getpid()}")
    b: str = field(default_factory=lambda: f"wsB{os.getpid()}")

    @property
    def nic_names(self) -> list[str]:
        return [f"ws{i}" for i in range(self.nics)]

    def create(self) -> TwoHosts:
        try:
            for ns in (self.a, self.b):
                _ip("netns", "add", ns)
                _ip("-n", ns, "link", "set", "lo", "up")
            for i, nic in enumerate(self.nic_names):
                _ip("link", "add", nic, "netns", self.a, "type", "veth", "peer", "name", nic, "netns", self.b)
                for ns, host in ((self.a, 1), (self.b, 2)):
                    _ip("-n", ns, "addr", "add", f"198.18.{i}.{host}/24", "dev", nic)
                    _ip("-n", ns, "link", "set", nic, "up")
                    subprocess.run(
                        ["tc", "-n", ns, "qdisc", "add", "dev", nic, "root", "tbf", "rate",
                         f"{self.rate_mbit}mbit", "burst", "256kb", "latency", "200ms"],
                        check=True, capture_output=True, text=True,
                    )
            self._wait_up()
        except BaseException:
            self.remove()
            raise
        return self

    def _wait_up(self, timeout: float = 10.0) -> None:
        """Waits for every veth end to have its carrier: libfabric lists only running interfaces, and a
        veth pair reports ``state UP`` a moment after both ends were set up (an engine started in that
        moment found no NIC ``ws0``)."""
        deadline = time.monotonic() + timeout
        for ns in (self.a, self.b):
            for nic in self.nic_names:
                while True:
                    out = subprocess.run(["ip", "-n", ns, "-o", "link", "show", "dev", nic],
                                         capture_output=True, text=True).stdout
                    if "state UP" in out and "LOWER_UP" in out:
                        break
                    if time.monotonic() > deadline:
                        raise RuntimeError(f"{nic} in namespace {ns} not up after {timeout} s: {out.strip()}")
                    time.sleep(0.02)

    def set_link(self, nic: int, up: bool) -> None:
        _ip("-n", self.a, "link", "set", self.nic_names[nic], "up" if up else "down")

    def remove(self) -> None:
        for ns in (self.a, self.b):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)

    def __enter__(self) -> TwoHosts:
        return self.create()

    def __exit__(self, *exc: object) -> None:
        self.remove()
