#!/usr/bin/env python
"""A resharded push across an emulated cluster of network namespaces, timed and checked against the simulator.

Hosts are network namespaces (tests.support.netns.Cluster): every GPU ("participant") owns
``--nics-per-gpu`` veth NICs limited by tc to ``--rate-mbit`` each way, all joined by one switch
namespace's bridge, plus an unlimited control network (``mgmt``) for Ray. A Ray node runs in every host
namespace (the head in host 0, ``ray start --address`` in the others), so trainers and rollouts are Ray
actors whose processes live in their host's namespace and whose Ray node id is their host for the planner.
The driver (this script, re-run with ``ip netns exec`` in host 0) creates the group with the real
coordinator; trainers hold dim-0 shards (FSDP-like), rollouts hold TP shards (row-parallel and
column-parallel tensors, a fused qkv) of ``--replicas`` replicas.

Measured: the push time (the slowest trainer's ``ws.push``, which returns once every destination
acknowledged), repeated; every destination checked byte for byte after every push; every NIC's bytes
(the kernel's counters and the engine's). Then the simulator runs on the same plan (planned from the
same layouts, hosts, round size) with the same links, and both are printed. ``--cut`` adds a push during
which NIC 0 of trainer host 0 is set down: the push must complete over the other NICs, every byte right.

``--delta-lr LR``: the weights are BF16 (as many elements as ``--mib`` of float32) on a trajectory of
Adam steps at ``LR`` from std-0.02 weights and std-1 gradients (every process computes it alike), pushed
by a dense group and then, in the same run on the same hosts and NICs, by a delta group (``delta=True``
sources, destinations with an inbox of ``--delta-inbox`` of what they hold); the first delta push is
untimed. Printed: both medians, their ratio, the changed fraction and the wire bytes against the dense
bytes; every push of both groups checked byte for byte. ``--fp8``: the rollouts hold q, k, v and o in
FP8 e4m3 with 128 x 128 block scales, which the sources quantize (a delta is then one of FP8 bytes).

Example (4 trainer ranks over 2 hosts -> 2 replicas of TP 2 over 2 hosts, 2 NICs of 100 Mbit/s per GPU):

    sudo .venv/bin/python scripts/emulated_cluster.py --trainer-hosts 2 --trainers-per-host 2 \\
        --rollout-hosts 2 --replicas 2 --tp 2 --nics-per-gpu 2 --rate-mbit 100 --mib 32 --pushes 5 --cut

The last line printed is one JSON object. Needs root (namespaces), iproute2 and Ray. Every namespace and
process it starts is removed at exit (also on failure); processes are ended by pid only.
``WSEC_KEEP_LOGS=DIR`` copies the nodes' and actors' logs (engine warnings, failed pushes) to DIR first.
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import secrets
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

RAY_PORT = 6379
HOST_RESOURCE = "wsec_host"  # a custom Ray resource per host: actors are placed by it


@dataclass
class Setup:
    trainer_hosts: int = 2
    trainers_per_host: int = 2
    rollout_hosts: int = 2
    replicas: int = 2
    tp: int = 2
    nics_per_gpu: int = 2
    rate_mbit: int = 100
    delay_ms: float = 0.0
    queue_ms: int = 200           # tbf's queue per NIC, in ms of its rate
    port_queue: str = "priority"  # netns.Cluster.port_queue: small packets first, or "fifo"
    mib: int = 32                 # model size (float32)
    pushes: int = 5
    cut: bool = False
    round_mib: float = 256.0      # the group's round_bytes
    relay: bool = False
    relay_chunk_mib: float = 64.0  # the group's relay_chunk_bytes (the chain's pipeline step)
    delta_lr: float | None = None  # BF16 weights stepped by Adam at this rate; dense then delta pushes
    delta_inbox: float = 0.25      # a destination's delta inbox, a fraction of the bytes it holds
    fp8: bool = False              # rollouts hold FP8 projections with 128 x 128 block scales
    # filled in by the launcher
    hosts: list[str] = field(default_factory=list)
    nic_names: list[str] = field(default_factory=list)
    head: str = ""

    @property
    def trainers(self) -> int:
        return self.trainer_hosts * self.trainers_per_host

    @property
    def rollouts(self) -> int:
        return self.replicas * self.tp

    @property
    def rollouts_per_host(self) -> int:
        return -(-self.rollouts // self.rollout_hosts)

    @property
    def gpus_per_host(self) -> int:
        return max(self.trainers_per_host, self.rollouts_per_host)

    def trainer_host(self, rank: int) -> int:
        return rank // self.trainers_per_host

    def rollout_host(self, rank: int) -> int:
        return self.trainer_hosts + rank // self.rollouts_per_host

    def nics_of(self, local_index: int) -> list[str]:
        k = self.nics_per_gpu
        return self.nic_names[local_index * k:(local_index + 1) * k]


# --------------------------------------------------------------------------------------------------
# The model: float32 tensors whose values are exact functions of (tensor, element, version), so every
# process builds what any version must hold without shipping data.

def model_shapes(mib: int, tp: int) -> dict[str, tuple[int, ...]]:
    """Square-ish layers: per layer a fused q/k/v (row shards fused per TP rank), an output projection
    (column-parallel: TP shards along dim 1, strided writes) and a norm (replicated)."""
    width = 1024
    layer_bytes = 4 * (3 * width * width + width * width + width)
    layers = max(1, round(mib * (1 << 20) / layer_bytes))
    shapes: dict[str, tuple[int, ...]] = {}
    for i in range(layers):
        for p in ("q", "k", "v"):
            shapes[f"l{i}.{p}"] = (width, width)
        shapes[f"l{i}.o"] = (width, width)
        shapes[f"l{i}.norm"] = (width,)
    assert all(s[0] % (tp * 8) == 0 for s in shapes.values())
    return shapes


def values(name_id: int, shape: tuple[int, ...], version: int, lr: float | None = None) -> Any:
    """Tensor ``name_id``'s full value at ``version``: float32 integers (``lr`` None: every word
    changes from version to version), or BF16 weights after ``version`` Adam steps at ``lr``."""
    import torch

    if lr is not None:
        return _trajectory(name_id, shape, lr).at(version)
    n = 1
    for d in shape:
        n *= d
    i = torch.arange(n, dtype=torch.int64)
    # below 2**23: exact in float32
    return ((i * 7 + version * 131 + name_id * 1009) % (1 << 23)).to(torch.float32).reshape(shape)


class AdamTrajectory:
    """One tensor's training run, the same in every process: float32 master weights of std 0.02 and
    gradients of std 1 from seeds of (tensor, step), Adam's update at ``lr``, BF16 weights cast from the
    master. Only elementwise torch ops, each one rounding, so every process computes every bit alike
    (no fused multiply-add, no reduction). Versions are asked for in increasing order; each one steps
    on from the last."""

    BETAS, EPS = (0.9, 0.999), 1e-8

    def __init__(self, name_id: int, shape: tuple[int, ...], lr: float) -> None:
        import torch

        self.name_id, self.shape, self.lr = name_id, shape, lr
        g = torch.Generator().manual_seed(1_000_003 * (name_id + 1))
        self.master = torch.randn(shape, generator=g, dtype=torch.float32).mul(0.02)
        self.m = torch.zeros(shape, dtype=torch.float32)
        self.v = torch.zeros(shape, dtype=torch.float32)
        self.step = 0

    def at(self, version: int) -> Any:
        import torch

        if version < self.step:
            raise ValueError(f"tensor {self.name_id}: version {version} asked after {self.step}")
        b1, b2 = self.BETAS
        while self.step < version:
            self.step += 1
            g = torch.Generator().manual_seed(1_000_003 * (self.name_id + 1) + self.step)
            grad = torch.randn(self.shape, generator=g, dtype=torch.float32)
            self.m = torch.add(torch.mul(self.m, b1), torch.mul(grad, 1 - b1))
            self.v = torch.add(torch.mul(self.v, b2), torch.mul(torch.mul(grad, grad), 1 - b2))
            m_hat = torch.div(self.m, 1 - b1 ** self.step)
            v_hat = torch.div(self.v, 1 - b2 ** self.step)
            update = torch.div(m_hat, torch.add(torch.sqrt(v_hat), self.EPS))
            self.master = torch.sub(self.master, torch.mul(update, self.lr))
        return self.master.to(torch.bfloat16)


_trajectories: dict[tuple[int, tuple[int, ...], float], AdamTrajectory] = {}


def _trajectory(name_id: int, shape: tuple[int, ...], lr: float) -> AdamTrajectory:
    key = (name_id, shape, lr)
    if key not in _trajectories:
        _trajectories[key] = AdamTrajectory(name_id, shape, lr)
    return _trajectories[key]


def trainer_box(shape: tuple[int, ...], rank: int, world: int) -> tuple[tuple[slice, ...], tuple[int, ...]]:
    rows = shape[0] // world
    if len(shape) == 1:
        return (slice(rank * rows, (rank + 1) * rows),), (rank * rows,)
    return (slice(rank * rows, (rank + 1) * rows), slice(None)), (rank * rows, 0)


def rollout_view(shapes: dict[str, tuple[int, ...]], tp_rank: int, tp: int, version: int,
                 lr: float | None = None, fp8: bool = False) -> dict[str, Any]:
    """What TP rank ``tp_rank`` holds of ``version``: fused qkv rows (``fp8``: q, k and v apart, each
    quantized with its scales), o's columns, the full norm."""
    import torch

    from weightsync.runtime.transforms import quantize_fp8_blocks

    names = list(shapes)
    full = {n: values(names.index(n), shapes[n], version, lr) for n in names}
    out: dict[str, Any] = {}
    for n in names:
        layer, part = n.split(".")
        if fp8 and part != "norm":
            q, scale = quantize_fp8_blocks(full[n], FP8_BLOCK)
            if part == "o":
                cols = shapes[n][1] // tp
                out[n] = q[:, tp_rank * cols:(tp_rank + 1) * cols].contiguous()
                tiles = cols // FP8_BLOCK[1]
                out[n + "_scale_inv"] = scale[:, tp_rank * tiles:(tp_rank + 1) * tiles].contiguous()
            else:
                rows = shapes[n][0] // tp
                out[n] = q[tp_rank * rows:(tp_rank + 1) * rows].clone()
                tiles = rows // FP8_BLOCK[0]
                out[n + "_scale_inv"] = scale[tp_rank * tiles:(tp_rank + 1) * tiles].clone()
            continue
        if part in ("k", "v"):
            continue
        if part == "q":
            rows = shapes[n][0] // tp
            sl = slice(tp_rank * rows, (tp_rank + 1) * rows)
            out[f"{layer}.qkv"] = torch.cat([full[f"{layer}.{p}"][sl] for p in ("q", "k", "v")])
        elif part == "o":
            cols = shapes[n][1] // tp
            out[n] = full[n][:, tp_rank * cols:(tp_rank + 1) * cols].contiguous()
        else:
            out[n] = full[n].clone()
    return out


def rollout_named(shapes: dict[str, tuple[int, ...]], local: dict[str, Any], tp_rank: int, tp: int
                  ) -> dict[str, Any]:
    import weightsync as ws

    named: dict[str, Any] = {}
    for key, t in local.items():
        layer, part = key.split(".")
        if part == "qkv":
            shape = shapes[f"{layer}.q"]
            rows = shape[0] // tp
            named[key] = ws.Fused(t, 0, [(f"{layer}.{p}", (tp_rank * rows, 0), (rows, shape[1]))
                                         for p in ("q", "k", "v")])
        elif part in ("q", "k", "v", "q_scale_inv", "k_scale_inv", "v_scale_inv"):  # FP8: rows of each
            full = _full_shape(shapes, key)
            named[key] = ws.Sharded(t, full, (tp_rank * t.shape[0], 0))
        elif part in ("o", "o_scale_inv"):
            full = _full_shape(shapes, key)
            named[key] = ws.Sharded(t, full, (0, tp_rank * t.shape[1]))
        else:
            named[key] = t
    return named


# The FP8 tiles of --fp8 rollouts (the group's fp8_block): every TP shard is whole tiles.
FP8_BLOCK = (128, 128)


def _full_shape(shapes: dict[str, tuple[int, ...]], key: str) -> tuple[int, ...]:
    """The whole tensor's shape of ``key``, a tensor or its FP8 scales (one per tile)."""
    if key.endswith("_scale_inv"):
        rows, cols = shapes[key[:-len("_scale_inv")]]
        return (-(-rows // FP8_BLOCK[0]), -(-cols // FP8_BLOCK[1]))
    return shapes[key]


def trainer_named(shapes: dict[str, tuple[int, ...]], rank: int, world: int, version: int,
                  lr: float | None = None) -> tuple[dict[str, Any], dict[str, Any]]:
    import weightsync as ws

    names = list(shapes)
    locals_: dict[str, Any] = {}
    named: dict[str, Any] = {}
    for n in names:
        sl, offs = trainer_box(shapes[n], rank, world)
        locals_[n] = values(names.index(n), shapes[n], version, lr)[sl].clone()
        named[n] = ws.Sharded(locals_[n], shapes[n], offs)
    return named, locals_


def layouts(setup: Setup) -> tuple[list[Any], list[Any]]:
    """The layouts the participants describe (same code path as ws.Source / ws.Destination)."""
    import torch

    from weightsync.runtime.describe import describe_tensors

    shapes = model_shapes(setup.mib, setup.tp)
    src = [describe_tensors(trainer_named(shapes, r, setup.trainers, 0, setup.delta_lr)[0])
           for r in range(setup.trainers)]
    dst = []
    for r in range(setup.rollouts):
        view = rollout_view(shapes, r % setup.tp, setup.tp, 0, setup.delta_lr, setup.fp8)
        local = {k: torch.zeros_like(v) for k, v in view.items()}
        dst.append(describe_tensors(rollout_named(shapes, local, r % setup.tp, setup.tp)))
    return src, dst


# --------------------------------------------------------------------------------------------------
# Ray actors (run inside their host's namespace: their raylet was started there)

class Trainer:
    def __init__(self, group: str, secret: str, rank: int, world: int, nics: list[str], mib: int, tp: int,
                 lr: float | None = None, delta: bool = False) -> None:
        import weightsync as ws

        self.shapes = model_shapes(mib, tp)
        self.rank, self.world, self.lr = rank, world, lr
        self.engine = ws.TransferEngine(nics=nics)
        named, self.locals = trainer_named(self.shapes, rank, world, 0, lr)
        self.src = ws.Source(group, rank=rank, tensors=named, engine=self.engine, secret=secret, delta=delta)

    def step(self, version: int) -> None:
        """The optimizer step: ``version``'s values in place (before the push's start, untimed)."""
        names = list(self.shapes)
        for n, local in self.locals.items():
            sl, _ = trainer_box(self.shapes[n], self.rank, self.world)
            local.copy_(values(names.index(n), self.shapes[n], version, self.lr)[sl])

    def push(self, version: int, start_at: float, timeout: float = 120.0) -> dict[str, Any]:
        """Pushes ``version`` (``step`` first) at ``start_at`` (time.monotonic: one clock for every
        process of the machine, whatever its namespace), as trainers leaving one optimizer step together
        would; returns the stats with the start and end times."""
        import weightsync as ws

        while (left := start_at - time.monotonic()) > 0:
            time.sleep(min(left, 0.05))
        t0 = time.monotonic()
        stats = ws.push(self.src, version=version, timeout=timeout)
        d = dict(stats.__dict__)
        d["start"], d["end"] = t0, time.monotonic()
        d["phases"] = dict(stats.phases)
        return d

    def close(self) -> None:
        self.src.close()
        self.engine.close()

    def nic_stats(self) -> list[dict[str, Any]]:
        return self.engine.stats()

    def host(self) -> str:
        from weightsync.control.client import host_id

        return host_id()


class Rollout:
    def __init__(self, group: str, secret: str, rank: int, tp: int, nics: list[str], mib: int,
                 lr: float | None = None, inbox: float = 0.0, fp8: bool = False) -> None:
        import torch

        import weightsync as ws

        self.shapes = model_shapes(mib, tp)
        self.tp_rank, self.tp, self.lr, self.fp8 = rank % tp, tp, lr, fp8
        want = rollout_view(self.shapes, self.tp_rank, tp, 0, lr, fp8)
        self.local = {k: torch.empty_like(v) for k, v in want.items()}
        for t in self.local.values():
            t.view(torch.uint8).fill_(0xFF)  # poison: NaN in float32, BF16 and FP8 e4m3fn
        self.engine = ws.TransferEngine(nics=nics)
        named = rollout_named(self.shapes, self.local, self.tp_rank, tp)
        held = sum(t.numel() * t.element_size() for t in self.local.values())
        self.dst = ws.Destination(group, rank=rank, tensors=named,
                                  mode="inplace", engine=self.engine, secret=secret,
                                  delta_bytes=int(inbox * held))

    def check(self, version: int, timeout: float = 120.0) -> list[str]:
        """Waits for ``version`` and compares every byte with what it must hold; returns the differences."""
        import torch

        try:
            got = self.dst.wait(version, timeout)
        except Exception as exc:  # reported with the push's figures, not raised: the run goes on
            return [f"rank {self.dst.rank}: {type(exc).__name__}: {exc}"]
        want = rollout_view(self.shapes, self.tp_rank, self.tp, version, self.lr, self.fp8)
        bad = [f"version {got} != {version}"] if got != version else []
        for k, t in self.local.items():
            if not torch.equal(t.view(torch.uint8), want[k].view(torch.uint8)):
                wrong = int((t.view(torch.uint8) != want[k].view(torch.uint8)).sum())
                bad.append(f"{k}: {wrong} bytes differ")
        return bad

    def close(self) -> None:
        self.dst.close()
        self.engine.close()

    def nic_stats(self) -> list[dict[str, Any]]:
        return self.engine.stats()

    def host(self) -> str:
        from weightsync.control.client import host_id

        return host_id()


def _kernel_nic_bytes(ns: str, nics: list[str]) -> list[dict[str, int]]:
    out = []
    for nic in nics:
        base = f"/sys/class/net/{nic}/statistics"
        got = subprocess.run(["ip", "netns", "exec", ns, "cat", f"{base}/tx_bytes", f"{base}/rx_bytes"],
                             capture_output=True, text=True, timeout=10, check=True).stdout.split()
        out.append({"tx": int(got[0]), "rx": int(got[1])})
    return out


def driver(setup: Setup) -> dict[str, Any]:
    """Runs inside host 0's namespace: group, actors, pushes, checks. With ``delta_lr`` the same
    trajectory is pushed twice, by a dense group and then by a delta group (``delta=True`` sources,
    destinations with an inbox), each with actors of its own on the same hosts and NICs."""
    import ray

    ray.init(address=f"{setup.head}:{RAY_PORT}", logging_level="ERROR", log_to_driver=False)
    want_nodes = len(setup.hosts)
    deadline = time.monotonic() + 120
    while len([n for n in ray.nodes() if n["Alive"]]) < want_nodes:
        if time.monotonic() > deadline:
            raise RuntimeError(f"only {len(ray.nodes())} of {want_nodes} Ray nodes joined")
        time.sleep(0.5)
    out = _run_group(setup, "emulated", delta=False)
    if setup.delta_lr is not None:
        out["delta"] = _run_group(setup, "emulated-delta", delta=True)
    ray.shutdown()
    return out


def _run_group(setup: Setup, name: str, delta: bool) -> dict[str, Any]:
    """One group's pushes: version 1 (dense, and the first writes to each peer) and, with ``delta``,
    version 2 (the first delta: its scratch and inbox in use) untimed; then ``pushes`` timed ones."""
    import ray

    import weightsync as ws

    group = ws.Group.create(name, setup.trainers, setup.rollouts, relay=setup.relay, fp8_block=FP8_BLOCK,
                            round_bytes=int(setup.round_mib * (1 << 20)),
                            relay_chunk_bytes=int(setup.relay_chunk_mib * (1 << 20)))
    T = ray.remote(num_cpus=0)(Trainer)
    R = ray.remote(num_cpus=0)(Rollout)
    inbox = setup.delta_inbox if delta else 0.0
    # Engines first (they join the group): destinations and sources may come up in any order.
    trainers = [T.options(resources={f"{HOST_RESOURCE}{setup.trainer_host(r)}": 1})
                .remote(name, group.secret, r, setup.trainers,
                        setup.nics_of(r % setup.trainers_per_host), setup.mib, setup.tp, setup.delta_lr,
                        delta)
                for r in range(setup.trainers)]
    rollouts = [R.options(resources={f"{HOST_RESOURCE}{setup.rollout_host(r)}": 1})
                .remote(name, group.secret, r, setup.tp, setup.nics_of(r % setup.rollouts_per_host),
                        setup.mib, setup.delta_lr, inbox, setup.fp8)
                for r in range(setup.rollouts)]
    hosts_seen = {"trainers": ray.get([t.host.remote() for t in trainers], timeout=300),
                  "rollouts": ray.get([r.host.remote() for r in rollouts], timeout=300)}
    status = group.status()

    def kernel_bytes() -> list[list[dict[str, int]]]:
        return [_kernel_nic_bytes(ns, setup.nic_names) for ns in setup.hosts]

    def one_push(version: int, cut_after: float | None = None) -> dict[str, Any]:
        ray.get([t.step.remote(version) for t in trainers], timeout=300)
        k0 = kernel_bytes()
        start_at = time.monotonic() + 1.0  # time for every trainer to get the call
        refs = [t.push.remote(version, start_at) for t in trainers]
        cut_at = None
        if cut_after is not None:
            time.sleep(max(start_at - time.monotonic(), 0.0) + cut_after)
            cut_at = time.monotonic() - start_at
            subprocess.run(["ip", "-n", setup.hosts[0], "link", "set", setup.nic_names[0], "down"],
                           check=True, timeout=30)
        stats = ray.get(refs, timeout=300)
        bad = ray.get([r.check.remote(version, 60.0) for r in rollouts], timeout=300)
        k1 = kernel_bytes()
        return {"version": version, "seconds": max(s["end"] for s in stats) - start_at,
                "late_start": max(s["start"] for s in stats) - start_at,
                "push_seconds": [round(s["seconds"], 4) for s in stats],
                "grant_seconds": [round(s["grant_seconds"], 4) for s in stats],
                "write_seconds": [round(s["write_seconds"], 4) for s in stats],
                "bytes": sum(s["bytes"] for s in stats), "writes": sum(s["writes"] for s in stats),
                "wire_bytes": sum(s["wire_bytes"] for s in stats),
                "dense_bytes": sum(s["dense_bytes"] for s in stats),
                "changed_fraction": max(s["changed_fraction"] for s in stats),
                "encode_seconds": [round(s["encode_seconds"], 4) for s in stats],
                "delta_destinations": sorted({d for s in stats for d in s["delta_destinations"]}),
                "delta_overflow_bytes": sum(s["delta_overflow_bytes"] for s in stats),
                "failed_destinations": sorted({d for s in stats for d in s["failed_destinations"]}),
                "failed_by_trainer": [s["failed_destinations"] for s in stats],
                "relayed": sorted({d for s in stats for d in s["relayed"]}),
                "errors": [e for b in bad for e in b], "cut_after": cut_after, "cut_at": cut_at,
                "kernel_tx": [[b["tx"] - a["tx"] for a, b in zip(h0, h1, strict=True)]
                              for h0, h1 in zip(k0, k1, strict=True)],
                "kernel_rx": [[b["rx"] - a["rx"] for a, b in zip(h0, h1, strict=True)]
                              for h0, h1 in zip(k0, k1, strict=True)]}

    out: dict[str, Any] = {"hosts_seen": hosts_seen, "relay": status.get("relay"),
                           "chain": status.get("chain"), "pushes": []}
    out["warmup"] = one_push(1)
    first = 2
    if delta:
        out["warmup_delta"] = one_push(2)
        first = 3
    for v in range(first, first + setup.pushes):
        out["pushes"].append(one_push(v))
    if setup.cut:
        typical = statistics.median(p["seconds"] for p in out["pushes"]) if out["pushes"] else 1.0
        out["cut"] = one_push(first + setup.pushes, cut_after=0.35 * typical)
        out["cut"]["engine_nics"] = ray.get(trainers[0].nic_stats.remote(), timeout=60)
        subprocess.run(["ip", "-n", setup.hosts[0], "link", "set", setup.nic_names[0], "up"], timeout=30)
    out["engine_nics"] = {"trainers": ray.get([t.nic_stats.remote() for t in trainers], timeout=60),
                          "rollouts": ray.get([r.nic_stats.remote() for r in rollouts], timeout=60)}
    # closed before the next group's engines open on the same NICs
    ray.get([a.close.remote() for a in trainers + rollouts], timeout=120)
    for a in trainers + rollouts:
        ray.kill(a)
    group.shutdown()
    return out


# --------------------------------------------------------------------------------------------------
# The launcher (root namespace): namespaces, Ray nodes, the driver, the simulator

class Launched:
    """What this run started: namespaces and processes, ended by pid and removed at exit."""

    def __init__(self) -> None:
        self.cluster: Any = None
        self.procs: list[subprocess.Popen[bytes]] = []
        self.temp = tempfile.mkdtemp(prefix="wsec")
        # Ray's token authentication, with a token of this run's own for every node and the driver
        # (Ray turns it on for a head by itself when ~/.ray/auth_token exists; the joining nodes must
        # then present the same token).
        token = os.path.join(self.temp, "ray_token")
        Path(token).write_text(secrets.token_hex(32))
        os.chmod(token, 0o600)
        self.env = {**os.environ, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": token,
                    "PYTHONPATH": str(ROOT),
                    # A loaded 2-core machine starts a node's agents slowly: Ray's 15-20 s waits for the
                    # node's registration and its agents' port files ran out (the raylet aborted).
                    "RAY_raylet_start_wait_time_s": "180", "RAY_agent_register_timeout_ms": "180000"}

    def start(self, cmd: list[str], log: str) -> subprocess.Popen[bytes]:
        f = open(os.path.join(self.temp, log), "wb")
        p = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, start_new_session=True,
                             env=self.env)
        self.procs.append(p)
        return p

    def close(self) -> None:
        from tests.support.peer import pid_alive

        # Everything running in our namespaces was started by this run (Ray's raylets, workers, GCS).
        pids: set[int] = set()
        if self.cluster is not None:
            for ns in self.cluster.names or []:
                got = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True, timeout=30)
                pids |= {int(x) for x in got.stdout.split()}
        pids |= {p.pid for p in self.procs if p.poll() is None}
        for sig in (signal.SIGTERM, signal.SIGKILL):
            for pid in sorted(pids):
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass
            deadline = time.monotonic() + 5
            while sig == signal.SIGTERM and time.monotonic() < deadline and any(pid_alive(p) for p in pids):
                time.sleep(0.1)
        for p in self.procs:
            try:
                p.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass
        self.procs = []
        if self.cluster is not None:
            self.cluster.remove()
            self.cluster = None
        keep = os.environ.get("WSEC_KEEP_LOGS")
        if keep:
            # The nodes' and actors' logs (engine warnings, failed pushes' reasons) for a run to look into.
            shutil.copytree(self.temp, keep, dirs_exist_ok=True, symlinks=True,
                            ignore=lambda d, names: [n for n in names if not (Path(d, n).is_dir()
                                                     or n.endswith((".log", ".out", ".err", ".json")))])
        shutil.rmtree(self.temp, ignore_errors=True)


def _ray_bin() -> str:
    return str(Path(sys.executable).parent / "ray")


def launch(setup: Setup, keep_logs: bool = False) -> dict[str, Any]:
    from tests.support import netns

    why = netns.available()
    if why:
        raise RuntimeError(why)
    hosts = setup.trainer_hosts + setup.rollout_hosts
    run = Launched()
    atexit.register(run.close)
    try:
        run.cluster = netns.Cluster(hosts=hosts, nics=setup.gpus_per_host * setup.nics_per_gpu,
                                    rate_mbit=setup.rate_mbit, delay_ms=setup.delay_ms,
                                    latency_ms=setup.queue_ms, port_queue=setup.port_queue,
                                    prefix="wec")
        run.cluster.create()
        setup.hosts = list(run.cluster.names)
        setup.nic_names = run.cluster.nic_names
        setup.head = run.cluster.mgmt_address(0)
        env_ray = [_ray_bin(), "start", "--block", "--disable-usage-stats", "--num-cpus", "2",
                   "--object-store-memory", str(80 << 20)]
        t0 = time.perf_counter()
        for h, ns in enumerate(setup.hosts):
            res = json.dumps({f"{HOST_RESOURCE}{h}": 64})
            where = (["--head", "--port", str(RAY_PORT), "--include-dashboard=false",
                      "--temp-dir", os.path.join(run.temp, "ray")] if h == 0
                     else ["--address", f"{setup.head}:{RAY_PORT}"])
            run.start(["ip", "netns", "exec", ns, *env_ray, *where, "--node-ip-address",
                       run.cluster.mgmt_address(h), "--resources", res], f"ray{h}.log")
            # One node at a time: nodes of one machine pick their socket names in the head's session
            # directory, and nodes started together raced for the same name (none of three joined).
            _wait_started(run, f"ray{h}.log", 300)
        cfg = os.path.join(run.temp, "setup.json")
        Path(cfg).write_text(json.dumps(asdict(setup)))
        got = subprocess.run(["ip", "netns", "exec", setup.hosts[0], sys.executable, __file__, "--driver",
                              cfg],
                             capture_output=True, text=True, timeout=1800, cwd=str(ROOT),
                             env=run.env)
        if got.returncode != 0:
            logs = "".join(f"\n--- {f}\n" + Path(run.temp, f).read_text()[-3000:]
                           for f in sorted(os.listdir(run.temp)) if f.endswith(".log"))
            raise RuntimeError(f"driver failed ({got.returncode}):\n{got.stdout[-4000:]}\n"
                               f"{got.stderr[-6000:]}"
                               f"{logs}")
        measured = json.loads(got.stdout.strip().splitlines()[-1])
        measured["cluster_up_s"] = round(time.perf_counter() - t0, 1)
        return measured
    finally:
        run.close()
        atexit.unregister(run.close)


def _wait_started(run: Launched, log: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    path = Path(run.temp, log)
    while time.monotonic() < deadline:
        if "Ray runtime started" in path.read_text(errors="replace"):
            return
        if run.procs[-1].poll() is not None:
            break
        time.sleep(0.5)
    raise RuntimeError(f"Ray node of {log} did not start: {path.read_text(errors='replace')[-3000:]}")


# TCP over Ethernet at MTU 1500 with timestamps: 1448 payload bytes in a 1514-byte frame (tc's tbf counts
# the frame from its Ethernet header on). The rxm/tcp providers' own headers add well under 1% here.
TCP_WIRE_EFFICIENCY = 1448 / 1514
# The engine's sender time per write over tcp;ofi_rxm: the inverse of bench_engine.py's 4 KiB writes per
# second on the development VM, where the emulated cluster runs.
ENGINE_WRITE_US = 8.7


def simulate(setup: Setup, **cost_kw: Any) -> dict[str, Any]:
    """The simulator on the plan the coordinator computes for this setup (same layouts, hosts, rounds),
    with the model of the cluster-scale figures ("ideal": a GPU's NICs as one port, no header bytes) and
    the corrected one ("engine": each NIC its own port with the engine's pieces on it, TCP's header
    bytes, this engine's per-write cost)."""
    from weightsync.plan.planner import plan
    from weightsync.sim.simulate import CostModel, simulate_relay
    from weightsync.sim.simulate import simulate as sim

    src, dst = layouts(setup)
    s_hosts = [setup.trainer_host(r) for r in range(setup.trainers)]
    d_hosts = [setup.rollout_host(r) for r in range(setup.rollouts)]
    relay = setup.relay and setup.tp == 1 and setup.replicas > 1
    if relay:  # the sources write into the chain's head (rollout 0); the members forward, in rank order
        p = plan(src, dst[:1], source_hosts=s_hosts, destination_hosts=d_hosts[:1],
                 round_bytes=int(setup.round_mib * (1 << 20)), fp8_block=FP8_BLOCK)
    else:
        p = plan(src, dst, source_hosts=s_hosts, destination_hosts=d_hosts,
                 round_bytes=int(setup.round_mib * (1 << 20)), fp8_block=FP8_BLOCK)
    out: dict[str, Any] = {"writes": len(p), "relay": relay}
    tcp = {"wire_efficiency": TCP_WIRE_EFFICIENCY, "msg_overhead_us": ENGINE_WRITE_US}
    models = {"ideal": {}, "tcp": tcp, "engine": {**tcp, "striping": "engine"}}
    for name, kw in models.items():
        cost = CostModel(nic_gbps=setup.rate_mbit / 1000.0, nics_per_gpu=setup.nics_per_gpu, **kw, **cost_kw)
        r = (simulate_relay(p, s_hosts, d_hosts, cost, int(setup.relay_chunk_mib * (1 << 20))) if relay
             else sim(p, s_hosts, d_hosts, cost))
        out[name] = {"sim_s": r.sim_s, "bound_s": r.bound_s, "bytes_total": r.bytes_total, "flows": r.flows,
                     "nic_bytes_in": None if r.nic_bytes_in is None else r.nic_bytes_in.tolist(),
                     "cost_model": asdict(cost)}
    return out


def compare(setup: Setup, measured: dict[str, Any]) -> dict[str, Any]:
    """Measured against simulated. The simulator predicts the data phase (first write to last landed);
    a push also has its control phase (the grants before the writes, the acks after the last landing),
    which the runtime measures in every push: total = data phase + control phase."""
    pushes = measured["pushes"]
    total = [p["seconds"] for p in pushes]
    data = [max(p["write_seconds"]) for p in pushes]
    sim = simulate(setup)
    if sim["relay"]:
        # Through a relay chain the version reaches the tail well after the sources' writes into the
        # head ended: the data phase is all of the push after the grants (the acks are in it too).
        data = [t - max(p["grant_seconds"]) for t, p in zip(total, pushes, strict=True)]
    control = [t - d for t, d in zip(total, data, strict=True)]

    def med(xs: list[float]) -> float:
        return float(statistics.median(xs))

    out = {"measured_s": total, "measured_data_s": data, "measured_control_s": control,
           "measured_median_s": med(total), "measured_spread_s": [min(total), max(total)],
           "data_median_s": med(data), "data_spread_s": [min(data), max(data)],
           "control_median_s": med(control),
           "sim": sim}
    for name in ("ideal", "tcp", "engine"):
        out[f"data_over_sim_{name}"] = med(data) / sim[name]["sim_s"]
        out[f"total_over_sim_{name}_plus_control"] = med(total) / (sim[name]["sim_s"] + med(control))
    # what the destinations' NICs received (kernel counters, payload and headers) against the prediction
    rx = [p["kernel_rx"] for p in pushes]
    out["kernel_rx_per_nic_median"] = [[med([r[h][k] for r in rx]) for k in range(len(rx[0][h]))]
                                       for h in range(len(rx[0]))]
    return out


def delta_summary(measured: dict[str, Any]) -> dict[str, Any]:
    """The delta group's timed pushes against the dense group's of the same run (same trajectory, hosts
    and NICs)."""
    dense = [p["seconds"] for p in measured["pushes"]]
    pushes = measured["delta"]["pushes"]
    delta = [p["seconds"] for p in pushes]
    rollouts = len(measured["delta"]["hosts_seen"]["rollouts"])
    d_med, n_med = statistics.median(delta), statistics.median(dense)
    return {"delta_s": delta, "dense_s": dense, "delta_median_s": d_med, "dense_median_s": n_med,
            "delta_over_dense": d_med / n_med, "dense_over_delta": n_med / d_med,
            "changed_fraction_median": statistics.median(p["changed_fraction"] for p in pushes),
            "wire_over_dense_bytes": (sum(p["wire_bytes"] for p in pushes)
                                      / sum(p["dense_bytes"] for p in pushes)),
            "overflow_bytes": sum(p["delta_overflow_bytes"] for p in pushes),
            "encode_seconds_max": max(max(p["encode_seconds"]) for p in pushes),
            "all_delta": all(len(p["delta_destinations"]) == rollouts for p in pushes)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--driver", help=argparse.SUPPRESS)
    d = Setup()
    for f in ("trainer_hosts", "trainers_per_host", "rollout_hosts", "replicas", "tp", "nics_per_gpu",
              "rate_mbit", "mib", "pushes"):
        ap.add_argument("--" + f.replace("_", "-"), type=int, default=getattr(d, f))
    ap.add_argument("--delay-ms", type=float, default=d.delay_ms, help="one-way delay per NIC (netem)")
    ap.add_argument("--queue-ms", type=int, default=d.queue_ms, help="tbf queue per NIC, ms of its rate")
    ap.add_argument("--port-queue", choices=("priority", "fifo"), default=d.port_queue,
                    help="how a shaped port queues: small packets (ACKs) first, or one FIFO as before")
    ap.add_argument("--round-mib", type=float, default=d.round_mib)
    ap.add_argument("--cut", action="store_true", help="one more push with NIC 0 of host 0 cut mid-push")
    ap.add_argument("--relay", action="store_true", help="relay (only where the destinations are replicas)")
    ap.add_argument("--relay-chunk-mib", type=float, default=d.relay_chunk_mib,
                    help="relay: the largest write a chain member forwards at once")
    ap.add_argument("--delta-lr", type=float, default=None,
                    help="BF16 weights stepped by Adam at this rate, pushed by a dense group, then by a "
                         "delta group: delta against dense in one run")
    ap.add_argument("--fp8", action="store_true",
                    help="rollouts hold q, k, v and o in FP8 with 128 x 128 block scales (sources quantize)")
    ap.add_argument("--delta-inbox", type=float, default=d.delta_inbox,
                    help="--delta-lr: a destination's inbox, a fraction of the bytes it holds")
    a = ap.parse_args(argv)
    if a.driver:
        setup = Setup(**json.loads(Path(a.driver).read_text()))
        print(json.dumps(driver(setup)))
        return 0
    keys = ("trainer_hosts", "trainers_per_host", "rollout_hosts", "replicas", "tp", "nics_per_gpu",
            "rate_mbit", "mib", "pushes", "delay_ms", "queue_ms", "port_queue", "round_mib", "cut",
            "relay", "relay_chunk_mib", "delta_lr", "delta_inbox", "fp8")
    setup = Setup(**{k: getattr(a, k) for k in keys})
    # SIGTERM (timeout, kill): unwind like Ctrl-C, so that launch's cleanup removes what it made
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    measured = launch(setup)
    cmp = compare(setup, measured)
    out = {"setup": {k: v for k, v in asdict(setup).items() if k not in ("hosts", "nic_names", "head")},
           **cmp, "errors": [e for p in [*measured["pushes"], measured["warmup"]] for e in p["errors"]],
           "measured": measured, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
           "load_avg": os.getloadavg()}
    if "cut" in measured:
        c = measured["cut"]
        print(f"NIC cut at {c['cut_at']:.3f} s: push {c['seconds']:.3f} s, errors {c['errors']}, "
              f"failed {c['failed_destinations']}, host 0 NIC tx bytes {c['kernel_tx'][0]}")
    if "delta" in measured:
        out["delta"] = delta_summary(measured)
        out["errors"] += [e for p in [*measured["delta"]["pushes"], measured["delta"]["warmup"],
                                      measured["delta"]["warmup_delta"]] for e in p["errors"]]
        dd = out["delta"]
        print(f"delta at lr {setup.delta_lr:g}: {dd['delta_median_s']:.3f} s against dense "
              f"{dd['dense_median_s']:.3f} s in the same run = {dd['delta_over_dense']:.3f}x "
              f"({dd['dense_over_delta']:.1f}x faster); changed {dd['changed_fraction_median']:.4f}, "
              f"wire {dd['wire_over_dense_bytes']:.4f} of the dense bytes, "
              f"overflow {dd['overflow_bytes']} B, "
              f"every push a delta to every destination: {dd['all_delta']}")
    sim = cmp["sim"]
    print(f"measured push {cmp['measured_median_s']:.3f} s (median of {len(cmp['measured_s'])}, "
          f"{cmp['measured_spread_s'][0]:.3f}-{cmp['measured_spread_s'][1]:.3f}): data phase "
          f"{cmp['data_median_s']:.3f} s ({cmp['data_spread_s'][0]:.3f}-{cmp['data_spread_s'][1]:.3f}), "
          f"control {cmp['control_median_s']:.3f} s")
    for name in ("ideal", "tcp", "engine"):
        print(f"simulated ({name}): {sim[name]['sim_s']:.3f} s (bound {sim[name]['bound_s']:.3f} s); "
              f"data/sim {cmp[f'data_over_sim_{name}']:.3f}, total/(sim+control) "
              f"{cmp[f'total_over_sim_{name}_plus_control']:.3f}")
    print(json.dumps(out))
    return 0 if not out["errors"] and not measured.get("cut", {}).get("errors") else 1


if __name__ == "__main__":
    sys.exit(main())
