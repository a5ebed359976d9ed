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


def _tc(*args: str) -> None:
    subprocess.run(["tc", *args], check=True, capture_output=True, text=True, timeout=30)


def _sysctl(ns: str, *settings: str) -> None:
    subprocess.run(["ip", "netns", "exec", ns, "sysctl", "-q", "-w", *settings], check=True,
                   capture_output=True, text=True, timeout=30)


@dataclass
class Cluster:
    """``hosts`` namespaces joined through one switch namespace: a many-host, many-NIC cluster.

    Host h has ``nics`` data NICs ``{prefix}0 .. {prefix}{nics-1}``, veth pairs whose other ends are ports
    of one bridge (the fabric) in the switch namespace; NIC k of host h is 198.18.{h+1}.{k+1}/16. Every
    NIC is limited by ``tbf`` to its rate (``rates_mbit[h][k]``, default ``rate_mbit``) in both
    directions: on the host's end (what the host sends) and on the switch's end (what it receives).
    ``delay_ms`` adds that one-way delay (netem, under the rate limit) on the host's end.

    ``port_queue``: how a shaped port queues. ``"fifo"``: tbf's one FIFO of ``latency_ms`` (every packet,
    a TCP ACK too, waits behind up to ``latency_ms`` of other flows' data). ``"priority"`` (default): an
    HTB limit of the same rate with two classes: IP packets under 256 bytes (pure TCP ACKs, the
    engine's announces and delivery-complete acknowledgements) and ARP go strictly first, everything
    else waits in a ``latency_ms`` byte FIFO. A real fabric's reverse traffic does not sit behind
    megabytes of data (switch buffers hold microseconds at line rate; RDMA ACKs come from the NIC, and
    RoCE fabrics give ACK/CNP traffic a class of its own); this kernel has no per-flow qdisc (sfq,
    fq_codel, fq are not built), so the small packets get the class.

    All NICs of a host are in one subnet, so each gets a routing table of its own, chosen by source
    address (``ip rule from``), and ARP answers only on the NIC that holds the address: a socket bound
    to a NIC's address (libfabric's tcp provider binds its endpoints to the NIC it was opened on) leaves
    and is answered through that NIC, not through whichever NIC the main table lists first.

    ``mgmt``: every host also gets ``mgmt`` (198.19.0.{h+1}/24, unlimited) on a second bridge: the
    control network (Ray) as a cluster's Ethernet beside its RDMA fabric. Addresses come from
    198.18.0.0/15 (RFC 2544) and exist only inside these namespaces."""

    hosts: int = 2
    nics: int = 2
    rate_mbit: int = 100
    rates_mbit: list[list[int]] | None = None
    delay_ms: float = 0.0
    latency_ms: int = 200  # how much traffic tbf queues before it drops
    burst_kb: int = 32
    port_queue: str = "priority"  # "fifo": tbf's single queue; "priority": small packets first (HTB)
    mgmt: bool = True
    prefix: str = "wn"
    names: list[str] | None = None
    switch: str = ""

    def __post_init__(self) -> None:
        if self.rates_mbit is None:
            self.rates_mbit = [[self.rate_mbit] * self.nics for _ in range(self.hosts)]
        if len(self.rates_mbit) != self.hosts or any(len(r) != self.nics for r in self.rates_mbit):
            raise ValueError(f"rates_mbit must be {self.hosts} lists of {self.nics} rates")
        _serial[0] += 1
        tag = f"{os.getpid()}x{_serial[0]}"
        self.names = self.names or [f"{self.prefix}H{h}x{tag}" for h in range(self.hosts)]
        self.switch = self.switch or f"{self.prefix}S{tag}"
        self._made: list[str] = []

    @property
    def nic_names(self) -> list[str]:
        return [f"{self.prefix}{k}" for k in range(self.nics)]

    def address(self, host: int, nic: int) -> str:
        return f"198.18.{host + 1}.{nic + 1}"

    def mgmt_address(self, host: int) -> str:
        return f"198.19.0.{host + 1}"

    def _limit(self, ns: str, dev: str, rate: int, delay_ms: float) -> None:
        if self.port_queue not in ("fifo", "priority"):
            raise ValueError(f"port_queue {self.port_queue!r}: 'fifo' or 'priority'")
        parent = ["root"]
        if delay_ms > 0:
            _tc("-n", ns, "qdisc", "add", "dev", dev, "root", "handle", "1:", "netem", "delay",
                f"{delay_ms}ms", "limit", "100000")
            parent = ["parent", "1:1"]
        if self.port_queue == "fifo":
            _tc("-n", ns, "qdisc", "add", "dev", dev, *parent, "handle", "10:", "tbf", "rate", f"{rate}mbit",
                "burst", f"{self.burst_kb}kb", "latency", f"{self.latency_ms}ms")
            return
        # One HTB class at the port's rate, two leaves: 10:1 (small packets) is assured the whole rate
        # and so always sent first; 10:2 (bulk) is assured almost nothing and borrows what 10:1 leaves.
        # The bulk FIFO holds what tbf's latency_ms held (rate x latency + burst), so the data's own
        # queueing, drops and TCP behaviour stay as with "fifo".
        burst = ["burst", f"{self.burst_kb}kb", "cburst", f"{self.burst_kb}kb"]
        limit = rate * 125 * self.latency_ms + self.burst_kb * 1024  # bytes: Mbit/s x ms = 125 bytes
        _tc("-n", ns, "qdisc", "add", "dev", dev, *parent, "handle", "10:", "htb", "default", "2")
        _tc("-n", ns, "class", "add", "dev", dev, "parent", "10:", "classid", "10:10", "htb",
            "rate", f"{rate}mbit", "ceil", f"{rate}mbit", *burst)
        _tc("-n", ns, "class", "add", "dev", dev, "parent", "10:10", "classid", "10:1", "htb",
            "rate", f"{rate}mbit", "ceil", f"{rate}mbit", "prio", "0", *burst)
        _tc("-n", ns, "class", "add", "dev", dev, "parent", "10:10", "classid", "10:2", "htb",
            "rate", "8kbit", "ceil", f"{rate}mbit", "prio", "1", *burst)
        _tc("-n", ns, "qdisc", "add", "dev", dev, "parent", "10:1", "handle", "11:", "pfifo",
            "limit", "10000")
        _tc("-n", ns, "qdisc", "add", "dev", dev, "parent", "10:2", "handle", "12:", "bfifo", "limit",
            str(limit))
        # IP total length (bytes 2-3 of the IP header) below 256: pure ACKs and small messages
        _tc("-n", ns, "filter", "add", "dev", dev, "parent", "10:", "protocol", "ip", "prio", "1", "u32",
            "match", "u16", "0x0000", "0xff00", "at", "2", "flowid", "10:1")
        _tc("-n", ns, "filter", "add", "dev", dev, "parent", "10:", "protocol", "arp", "prio", "2", "u32",
            "match", "u32", "0", "0", "at", "0", "flowid", "10:1")

    def create(self) -> Cluster:
        assert self.names is not None and self.rates_mbit is not None
        try:
            for ns in [self.switch, *self.names]:
                _ip("netns", "add", ns)
                self._made.append(ns)
                _ip("-n", ns, "link", "set", "lo", "up")
            _ip("-n", self.switch, "link", "add", "fabric", "type", "bridge")
            _ip("-n", self.switch, "link", "set", "fabric", "up")
            if self.mgmt:
                _ip("-n", self.switch, "link", "add", "mgmt", "type", "bridge")
                _ip("-n", self.switch, "link", "set", "mgmt", "up")
            for h, ns in enumerate(self.names):
                _sysctl(ns, "net.ipv4.conf.all.arp_ignore=1", "net.ipv4.conf.all.arp_announce=2",
                        "net.ipv4.conf.all.rp_filter=0", "net.ipv4.conf.default.rp_filter=0")
                for k, nic in enumerate(self.nic_names):
                    port = f"h{h}n{k}"
                    _ip("link", "add", nic, "netns", ns, "type", "veth", "peer", "name", port, "netns",
                        self.switch)
                    _ip("-n", self.switch, "link", "set", port, "master", "fabric")
                    _ip("-n", self.switch, "link", "set", port, "up")
                    addr = self.address(h, k)
                    _ip("-n", ns, "addr", "add", f"{addr}/16", "dev", nic)
                    _ip("-n", ns, "link", "set", nic, "up")
                    table = str(100 + k)
                    _ip("-n", ns, "route", "add", "198.18.0.0/16", "dev", nic, "src", addr, "table", table)
                    _ip("-n", ns, "rule", "add", "from", addr, "table", table, "priority", str(1000 + k))
                    rate = self.rates_mbit[h][k]
                    self._limit(ns, nic, rate, self.delay_ms)
                    self._limit(self.switch, port, rate, 0.0)
                if self.mgmt:
                    port = f"h{h}m"
                    _ip("link", "add", "mgmt", "netns", ns, "type", "veth", "peer", "name", port, "netns",
                        self.switch)
                    _ip("-n", self.switch, "link", "set", port, "master", "mgmt")
                    _ip("-n", self.switch, "link", "set", port, "up")
                    _ip("-n", ns, "addr", "add", f"{self.mgmt_address(h)}/24", "dev", "mgmt")
                    _ip("-n", ns, "link", "set", "mgmt", "up")
            self.wait_up()
        except BaseException:
            self.remove()
            raise
        return self

    def wait_up(self, host: int | None = None, nic: int | None = None, timeout: float = 15.0) -> None:
        """Waits until the NICs (default: all; ``mgmt`` too) report carrier (see TwoHosts.wait_up)."""
        assert self.names is not None
        deadline = time.monotonic() + timeout
        hosts = range(self.hosts) if host is None else [host]
        for h in hosts:
            names = self.nic_names if nic is None else [self.nic_names[nic]]
            if nic is None and self.mgmt:
                names = [*names, "mgmt"]
            for name in names:
                while True:
                    out = subprocess.run(["ip", "-n", self.names[h], "-o", "link", "show", "dev", name],
                                         capture_output=True, text=True, timeout=10).stdout
                    if "state UP" in out and "LOWER_UP" in out:
                        break
                    if time.monotonic() > deadline:
                        raise RuntimeError(f"{name} in namespace {self.names[h]} not up after {timeout} s")
                    time.sleep(0.02)

    def set_link(self, host: int, nic: int, up: bool) -> None:
        """Cuts (or restores) NIC ``nic`` of ``host``: its host end goes down, as a pulled cable."""
        assert self.names is not None
        _ip("-n", self.names[host], "link", "set", self.nic_names[nic], "up" if up else "down")
        if up:
            self.wait_up(host, nic)

    def nic_bytes(self, host: int) -> list[dict[str, int]]:
        """Bytes each data NIC of ``host`` sent (``tx``) and received (``rx``), from the kernel's counters."""
        assert self.names is not None
        out = []
        for nic in self.nic_names:
            base = f"/sys/class/net/{nic}/statistics"
            got = subprocess.run(["ip", "netns", "exec", self.names[host], "cat", f"{base}/tx_bytes",
                                  f"{base}/rx_bytes"], capture_output=True, text=True, timeout=10, check=True)
            tx, rx = (int(x) for x in got.stdout.split())
            out.append({"tx": tx, "rx": rx})
        return out

    def remove(self) -> None:
        """Deletes exactly the namespaces ``create`` made (their veths and bridges go with them)."""
        for ns in reversed(self._made):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)
        self._made = []

    def __enter__(self) -> Cluster:
        return self.create()

    def __exit__(self, *exc: object) -> None:
        self.remove()
