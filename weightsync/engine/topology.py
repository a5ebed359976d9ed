"""Which NICs an engine uses by default: the ones nearest its GPU (or its thread's CPUs), from sysfs.

Pure Python (no torch, no Ray, no ``weightsync._ext``), so it runs against a fixture directory as well as
against the real ``/sys``.

Where things are in sysfs
-------------------------
* A PCI function ``<bdf>`` (``0000:1b:00.0``) is ``<sysfs>/bus/pci/devices/<bdf>``, a symlink into
  ``<sysfs>/devices/pci<domain>:<bus>/<root port>/<bridge>/.../<bdf>``: the resolved path lists, from
  the host bridge down, every PCI bridge above the function (the root port first, then for a PCIe
  switch its upstream port and the downstream port the function hangs off).
* A NIC is named by its libfabric domain. ``efa`` and ``verbs`` domains are RDMA devices,
  ``<sysfs>/class/infiniband/<dev>/device`` (libfabric may append ``-rdm``, ``-dgrm``, ``-xrc``...: the
  suffix is dropped when the name itself is not there); ``tcp`` (and ``udp``, ``sockets``) domains are
  network interfaces, ``<sysfs>/class/net/<if>/device``. The NIC's PCI function is the deepest PCI
  address on the resolved path (a virtio NIC's ``device`` is a virtio node below its PCI function).
  Loopback and virtual interfaces (``lo``, veth, bridges, ifb) have no ``device`` link: no locality.
* ``numa_node`` in a PCI function's directory is its NUMA node (-1: unknown, as in most VMs);
  ``<sysfs>/devices/system/node/node<N>/cpulist`` lists the CPUs of node N.

How the choice is made
----------------------
For an engine on a GPU (its PCI address known):

1. **Same PCIe switch.** Let ``bridges(x)`` be the PCI bridges above function ``x``, root port first.
   A NIC shares a switch with the GPU when ``bridges(gpu)`` and ``bridges(nic)`` have a common prefix
   of at least two bridges: the same root port *and* a bridge below it (a switch's upstream port). The
   deepest common bridge is where their traffic meets; the NICs whose common prefix with the GPU is the
   longest are chosen, so with two levels of switches a GPU takes the NICs of its own leaf switch, not
   every NIC of the upper one. GPUs sharing a switch share its NICs.
   Sharing only the host bridge (the CPU's root complex) does not count: that path crosses the CPU.
2. **Same NUMA node** (the GPU's ``numa_node``, when known): the NICs on that node.
3. **All** the candidate NICs, with the reason why nothing nearer was found.

For an engine without a GPU (CPU memory): the NUMA nodes of the CPUs the calling thread may run on
(``os.sched_getaffinity``), and the NICs on those nodes; all NICs when the thread may run everywhere,
when NUMA information is missing, or when no NIC is on its nodes.

Every choice carries a ``reason`` in words ("same PCIe switch as GPU 0000:1b:00.0 ...", "same NUMA node
1 ...", "no locality information ...: all NICs") for the log and the engine's ``nic_choice``.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

_BDF = re.compile(r"^[0-9a-f]{4,8}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-7]$")
_HOST_BRIDGE = re.compile(r"^pci[0-9a-f]{4,8}:[0-9a-f]{2}$")
_BUS_ID = re.compile(r"^([0-9a-fA-F]{1,8}):([0-9a-fA-F]{1,2}):([0-9a-fA-F]{1,2})\.([0-7])$")

# Core providers whose domains are RDMA devices (class/infiniband) or network interfaces (class/net).
_RDMA_PROVIDERS = ("efa", "verbs", "psm3", "opx", "cxi")
_NETDEV_PROVIDERS = ("tcp", "udp", "sockets", "net")


@dataclass(frozen=True)
class PciLocation:
    """Where a PCI function sits: its address, the bridges above it (root port first) under its host
    bridge, and its NUMA node (-1: unknown)."""

    bdf: str
    host_bridge: str
    bridges: tuple[str, ...]
    numa_node: int

    def common_bridges(self, other: PciLocation) -> int:
        """How many bridges, from the root port down, ``self`` and ``other`` have in common."""
        if self.host_bridge != other.host_bridge:
            return 0
        n = 0
        for a, b in zip(self.bridges, other.bridges, strict=False):
            if a != b:
                break
            n += 1
        return n


@dataclass(frozen=True)
class NicChoice:
    """The NICs an engine uses and why. ``locality``: "switch", "numa", "all" (nothing nearer found, or
    nothing known) or "given" (``nics=`` or ``$WEIGHTSYNC_NICS``). ``gpu``: the GPU's PCI address the
    choice was made for (None for a CPU-memory engine or when it is unknown). ``candidates``: the NICs
    the choice was made from."""

    nics: tuple[str, ...]
    reason: str
    locality: str
    gpu: str | None = None
    candidates: tuple[str, ...] = field(default=())

    def as_dict(self) -> dict[str, Any]:
        return {"nics": list(self.nics), "reason": self.reason, "locality": self.locality,
                "gpu": self.gpu, "candidates": list(self.candidates)}


# --- sysfs ------------------------------------------------------------------------------------------------
def normalize_bus_id(bus_id: str | bytes) -> str:
    """A PCI bus id as sysfs names it (``0000:1b:00.0``): CUDA answers ``0000:1B:00.0`` and nvidia-smi
    ``00000000:1B:00.0``. Raises ValueError for anything else."""
    text = bus_id.decode("ascii", "replace") if isinstance(bus_id, bytes) else bus_id
    m = _BUS_ID.match(text.strip().strip("\x00").strip())
    if not m:
        raise ValueError(f"not a PCI bus id: {text!r}")
    domain, bus, dev, fn = (int(g, 16) for g in m.groups())
    return f"{domain:04x}:{bus:02x}:{dev:02x}.{fn:x}"


def _read_int(path: str, default: int = -1) -> int:
    try:
        with open(path) as f:
            return int(f.read().strip())
    except (OSError, ValueError):
        return default


def _location_of(sysfs: str, path: str) -> PciLocation | None:
    """The PCI location of the deepest PCI function on the resolved ``path`` (a device directory or a
    node below one), or None when the path is not below a PCI host bridge (virtual devices)."""
    devices = os.path.join(os.path.realpath(sysfs), "devices")
    real = os.path.realpath(path)
    rel = os.path.relpath(real, devices)
    if rel.startswith(".."):
        return None
    parts = rel.split(os.sep)
    if not parts or not _HOST_BRIDGE.match(parts[0]):
        return None
    chain: list[str] = []
    for part in parts[1:]:
        if not _BDF.match(part):
            break  # below the PCI function: virtio2, net/eth0, infiniband/mlx5_0 ...
        chain.append(part)
    if not chain:
        return None
    function_dir = os.path.join(devices, parts[0], *chain)
    return PciLocation(bdf=chain[-1], host_bridge=parts[0], bridges=tuple(chain[:-1]),
                       numa_node=_read_int(os.path.join(function_dir, "numa_node")))


def pci_location(bdf: str, sysfs: str = "/sys") -> PciLocation | None:
    """The location of PCI function ``bdf`` (any spelling ``normalize_bus_id`` accepts), or None when
    sysfs does not list it."""
    link = os.path.join(sysfs, "bus", "pci", "devices", normalize_bus_id(bdf))
    if not os.path.exists(link):
        return None
    return _location_of(sysfs, link)


def _device_classes(provider: str) -> tuple[str, ...]:
    core = provider.split(";")[0].strip().lower()
    if core in _RDMA_PROVIDERS:
        return ("infiniband",)
    if core in _NETDEV_PROVIDERS:
        return ("net",)
    return ("infiniband", "net")


def nic_location(domain: str, provider: str, sysfs: str = "/sys") -> PciLocation | None:
    """The PCI location of the NIC behind libfabric domain ``domain`` of ``provider``, or None when it has
    none (loopback, virtual interfaces, a name sysfs does not know)."""
    names = [domain]
    if "-" in domain:
        names.append(domain.rsplit("-", 1)[0])  # efa "rdmap16s27-rdm", verbs "mlx5_0-xrc"
    for cls in _device_classes(provider):
        for name in names:
            device = os.path.join(sysfs, "class", cls, name, "device")
            if os.path.exists(device):
                return _location_of(sysfs, device)
    return None


def _parse_cpulist(text: str) -> set[int]:
    cpus: set[int] = set()
    for item in text.strip().split(","):
        if not item:
            continue
        lo, _, hi = item.partition("-")
        cpus.update(range(int(lo), int(hi or lo) + 1))
    return cpus


def numa_cpus(sysfs: str = "/sys") -> dict[int, set[int]]:
    """NUMA node -> its CPUs, from ``<sysfs>/devices/system/node/node*/cpulist`` (empty if absent)."""
    base = os.path.join(sysfs, "devices", "system", "node")
    nodes: dict[int, set[int]] = {}
    try:
        entries = os.listdir(base)
    except OSError:
        return nodes
    for entry in entries:
        m = re.fullmatch(r"node(\d+)", entry)
        if not m:
            continue
        try:
            with open(os.path.join(base, entry, "cpulist")) as f:
                nodes[int(m.group(1))] = _parse_cpulist(f.read())
        except (OSError, ValueError):
            continue
    return nodes


def thread_cpus() -> set[int]:
    """The CPUs the calling thread may run on (Linux: ``sched_getaffinity`` of pid 0 is this thread)."""
    return set(os.sched_getaffinity(0))


# --- the choice -----------------------------------------------------------------------------------------
def _names(nics: Iterable[str]) -> str:
    return ", ".join(nics)


def choose_nics(candidates: Sequence[str], provider: str, gpu_bdf: str | None = None, *,
                sysfs: str = "/sys", cpus: Iterable[int] | None = None) -> NicChoice:
    """The NICs among ``candidates`` (libfabric domains of ``provider``) nearest the GPU at PCI address
    ``gpu_bdf``, or, with ``gpu_bdf=None`` (a CPU-memory engine), nearest the CPUs ``cpus`` (default: the
    calling thread's). See the module's docstring for the rules."""
    candidates = tuple(candidates)
    locations = {nic: nic_location(nic, provider, sysfs) for nic in candidates}
    placed = {nic: loc for nic, loc in locations.items() if loc is not None}
    unplaced = [nic for nic, loc in locations.items() if loc is None]

    def everything(why: str, gpu: str | None = None) -> NicChoice:
        return NicChoice(candidates, f"{why}: all NICs", "all", gpu, candidates)

    def picked(nics: Iterable[str], reason: str, locality: str, gpu: str | None = None) -> NicChoice:
        chosen = set(nics)  # keep the candidates' order: it is the engine's NIC order
        return NicChoice(tuple(n for n in candidates if n in chosen), reason, locality, gpu, candidates)

    if not candidates:
        return NicChoice((), "no NICs to choose from", "all", normalize_bus_id(gpu_bdf) if gpu_bdf else None)
    no_device = f"{_names(unplaced)}: no PCI device" if unplaced else ""
    if not placed:
        return everything(f"no locality information ({no_device})",
                          normalize_bus_id(gpu_bdf) if gpu_bdf else None)

    if gpu_bdf is not None:
        gpu = normalize_bus_id(gpu_bdf)
        where = pci_location(gpu, sysfs)
        if where is None:
            return everything(f"no locality information (GPU {gpu} not in {sysfs}/bus/pci)", gpu)
        shared = {nic: where.common_bridges(loc) for nic, loc in placed.items()}
        deepest = max(shared.values())
        if deepest >= 2:  # the root port and at least one bridge below it: a PCIe switch
            meet = where.bridges[deepest - 1]
            return picked([n for n, d in shared.items() if d == deepest],
                          f"same PCIe switch as GPU {gpu} (bridge {meet})", "switch", gpu)
        if where.numa_node >= 0:
            near = [n for n, loc in placed.items() if loc.numa_node == where.numa_node]
            if near:
                return picked(near, f"same NUMA node {where.numa_node} as GPU {gpu}", "numa", gpu)
            return everything(f"no NIC under the PCIe switch or on NUMA node {where.numa_node} of GPU {gpu}",
                              gpu)
        return everything(f"no NIC under the PCIe switch of GPU {gpu}, and its NUMA node is unknown", gpu)

    nodes = numa_cpus(sysfs)
    mine = set(thread_cpus() if cpus is None else cpus)
    thread_nodes = sorted(n for n, node_cpus in nodes.items() if node_cpus & mine)
    if not thread_nodes:
        return everything("no locality information (no NUMA nodes for this thread's CPUs)")
    if len(nodes) > 1 and len(thread_nodes) == len(nodes):
        listed = ",".join(map(str, thread_nodes))
        return everything(f"this thread may run on every NUMA node ({listed})")
    near = [n for n, loc in placed.items() if loc.numa_node in thread_nodes]
    label = (f"NUMA node {thread_nodes[0]}" if len(thread_nodes) == 1
             else f"NUMA nodes {','.join(map(str, thread_nodes))}")
    if near:
        return picked(near, f"same {label} as this thread's CPUs", "numa")
    if all(loc.numa_node < 0 for loc in placed.values()):
        return everything(f"no locality information (NUMA node of {_names(placed)} unknown"
                          + (f"; {no_device})" if no_device else ")"))
    return everything(f"no NIC on {label} of this thread's CPUs")


def given_nics(nics: Sequence[str] | None, env: Mapping[str, str] | None = None) -> NicChoice | None:
    """The choice made by the user, if any: ``nics`` (the engine's ``nics=``), else ``WEIGHTSYNC_NICS``
    in ``env`` (default ``os.environ``; comma-separated domain names, blanks ignored)."""
    if nics is not None:
        chosen = tuple(nics)
        return NicChoice(chosen, "given by nics=", "given", None, chosen)
    value = (os.environ if env is None else env).get("WEIGHTSYNC_NICS", "")
    listed = tuple(n.strip() for n in value.split(",") if n.strip())
    if listed:
        return NicChoice(listed, "given by WEIGHTSYNC_NICS", "given", None, listed)
    return None


# --- the GPU's PCI address --------------------------------------------------------------------------------
def _cuda_driver() -> Any:
    """cuda-python's driver module (``cuda.bindings.driver``; ``cuda.cuda`` before cuda-python 12.6),
    imported only when a GPU engine asks, so CPU installs never need it. Raises ImportError."""
    try:
        from cuda.bindings import driver
    except ImportError:
        from cuda import cuda as driver  # the older layout of cuda-python
    return driver


def _check(result: Any, call: str) -> Any:
    """cuda-python calls return ``(CUresult, values...)``: the values, or RuntimeError naming the call."""
    status, *values = result if isinstance(result, tuple) else (result,)
    if int(status) != 0:
        raise RuntimeError(f"{call} failed: {getattr(status, 'name', status)}")
    return values[0] if len(values) == 1 else tuple(values)


def gpu_pci_bus_id(ordinal: int) -> tuple[str | None, str]:
    """The PCI address of process-local CUDA device ``ordinal`` (as ``CUDA_VISIBLE_DEVICES`` numbers
    them) from the CUDA driver through cuda-python: ``(bdf, "")``, or ``(None, why)`` when cuda-python
    is missing, the driver or the device is not there."""
    try:
        driver = _cuda_driver()
    except ImportError:
        return None, "cuda-python is not installed (pip install 'weightsync[cuda]')"
    try:
        _check(driver.cuInit(0), "cuInit")
        device = _check(driver.cuDeviceGet(int(ordinal)), "cuDeviceGet")
        raw = _check(driver.cuDeviceGetPCIBusId(32, device), "cuDeviceGetPCIBusId")
        return normalize_bus_id(raw), ""
    except Exception as e:  # the driver library missing, no device: the engine still works, unplaced
        return None, f"CUDA device {ordinal}: {e}"


def gpu_count() -> tuple[int, str]:
    """How many CUDA devices this process sees, through cuda-python: ``(n, "")`` or ``(0, why)``."""
    try:
        driver = _cuda_driver()
    except ImportError:
        return 0, "cuda-python is not installed"
    try:
        _check(driver.cuInit(0), "cuInit")
        return int(_check(driver.cuDeviceGetCount(), "cuDeviceGetCount")), ""
    except Exception as e:
        return 0, str(e)


def engine_nics(candidates: Sequence[str], provider: str, cuda_device: int | None, *,
                sysfs: str = "/sys") -> NicChoice:
    """The default choice for an engine on CUDA device ``cuda_device`` (process-local ordinal; None for a
    CPU-memory engine): by the GPU's PCI address, or by the calling thread's CPUs."""
    if cuda_device is None:
        return choose_nics(candidates, provider, None, sysfs=sysfs)
    bdf, why = gpu_pci_bus_id(cuda_device)
    if bdf is None:
        return NicChoice(tuple(candidates), f"no locality information (PCI address of GPU {cuda_device} "
                         f"unknown: {why}): all NICs", "all", None, tuple(candidates))
    return choose_nics(candidates, provider, bdf, sysfs=sysfs)
