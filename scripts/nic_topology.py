#!/usr/bin/env python
"""Which NICs each GPU's engine would pick on this machine, and why (weightsync.engine.topology).

Reads the real sysfs. GPUs are those the CUDA driver shows this process (through cuda-python, so
``CUDA_VISIBLE_DEVICES`` applies); without cuda-python, the NVIDIA GPUs sysfs lists. The candidate NICs
are the libfabric domains of the provider (``--provider``, default the engine's choice), or ``--nics``.

    python scripts/nic_topology.py                       # every GPU, then this thread's CPUs
    python scripts/nic_topology.py --provider efa --json

For TCP the engine's own default is loopback only (``lo``: no PCI device, so no locality); the
interfaces shown here are what it would choose among given ``WEIGHTSYNC_NICS``/``nics=`` lists or the
other providers' NICs.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from weightsync.engine import topology


def _candidates(provider: str, sysfs: str) -> tuple[list[str], str]:
    """The provider's NICs as libfabric lists them, or, without the built engine, as sysfs lists them."""
    try:
        from weightsync import _ext

        return [domain for _prov, domain, _fabric in _ext.discover(provider)], "libfabric"
    except ImportError as e:
        cls = "net" if provider.split(";")[0] in ("tcp", "udp", "sockets") else "infiniband"
        try:
            names = sorted(os.listdir(os.path.join(sysfs, "class", cls)))
        except OSError:
            names = []
        return names, f"{sysfs}/class/{cls} (weightsync._ext unavailable: {e})"


def _provider(given: str | None) -> str:
    if given:
        return given
    env = os.environ.get("WEIGHTSYNC_PROVIDER")
    if env:
        return env
    try:
        from weightsync import _ext

        return _ext.pick_provider()
    except ImportError:
        return "tcp;ofi_rxm"


def _sysfs_gpus(sysfs: str) -> list[str]:
    """NVIDIA display/3D controllers (vendor 0x10de, class 0x03xxxx) in sysfs, by PCI address."""
    base = os.path.join(sysfs, "bus", "pci", "devices")
    found = []
    for bdf in sorted(os.listdir(base)) if os.path.isdir(base) else []:
        try:
            with open(os.path.join(base, bdf, "vendor")) as f:
                vendor = f.read().strip()
            with open(os.path.join(base, bdf, "class")) as f:
                pci_class = f.read().strip()
        except OSError:
            continue
        if vendor == "0x10de" and pci_class.startswith("0x03"):
            found.append(bdf)
    return found


def _where(loc: topology.PciLocation | None) -> str:
    if loc is None:
        return "no PCI device"
    return f"{loc.bdf}  numa {loc.numa_node}  path {'/'.join((loc.host_bridge, *loc.bridges))}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--provider", help="libfabric provider (default: $WEIGHTSYNC_PROVIDER or the engine's)")
    ap.add_argument("--nics", help="comma-separated candidate domains (default: the provider's NICs)")
    ap.add_argument("--sysfs", default="/sys", help="sysfs root (default /sys)")
    ap.add_argument("--json", action="store_true", help="one JSON object instead of text")
    args = ap.parse_args(argv)

    provider = _provider(args.provider)
    if args.nics:
        candidates, source = [n.strip() for n in args.nics.split(",") if n.strip()], "--nics"
    else:
        candidates, source = _candidates(provider, args.sysfs)

    rows: list[dict[str, Any]] = []
    count, why = topology.gpu_count()
    if count:
        for ordinal in range(count):
            bdf, why_not = topology.gpu_pci_bus_id(ordinal)
            choice = (topology.choose_nics(candidates, provider, bdf, sysfs=args.sysfs) if bdf
                      else topology.engine_nics(candidates, provider, ordinal, sysfs=args.sysfs))
            rows.append({"engine": f"cuda:{ordinal}", "gpu": bdf or why_not, **choice.as_dict()})
    else:
        for bdf in _sysfs_gpus(args.sysfs):
            choice = topology.choose_nics(candidates, provider, bdf, sysfs=args.sysfs)
            rows.append({"engine": f"GPU {bdf} (from sysfs: {why})", "gpu": bdf, **choice.as_dict()})
    cpu = topology.choose_nics(candidates, provider, None, sysfs=args.sysfs)
    cpus = sorted(topology.thread_cpus())
    rows.append({"engine": f"CPU (this thread: {len(cpus)} CPUs)", "gpu": None, **cpu.as_dict()})

    nics = {nic: topology.nic_location(nic, provider, args.sysfs) for nic in candidates}
    override = os.environ.get("WEIGHTSYNC_NICS")
    if args.json:
        print(json.dumps({
            "provider": provider, "candidates_from": source, "WEIGHTSYNC_NICS": override,
            "nics": {n: (loc.__dict__ if loc else None) for n, loc in nics.items()}, "engines": rows,
        }, default=list))
        return 0
    print(f"provider {provider}; candidate NICs from {source}")
    if override:
        print(f"note: WEIGHTSYNC_NICS={override} is set: engines use it instead of the choices below")
    for nic, loc in nics.items():
        print(f"  NIC {nic:<20} {_where(loc)}")
    if not count and not rows[:-1]:
        print(f"no GPU seen ({why})")
    for row in rows:
        gpu = row["gpu"]
        where = _where(topology.pci_location(gpu, args.sysfs)) if isinstance(gpu, str) and ":" in gpu else ""
        print(f"{row['engine']}{'  GPU ' + where if where else ''}")
        print(f"  -> {','.join(row['nics']) or '(none)'}: {row['reason']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
