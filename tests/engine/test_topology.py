"""NIC affinity (weightsync.engine.topology) against sysfs trees built the way Linux lays them out:
``bus/pci/devices/<bdf>`` symlinks into
``devices/pci<dom>:<bus>/<root port>/<switch up>/<switch down>/<bdf>``,
``class/net/<if>`` and ``class/infiniband/<dev>`` symlinks whose ``device`` leads to the PCI function,
``numa_node`` files and ``devices/system/node/node<N>/cpulist``."""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

from weightsync.engine import topology
from weightsync.engine.topology import NicChoice, choose_nics, given_nics, nic_location, normalize_bus_id

VERBS = "verbs;ofi_rxm"
EFA = "efa"
TCP = "tcp;ofi_rxm"
HAVE_CUDA_PYTHON = importlib.util.find_spec("cuda") is not None


class Sysfs:
    """A fake /sys under ``root`` with real symlinks (relative, as the kernel makes them)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        (root / "devices").mkdir(parents=True)
        (root / "bus" / "pci" / "devices").mkdir(parents=True)

    def pci(self, host_bridge: str, *chain: str, numa: int = -1, ids: tuple[str, str] | None = None) -> str:
        """PCI functions ``chain`` (root port first, the device last) under ``host_bridge``
        (``pci0000:17``), each with its ``numa_node`` and its ``bus/pci/devices`` link; ``ids``: the
        device's ``vendor`` and ``class``. The device's BDF."""
        path = self.root / "devices" / host_bridge
        for bdf in chain:
            path = path / bdf
            path.mkdir(parents=True, exist_ok=True)
            (path / "numa_node").write_text(f"{numa}\n")
            link = self.root / "bus" / "pci" / "devices" / bdf
            if not link.is_symlink():
                link.symlink_to(os.path.relpath(path, link.parent))
        if ids:
            (path / "vendor").write_text(ids[0] + "\n")
            (path / "class").write_text(ids[1] + "\n")
        return chain[-1]

    def _function_dir(self, bdf: str) -> Path:
        return Path(os.path.realpath(self.root / "bus" / "pci" / "devices" / bdf))

    def _class_link(self, cls: str, name: str, node: Path) -> None:
        link = self.root / "class" / cls / name
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(node, link.parent))

    def netdev(self, name: str, bdf: str | None, *, via: str | None = None) -> None:
        """Network interface ``name`` of PCI function ``bdf`` (``via``: an intermediate node such as a
        virtio device, which is then what ``device`` points at), or a virtual one (``bdf=None``)."""
        if bdf is None:
            node = self.root / "devices" / "virtual" / "net" / name
            node.mkdir(parents=True)
        else:
            parent = self._function_dir(bdf)
            if via:
                parent = parent / via
                parent.mkdir()
            node = parent / "net" / name
            node.mkdir(parents=True)
            (node / "device").symlink_to(os.path.relpath(parent, node))
        self._class_link("net", name, node)

    def ibdev(self, name: str, bdf: str) -> None:
        """RDMA device ``name`` (``mlx5_0``, ``rdmap16s27``) of PCI function ``bdf``."""
        parent = self._function_dir(bdf)
        node = parent / "infiniband" / name
        node.mkdir(parents=True)
        (node / "device").symlink_to(os.path.relpath(parent, node))
        self._class_link("infiniband", name, node)

    def nodes(self, cpulists: dict[int, str]) -> None:
        for node, cpulist in cpulists.items():
            d = self.root / "devices" / "system" / "node" / f"node{node}"
            d.mkdir(parents=True)
            (d / "cpulist").write_text(cpulist + "\n")


def bdf(bus: int, dev: int = 0, fn: int = 0) -> str:
    return f"0000:{bus:02x}:{dev:02x}.{fn}"


@pytest.fixture
def sysfs(tmp_path: Path) -> Sysfs:
    return Sysfs(tmp_path / "sys")


NVIDIA_3D = ("0x10de", "0x030200")


def switch(tree: Sysfs, base_bus: int, endpoints: int, numa: int, gpu_first: bool = False) -> list[str]:
    """A root port on host bridge ``pci0000:<base_bus>`` with a PCIe switch below it (upstream port,
    one downstream port per endpoint); the endpoints' BDFs, in order (``gpu_first``: the first endpoint
    has an NVIDIA GPU's vendor and class)."""
    hb = f"pci0000:{base_bus:02x}"
    root_port, upstream = bdf(base_bus, 1), bdf(base_bus + 1)
    return [tree.pci(hb, root_port, upstream, bdf(base_bus + 2, i), bdf(base_bus + 3 + i), numa=numa,
                     ids=NVIDIA_3D if gpu_first and i == 0 else None)
            for i in range(endpoints)]


def two_sockets(tree: Sysfs) -> None:
    tree.nodes({0: "0-3,8-11", 1: "4-7,12-15"})


# --- layouts of the issue ---------------------------------------------------------------------------------
def dgx(sysfs: Sysfs) -> tuple[list[str], list[str]]:
    """A DGX-H100-like node: each PCIe switch holds one GPU and one ConnectX NIC. (GPUs, NICs)."""
    two_sockets(sysfs)
    gpus = []
    for i in range(8):
        gpu, nic = switch(sysfs, 0x10 + 0x10 * i, 2, numa=i // 4, gpu_first=True)
        sysfs.ibdev(f"mlx5_{i}", nic)
        gpus.append(gpu)
    return gpus, [f"mlx5_{i}" for i in range(8)]


def test_eight_gpus_eight_nics_one_per_switch(sysfs: Sysfs) -> None:
    gpus, nics = dgx(sysfs)
    for i, gpu in enumerate(gpus):
        choice = choose_nics(nics, VERBS, gpu, sysfs=str(sysfs.root))
        assert choice.nics == (f"mlx5_{i}",), choice
        assert choice.locality == "switch"
        assert choice.reason.startswith(f"same PCIe switch as GPU {gpu}")
        assert choice.gpu == gpu and choice.candidates == tuple(nics)


def test_eight_gpus_thirty_two_efa_nics_four_per_gpu(sysfs: Sysfs) -> None:
    """A p5-like node: four EFA NICs (libfabric domains ``<dev>-rdm``) beside each GPU, plus an NVMe."""
    two_sockets(sysfs)
    gpus, expected = [], []
    for i in range(8):
        gpu, *nics, _nvme = switch(sysfs, 0x10 + 0x10 * i, 6, numa=i // 4)
        names = []
        for nic in nics:
            dev = f"rdmap{int(nic.split(':')[1], 16)}s0"
            sysfs.ibdev(dev, nic)
            names.append(f"{dev}-rdm")
        gpus.append(gpu)
        expected.append(tuple(names))
    domains = [d for group in expected for d in group]
    assert len(domains) == 32
    for gpu, mine in zip(gpus, expected, strict=True):
        choice = choose_nics(domains, EFA, gpu, sysfs=str(sysfs.root))
        assert choice.nics == mine and choice.locality == "switch"


def test_two_gpus_share_a_switch_and_its_nics(sysfs: Sysfs) -> None:
    two_sockets(sysfs)
    gpu_a, gpu_b, nic_a, nic_b = switch(sysfs, 0x10, 4, numa=0)
    gpu_c, nic_c = switch(sysfs, 0x30, 2, numa=0)
    for name, nic in (("mlx5_0", nic_a), ("mlx5_1", nic_b), ("mlx5_2", nic_c)):
        sysfs.ibdev(name, nic)
    nics = ["mlx5_0", "mlx5_1", "mlx5_2"]
    for gpu in (gpu_a, gpu_b):
        assert choose_nics(nics, VERBS, gpu, sysfs=str(sysfs.root)).nics == ("mlx5_0", "mlx5_1")
    assert choose_nics(nics, VERBS, gpu_c, sysfs=str(sysfs.root)).nics == ("mlx5_2",)


def test_two_levels_of_switches_pick_the_leaf_switch(sysfs: Sysfs) -> None:
    """Under one upper switch, two leaf switches each with a GPU and a NIC, and a NIC on the upper
    switch itself: a GPU takes its leaf's NIC; a GPU on a leaf without a NIC takes the upper one's."""
    hb, rp, up = "pci0000:10", bdf(0x10, 1), bdf(0x11)
    leaf = {}
    for k, bus in enumerate((0x20, 0x30, 0x40)):
        chain = (rp, up, bdf(0x12, k), bdf(bus))  # the upper switch's downstream port, the leaf's upstream
        leaf[k] = [sysfs.pci(hb, *chain, bdf(bus + 1, i), bdf(bus + 2 + i), numa=0) for i in range(2)]
    upper_nic = sysfs.pci(hb, rp, up, bdf(0x12, 5), bdf(0x50), numa=0)
    sysfs.ibdev("mlx5_0", leaf[0][1])
    sysfs.ibdev("mlx5_1", leaf[1][1])
    sysfs.ibdev("mlx5_9", upper_nic)
    nics = ["mlx5_0", "mlx5_1", "mlx5_9"]
    root = str(sysfs.root)
    assert choose_nics(nics, VERBS, leaf[0][0], sysfs=root).nics == ("mlx5_0",)
    assert choose_nics(nics, VERBS, leaf[1][0], sysfs=root).nics == ("mlx5_1",)
    # leaf 2 has no NIC: the GPU meets every NIC at the upper switch's upstream port; all are equally near
    lonely = choose_nics(nics, VERBS, leaf[2][0], sysfs=root)
    assert lonely.nics == tuple(nics) and lonely.locality == "switch"
    assert f"(bridge {up})" in lonely.reason


def test_nics_all_on_one_numa_node(sysfs: Sysfs) -> None:
    """GPUs and NICs each on their own root port (no switches): the GPU on the NICs' node takes them
    by NUMA node; the GPU on the other node finds none near and takes all, saying so."""
    two_sockets(sysfs)
    gpu0 = sysfs.pci("pci0000:10", bdf(0x10, 1), bdf(0x11), numa=0)
    gpu1 = sysfs.pci("pci0000:80", bdf(0x80, 1), bdf(0x81), numa=1)
    for i, bus in enumerate((0x20, 0x30)):
        sysfs.ibdev(f"mlx5_{i}", sysfs.pci(f"pci0000:{bus:02x}", bdf(bus, 1), bdf(bus + 1), numa=0))
    sysfs.netdev("lo", None)
    nics = ["mlx5_0", "mlx5_1"]
    near = choose_nics([*nics, "lo"], VERBS, gpu0, sysfs=str(sysfs.root))
    assert near.nics == tuple(nics) and near.locality == "numa"
    assert near.reason == f"same NUMA node 0 as GPU {gpu0}"
    far = choose_nics(nics, VERBS, gpu1, sysfs=str(sysfs.root))
    assert far.nics == tuple(nics) and far.locality == "all"
    assert far.reason.endswith(": all NICs") and "NUMA node 1" in far.reason


def test_gpu_without_a_nic_nearby_falls_back_to_numa_then_all(sysfs: Sysfs) -> None:
    two_sockets(sysfs)
    (gpu0,) = switch(sysfs, 0x10, 1, numa=0)  # a switch with only the GPU under it
    nic0_a, nic0_b = switch(sysfs, 0x20, 2, numa=0)
    (nic1,) = switch(sysfs, 0x80, 1, numa=1)
    (gpu_unknown,) = switch(sysfs, 0xa0, 1, numa=-1)  # a VM: no NUMA information
    for name, nic in (("mlx5_0", nic0_a), ("mlx5_1", nic0_b), ("mlx5_2", nic1)):
        sysfs.ibdev(name, nic)
    nics = ["mlx5_0", "mlx5_1", "mlx5_2"]
    root = str(sysfs.root)
    by_numa = choose_nics(nics, VERBS, gpu0, sysfs=root)
    assert by_numa.nics == ("mlx5_0", "mlx5_1") and by_numa.locality == "numa"
    everything = choose_nics(nics, VERBS, gpu_unknown, sysfs=root)
    assert everything.nics == tuple(nics) and everything.locality == "all"
    assert "NUMA node is unknown" in everything.reason
    missing = choose_nics(nics, VERBS, "0000:ee:00.0", sysfs=root)
    assert missing.locality == "all" and "not in" in missing.reason and missing.nics == tuple(nics)


def test_sharing_only_the_host_bridge_is_not_a_switch(sysfs: Sysfs) -> None:
    """Two root ports of one host bridge: the path between them crosses the CPU's root complex."""
    gpu = sysfs.pci("pci0000:10", bdf(0x10, 1), bdf(0x11), numa=1)
    sysfs.ibdev("mlx5_0", sysfs.pci("pci0000:10", bdf(0x10, 2), bdf(0x12), numa=1))
    choice = choose_nics(["mlx5_0"], VERBS, gpu, sysfs=str(sysfs.root))
    assert choice.locality == "numa"


# --- CPU-memory engines -----------------------------------------------------------------------------------
def cpu_machine(sysfs: Sysfs) -> list[str]:
    sysfs.nodes({0: "0-3", 1: "4-7", 2: "8-11", 3: "12-15"})
    names = []
    for node in range(4):
        bus = 0x10 + 0x20 * node
        sysfs.netdev(f"ens{node}", sysfs.pci(f"pci0000:{bus:02x}", bdf(bus, 1), bdf(bus + 1), numa=node))
        names.append(f"ens{node}")
    sysfs.netdev("lo", None)
    return [*names, "lo"]


def test_cpu_engine_picks_its_threads_numa_node(sysfs: Sysfs) -> None:
    nics = cpu_machine(sysfs)
    root = str(sysfs.root)
    one = choose_nics(nics, TCP, None, sysfs=root, cpus={5, 6})
    assert one.nics == ("ens1",) and one.locality == "numa"
    assert one.reason == "same NUMA node 1 as this thread's CPUs" and one.gpu is None
    two = choose_nics(nics, TCP, None, sysfs=root, cpus={1, 13})
    assert two.nics == ("ens0", "ens3") and two.reason.startswith("same NUMA nodes 0,3")
    everywhere = choose_nics(nics, TCP, None, sysfs=root, cpus=range(16))
    assert everywhere.nics == tuple(nics) and everywhere.locality == "all"
    assert "every NUMA node" in everywhere.reason


def test_cpu_engine_uses_the_calling_threads_affinity(sysfs: Sysfs) -> None:
    mine = sorted(os.sched_getaffinity(0))
    sysfs.nodes({0: ",".join(map(str, mine)), 1: "100000-100003"})
    for node, bus in ((0, 0x10), (1, 0x80)):
        sysfs.netdev(f"ens{node}", sysfs.pci(f"pci0000:{bus:02x}", bdf(bus, 1), bdf(bus + 1), numa=node))
    choice = choose_nics(["ens0", "ens1"], TCP, None, sysfs=str(sysfs.root))
    assert choice.nics == ("ens0",) and choice.locality == "numa"


def test_cpu_engine_without_numa_information(sysfs: Sysfs) -> None:
    nics = cpu_machine(sysfs)
    no_nodes = Sysfs(sysfs.root.parent / "bare")
    for name in ("ens0", "lo"):
        no_nodes.netdev(name, None if name == "lo" else no_nodes.pci("pci0000:10", bdf(0x10, 1), bdf(0x11)))
    choice = choose_nics(["ens0", "lo"], TCP, None, sysfs=str(no_nodes.root), cpus={0})
    assert choice.nics == ("ens0", "lo") and choice.reason.startswith("no locality information")
    assert choose_nics(nics, TCP, None, sysfs=str(sysfs.root), cpus={5}).nics == ("ens1",)


# --- how NICs are found -----------------------------------------------------------------------------------
def test_nic_locations_of_each_kind(sysfs: Sysfs) -> None:
    (nic,) = switch(sysfs, 0x10, 1, numa=1)
    (virtio,) = switch(sysfs, 0x30, 1, numa=0)
    sysfs.ibdev("rdmap19s0", nic)
    sysfs.netdev("eth0", virtio, via="virtio2")  # a VM's NIC: device -> the virtio node
    sysfs.netdev("veth0", None)
    root = str(sysfs.root)
    loc = nic_location("rdmap19s0-rdm", EFA, root)
    assert loc is not None and loc.bdf == nic and loc.numa_node == 1
    assert loc.host_bridge == "pci0000:10" and loc.bridges == (bdf(0x10, 1), bdf(0x11), bdf(0x12, 0))
    eth = nic_location("eth0", TCP, root)
    assert eth is not None and eth.bdf == virtio
    assert nic_location("veth0", TCP, root) is None
    assert nic_location("nonexistent0", TCP, root) is None
    assert nic_location("eth0", EFA, root) is None  # an RDMA provider looks among RDMA devices only


def test_normalize_bus_id() -> None:
    assert normalize_bus_id("0000:1B:00.0") == "0000:1b:00.0"
    assert normalize_bus_id(b"00000000:1B:00.0\x00\x00") == "0000:1b:00.0"
    assert normalize_bus_id("0001:c3:1f.7") == "0001:c3:1f.7"
    with pytest.raises(ValueError):
        normalize_bus_id("GPU-1234")


def test_no_candidates() -> None:
    assert choose_nics([], VERBS, None).nics == ()


# --- this machine and the engine ----------------------------------------------------------------------------
def test_loopback_on_this_machine_has_no_locality() -> None:
    """The real /sys: ``lo`` has no PCI device, so the engine keeps it and says why."""
    choice = choose_nics(["lo"], TCP, None)
    assert choice.nics == ("lo",) and choice.locality == "all"
    assert choice.reason == "no locality information (lo: no PCI device): all NICs"


@pytest.mark.skipif(HAVE_CUDA_PYTHON, reason="cuda-python is installed here")
def test_gpu_engine_without_cuda_python_takes_all_nics() -> None:
    bdf_, why = topology.gpu_pci_bus_id(0)
    assert bdf_ is None and "cuda-python is not installed" in why
    choice = topology.engine_nics(["lo"], TCP, 0)
    assert choice.nics == ("lo",) and choice.locality == "all"
    assert "PCI address of GPU 0 unknown" in choice.reason


def test_given_nics_override() -> None:
    assert given_nics(None, {}) is None
    assert given_nics(None, {"WEIGHTSYNC_NICS": " , "}) is None
    by_arg = given_nics(["eth1", "eth0"], {"WEIGHTSYNC_NICS": "lo"})
    assert by_arg == NicChoice(("eth1", "eth0"), "given by nics=", "given", None, ("eth1", "eth0"))
    by_env = given_nics(None, {"WEIGHTSYNC_NICS": " eth0, ,eth1 "})
    assert by_env is not None and by_env.nics == ("eth0", "eth1")
    assert by_env.reason == "given by WEIGHTSYNC_NICS"


def test_engine_shows_and_logs_its_choice(monkeypatch: pytest.MonkeyPatch,
                                          caplog: pytest.LogCaptureFixture) -> None:
    from weightsync.engine import TransferEngine

    monkeypatch.delenv("WEIGHTSYNC_NICS", raising=False)
    monkeypatch.setenv("WEIGHTSYNC_PROVIDER", TCP)
    with caplog.at_level(logging.INFO, logger="weightsync.engine"):
        with TransferEngine("fabric") as eng:
            default = eng.nic_choice
            assert default.nics == tuple(eng.nics) == ("lo",)
            assert default.locality == "all" and "lo: no PCI device" in default.reason
    assert any(default.reason in r.getMessage() for r in caplog.records if r.name == "weightsync.engine")
    with TransferEngine("fabric", nics=["lo", "lo"]) as eng:
        assert eng.nic_choice.reason == "given by nics=" and eng.nics == ["lo", "lo"]
    monkeypatch.setenv("WEIGHTSYNC_NICS", "lo,lo")
    with TransferEngine("fabric") as eng:
        assert eng.nic_choice.reason == "given by WEIGHTSYNC_NICS" and eng.nics == ["lo", "lo"]


@pytest.mark.skipif(HAVE_CUDA_PYTHON, reason="GPUs come from the CUDA driver here")
def test_script_prints_each_gpus_choice(sysfs: Sysfs) -> None:
    """scripts/nic_topology.py on a fixture sysfs: without cuda-python it finds the GPUs in sysfs."""
    gpus, nics = dgx(sysfs)
    script = Path(__file__).resolve().parents[2] / "scripts" / "nic_topology.py"
    out = subprocess.run([sys.executable, str(script), "--sysfs", str(sysfs.root), "--provider", VERBS,
                          "--nics", ",".join(nics), "--json"], capture_output=True, text=True, timeout=60,
                         check=True, env={**os.environ, "WEIGHTSYNC_NICS": ""})
    report = json.loads(out.stdout)
    engines = report["engines"]
    assert [e["gpu"] for e in engines[:-1]] == gpus
    assert [e["nics"] for e in engines[:-1]] == [[nic] for nic in nics]
    assert engines[-1]["gpu"] is None and engines[-1]["engine"].startswith("CPU")
    assert report["nics"]["mlx5_3"]["bdf"] == bdf(0x10 + 0x10 * 3 + 4)
    text = subprocess.run([sys.executable, str(script), "--sysfs", str(sysfs.root), "--provider", VERBS,
                           "--nics", ",".join(nics)], capture_output=True, text=True, timeout=60, check=True)
    assert f"-> mlx5_0: same PCIe switch as GPU {gpus[0]}" in text.stdout
