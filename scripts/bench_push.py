"""Push benchmarks: weightsync against the broadcasts RL frameworks use, delta pushes, and the CPU section.

GPU scenarios (``--device cuda``, one host with four NVLink GPUs; every source and destination a Ray GPU
actor; random bf16 weights built from public configs, see scripts/bench_worker.py):

1. Llama-3-8B, 2 trainer GPUs (FSDP over 2, dim-0 shards) to 2 rollout GPUs holding full replicas in
   vLLM's fused layout (``qkv_proj``, ``gate_up_proj``);
2. the same trainers to one TP-2 rollout (vLLM's TP layout: fused per rank, row-parallel split on dim 1);
3. 1 trainer GPU to 3 full replicas (fan-out);
4. Qwen3-30B-A3B, 2 trainers to one rollout with TP-2 attention and expert parallelism over 2 GPUs.

Measured in the same run, on the same tensors:

* weightsync: every trainer calls ``ws.push`` for the same version at once (after a barrier);
  destinations ``inplace``; one warm-up push (opens the IPC handles), then the median over ``--pushes``
  of the slowest source's ``push()`` time (ends when every destination acked the complete version);
* a. gather + bucketed broadcast: per bucket, the trainers all-gather the shards (what FSDP's
  ``full_tensor()`` does), trainer 0 NCCL-broadcasts the bucket to the rollouts, the rollouts copy each
  tensor's slices into their fused parameters; every bucket size of ``--buckets-mib``, the best reported;
* b. the same one parameter at a time (OpenRLHF's way);
* c. checkpoint-engine (PyPI) in broadcast mode (scripts/bench_ckpt_engine.py);
* d. the bound: the most bytes any GPU must receive or send, over the copy-engine bandwidth measured at
  the start of the run (one device-to-device copy GPU 0 -> GPU 1 in the driver). "must" lets relays
  forward bytes (scenario 3: a trainer must send the model once); "direct" is what direct writes from
  the holders must move (scenario 3: the model three times from the one trainer).

Every timed run is verified afterwards: each rollout compares every byte of every parameter with its own
copy of that version's values (trainers update their shards and rollouts poison theirs with NaN before
each run), so a run that moves wrong bytes fails instead of reporting a figure. Output: a table, one
JSON line, and with ``--out DIR`` bench_push.md, bench_push.json and bench_push.png. ``--device cpu``
runs the same code on CPU actors (gloo, TCP loopback; tiny shapes by default) to check it without GPUs.

``--delta-lr LR`` (1e-6 for the figures quoted) adds, per scenario right after its weightsync push, the
same scenario as delta pushes; this is the delta push benchmark (scenario 5, one trainer to one fused
replica on two GPUs, is the smallest; scripts/bench_delta.py times the codec alone). A group of its own
with ``ws.Source(delta=True)`` trainers and rollouts with a delta inbox (``--delta-inbox``, a fraction of
the rollout's bytes); one warm-up push (dense: no reference yet), then per push one Adam step on the
trainers (fp32 masters, ``0.02 * randn`` initially, on random gradients; the BF16 shards are the rounded
masters, so the changes come from a training step and the changed fraction is measured), and the timed
delta push (first one a warm-up). ``--adam kept`` (default): Adam's moments and step count kept across
pushes as a trainer's optimizer keeps them (KeptAdam: torch.optim.Adam's single-tensor math, checked
bitwise against it on CPU at the start of a ``--device cpu`` run); the moments on the trainer's GPU while
they fit with 8 GB to spare, else pinned host memory; the first ``--adam-warmup`` steps (default 2)
pushed untimed, so the timed pushes are Adam's steps 3 on. Where the trainers' pinned state would exceed
40% of the host's RAM (``--adam-host-fraction``) (scenario 4, Qwen3-30B-A3B: masters 61 GB and moments
122 GB per trainer) that scenario falls back to ``first`` and says so (printed, in the table's note and
the JSON's ``adam_note``). ``--adam first``: torch.optim.Adam's first step every push (fresh moments).
The changed fraction depends on the step: the first moves every value by exactly ``lr``; kept moments at
lr 1e-6, steps 1-8: 4.23, 2.84, 2.30, 2.01, 1.81, 1.67, 1.56, 1.47% of BF16 values (lr 1e-5: 25.1, 17.5,
14.5, 12.8, 11.6, 10.8, 10.2, 9.6%). Printed per scenario: the Adam mode and the timed steps, the
fraction of BF16 values each step changed (and what the push saw), one Adam step's seconds and where the
state lives, the dense push's median (the weightsync part above: same run, same scenario), the delta
push's, their ratio (the goal: at most 0.35x), wire bytes against dense bytes and how much of the wire
is writes sent as planned for want of inbox room, encode (by phase) and apply seconds (PushStats), and
for one trainer to one rollout GPU the encode and apply GB/s as scripts/simulate_delta.py's inputs.
Rollouts are not poisoned between delta pushes (a delta lands on the version they hold); after every push
their bytes are compared with the trainers' (gathered and broadcast to them). A fan-out that relays
(scenario 3) relays its delta pushes too: the writes sent as planned go through the chain, each replica
gets the encoded changes from the trainer directly. ``--delta-trace DIR``: one more push after the timed
ones, untimed, recorded on every participant (host marks; on GPUs the profiler's kernels and copies), its
timeline printed. The budget (``--budget-s``) holds: the part is not started after it, and stops after
two timed pushes once it is spent. The kernel and the torch paths of the compare: run twice, the second
time with ``WEIGHTSYNC_DELTA_KERNELS=0``.

``--cpu``: the control plane's own cost on this machine, over TCP loopback.

1. Round trip of a push of a small model (all sources push, every destination has the version and has
   acknowledged it): the median over many pushes of the slowest source's ``push()`` time.
2. GB/s of a large model pushed from 2 sources to 2 full-replica destinations, beside the engine's
   own figure for one write of the same per-destination bytes between two actors, measured in the same
   run: what the control plane costs on top of the data plane.
3. Scenario 1 at small scale (a 0.25 GB Llama-shaped model; tiny with ``--quick``) against gloo
   broadcasts (a, b), the bound taken from the engine's one-write figure of 2.

Every pushed version is checked on the destinations, here too.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import os
import platform
import secrets
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
from scripts.bench_common import (  # noqa: E402
    DELTA_GOAL,
    add_adam_options,
    met,
    percents,
    round_into,
    step_span,
    untimed_steps,
)
from scripts.bench_common import timeline as marks_timeline  # noqa: E402
from scripts.bench_worker import Worker, bucket_plan  # noqa: E402

# NVLink multicast stays off in every process this benchmark starts (the lent GPU hosts require it).
NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
os.environ.update(NO_MULTICAST)


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

    def close(self) -> None:
        self.src.close()


class Rollout:
    def __init__(self, group: str, rank: int, shapes: dict[str, tuple[int, int]]) -> None:
        self.tensors = {name: torch.full(shape, float("nan")) for name, shape in shapes.items()}
        self.dst = ws.Destination(group, rank=rank, tensors=self.tensors, mode="inplace")

    def checksums(self, version: int) -> dict[str, str]:
        self.dst.wait(version, timeout=60)
        return {k: checksum(v) for k, v in self.tensors.items()}

    def close(self) -> None:
        self.dst.close()


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

    def close(self) -> None:
        self.engine.close()


class Host:
    """One actor process that hosts several of the objects above in turn (``--cpu``): four processes for
    the whole CPU section instead of one per object, because starting a process that imports torch is
    most of a quick run's time on a 2-core machine."""

    def __init__(self) -> None:
        self.objs: dict[str, Any] = {}

    def make(self, key: str, cls: Any, *args: Any) -> None:
        self.objs[key] = cls(*args)

    def call(self, key: str, method: str, *args: Any) -> Any:
        return getattr(self.objs[key], method)(*args)

    def drop(self, key: str) -> None:
        obj = self.objs.pop(key, None)
        if obj is not None and hasattr(obj, "close"):
            obj.close()


class Hosted:
    """``actor.method.remote(...)`` for an object living in a Host under ``key``."""

    def __init__(self, host: Any, key: str) -> None:
        self.host, self.key = host, key

    def __getattr__(self, method: str) -> Any:
        host, key = self.host, self.key

        class _Remote:
            @staticmethod
            def remote(*args: Any) -> Any:
                return host.call.remote(key, method, *args)

        return _Remote()


def _drop(obj: Any) -> None:
    if isinstance(obj, Hosted):
        ray.get(obj.host.drop.remote(obj.key), timeout=60)
    else:
        ray.kill(obj)


def run_group(name: str, shapes: dict[str, tuple[int, int]], pushes: int,
              hosts: list[Any] | None = None) -> dict[str, Any]:
    group = ws.Group.create(name, num_sources=2, num_destinations=2)
    # Sources and destinations start at once (each constructor waits for the group's plan).
    if hosts is None:
        trainers = [ray.remote(num_cpus=0)(Trainer).remote(name, i, 2, shapes) for i in range(2)]
        rollouts = [ray.remote(num_cpus=0)(Rollout).remote(name, j, shapes) for j in range(2)]
        ray.get([a.__ray_ready__.remote() for a in trainers + rollouts], timeout=300)
    else:
        made = [hosts[i].make.remote(f"{name}/t{i}", Trainer, name, i, 2, shapes) for i in range(2)]
        made += [hosts[2 + j].make.remote(f"{name}/r{j}", Rollout, name, j, shapes) for j in range(2)]
        ray.get(made, timeout=300)
        trainers = [Hosted(hosts[i], f"{name}/t{i}") for i in range(2)]
        rollouts = [Hosted(hosts[2 + j], f"{name}/r{j}") for j in range(2)]
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
            _drop(a)
        group.shutdown()


def engine_baseline(nbytes: int, repeat: int, hosts: list[Any] | None = None) -> dict[str, Any]:
    if hosts is None:
        end = ray.remote(num_cpus=0)(EngineEnd)
        a, b = end.remote(nbytes), end.remote(nbytes)
    else:
        ray.get([hosts[0].make.remote("engine/a", EngineEnd, nbytes),
                 hosts[2].make.remote("engine/b", EngineEnd, nbytes)], timeout=300)
        a, b = Hosted(hosts[0], "engine/a"), Hosted(hosts[2], "engine/b")
    try:
        address, descriptor = ray.get(b.info.remote())
        times = ray.get(a.send.remote(address, descriptor, repeat), timeout=600)
        ray.get(b.received.remote(len(times) * ray.get(a.imm_count.remote())), timeout=60)
    finally:
        _drop(a)
        _drop(b)
    best = min(times)
    return {"bytes": nbytes, "median_s": statistics.median(times), "best_gbps": nbytes / best / 1e9,
            "median_gbps": nbytes / statistics.median(times) / 1e9}


# ------------------------------------------------------------------------------------------------
# Scenarios: real model shapes, FSDP trainers to vLLM-layout rollouts, against broadcasts.

SCENARIOS: dict[int, dict[str, Any]] = {
    1: {"model": "llama", "T": 2, "R": 2, "tp": 1, "what": "2 FSDP trainers -> 2 full replicas (fused)"},
    2: {"model": "llama", "T": 2, "R": 2, "tp": 2,
        "what": "2 FSDP trainers -> 1 TP-2 rollout (fused qkv/gate_up)"},
    3: {"model": "llama", "T": 1, "R": 3, "tp": 1, "what": "1 trainer -> 3 full replicas (fan-out)"},
    4: {"model": "moe", "T": 2, "R": 2, "tp": 2,
        "what": "MoE: 2 FSDP trainers -> 1 rollout, TP-2 attention, EP-2 experts"},
    # The 2-GPU analogues (a host with two NVLink GPUs): one trainer holding the whole model.
    5: {"model": "llama", "T": 1, "R": 1, "tp": 1, "what": "1 trainer -> 1 full replica (fused)"},
    6: {"model": "moe", "T": 1, "R": 1, "tp": 1, "what": "MoE: 1 trainer -> 1 rollout (fused experts)"},
}
MODELS = {"full": {"llama": "llama-3-8b", "moe": "qwen3-30b-a3b"},
          "small": {"llama": "llama-small", "moe": "moe-tiny"},
          "tiny": {"llama": "llama-tiny", "moe": "moe-tiny"}}


def _pythonpath() -> str:
    # The repository first, then whatever the caller added (e.g. where checkpoint-engine's wheels went).
    extra = os.environ.get("PYTHONPATH", "")
    return ROOT + (os.pathsep + extra if extra else "")


def _forwarded_env() -> dict[str, str]:
    """Settings of this process the actors must share: which delta compare path runs
    (WEIGHTSYNC_DELTA_KERNELS) and how many hardware queues a GPU's streams are spread over
    (CUDA_DEVICE_MAX_CONNECTIONS)."""
    return {k: os.environ[k] for k in ("WEIGHTSYNC_DELTA_KERNELS", "CUDA_DEVICE_MAX_CONNECTIONS")
            if k in os.environ}


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def copy_engine_gbps(nbytes: int, repeat: int) -> dict[str, Any]:
    """GB/s of one device-to-device copy GPU 0 -> GPU 1 in this (driver) process: ``Tensor.copy_``
    across devices is a peer memcpy on the copy engines over NVLink, no SMs. Median of ``repeat``."""
    a = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device="cuda:0")
    b = torch.empty(nbytes, dtype=torch.uint8, device="cuda:1")
    b.copy_(a)
    torch.cuda.synchronize(0)
    torch.cuda.synchronize(1)
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        b.copy_(a, non_blocking=True)
        torch.cuda.synchronize(0)
        torch.cuda.synchronize(1)
        times.append(time.perf_counter() - t0)
    ok = bool(torch.equal(a.cpu(), b.cpu()))
    del a, b
    torch.cuda.empty_cache()
    if not ok:
        raise SystemExit("copy-engine bound: the copy GPU 0 -> GPU 1 landed wrong bytes")
    return {"gbps": nbytes / statistics.median(times) / 1e9, "bytes": nbytes, "times": times,
            "how": "torch copy_ cuda:0 -> cuda:1 in one process (peer memcpy on the copy engines)"}


class Team:
    """The T + R worker actors of one scenario; restarted after a failed part (a hung collective).
    With ``hosts`` (the CPU section) the workers live in those long-lived actors instead."""

    def __init__(self, spec: dict[str, Any], model: str, device: str, hosts: list[Any] | None = None,
                 worker: type = Worker) -> None:
        self.spec, self.model, self.device, self.hosts = spec, model, device, hosts
        self.worker = worker
        self.workers: list[Any] = []
        self._started = 0

    def start(self, timeout: float) -> list[dict[str, Any]]:
        self.stop()
        T, R = self.spec["T"], self.spec["R"]
        port = free_port()
        args = [(rank, T, R, self.spec["tp"], self.model, self.device, port) for rank in range(T + R)]
        self._started += 1
        if self.hosts is not None:
            keys = [f"team{id(self)}-{self._started}/w{rank}" for rank in range(T + R)]
            ray.get([self.hosts[rank].make.remote(keys[rank], self.worker, *args[rank])
                     for rank in range(T + R)], timeout=timeout)
            self.workers = [Hosted(self.hosts[rank], keys[rank]) for rank in range(T + R)]
        else:
            opts = {"num_gpus": 1, "num_cpus": 0} if self.device == "cuda" else {"num_cpus": 0}
            cls = ray.remote(**opts)(self.worker)
            self.workers = [cls.remote(*a) for a in args]
        return ray.get([w.info.remote() for w in self.workers], timeout=timeout)

    @property
    def trainers(self) -> list[Any]:
        return self.workers[:self.spec["T"]]

    @property
    def rollouts(self) -> list[Any]:
        return self.workers[self.spec["T"]:]

    def call(self, method: str, *args: Any, timeout: float, who: list[Any] | None = None) -> list[Any]:
        return ray.get([getattr(w, method).remote(*args) for w in (who or self.workers)], timeout=timeout)

    def verify(self, version: int, timeout: float) -> int:
        out = self.call("verify", version, timeout=timeout, who=self.rollouts)
        bad = [(j, o["bad"], o["nbad"]) for j, o in enumerate(out) if not o["ok"]]
        if bad:
            raise RuntimeError(f"version {version}: wrong bytes on rollouts (rollout, first pieces, count): "
                               f"{bad}")
        return sum(o["bytes"] for o in out)

    def stop(self) -> None:
        if self.hosts is None and self.workers:
            # Let the workers end what they started (checkpoint-engine's processes, engines) before the
            # kill; a worker stuck in a collective does not answer and is killed all the same.
            refs = [w.close.remote() for w in self.workers]
            ray.wait(refs, num_returns=len(refs), timeout=20)
        for w in self.workers:
            try:
                _drop(w)
            except Exception as exc:  # a worker that is gone already
                print(f"    (stopping a worker: {type(exc).__name__})", flush=True)
        if self.hosts is None:
            # Wait until the killed processes are gone, so the next team finds their GPU memory free.
            for w in self.workers:
                try:
                    ray.get(w.__ray_ready__.remote(), timeout=15)
                except Exception:  # RayActorError once the actor is dead: what we wait for
                    pass
        self.workers = []


# ------------------------------------------------------------------------------------------------
# Delta pushes (``--delta-lr``): the same scenarios with changes from a training step.

ADAM_CHUNK = 1 << 26  # elements of the flat buffer one Adam step takes at a time (fp32: 256 MiB)
MASTER_HEADROOM = 8 << 30  # GPU bytes left free beside fp32 masters kept on the GPU (encode, apply, Adam)
VERIFY_BUCKET = 256 << 20  # bytes per gather + broadcast of the check against the sources

ADAM_BETAS = (0.9, 0.999)  # torch.optim.Adam's defaults
ADAM_EPS = 1e-8


def adam_update(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
                step: int, lr: float) -> None:
    """One Adam step of ``param`` in place with its moments kept: torch.optim.Adam's single-tensor update
    (default betas and eps, no weight decay, not amsgrad, not capturable), op for op, so that on CPU the
    masters are bitwise torch's (adam_self_check). ``step`` is this step's number (1 for the first): the
    bias corrections come from it, as torch's do from its step count."""
    beta1, beta2 = ADAM_BETAS
    exp_avg.lerp_(grad, 1 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
    step_size = lr / (1 - beta1 ** float(step))
    denom = (exp_avg_sq.sqrt() / (1 - beta2 ** float(step)) ** 0.5).add_(ADAM_EPS)
    param.addcdiv_(exp_avg, denom, value=-step_size)


class KeptAdam:
    """Adam's state kept across steps for fp32 masters held in 1-D chunks (views; on the GPU or in pinned
    host memory): per chunk ``exp_avg`` and ``exp_avg_sq``, and one step count (every chunk is stepped
    every step). Each moment chunk lives on the GPU while ``gpu_budget`` bytes last, else in pinned host
    memory (on CPU: host memory); host-held chunks come to the GPU for their step and go back after it.
    ``step`` yields each chunk's updated master on the device, for the caller to round into its BF16 copy,
    and writes host-held masters and moments back when the caller moves on. Adam is elementwise: stepping
    chunks is stepping the tensors they cover."""

    def __init__(self, masters: list[torch.Tensor], dev: torch.device, gpu_budget: int) -> None:
        self.masters, self.dev = masters, dev
        self.exp_avg: list[torch.Tensor] = []
        self.exp_avg_sq: list[torch.Tensor] = []
        self.gpu_bytes = self.host_bytes = 0
        for m in masters:
            for moments in (self.exp_avg, self.exp_avg_sq):
                nbytes = 4 * m.numel()
                on_gpu = dev.type == "cuda" and nbytes <= gpu_budget - self.gpu_bytes
                where = dev if on_gpu or dev.type != "cuda" else torch.device("cpu")
                moments.append(torch.zeros(m.numel(), dtype=torch.float32, device=where,
                                           pin_memory=where != dev))
                if on_gpu:
                    self.gpu_bytes += nbytes
                else:
                    self.host_bytes += nbytes
        self.steps = 0

    @staticmethod
    def plan(sizes: list[int], cuda: bool, gpu_budget: int) -> tuple[int, int]:
        """The moments' (GPU bytes, host bytes) for chunks of ``sizes`` elements, placed as __init__ does."""
        gpu = host = 0
        for n in sizes:
            for _ in range(2):
                if cuda and 4 * n <= gpu_budget - gpu:
                    gpu += 4 * n
                else:
                    host += 4 * n
        return gpu, host

    def reset(self) -> None:
        """Fresh moments and step count (a new optimizer on the same masters)."""
        for t in (*self.exp_avg, *self.exp_avg_sq):
            t.zero_()
        self.steps = 0

    def step(self, lr: float, grad: Any) -> Any:
        """One step on the gradients ``grad(i)`` (chunk i's, on the device): yields (i, updated master on
        the device); the state is written back when the caller asks for the next chunk."""
        self.steps += 1
        for i, master in enumerate(self.masters):
            held = [master, self.exp_avg[i], self.exp_avg_sq[i]]
            on_dev = [t.to(self.dev, non_blocking=True) for t in held]
            adam_update(on_dev[0], grad(i), on_dev[1], on_dev[2], self.steps, lr)
            yield i, on_dev[0]
            for h, d in zip(held, on_dev, strict=True):
                if h.device != d.device:
                    h.copy_(d, non_blocking=True)
            del on_dev
        if self.dev.type == "cuda":
            torch.cuda.current_stream(self.dev).synchronize()


def adam_self_check(steps: int = 4, chunk: int = 700) -> str:
    """KeptAdam over chunks of a flat buffer (chunks that split tensors and span their ends) against
    torch.optim.Adam (single-tensor, kept across steps) over the tensors, on CPU, same gradients: the fp32
    masters must be bitwise equal after every step, at lr 1e-6 and 1e-5. Raises otherwise."""
    sizes = [1000, 2500, 333, 4096]
    for lr in (1e-6, 1e-5):
        g = torch.Generator().manual_seed(7)
        flat = torch.randn(sum(sizes), generator=g) * 0.02
        flat[1000:3500] += 1.0  # a norm scale's magnitude too
        params = [torch.nn.Parameter(t.clone()) for t in flat.split(sizes)]
        ref = torch.optim.Adam(params, lr=lr, foreach=False)
        chunks = list(flat.split(chunk))
        adam = KeptAdam(chunks, torch.device("cpu"), 0)
        for s in range(1, steps + 1):
            grads = torch.randn(flat.numel(), generator=g)
            for p, gp in zip(params, grads.split(sizes), strict=True):
                p.grad = gp.clone()
            ref.step()
            gchunks = grads.split(chunk)
            for _ in adam.step(lr, lambda i, gchunks=gchunks: gchunks[i]):
                pass
            want = torch.cat([p.detach() for p in params])
            if not torch.equal(flat.view(torch.int32), want.view(torch.int32)):
                bad = int((flat.view(torch.int32) != want.view(torch.int32)).sum())
                raise SystemExit(f"adam self-check: lr {lr:g} step {s}: {bad} fp32 masters differ from "
                                 "torch.optim.Adam's")
    return (f"adam self-check: chunked kept-moment Adam equals torch.optim.Adam bitwise over {steps} steps "
            f"at lr 1e-6 and 1e-5 (CPU)")



class DeltaWorker(Worker):
    """A scenario worker that also pushes deltas: sources with ``delta=True``, rollouts with a delta inbox,
    and, on trainers, fp32 master weights stepped by Adam with the BF16 shards the rounded masters.

    The masters cover the trainer's flat buffer (every shard a view into it, 256-element aligned) end to
    end; they are stepped on random gradients one chunk of ADAM_CHUNK elements at a time (Adam is
    elementwise, so stepping chunks of the flat buffer is stepping each tensor), either with Adam's moments
    kept across steps (``--adam kept``, KeptAdam: a trainer's optimizer; the moments placed like the
    masters, on the GPU while they fit with MASTER_HEADROOM to spare, else pinned host memory) or as
    torch.optim.Adam's first step every time (``--adam first``: fresh moments, every value moves by about
    ``lr``; the figures before kept moments). Gradients are zero in the gaps between views, which
    therefore never change (in either mode) and are not counted. Initial masters are
    ``0.02 * randn`` (norm scales ``1 + 0.02 * randn``): the changed fraction
    depends on the weights' magnitude against BF16's spacing, so the scale must be a trained model's."""

    def delta_setup(self, group: str, inbox_fraction: float, tuning: dict[str, Any]) -> dict[str, Any]:
        """As ``ws_setup`` (inplace), with ``delta=True`` sources and an inbox of ``inbox_fraction`` of the
        rollout's bytes on every destination."""
        t0 = time.perf_counter()
        engine_opts = {k: tuning[k] for k in ("cuda_streams", "cuda_batch_bytes") if k in tuning}
        if "cuda_rounds_in_flight" in tuning:
            from weightsync.runtime import push as ws_push

            ws_push.ORDERED_ROUNDS_IN_FLIGHT = tuning["cuda_rounds_in_flight"]
        self.engine = ws.TransferEngine(**engine_opts) if engine_opts else None
        tensors = {p.key: self._as_ws(p) for p in self.params}
        if self.trainer:
            self.src = ws.Source(group, rank=self.rank, tensors=tensors, timeout=300, engine=self.engine,
                                 delta=True)
            return {"setup_s": time.perf_counter() - t0}
        nbytes = sum(t.numel() * t.element_size() for t in self.local.values())
        inbox = max(int(nbytes * inbox_fraction), 1 << 20)
        self.dst = ws.Destination(group, rank=self.rank - self.T, tensors=tensors, mode="inplace",
                                  timeout=300, push_timeout=120, engine=self.engine, delta_bytes=inbox)
        return {"setup_s": time.perf_counter() - t0, "inbox_bytes": inbox}

    def _as_ws(self, p: Any) -> Any:
        from scripts.bench_worker import as_ws

        return as_ws(p, self.local[p.key])

    def _delta_layout(self) -> None:
        """Where the gaps between views and the norm scales lie in the flat buffer."""
        gaps, norms, end = [], [], 0
        for key, off, shape in self.views:
            gaps.append(np.arange(end, off, dtype=np.int64))
            end = off + int(np.prod(shape))
            if key.endswith("norm.weight"):
                norms.append((off, end))
        gaps.append(np.arange(end, self.flat.numel(), dtype=np.int64))
        self.gaps = np.concatenate(gaps)
        self.gaps_dev = torch.from_numpy(self.gaps).to(self.dev)
        self.norms = norms
        self.real_elements = sum(int(np.prod(shape)) for _, _, shape in self.views)

    def _initial_master(self, c0: int, c1: int) -> torch.Tensor:
        """Elements [c0, c1) of the initial masters (the same values on every call)."""
        g = torch.Generator(device=self.dev)
        g.manual_seed(zlib.crc32(f"master/{self.rank}/{c0}".encode()))
        m = torch.randn(c1 - c0, generator=g, device=self.dev, dtype=torch.float32).mul_(0.02)
        for a, b in self.norms:
            if a < c1 and b > c0:
                m[max(a, c0) - c0:min(b, c1) - c0] += 1.0
        self._zero_gaps(m, c0, c1)
        return m

    def _zero_gaps(self, t: torch.Tensor, c0: int, c1: int) -> None:
        lo, hi = np.searchsorted(self.gaps, [c0, c1])
        if hi > lo:
            t[self.gaps_dev[lo:hi] - c0] = 0

    def delta_init(self) -> None:
        """Trainers: the BF16 shards become the initial masters rounded (the masters are not kept yet: the
        first push allocates the source's reference, and where the masters fit is decided after it)."""
        if not self.trainer:
            return
        self._delta_layout()
        n = self.flat.numel()
        for c0 in range(0, n, ADAM_CHUNK):
            c1 = min(n, c0 + ADAM_CHUNK)
            self.flat[c0:c1].copy_(self._initial_master(c0, c1))
        self.master: list[torch.Tensor] = []
        self.grad_gen = torch.Generator(device=self.dev)
        self.grad_gen.manual_seed(zlib.crc32(f"grad/{self.rank}".encode()))
        self._sync()

    def _gpu_free(self) -> int:
        if not self.cuda:
            return 0
        torch.cuda.empty_cache()  # blocks torch keeps cached count as used in the driver's figure
        return torch.cuda.mem_get_info()[0]

    def delta_plan(self, adam: str) -> dict[str, Any]:
        """Trainers: where delta_masters(adam) would put the masters and moments now: bytes on the GPU and
        in (pinned) host memory; the driver falls back to ``first`` where the host bytes are too many."""
        if not self.trainer:
            return {}
        n = self.flat.numel()
        free = self._gpu_free()
        masters_on_gpu = not self.cuda or free >= 4 * n + MASTER_HEADROOM
        gpu, host = (4 * n, 0) if masters_on_gpu else (0, 4 * n)
        if adam == "kept":
            sizes = [min(n, c0 + ADAM_CHUNK) - c0 for c0 in range(0, n, ADAM_CHUNK)]
            budget = free - MASTER_HEADROOM - (4 * n if masters_on_gpu and self.cuda else 0)
            mg, mh = KeptAdam.plan(sizes, self.cuda, budget)
            gpu, host = gpu + mg, host + mh
        if not self.cuda:  # everything is host memory on CPU
            gpu, host = 0, gpu + host
        return {"gpu_bytes": gpu, "host_bytes": host}

    def delta_masters(self, adam: str = "first") -> dict[str, Any]:
        """Trainers: the fp32 masters, on the GPU where they fit beside what is there now (the shards,
        the source's reference and inbox payloads) with MASTER_HEADROOM to spare, else in pinned host
        memory (they come to the GPU a chunk at a time). One tensor per ADAM_CHUNK elements: no single
        allocation of the whole, and pinned blocks (which torch rounds up to a power of two) waste
        nothing. With ``adam`` "kept", Adam's moments too (KeptAdam), on the GPU chunk by chunk while the
        rest of the headroom lasts, else pinned host memory."""
        if not self.trainer:
            return {}
        n = self.flat.numel()
        where = self.dev
        free = self._gpu_free()
        if self.cuda and free < 4 * n + MASTER_HEADROOM:
            where = torch.device("cpu")
        self.master_apart = where != self.dev
        t0 = time.perf_counter()
        self.master = []
        for c0 in range(0, n, ADAM_CHUNK):
            c1 = min(n, c0 + ADAM_CHUNK)
            m = torch.empty(c1 - c0, dtype=torch.float32, device=where, pin_memory=self.master_apart)
            self.master.append(m.copy_(self._initial_master(c0, c1), non_blocking=True))
        self._sync()
        out = {"master_on": "GPU" if where.type == "cuda" else ("pinned host" if self.cuda else "host"),
               "master_bytes": 4 * n, "adam": adam}
        self.kept: KeptAdam | None = None
        if adam == "kept":
            budget = self._gpu_free() - MASTER_HEADROOM
            self.kept = KeptAdam(self.master, self.dev, budget)
            out.update(moments_gpu_bytes=self.kept.gpu_bytes, moments_host_bytes=self.kept.host_bytes)
        out["master_s"] = time.perf_counter() - t0
        return out

    def delta_step(self, lr: float) -> dict[str, Any]:
        """Trainers: one Adam step of the masters on random gradients, the shards the rounded masters.
        Returns the BF16 values the step changed (counted here, apart from the push) and the total."""
        if not self.trainer:
            return {"changed": 0, "total": 0}
        assert self.master, "delta_masters first"
        t0 = time.perf_counter()
        n = self.flat.numel()
        changed = torch.zeros((), dtype=torch.int64, device=self.dev)
        if self.kept is not None:
            def grad(i: int) -> torch.Tensor:
                c0 = i * ADAM_CHUNK
                c1 = min(n, c0 + ADAM_CHUNK)
                g = torch.randn(c1 - c0, generator=self.grad_gen, device=self.dev, dtype=torch.float32)
                self._zero_gaps(g, c0, c1)  # zero gradients keep zero moments: the gaps never move
                return g

            for i, p in self.kept.step(lr, grad):
                changed += round_into(self.flat[i * ADAM_CHUNK:i * ADAM_CHUNK + p.numel()], p)
            self._sync()
            return {"changed": int(changed), "total": self.real_elements, "step_s": time.perf_counter() - t0,
                    "adam_step": self.kept.steps}
        for c0, master in zip(range(0, n, ADAM_CHUNK), self.master, strict=True):
            c1 = min(n, c0 + ADAM_CHUNK)
            # Masters on the device: the parameter is a view of them, stepped in place; else a copy.
            p = torch.nn.Parameter(master.to(self.dev, non_blocking=True, copy=self.master_apart))
            grad = torch.randn(c1 - c0, generator=self.grad_gen, device=self.dev, dtype=torch.float32)
            self._zero_gaps(grad, c0, c1)  # a zero gradient leaves Adam's first step at zero
            p.grad = grad
            torch.optim.Adam([p], lr=lr).step()
            changed += round_into(self.flat[c0:c1], p.detach())
            if self.master_apart:
                master.copy_(p.detach(), non_blocking=True)
            del p, grad
        self._sync()
        return {"changed": int(changed), "total": self.real_elements, "step_s": time.perf_counter() - t0,
                "adam_step": 1}

    def delta_push(self, version: int) -> dict[str, Any]:
        """``ws_push``, with the sender's encode by phase and whether its compare ran as kernels (the
        delta sender's own figures; absent where it has none), and the push's start and end on the host
        clock (``push_ns``: where a recorded push's timeline starts)."""
        start_ns = time.time_ns()
        stats = self.ws_push(version)
        if stats:
            stats["push_ns"] = [start_ns, time.time_ns()]
        sender = getattr(self.src, "_delta", None) if self.trainer else None
        if sender is not None:
            stats["encode_phases"] = dict(getattr(sender, "phases", {}))
            if hasattr(sender, "use_kernels"):
                stats["compare_path"] = "kernel" if sender.use_kernels else "torch"
        return stats

    def verify_sources(self) -> dict[str, Any]:
        """Rollouts: every parameter byte equals the trainers' shards now. The trainers all-gather each
        bucket of checkpoint tensors (VERIFY_BUCKET bytes), trainer 0 broadcasts it to the rollouts, which
        compare every piece they hold with it (the broadcast baseline's path, comparing instead of
        copying): a check against the sources' bytes, which after Adam steps no rollout can recompute."""
        buckets = bucket_plan(self.cfg, VERIFY_BUCKET)
        buf = torch.empty(max(sum(n for _, _, n in b) for b in buckets), dtype=torch.uint8, device=self.dev)
        bad: list[str] = []
        checked = 0
        for tensors in self.gather_broadcast(buckets, buf):
            names, differs = [], []
            for name, full in tensors:
                for view, src_box in self.consumers.get(name, ()):
                    names.append(name)
                    differs.append((view.view(torch.int16) != full[src_box].view(torch.int16)).any())
                    checked += view.numel() * view.element_size()
            if differs:  # one host sync per bucket
                bad += [nm for nm, d in zip(names, torch.stack(differs).tolist(), strict=True) if d]
        self._sync()
        del buf
        if self.cuda:
            torch.cuda.empty_cache()
        return {"ok": not bad, "bytes": checked, "bad": bad[:5], "nbad": len(bad)}

    def trace_start(self) -> None:
        """Records this participant's timeline until :meth:`trace_stop`: the host marks
        (weightsync.runtime.trace), and on a GPU the profiler's kernels and copies."""
        from scripts.bench_common import record

        self.recording = record(self.dev)

    def trace_stop(self, folder: str, tag: str) -> tuple[str, str]:
        """Stops the recording and writes it into ``folder``; returns (who, its path)."""
        who = f"trainer {self.rank}" if self.trainer else f"rollout {self.rank - self.T}"
        path = os.path.join(folder, f"{tag}-{who.replace(' ', '')}.json")
        rec, self.recording = getattr(self, "recording", None), None
        if rec is not None:
            rec.stop(path)
        return who, path

    def delta_close(self) -> None:
        self.ws_close()
        self.master = []
        self.kept = None
        # pinned host blocks stay cached in torch otherwise (checkpoint-engine's baseline pins more)
        getattr(torch._C, "_host_emptyCache", lambda: None)()
        if self.cuda:
            torch.cuda.empty_cache()


def _delta_worker() -> type:
    # The class as scripts.bench_push's, not __main__'s: Ray then sends the actors a reference to it.
    from scripts.bench_push import DeltaWorker as cls

    return cls


def _run_part(team: Team, fn: Any, timeout: float, deadline: float | None = None) -> dict[str, Any]:
    """One measured part; a failure is reported in the results and the team restarted for the next.
    A part that would start after ``deadline`` (time.monotonic) is skipped: the run must end in time."""
    if deadline is not None and time.monotonic() > deadline:
        print("    skipped: the run's time budget is spent", flush=True)
        return {"error": "skipped: the run's time budget is spent"}
    try:
        return fn()
    except Exception as exc:  # a failed part must not take the other measurements down with it
        text = str(exc).strip()
        msg = f"{type(exc).__name__}: {text.splitlines()[-1] if text else ''}"
        print(f"    FAILED: {msg}", flush=True)
        team.start(timeout)
        # The whole text (a worker's traceback) goes to the JSON: GPU runs are too few to repeat for it.
        return {"error": msg[:500], "error_detail": text[-6000:]}


def run_scenario(num: int, args: argparse.Namespace, bw_gbps: float, version0: int,
                 hosts: list[Any] | None = None) -> dict[str, Any]:
    from scripts.bench_worker import CONFIGS, traffic

    spec = SCENARIOS[num]
    model = MODELS[args.scale][spec["model"]]
    cfg = CONFIGS[model]
    T, R, tp = spec["T"], spec["R"], spec["tp"]
    tr = traffic(cfg, T, R, tp)
    out: dict[str, Any] = {
        "scenario": num, "what": spec["what"], "model": model, "trainers": T, "rollouts": R, "rollout_tp": tp,
        "model_bytes": tr["model_bytes"], "recv_bytes": tr["recv"], "send_direct_bytes": tr["send_direct"],
        "must_bytes": tr["must_bytes"], "direct_bytes": tr["direct_bytes"],
        "bound_s": tr["must_bytes"] / (bw_gbps * 1e9), "direct_bound_s": tr["direct_bytes"] / (bw_gbps * 1e9),
    }
    print(f"scenario {num}: {spec['what']}, {model} ({tr['model_bytes'] / 1e9:.2f} GB); bound "
          f"{out['bound_s'] * 1e3:.2f} ms ({tr['must_bytes'] / 1e9:.2f} GB at {bw_gbps:.1f} GB/s)",
          flush=True)
    tmo = args.call_timeout
    team = Team(spec, model, args.device, hosts, _delta_worker() if args.delta_lr is not None else Worker)
    t_start = time.perf_counter()
    out["workers"] = team.start(tmo)
    out["start_s"] = time.perf_counter() - t_start
    version = version0

    def next_version() -> int:
        nonlocal version
        version += 1
        team.call("set_version", version, timeout=tmo)  # trainers: new values; rollouts: NaN poison
        return version

    def weightsync() -> dict[str, Any]:
        name = f"bench-s{num}-{os.getpid()}"
        group = ws.Group.create(name, num_sources=T, num_destinations=R, **args.group_opts)
        try:
            t0 = time.perf_counter()
            setup = team.call("ws_setup", name, "inplace", args.tuning, timeout=tmo)
            res: dict[str, Any] = {"mode": "inplace", "setup_s": time.perf_counter() - t0,
                                   "times": [], "phases": [], "writes": 0, "verified_bytes": 0}
            del setup
            for i in range(args.pushes + 1):  # the first push opens the IPC handles: warm-up, not counted
                v = next_version()
                stats = team.call("ws_push", v, timeout=tmo, who=team.trainers)
                team.call("ws_wait", v, timeout=tmo, who=team.rollouts)
                if any(s["failed_destinations"] for s in stats):
                    raise RuntimeError(f"push {v} failed: {[s['failed_destinations'] for s in stats]}")
                res["verified_bytes"] += team.verify(v, tmo)
                slowest = max(stats, key=lambda s: s["seconds"])
                if i == 0:
                    res["first_s"] = slowest["seconds"]
                    continue
                res["times"].append(slowest["seconds"])
                res["phases"].append(slowest["phases"])
                res["writes"] = sum(s["writes"] for s in stats)
            res["median_s"] = statistics.median(res["times"])
            team.call("ws_close", timeout=tmo)
            return res
        finally:
            group.shutdown()

    def delta() -> dict[str, Any]:
        """The scenario as delta pushes (``--delta-lr``; DeltaWorker): a warm-up push (dense: the sources
        have no reference yet), then per push one Adam step on the trainers and the delta push, timed as
        above (the slowest source's ``push()``); the first delta push is a warm-up too (with ``--adam
        kept``, the first ``--adam-warmup``: Adam's early steps change more values). The rollouts are
        not poisoned in between (a delta lands on the version they hold); after every push their bytes
        are checked against the trainers'."""
        res: dict[str, Any] = {"lr": args.delta_lr, "inbox_fraction": args.delta_inbox, "times": [],
                               "changed_fraction": [], "push_changed_fraction": [], "wire_bytes": [],
                               "dense_bytes": [], "encode_s": [], "apply_s": [], "step_s": [],
                               "not_delta": [], "phases": [], "encode_phases": [], "overflow_bytes": [],
                               "encode_path_s": [], "verified_bytes": 0}
        name = f"bench-s{num}-delta-{os.getpid()}"
        group = ws.Group.create(name, num_sources=T, num_destinations=R, **args.group_opts)
        try:
            setup = team.call("delta_setup", name, args.delta_inbox, args.tuning, timeout=tmo)
            res["inbox_bytes"] = [x["inbox_bytes"] for x in setup[T:]]
            team.call("delta_init", timeout=tmo, who=team.trainers)

            def push_checked(trace: str = "") -> list[dict[str, Any]]:
                """One push, its bytes checked on every rollout; ``trace``: a folder to record every
                participant's timeline of it into (printed)."""
                nonlocal version
                version += 1
                if trace:
                    team.call("trace_start", timeout=tmo)
                stats = team.call("delta_push", version, timeout=tmo, who=team.trainers)
                team.call("ws_wait", version, timeout=tmo, who=team.rollouts)
                if trace:
                    os.makedirs(trace, exist_ok=True)
                    paths = dict(team.call("trace_stop", trace, f"s{num}-v{version}", timeout=tmo))
                    span = (min(s["push_ns"][0] for s in stats), max(s["push_ns"][1] for s in stats))
                    print("\n".join(f"    {line}" for line in marks_timeline(paths, span)), flush=True)
                if any(s["failed_destinations"] for s in stats):
                    raise RuntimeError(f"push {version} failed: {[s['failed_destinations'] for s in stats]}")
                out_ = team.call("verify_sources", timeout=tmo)[T:]
                bad = [(j, o["bad"], o["nbad"]) for j, o in enumerate(out_) if not o["ok"]]
                if bad:
                    raise RuntimeError(f"version {version}: rollout bytes differ from the trainers' "
                                       f"(rollout, first tensors, count): {bad}")
                res["verified_bytes"] += sum(o["bytes"] for o in out_)
                return stats

            res["first_dense_s"] = max(s["seconds"] for s in push_checked())
            res["adam"] = args.adam
            if args.adam == "kept":
                # Every trainer of a scenario is on this host: their pinned state adds up.
                plan = team.call("delta_plan", "kept", timeout=tmo, who=team.trainers)
                host = sum(x["host_bytes"] for x in plan)
                ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
                if host > args.adam_host_fraction * ram:
                    res["adam"] = "first"
                    res["adam_note"] = (
                        f"Adam's first step each push (fresh moments), not kept moments: the trainers' "
                        f"masters and moments would take {host / 1e9:.0f} GB of host memory, more than "
                        f"{args.adam_host_fraction:.0%} of its {ram / 1e9:.0f} GB")
                    print(f"    delta: {res['adam_note']}", flush=True)
            res["masters"] = team.call("delta_masters", res["adam"], timeout=tmo, who=team.trainers)
            # untimed steps (each pushed and checked): the first warms the delta path up; with kept moments
            # --adam-warmup of them, so the timed pushes are Adam's steps warm-up + 1 on
            untimed = untimed_steps(res["adam"], args.adam_warmup, 1)
            res["adam_steps"] = []
            for i in range(untimed + args.pushes):
                if len(res["times"]) >= 2 and time.monotonic() > args.deadline:
                    res["cut"] = f"stopped after {len(res['times'])} timed pushes: the run's budget is spent"
                    print(f"    delta: {res['cut']}", flush=True)
                    break
                steps = team.call("delta_step", args.delta_lr, timeout=tmo, who=team.trainers)
                stats = push_checked()
                if i == 0:
                    res["first_s"] = max(s["seconds"] for s in stats)
                if i < untimed:
                    continue
                res["adam_steps"].append(max(x.get("adam_step", 1) for x in steps))
                slowest = max(stats, key=lambda s: s["seconds"])
                res["times"].append(slowest["seconds"])
                res["phases"].append(slowest["phases"])
                encoder = max(stats, key=lambda s: s["encode_seconds"])
                res["encode_phases"].append(encoder.get("encode_phases"))
                # the encode on the push's path: the reference's update (finish) overlaps the apply
                res["encode_path_s"].append(encoder["encode_seconds"]
                                            - (encoder.get("encode_phases") or {}).get("finish", 0.0))
                res["overflow_bytes"].append(sum(s.get("delta_overflow_bytes", 0) for s in stats))
                res["compare_path"] = sorted({s["compare_path"] for s in stats if "compare_path" in s})
                res["changed_fraction"].append(sum(x["changed"] for x in steps)
                                               / sum(x["total"] for x in steps))
                seen = [s["changed_fraction"] for s in stats if s["changed_fraction"] >= 0]
                res["push_changed_fraction"].append(statistics.fmean(seen) if seen else None)
                res["wire_bytes"].append(sum(s["wire_bytes"] for s in stats))
                res["dense_bytes"].append(sum(s["dense_bytes"] for s in stats))
                res["encode_s"].append(max(s["encode_seconds"] for s in stats))
                res["apply_s"].append(max(s["apply_seconds"] for s in stats))
                res["step_s"].append(max(x["step_s"] for x in steps))
                # destinations a source wrote this version without a delta (none expected)
                res["not_delta"].append(sum(len(set(s["destinations"]) - set(s["delta_destinations"]))
                                            for s in stats))
            if args.delta_trace and res["times"]:
                # one more step and push, recorded on every participant and not timed: the profiler
                # slows every CUDA call
                print(f"    delta: a push recorded into {args.delta_trace} (untimed):", flush=True)
                team.call("delta_step", args.delta_lr, timeout=tmo, who=team.trainers)
                push_checked(args.delta_trace)
            team.call("delta_close", timeout=tmo)
        finally:
            group.shutdown()
        res["median_s"] = statistics.median(res["times"])
        for key in ("changed_fraction", "wire_bytes", "dense_bytes", "encode_s", "apply_s", "step_s",
                    "overflow_bytes", "encode_path_s"):
            res[f"{key}_median"] = statistics.median(res[key])
        if T == 1 and R * tp == 1:
            # one trainer to one rollout GPU: the GB/s of dense bytes one GPU encodes and one applies, the
            # inputs scripts/simulate_delta.py takes
            dense_gb = res["dense_bytes_median"] / 1e9
            res["simulate_delta"] = (
                "python scripts/simulate_delta.py --model kimi-k2 --changed 0.01 0.02 "
                f"0.05 --encode-gbs {dense_gb / max(res['encode_path_s_median'], 1e-9):.0f} "
                f"--apply-gbs {dense_gb / max(res['apply_s_median'], 1e-9):.0f}")
        seen = [x for x in res["push_changed_fraction"] if x is not None]
        res["push_changed_fraction_median"] = statistics.median(seen) if seen else None
        dense = out.get("weightsync", {}).get("median_s")
        res["dense_median_s"] = dense
        res["delta_over_dense"] = res["median_s"] / dense if dense else None
        return res

    def broadcast(bucket_bytes: int) -> dict[str, Any]:
        times, verified = [], 0
        for i in range(args.reps + 1):  # first run: NCCL communicators and buffers, not counted
            v = next_version()
            secs = team.call("broadcast", bucket_bytes, timeout=tmo)
            verified += team.verify(v, tmo)
            if i:
                times.append(max(secs))
        return {"times": times, "median_s": statistics.median(times), "verified_bytes": verified}

    try:
        out["weightsync"] = _run_part(team, weightsync, tmo, args.deadline)
        _say("weightsync", out["weightsync"])
        if args.delta_lr is not None:
            out["delta"] = _run_part(team, delta, tmo, args.deadline)
            _say_delta(out["delta"])
        if "a" in args.baselines:
            out["a"] = {}
            for mib in args.buckets_mib:
                res = out["a"][f"{mib:g}"] = _run_part(team, lambda mib=mib: broadcast(int(mib * 2**20)), tmo,
                                                       args.deadline)
                _say(f"a: gather + broadcast, {mib:g} MiB buckets", res)
            good = {k: r["median_s"] for k, r in out["a"].items() if "median_s" in r}
            if good:
                best = min(good, key=lambda k: good[k])
                out["a_best"] = {"bucket_mib": float(best), "median_s": good[best]}
        if "b" in args.baselines:
            out["b"] = _run_part(team, lambda: broadcast(0), tmo, args.deadline)
            _say("b: per-parameter broadcast", out["b"])
        if "c" in args.baselines and importlib.util.find_spec("checkpoint_engine") is None:
            out["c"] = {"error": "checkpoint-engine is not installed here (pip install --no-index --no-deps "
                                 ".whl/*.whl)"}
            _say("c: checkpoint-engine", out["c"])
        elif "c" in args.baselines:
            out["c"] = _run_part(team, lambda: checkpoint_engine(team, args, next_version), tmo,
                                 args.deadline)
            _say("c: checkpoint-engine", out["c"])
    finally:
        team.stop()
    out["versions_used"] = version - version0
    summarize(out)
    return out


def checkpoint_engine(team: Team, args: argparse.Namespace, next_version: Any) -> dict[str, Any]:
    """Baseline c (see scripts/bench_ckpt_engine.py): ParameterServer.update in broadcast mode."""
    tmo = args.call_timeout
    team.call("ce_start", free_port(), tmo, timeout=tmo + 30)
    try:
        times, registers, verified = [], [], 0
        for i in range(args.reps + 1):  # first update: NCCL communicators, not counted
            v = next_version()
            reg = team.call("ce_register", timeout=tmo)
            secs = team.call("ce_update", timeout=tmo)
            verified += team.verify(v, tmo)
            if i:
                times.append(max(secs))
                registers.append(max(reg))
        return {"times": times, "median_s": statistics.median(times), "register_times": registers,
                "register_median_s": statistics.median(registers), "verified_bytes": verified,
                "what": "ParameterServer.update, broadcast mode, auto_pg=False; register = trainers' shards "
                        "into its pinned pool (not in median_s)"}
    finally:
        team.call("ce_stop", timeout=60)


def _say(what: str, res: dict[str, Any]) -> None:
    if "median_s" in res:
        print(f"    {what}: median {res['median_s'] * 1e3:.2f} ms over {len(res['times'])} "
              f"({', '.join(f'{t * 1e3:.1f}' for t in res['times'])}), verified", flush=True)
    else:
        print(f"    {what}: {res.get('error', res)}", flush=True)


def _say_delta(res: dict[str, Any]) -> None:
    if "median_s" not in res:
        print(f"    delta push: {res.get('error', res)}", flush=True)
        return
    ratio = res["delta_over_dense"]
    wire, dense = res["wire_bytes_median"], res["dense_bytes_median"]
    print(f"    delta push at lr {res['lr']:g}, {_adam_what(res)}: {res['changed_fraction_median']:.3%} of "
          f"BF16 values changed (per step {percents(res['changed_fraction'])}); "
          f"median {res['median_s'] * 1e3:.2f} ms over {len(res['times'])} "
          f"({', '.join(f'{t * 1e3:.1f}' for t in res['times'])}), dense {_ms(res['dense_median_s'])} ms, "
          f"delta/dense {'–' if ratio is None else f'{ratio:.3f}x'}; wire {_size(wire)} of {_size(dense)} "
          f"({wire / dense:.1%}; of it {_size(res['overflow_bytes_median'])} of writes sent as planned for "
          f"want of inbox room); encode {res['encode_s_median'] * 1e3:.2f} ms, apply "
          f"{res['apply_s_median'] * 1e3:.2f} ms; verified against the trainers", flush=True)
    if res.get("simulate_delta"):
        print(f"    simulator inputs (this push's encode and apply GB/s): {res['simulate_delta']}",
              flush=True)
    masters = [m for m in res.get("masters", []) if m]
    if masters:
        m = masters[0]
        moments = (f", moments {m['moments_gpu_bytes'] / 1e9:.1f} GB on the GPU and "
                   f"{m['moments_host_bytes'] / 1e9:.1f} GB in host memory"
                   if "moments_gpu_bytes" in m else "")
        print(f"    adam: {res.get('adam', 'first')}; one step {res['step_s_median']:.2f} s (slowest "
              f"trainer, median); per trainer masters {m['master_bytes'] / 1e9:.1f} GB on {m['master_on']}"
              f"{moments}",
              flush=True)
    phases = [p for p in res.get("encode_phases", []) if p]
    if phases:
        names = sorted({k for p in phases for k in p})
        path = f"; compare path {'/'.join(res['compare_path'])}" if res.get("compare_path") else ""
        print("    delta encode by phase (slowest encoder, medians): " + ", ".join(
            f"{k} {statistics.median(p.get(k, 0.0) for p in phases) * 1e3:.2f} ms" for k in names) + path,
            flush=True)
    if any(res["not_delta"]):
        print(f"    delta push: destinations written dense per push: {res['not_delta']}", flush=True)


def _adam_what(d: dict[str, Any]) -> str:
    """How the timed pushes' changes were made: Adam's mode and the step numbers."""
    steps = d.get("adam_steps") or []
    if d.get("adam", "first") == "first":
        return "Adam's first step (fresh moments) each push" + (" [fallback]" if d.get("adam_note") else "")
    if not steps:
        return "Adam kept"
    return f"Adam kept, step{'' if steps[0] == steps[-1] else 's'} {step_span(steps)}"


def _size(n: float) -> str:
    return f"{n / 1e9:.3f} GB" if n >= 1e8 else f"{n / 1e6:.3f} MB"


def summarize(out: dict[str, Any]) -> None:
    """Ratios: weightsync to the bound, and speedups over the best broadcast and over checkpoint-engine."""
    wsr = out.get("weightsync", {})
    base = {"a": out.get("a_best", {}).get("median_s"), "b": out.get("b", {}).get("median_s"),
            "c": out.get("c", {}).get("median_s")}
    if "median_s" not in wsr:
        return
    w = wsr["median_s"]
    out["ratio_to_bound"] = w / out["bound_s"]
    out["ratio_to_direct_bound"] = w / out["direct_bound_s"]
    bcast = [x for k, x in base.items() if k in "ab" and x]
    if bcast:
        out["speedup_over_broadcast"] = min(bcast) / w
    if base["c"]:
        out["speedup_over_checkpoint_engine"] = base["c"] / w
    every = [x for x in base.values() if x]
    if every:
        out["speedup_over_best_baseline"] = min(every) / w


def _ms(x: float | None) -> str:
    return "–" if x is None else f"{x * 1e3:.1f}"


def table(rows: list[dict[str, Any]], bw: dict[str, Any], card: str) -> str:
    lines = [
        f"Card: {card}; bound bandwidth {bw['gbps']:.1f} GB/s ({bw['how']}); "
        f"date {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; times are medians in ms.",
        "",
        "| scenario | model GB | max GB per GPU (must / direct) | bound (d) | weightsync | a: gather + "
        "bucketed broadcast (best bucket) | b: per-parameter broadcast | c: checkpoint-engine | "
        "weightsync / bound | speedup over best baseline |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        wsr = r.get("weightsync", {})
        a = r.get("a_best")
        a_s = f"{_ms(a['median_s'])} ({a['bucket_mib']:g} MiB)" if a else _err(r.get("a"))
        b = r.get("b", {})
        c = r.get("c", {})
        ratio = r.get("ratio_to_bound")
        ratio_s = "–" if ratio is None else f"{ratio:.2f}x"
        if ratio is not None and r["direct_bytes"] != r["must_bytes"]:
            ratio_s += f" ({r['ratio_to_direct_bound']:.2f}x direct)"
        sp = r.get("speedup_over_best_baseline")
        lines.append(
            f"| {r['scenario']}. {r['what']} | {r['model_bytes'] / 1e9:.2f} | "
            f"{r['must_bytes'] / 1e9:.2f} / {r['direct_bytes'] / 1e9:.2f} | {_ms(r['bound_s'])} | "
            f"{_ms(wsr.get('median_s')) if 'median_s' in wsr else _err(wsr)} | {a_s} | "
            f"{_ms(b.get('median_s')) if 'median_s' in b else _err(b)} | "
            f"{_ms(c.get('median_s')) if 'median_s' in c else _err(c)} | {ratio_s} | "
            f"{'–' if sp is None else f'{sp:.2f}x'} |")
    lines += ["", "Notes: weightsync destinations `inplace`, median of the slowest source's `push()` after "
              "one warm-up push; baselines median after one warm-up run each; bound = max bytes a GPU must "
              "send or receive (direct: with every byte written by the trainer that holds it) / the "
              "bandwidth above; every timed run verified byte for byte on every rollout afterwards."]
    for r in rows:
        bits = []
        wsr = r.get("weightsync", {})
        if "median_s" in wsr:
            bits.append(f"weightsync first push {_ms(wsr.get('first_s'))} ms, {wsr.get('writes')} writes")
        a = r.get("a") or {}
        if a:
            bits.append("a by bucket: " + ", ".join(f"{k} MiB {_ms(v['median_s'])}" if "median_s" in v
                                                    else f"{k} MiB failed" for k, v in a.items()))
        c = r.get("c") or {}
        if "register_median_s" in c:
            bits.append(f"c register (trainers' shards into pinned host memory, not in c's time) "
                        f"{_ms(c['register_median_s'])} ms")
        for part in ("weightsync", "b", "c"):
            err = (r.get(part) or {}).get("error")
            if err:
                bits.append(f"{part} failed: {err[:200]}")
        lines.append(f"- scenario {r['scenario']} ({r['model']}): " + "; ".join(bits))
    return "\n".join(lines) + "\n"


def delta_table(rows: list[dict[str, Any]]) -> str:
    """The delta pushes (``--delta-lr``) beside each scenario's dense push of the same run; "" if none."""
    rows = [r for r in rows if "delta" in r]
    if not rows:
        return ""
    lines = ["Delta pushes: per push one Adam step of fp32 masters on random gradients (moments kept across "
             "steps, or Adam's first step with fresh moments: the adam column), the BF16 weights the rounded "
             "masters; medians in ms; dense = the weightsync column above (same run, same team); every delta "
             "push verified against the trainers' bytes.", "",
             "| scenario | lr | adam | BF16 values changed (step / push) | dense push | delta push | delta / "
             "dense | wire / dense bytes | of the wire, for want of inbox room | encode | apply | note |",
             "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        d = r["delta"]
        if "median_s" not in d:
            lines.append(f"| {r['scenario']}. {r['what']} | – | – | – | – | – | – | – | – | – | – | "
                         f"{(d.get('error') or '')[:200]} |")
            continue
        pf = d.get("push_changed_fraction_median")
        ratio = d.get("delta_over_dense")
        note = "; ".join(x for x in (d.get("cut"), d.get("adam_note"),
                                     f"destinations written dense: {d['not_delta']}" if any(d["not_delta"])
                                     else None) if x)
        lines.append(f"| {r['scenario']}. {r['what']} | {d['lr']:g} | {_adam_what(d)} | "
                     f"{d['changed_fraction_median']:.2%} / "
                     f"{'–' if pf is None else f'{pf:.2%}'} | {_ms(d.get('dense_median_s'))} | "
                     f"{_ms(d['median_s'])} | {'–' if ratio is None else f'{ratio:.3f}x'} | "
                     f"{_size(d['wire_bytes_median'])} / {_size(d['dense_bytes_median'])} | "
                     f"{_size(d.get('overflow_bytes_median', 0))} | "
                     f"{_ms(d['encode_s_median'])} | {_ms(d['apply_s_median'])} | {note} |")
    return "\n".join(lines) + "\n"


def _err(res: Any) -> str:
    if not res:
        return "–"
    if isinstance(res, dict) and "error" in res:
        return "failed"
    return "–"


def plot(rows: list[dict[str, Any]], path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series = [("bound (d)", lambda r: r.get("bound_s")),
              ("weightsync", lambda r: r.get("weightsync", {}).get("median_s")),
              ("a: gather + bucketed bcast", lambda r: r.get("a_best", {}).get("median_s")),
              ("b: per-param bcast", lambda r: r.get("b", {}).get("median_s")),
              ("c: checkpoint-engine", lambda r: r.get("c", {}).get("median_s"))]
    lrs = {r["delta"]["lr"] for r in rows if "lr" in r.get("delta", {})}
    if lrs:
        series.insert(2, (f"weightsync delta push (lr {', '.join(f'{x:g}' for x in sorted(lrs))})",
                          lambda r: r.get("delta", {}).get("median_s")))
    fig, ax = plt.subplots(figsize=(10, 4.5))
    width = 0.8 / len(series)
    for k, (label, get) in enumerate(series):
        xs = [i + k * width for i in range(len(rows))]
        ys = [(get(r) or float("nan")) * 1e3 for r in rows]  # a missing figure leaves a gap
        ax.bar(xs, ys, width, label=label)
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(rows))])
    ax.set_xticklabels([f"{r['scenario']}. {r['model']}\n{r['trainers']} -> {r['rollouts']} "
                        f"(TP {r['rollout_tp']})" for r in rows], fontsize=8)
    ax.set_yscale("log")  # the baselines span two orders of magnitude
    ax.set_ylabel("push time, ms (median, log scale)")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def run_scenarios(args: argparse.Namespace) -> dict[str, Any]:
    """The GPU benchmark (``--device cuda``), or the same code on CPU processes over gloo/TCP."""
    t0 = time.perf_counter()
    if args.device == "cuda":
        if torch.cuda.device_count() < 2:
            raise SystemExit(f"--device cuda needs GPUs, found {torch.cuda.device_count()}")
        card = f"{torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}"
        bw = copy_engine_gbps(args.bound_mib << 20, 5)
    else:
        card = f"CPU: {platform.node()} ({os.cpu_count()} cores), tcp;ofi_rxm loopback and gloo"
        bw = None
        if args.delta_lr is not None and args.adam == "kept":
            print(adam_self_check(), flush=True)  # KeptAdam against torch.optim.Adam, bitwise
    gpus = torch.cuda.device_count() if args.device == "cuda" else 0
    # Few CPUs on purpose: every actor takes none, and Ray prestarts a Python worker per CPU.
    ray.init(address="local", num_cpus=8, num_gpus=gpus, include_dashboard=False,
             log_to_driver=args.verbose,
             runtime_env={"env_vars": {"PYTHONPATH": _pythonpath(), **NO_MULTICAST, **_forwarded_env(),
                                       "WEIGHTSYNC_SECRET": secrets.token_hex(16)}})
    rows: list[dict[str, Any]] = []
    try:
        if bw is None:
            # The CPU's "copy engine": the engine's own single write of one rollout's bytes over loopback.
            from scripts.bench_worker import CONFIGS, traffic

            most = max(traffic(CONFIGS[MODELS[args.scale][SCENARIOS[s]["model"]]], SCENARIOS[s]["T"],
                               SCENARIOS[s]["R"], SCENARIOS[s]["tp"])["must_bytes"] for s in args.scenarios)
            eng = engine_baseline(max(most, 1 << 20), 3)
            bw = {"gbps": eng["median_gbps"], "bytes": eng["bytes"],
                  "how": "one weightsync engine write between two actors, tcp;ofi_rxm loopback"}
        print(f"{card}; bound bandwidth {bw['gbps']:.1f} GB/s ({bw['how']})", flush=True)
        version = 0
        for s in args.scenarios:
            if time.monotonic() > args.deadline:
                print(f"scenario {s}: skipped, the run's budget of {args.budget_s} s is spent", flush=True)
                continue
            row = run_scenario(s, args, bw["gbps"], version)
            version += row["versions_used"]
            rows.append(row)
            if args.out:
                _write(args.out, rows, bw, card, partial=True)
    finally:
        ray.shutdown()
    result = {"card": card, "date": time.strftime("%Y-%m-%d"), "bound_bandwidth": bw,
              "tuning": {**args.tuning, **args.group_opts},
              "scenarios": rows, "wall_s": time.perf_counter() - t0, "device": args.device,
              "scale": args.scale}
    result["goals"] = goals(rows)
    print()
    print(table(rows, bw, card))
    if delta_table(rows):
        print(delta_table(rows))
    for line in result["goals"]:
        print(line)
    if args.out:
        _write(args.out, rows, bw, card, partial=False, result=result)
    return result


def goals(rows: list[dict[str, Any]]) -> list[str]:
    """The issue's goals, each with what this run measured."""
    by = {r["scenario"]: r for r in rows}
    out = []
    for s in (1, 2):
        r = by.get(s, {})
        x = r.get("ratio_to_bound")
        out.append(f"goal: scenario {s} within 1.15x of the bound: "
                   + ("not measured" if x is None else f"{x:.2f}x, {met(x <= 1.15)}"))
    r = by.get(1, {})
    x = r.get("speedup_over_broadcast")
    out.append("goal: scenario 1 at least 1.7x faster than the best broadcast (a, b): "
               + ("not measured" if x is None else f"{x:.2f}x, {met(x >= 1.7)}"))
    x = r.get("speedup_over_checkpoint_engine")
    out.append("goal: scenario 1 faster than checkpoint-engine: "
               + ("not measured" if x is None else f"{x:.2f}x, {met(x > 1)}"))
    for r in rows:  # --delta-lr
        if "delta" not in r:
            continue
        d = r["delta"]
        x = d.get("delta_over_dense")
        what = f"goal: scenario {r['scenario']} delta push at most {DELTA_GOAL:g}x its dense push"
        if x is None:
            out.append(f"{what}: not measured ({(d.get('error') or 'no dense push')[:120]})")
        else:
            out.append(f"{what} (lr {d['lr']:g}, {_adam_what(d)}, {d['changed_fraction_median']:.2%} "
                       f"changed): {x:.3f}x, {met(x <= DELTA_GOAL)}")
    return out


def _write(out: str, rows: list[dict[str, Any]], bw: dict[str, Any], card: str, partial: bool,
           result: dict[str, Any] | None = None) -> None:
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "bench_push.md"), "w") as f:
        f.write(table(rows, bw, card))
        if delta_table(rows):
            f.write("\n" + delta_table(rows))
    with open(os.path.join(out, "bench_push.json"), "w") as f:
        json.dump(result or {"partial": partial, "card": card, "bound_bandwidth": bw, "scenarios": rows}, f,
                  indent=1, default=str)
    plot(rows, os.path.join(out, "bench_push.png"), f"weightsync push vs broadcast baselines, {card}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cpu", action="store_true",
                    help="the CPU section: control-plane cost over TCP loopback, and scenario 1 at small "
                         "scale against gloo broadcasts")
    ap.add_argument("--quick", action="store_true", help="small sizes, for a smoke test")
    ap.add_argument("--small-pushes", type=int, default=100)
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda",
                    help="scenarios on GPU actors (NCCL baselines) or on CPU actors (gloo baselines)")
    ap.add_argument("--scale", choices=list(MODELS), default=None,
                    help="model shapes: full (Llama-3-8B, Qwen3-30B-A3B; default on cuda), small, tiny "
                         "(default on cpu)")
    ap.add_argument("--scenarios", default="1,3,2,4", help="in this order (the budget may cut the last)")
    ap.add_argument("--baselines", default="a,b,c")
    ap.add_argument("--buckets-mib", default=None,
                    help="bucket sizes of baseline a (default 256,512,1024,2048; 0.25,1 at tiny scale)")
    ap.add_argument("--pushes", type=int, default=5, help="timed weightsync pushes (after one warm-up)")
    ap.add_argument("--reps", type=int, default=3, help="timed runs of each baseline (after one warm-up)")
    ap.add_argument("--bound-mib", type=int, default=2048, help="bytes of the copy-engine bandwidth copy")
    ap.add_argument("--call-timeout", type=float, default=150.0, help="seconds any one step may take")
    ap.add_argument("--budget-s", type=float, default=450.0,
                    help="start no scenario and no measured part after this many seconds from the start")
    ap.add_argument("--delta-lr", type=float, default=None,
                    help="also push each scenario as deltas: per push one Adam step at this learning rate "
                         "(1e-6 for the quoted figures), against the scenario's dense push")
    add_adam_options(ap, when="with --delta-lr: ")
    ap.add_argument("--adam-host-fraction", type=float, default=0.4,
                    help="with --adam kept: a scenario whose trainers' Adam state (masters, moments) would "
                         "take more of the host's RAM than this falls back to --adam first, and says so")
    ap.add_argument("--delta-inbox", type=float, default=0.125,
                    help="each destination's delta inbox, a fraction of its bytes (with --delta-lr)")
    ap.add_argument("--delta-trace", default="",
                    help="with --delta-lr: after the timed delta pushes of each scenario one more, "
                         "recorded on every participant (host marks; on GPUs the profiler's kernels and "
                         "copies) into this folder, its timeline printed")
    ap.add_argument("--out", default=None, help="write bench_push.md, bench_push.json, bench_push.png here")
    ap.add_argument("--verbose", action="store_true", help="actors' logs on the driver's terminal")
    ap.add_argument("--cuda-streams", type=int, default=None,
                    help="engine cuda_streams (default: the library's)")
    ap.add_argument("--cuda-batch-mib", type=float, default=None,
                    help="engine cuda_batch_bytes in MiB (0: no batched copies; default: the library's)")
    ap.add_argument("--local-round-mib", type=float, default=None,
                    help="Group.create(local_round_bytes=) in MiB (default: the library's)")
    ap.add_argument("--cuda-rounds-in-flight", type=int, default=None,
                    help="rounds a source posts ahead on the cuda lane (0: all; default: the library's)")
    args = ap.parse_args(argv)
    args.deadline = time.monotonic() + args.budget_s
    args.scenarios = [int(s) for s in args.scenarios.split(",") if s]
    args.baselines = [b for b in args.baselines.split(",") if b]
    if args.cpu:
        args.device = "cpu"
        args.baselines = [b for b in args.baselines if b != "c"]
        if args.quick:
            args.pushes, args.reps = min(args.pushes, 2), min(args.reps, 1)
    if args.scale is None:
        if args.cpu:
            args.scale = "tiny" if args.quick else "small"
        else:
            args.scale = "full" if args.device == "cuda" else "tiny"
    if args.buckets_mib is None:
        args.buckets_mib = {"full": "256,512,1024,2048", "small": "16,64,256"}.get(args.scale, "0.25,1")
        if args.quick:
            args.buckets_mib = "1"  # a smoke test: one bucket size shows the path works
    args.buckets_mib = [float(x) for x in args.buckets_mib.split(",") if x]
    args.tuning = {}
    if args.cuda_streams is not None:
        args.tuning["cuda_streams"] = args.cuda_streams
    if args.cuda_rounds_in_flight is not None:
        args.tuning["cuda_rounds_in_flight"] = args.cuda_rounds_in_flight or None
    if args.cuda_batch_mib is not None:
        args.tuning["cuda_batch_bytes"] = int(args.cuda_batch_mib * 2**20)
    args.group_opts = {}
    if args.local_round_mib is not None:
        args.group_opts["local_round_bytes"] = int(args.local_round_mib * 2**20)
    return args


def main() -> None:
    args = parse_args()
    if not args.cpu:
        result = run_scenarios(args)
        print(json.dumps(result, default=str))
        return
    cpu_section(args)


def cpu_section(args: argparse.Namespace) -> None:
    """Control-plane cost over TCP loopback, and scenario 1 at small scale against gloo broadcasts."""
    t0 = time.perf_counter()
    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=args.verbose,
             runtime_env={"env_vars": {"PYTHONPATH": _pythonpath(), **NO_MULTICAST, **_forwarded_env(),
                                       "WEIGHTSYNC_SECRET": secrets.token_hex(16)}})
    hosts = [ray.remote(num_cpus=0)(Host).remote() for _ in range(4)]
    try:
        small = run_group("bench-small", model_shapes(1 << 20, 4), 5 if args.quick else args.small_pushes,
                          hosts)
        big_bytes = (32 << 20) if args.quick else (1 << 30)
        big = run_group("bench-big", model_shapes(big_bytes, 8), 2 if args.quick else 5, hosts)
        # Each destination receives the whole model, half from each source: per-destination bytes.
        base = engine_baseline(big["model_bytes"], 2 if args.quick else 3, hosts)
        # Scenario 1 on CPU processes: weightsync over tcp;ofi_rxm loopback against gloo broadcasts (a, b).
        # Its bound uses the engine's own one-write bandwidth measured just above.
        bw = {"gbps": base["median_gbps"], "bytes": base["bytes"],
              "how": "one weightsync engine write between two actors, tcp;ofi_rxm loopback"}
        s1 = run_scenario(1, args, bw["gbps"], 0, hosts) if 1 in args.scenarios else None
    finally:
        ray.shutdown()
    result: dict[str, Any] = {
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
        "scenario_1": s1,
        "wall_s": time.perf_counter() - t0,
    }
    print(f"1 MiB-class model ({small['model_bytes']} B), 2 -> 2: median push round trip "
          f"{result['small_push_median_ms']:.2f} ms (p90 {result['small_push_p90_ms']:.2f} ms)")
    print(f"{big['model_bytes'] / 2**30:.2f} GiB model, 2 -> 2 replicas: {big['median_s']:.2f} s, "
          f"{big['median_gbps']:.2f} GB/s total; engine alone, one write of the same bytes: "
          f"{base['median_gbps']:.2f} GB/s (push/engine {result['push_vs_engine']:.2f})")
    if s1 is not None:
        card = f"CPU: {platform.node()} ({os.cpu_count()} cores), tcp;ofi_rxm loopback and gloo"
        print()
        print(table([s1], bw, card))
        if delta_table([s1]):
            print(delta_table([s1]))
        if args.out:
            _write(args.out, [s1], bw, card, partial=False, result=result)
    print(json.dumps(result, default=str))


if __name__ == "__main__":
    main()
