"""Push benchmarks. ``--cpu``: the control plane's own cost on this machine, over TCP loopback.

1. Round trip of a push of a small model (all sources push, every destination has the version and has
   acknowledged it): the median over many pushes of the slowest source's ``push()`` time.
2. GB/s of a large model pushed from 2 sources to 2 full-replica destinations, beside the engine's
   own figure for one write of the same per-destination bytes between two actors, measured in the same
   run: what the control plane costs on top of the data plane.

Every pushed version is checked on the destinations (checksums of every tensor against the sources'),
so a run that moves wrong bytes fails instead of reporting a figure.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import statistics
import sys
import time
import zlib
from typing import Any

import numpy as np
import ray
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import weightsync as ws  # noqa: E402


def model_shapes(total_bytes: int, tensors: int) -> dict[str, tuple[int, int]]:
    rows = max(2, (total_bytes // 4 // tensors) // 256 // 2 * 2)  # fp32, 256 columns, even rows
    return {f"layer{i}.weight": (rows, 256) for i in range(tensors)}


def values(shape: tuple[int, int], name: str, version: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(zlib.crc32(name.encode()) * 1000 + version)
    return torch.rand(shape, generator=g)


def checksum(t: torch.Tensor) -> str:
    # A digest of the bytes: exact, unlike a float sum whose rounding depends on the summation order.
    return hashlib.blake2b(t.contiguous().numpy().tobytes(), digest_size=16).hexdigest()


class Trainer:
    def __init__(self, group: str, rank: int, world: int, shapes: dict[str, tuple[int, int]]) -> None:
        self.rank, self.world, self.shapes = rank, world, shapes
        self.locals: dict[str, torch.Tensor] = {}
        tensors: dict[str, Any] = {}
        for name, (rows, cols) in shapes.items():
            n = rows // world
            local = torch.empty(n, cols)
            self.locals[name] = local
            tensors[name] = ws.Sharded(local, (rows, cols), (rank * n, 0))
        self.src = ws.Source(group, rank=rank, tensors=tensors)

    def set_version(self, version: int) -> None:
        for name, local in self.locals.items():
            full = values(self.shapes[name], name, version)
            n = local.shape[0]
            local.copy_(full[self.rank * n:(self.rank + 1) * n])

    def push(self, version: int) -> dict[str, Any]:
        return ws.push(self.src, version, timeout=120).__dict__


class Rollout:
    def __init__(self, group: str, rank: int, shapes: dict[str, tuple[int, int]]) -> None:
        self.tensors = {name: torch.full(shape, float("nan")) for name, shape in shapes.items()}
        self.dst = ws.Destination(group, rank=rank, tensors=self.tensors, mode="inplace")

    def checksums(self, version: int) -> dict[str, str]:
        self.dst.wait(version, timeout=60)
        return {k: checksum(v) for k, v in self.tensors.items()}


class EngineEnd:
    """One side of the engine-only baseline: a bare TransferEngine in an actor."""

    def __init__(self, nbytes: int) -> None:
        self.engine = ws.TransferEngine()
        self.buf = np.frombuffer(np.random.default_rng(0).bytes(nbytes), dtype=np.uint8).copy()
        self.region = self.engine.register(self.buf)

    def info(self) -> tuple[bytes, bytes]:
        return self.engine.address, self.region.descriptor

    def send(self, address: bytes, descriptor: bytes, repeat: int) -> list[float]:
        peer = self.engine.connect(address)
        times = []
        for _ in range(repeat):
            t0 = time.perf_counter()
            self.engine.write(self.region, 0, peer, descriptor, 0, self.buf.nbytes, imm=1).wait(120)
            times.append(time.perf_counter() - t0)
        return times

    def imm_count(self) -> int:
        return self.engine.imm_count(self.buf.nbytes)

    def received(self, n: int) -> int:
        self.engine.counter(1).wait(n, timeout=120)
        return int(self.buf[:4096].sum())


def run_group(name: str, shapes: dict[str, tuple[int, int]], pushes: int) -> dict[str, Any]:
    group = ws.Group.create(name, num_sources=2, num_destinations=2)
    trainers = [ray.remote(num_cpus=0)(Trainer).remote(name, i, 2, shapes) for i in range(2)]
    rollouts = [ray.remote(num_cpus=0)(Rollout).remote(name, j, shapes) for j in range(2)]
    ray.get([a.__ray_ready__.remote() for a in trainers + rollouts], timeout=300)
    try:
        times, gbps = [], []
        for version in range(1, pushes + 1):
            ray.get([t.set_version.remote(version) for t in trainers])
            stats = ray.get([t.push.remote(version) for t in trainers], timeout=300)
            if any(s["failed_destinations"] for s in stats):
                raise SystemExit(f"push {version} failed: {stats}")
            times.append(max(s["seconds"] for s in stats))
            gbps.append(sum(s["bytes"] for s in stats) / times[-1] / 1e9)
            if version in (1, pushes):  # verify the first and the last version on every destination
                want = {k: checksum(values(shape, k, version)) for k, shape in shapes.items()}
                for got in ray.get([r.checksums.remote(version) for r in rollouts], timeout=120):
                    if got != want:
                        raise SystemExit(f"destination tensors differ from version {version}")
        model_bytes = sum(r * c * 4 for r, c in shapes.values())
        return {"model_bytes": model_bytes, "pushes": pushes, "median_s": statistics.median(times),
                "p90_s": float(np.percentile(times, 90)), "median_gbps": statistics.median(gbps),
                "first_s": times[0]}
    finally:
        for a in trainers + rollouts:
            ray.kill(a)
        group.shutdown()


def engine_baseline(nbytes: int, repeat: int) -> dict[str, Any]:
    end = ray.remote(num_cpus=0)(EngineEnd)
    a, b = end.remote(nbytes), end.remote(nbytes)
    address, descriptor = ray.get(b.info.remote())
    times = ray.get(a.send.remote(address, descriptor, repeat), timeout=600)
    ray.get(b.received.remote(len(times) * ray.get(a.imm_count.remote())), timeout=60)
    ray.kill(a)
    ray.kill(b)
    best = min(times)
    return {"bytes": nbytes, "median_s": statistics.median(times), "best_gbps": nbytes / best / 1e9,
            "median_gbps": nbytes / statistics.median(times) / 1e9}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cpu", action="store_true", help="the CPU benchmark (the GPU scenarios need GPUs)")
    ap.add_argument("--quick", action="store_true", help="small sizes, for a smoke test")
    ap.add_argument("--small-pushes", type=int, default=100)
    args = ap.parse_args()
    if not args.cpu:
        raise SystemExit("only --cpu is available so far: the GPU scenarios arrive with the NVLink transport")

    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": ROOT}})
    try:
        small = run_group("bench-small", model_shapes(1 << 20, 4), 10 if args.quick else args.small_pushes)
        big_bytes = (64 << 20) if args.quick else (1 << 30)
        big = run_group("bench-big", model_shapes(big_bytes, 8), 2 if args.quick else 5)
        # Each destination receives the whole model, half from each source: per-destination bytes.
        base = engine_baseline(big["model_bytes"], 2 if args.quick else 3)
    finally:
        ray.shutdown()
    result = {
        "machine": f"{platform.node()} ({os.cpu_count()} cores), tcp;ofi_rxm loopback",
        "date": time.strftime("%Y-%m-%d"),
        "small_model_bytes": small["model_bytes"],
        "small_push_median_ms": small["median_s"] * 1e3,
        "small_push_p90_ms": small["p90_s"] * 1e3,
        "big_model_bytes": big["model_bytes"],
        "big_push_median_s": big["median_s"],
        "big_push_gbps": big["median_gbps"],
        "engine_one_write_gbps": base["median_gbps"],
        "push_vs_engine": big["median_gbps"] / base["median_gbps"],
    }
    print(f"1 MiB-class model ({small['model_bytes']} B), 2 -> 2: median push round trip "
          f"{result['small_push_median_ms']:.2f} ms (p90 {result['small_push_p90_ms']:.2f} ms)")
    print(f"{big['model_bytes'] / 2**30:.2f} GiB model, 2 -> 2 replicas: {big['median_s']:.2f} s, "
          f"{big['median_gbps']:.2f} GB/s total; engine alone, one write of the same bytes: "
          f"{base['median_gbps']:.2f} GB/s (push/engine {result['push_vs_engine']:.2f})")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
