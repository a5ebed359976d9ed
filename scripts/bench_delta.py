"""Delta push benchmark (issue 18): what an RL step changes, and what sending only that costs.

One trainer (a Ray actor on GPU 0) keeps fp32 master weights of a Llama-shaped model (Hugging Face names
and shapes from scripts/bench_worker.py's config; on a GPU the masters live in host memory and come to
the GPU one tensor at a time) and the BF16 copy it pushes (the rounded master). Each step is an Adam step
on random gradients at ``--lrs`` (default 1e-6 and 1e-5), after which the BF16 copy is the master rounded
again. The changes therefore come from a training step, not from a chosen fraction; the fraction of BF16
values the step changed is measured and printed beside every figure, with the Adam mode and the steps.

``--adam kept`` (default): Adam's moments and step count are kept across steps as a trainer's optimizer
keeps them (torch.optim.Adam's single-tensor math, default betas and eps, over chunks of at most 64M
elements; on CPU the script first checks it bitwise against torch.optim.Adam); the moments live on the
trainer's GPU while they fit with 8 GB to spare, else in pinned host memory, a chunk at a time on the GPU
(Llama-3-8B: masters 32 GB and moments 64 GB, mostly host memory; the step's seconds are printed). Each
learning rate starts a fresh optimizer, and its first ``--adam-warmup`` steps (default 2) are pushed to
every group untimed: the timed pushes are Adam's steps 3 on. ``--adam first``: Adam's first step every
time (torch.optim.Adam made afresh per tensor, fresh moments), the figures before kept moments. The changed
fraction depends on the step: the first moves every value by exactly ``lr`` (bias-corrected m / sqrt(v) is
+-1), later steps by less where the gradients disagree. Kept moments on 0.02 * randn masters and random
gradients, steps 1-8: lr 1e-6 4.23, 2.84, 2.30, 2.01, 1.81, 1.67, 1.56, 1.47% of BF16 values; lr 1e-5
25.1, 17.5, 14.5, 12.8, 11.6, 10.8, 10.2, 9.6%. Figures from before kept moments are all at 4.23% (step 1).

One rollout (a Ray actor on GPU 1) holds two full replicas in vLLM's fused layout (``qkv_proj``,
``gate_up_proj``), ``inplace``, each in a group of its own with the same trainer tensors:

* dense: ``ws.Source(delta=False)`` into a destination without a delta inbox: the push as it is;
* delta: ``ws.Source(delta=True)`` into a destination with an inbox (``--inbox`` of the model's bytes):
  the push sends per planned write only the changed words (encode on the trainer's GPU, transfer, and
  the scatter on the rollout's GPU before it acks are all inside the push's time).

Per step both groups push the same version; after every timed push (and the last push of each learning
rate) the rollout's bytes are checked against the trainer's (a position-weighted digest per tensor on
both GPUs). The copy bound is one
copy-engine copy of the model's bytes GPU 0 -> GPU 1 (on CPU: a host memcpy, for scale only). Goals
(the issue's): at lr 1e-6 the delta push at most 0.35x the dense push on the same 2-GPU machine; on CPU
over TCP loopback at least 5x faster than dense.

    python scripts/bench_delta.py                      # 2 GPUs, Llama-3-8B shapes
    python scripts/bench_delta.py --device cpu         # small shapes, TCP loopback (runs anywhere)
    python scripts/bench_delta.py --micro --device cpu --model llama-500m   # CPU encode/apply only

``--micro``: the source and the destination in this process (threads; only the coordinator is a Ray
actor), one delta group, the same Adam steps (``--adam`` alike); it prints the sender's encode and the
receiver's apply seconds per push (what ``PushStats`` reports) and checks the bytes after every push. It
is the figure to watch while working on weightsync/delta/sender.py: on a busy CPU the TCP pushes of the
full benchmark vary by more than the encode does. ``--baseline OLD_DELTA.py`` (for instance ``git show
426276a:weightsync/delta/sender.py > /tmp/delta_old.py``) adds a second group whose source and
destination use that file's delta classes, over the same tensors, pushed in alternating order after every
step: a before/after comparison under the same load.

Encode is reported by phase (the sender's ``phases``: ``compare``, the changed words found, their values
gathered and, on the kernel path, the reference updated; ``begin``, the host's choice of sparse writes;
``finalize``, the streams' index sections and values written; ``finish``, the torch path's reference
update), beside ``transfer`` (the push's seconds less apply and the encode before ``finish``, which
overlaps the apply: the wire, the grant and the acks) and ``apply`` (the receiver's scatter); each line
names the compare path that ran: ``kernel`` (the Triton kernels of weightsync/delta/triton_kernels.py,
on CUDA with triton, unless WEIGHTSYNC_DELTA_KERNELS=0) or ``torch``. ``--ab`` adds a third group,
``delta-torch``: another delta source over the same tensors whose sender uses the torch path, into a
third replica whose receiver scatters with torch ops too, pushed in alternating order with ``delta``
after every step, its bytes checked alike: kernel and torch paths measured in one run.

    python scripts/bench_delta.py --lrs 1e-6 --ab      # 2 GPUs: kernel and torch paths side by side
    python scripts/bench_delta.py --compare            # 1 GPU: compare and scatter alone, both paths
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import statistics
import sys
import time
from typing import Any

import numpy as np
import ray
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import weightsync as ws  # noqa: E402

# The same actor set-up and byte check as the non-blocking push benchmark (importing it also turns NVLink
# multicast off in this process, as NO_MULTICAST says).
from scripts.bench_async import NO_MULTICAST, _device, _sync, digest  # noqa: E402
from scripts.bench_common import (  # noqa: E402
    DELTA_GOAL,
    add_adam_options,
    met,
    percents,
    round_into,
    step_span,
    untimed_steps,
)
from weightsync.runtime import trace as marks  # noqa: E402


def adam_step(master: dict[str, torch.Tensor], weights: dict[str, torch.Tensor], gen: torch.Generator,
              lr: float, dev: torch.device) -> float:
    """One Adam step of every master on random gradients; the BF16 copy rounded again. Returns the
    fraction of BF16 values that changed (counted here, independently of the push)."""
    changed = total = 0
    for name, w in weights.items():
        p = torch.nn.Parameter(master[name].to(dev, non_blocking=True))
        p.grad = torch.randn(p.shape, generator=gen, device=dev, dtype=torch.float32)
        torch.optim.Adam([p], lr=lr).step()
        changed += int(round_into(w, p.detach()))
        total += w.numel()
        master[name].copy_(p.detach(), non_blocking=True)
        del p
    _sync(dev)
    return changed / total


class KeptAdamState:
    """``--adam kept``: Adam's moments and step count kept across steps for ``master`` (scripts.bench_push's
    KeptAdam over chunks of at most ADAM_CHUNK elements of each tensor: Adam's state for the embedding
    alone is 6 GB); the moments on the GPU while they fit with MASTER_HEADROOM and ``reserve`` bytes (the
    delta encodes' changed positions and values) to spare beside what is there when it is made (after the
    first pushes: the sources' references), else in pinned host memory (on CPU: host memory).
    ``adam.reset()`` starts a fresh optimizer on the same masters."""

    def __init__(self, master: dict[str, torch.Tensor], dev: torch.device, reserve: int = 0) -> None:
        from scripts.bench_push import ADAM_CHUNK, MASTER_HEADROOM, KeptAdam

        self.chunks: list[tuple[str, int, int]] = []
        views = []
        for name, m in master.items():
            flat = m.view(-1)
            for a in range(0, flat.numel(), ADAM_CHUNK):
                b = min(flat.numel(), a + ADAM_CHUNK)
                self.chunks.append((name, a, b))
                views.append(flat[a:b])
        budget = 0
        if dev.type == "cuda":
            torch.cuda.empty_cache()
            budget = torch.cuda.mem_get_info(dev)[0] - MASTER_HEADROOM - reserve
        self.adam = KeptAdam(views, dev, budget)

    def step(self, weights: dict[str, torch.Tensor], gen: torch.Generator, lr: float,
             dev: torch.device) -> float:
        """One Adam step on random gradients, the BF16 copy rounded again; the fraction of BF16 values
        that changed."""
        changed = torch.zeros((), dtype=torch.int64, device=dev)
        total = 0

        def grad(i: int) -> torch.Tensor:
            _, a, b = self.chunks[i]
            return torch.randn(b - a, generator=gen, device=dev, dtype=torch.float32)

        for i, p in self.adam.step(lr, grad):
            name, a, b = self.chunks[i]
            changed += round_into(weights[name].view(-1)[a:b], p)
            total += b - a
        _sync(dev)
        return int(changed) / total

    def where(self) -> dict[str, Any]:
        return {"moments_gpu_bytes": self.adam.gpu_bytes, "moments_host_bytes": self.adam.host_bytes}


def adam_what(adam: str, steps: list[int]) -> str:
    """The Adam mode and the step numbers of the timed pushes, as printed beside every figure."""
    if adam == "first":
        return "first step"
    return f"kept {step_span(steps)}" if steps else "kept"


def model_config(model: str) -> dict[str, Any]:
    from scripts.bench_worker import CONFIGS

    return MICRO_CONFIGS[model] if model in MICRO_CONFIGS else CONFIGS[model]


# Llama shapes between llama-small (0.225 GB) and Llama-3-8B for CPU figures: 0.49e9 parameters (0.98 GB
# in bf16), 75 tensors.
MICRO_CONFIGS = {
    "llama-500m": {"architectures": ["LlamaForCausalLM"], "hidden_size": 2048, "num_hidden_layers": 8,
                   "num_attention_heads": 16, "num_key_value_heads": 4, "head_dim": 128,
                   "intermediate_size": 5632, "vocab_size": 32000, "tie_word_embeddings": False},
}


def init_weights(model: str, dev: torch.device) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """The fp32 masters (in pinned host memory on a GPU: 32 GB for 8B parameters) and their BF16 copy on
    ``dev``, Hugging Face names in checkpoint order."""
    from scripts.bench_worker import DTYPE, checkpoint_tensors

    g = torch.Generator(device=dev).manual_seed(1)
    master: dict[str, torch.Tensor] = {}
    weights: dict[str, torch.Tensor] = {}
    for name, shape in checkpoint_tensors(model_config(model)):
        m = torch.randn(shape, generator=g, device=dev, dtype=torch.float32) * 0.02
        if name.endswith("norm.weight"):
            m += 1.0  # RMSNorm scales start at 1
        weights[name] = m.to(DTYPE)
        if dev.type == "cuda":
            host = torch.empty(shape, dtype=torch.float32, pin_memory=True)
            host.copy_(m)
            m = host
        master[name] = m
    return master, weights


PHASES = ("compare", "begin", "staged", "finalize", "finish")


class Trainer:
    """fp32 masters, their BF16 copy (the pushed tensors), and one source per group (``delta-torch``: a
    delta source whose sender compares with torch ops)."""

    def __init__(self, groups: dict[str, str], model: str, adam: str = "first", max_lr: float = 1e-5) -> None:
        self.dev = _device()
        self.master, self.weights = init_weights(model, self.dev)
        self.adam, self.max_lr = adam, max_lr
        self.kept: KeptAdamState | None = None  # made at the first step: after the sources' references
        self.srcs = {kind: ws.Source(group, rank=0, tensors=self.weights, timeout=300, delta=kind != "dense")
                     for kind, group in groups.items()}
        if "delta-torch" in self.srcs:
            self.srcs["delta-torch"]._delta.use_kernels = False
        self.gen = torch.Generator(device=self.dev).manual_seed(2)
        self.version = 0

    def info(self) -> dict[str, Any]:
        out = {"bytes": sum(t.numel() * t.element_size() for t in self.weights.values()),
               "tensors": len(self.weights), "device": str(self.dev)}
        if self.dev.type == "cuda":
            out["gpu"] = torch.cuda.get_device_name(0)
        return out

    def compare_floor(self, repeat: int = 5) -> dict[str, Any]:
        """CPU: the host compare (weightsync.delta.host, on its threads) of the weights against an
        unchanged copy, median of ``repeat``. Nothing changed, so nothing is written: only the reads of
        the tensors and the reference that every delta push's compare makes, whatever else it does."""
        from weightsync.delta import host as delta_host
        from weightsync.delta.units import word_dtype

        spaces: dict[int, list[torch.Tensor]] = {}
        for t in self.weights.values():
            w = t.element_size()
            spaces.setdefault(w, []).append(t.reshape(-1).view(word_dtype(w)))
        refs = {w: torch.cat(vs) for w, vs in spaces.items()}
        times = []
        for _ in range(repeat):
            t0 = time.perf_counter()
            for w, vs in spaces.items():
                idx, _ = delta_host.compare(vs, refs[w], 0)
                assert idx.numel() == 0
            times.append(time.perf_counter() - t0)
        read = 2 * sum(int(r.numel()) * r.element_size() for r in refs.values())
        return {"seconds": statistics.median(times), "read_bytes": read, "threads": delta_host.threads()}

    def adam_step(self, lr: float, reset: bool = False) -> dict[str, Any]:
        """One Adam step (``reset``: a fresh optimizer first, kept mode); its changed fraction, step
        number and seconds, and where the kept moments live."""
        t0 = time.perf_counter()
        if self.adam == "first":
            frac = adam_step(self.master, self.weights, self.gen, lr, self.dev)
            return {"changed_fraction": frac, "step": 1, "step_s": time.perf_counter() - t0}
        if self.kept is None:
            # GPU memory left for the delta encodes: per delta source about 10 bytes (position, value) per
            # changed word; Adam's first step changes 4.2% of the words at lr 1e-6, 25% at 1e-5: bounded
            # by 5% per 1e-6 of the largest lr
            words = sum(t.numel() for t in self.weights.values())
            frac = min(1.0, 0.05 * self.max_lr / 1e-6)
            reserve = int((len(self.srcs) - 1) * 10 * words * frac)
            self.kept = KeptAdamState(self.master, self.dev, reserve)
        elif reset:
            self.kept.adam.reset()
        t1 = time.perf_counter()
        frac = self.kept.step(self.weights, self.gen, lr, self.dev)
        return {"changed_fraction": frac, "step": self.kept.adam.steps, "step_s": time.perf_counter() - t1,
                "setup_s": t1 - t0, **self.kept.where()}

    def push(self, kind: str, version: int, trace: str = "", device_events: bool = True) -> dict[str, Any]:
        """One push of group ``kind``; ``trace``: a path to write its timeline to (host marks, with
        ``device_events`` the CUDA kernels and copies too; the push's start and end on the host clock
        beside them, as ``push_ns``)."""
        _sync(self.dev)
        rec = _record(self.dev, device_events) if trace else None
        start_ns = time.time_ns()
        t0 = time.perf_counter()
        stats = ws.push(self.srcs[kind], version, timeout=300)
        wall = time.perf_counter() - t0
        if rec is not None:
            rec.stop(trace, push_ns=[start_ns, start_ns + int(wall * 1e9)])
        sender = self.srcs[kind]._delta
        return {"wall_s": wall, "seconds": stats.seconds, "wire_bytes": stats.wire_bytes,
                "overflow_bytes": stats.delta_overflow_bytes, "dense_bytes": stats.dense_bytes,
                "changed_fraction": stats.changed_fraction,
                "encode_s": stats.encode_seconds, "apply_s": stats.apply_seconds,
                "ref_bytes": stats.delta_ref_bytes, "delta": stats.delta_destinations == [0],
                "phases": dict(sender.phases), "path": "kernel" if sender.use_kernels else "torch",
                "scratch_bytes": sender.scratch_bytes}

    def digests(self) -> dict[str, int]:
        return {name: digest(t) for name, t in self.weights.items()}

    def close(self) -> None:
        for s in self.srcs.values():
            s.close()


class Rollout:
    """Full replicas in vLLM's fused layout, one per group (the delta ones with an inbox)."""

    def __init__(self, groups: dict[str, str], model: str, inbox: float) -> None:
        from scripts.bench_worker import DTYPE, as_ws, rollout_params

        self.dev = _device()
        self.params = rollout_params(model_config(model), 1, 0)
        self._rec: _Recording | None = None  # trace(): this GPU's timeline while a push is traced
        self.local: dict[str, dict[str, torch.Tensor]] = {}
        self.dsts: dict[str, ws.Destination] = {}
        nbytes = sum(torch.Size(p.shape).numel() * 2 for p in self.params)
        for kind, group in groups.items():
            local = {p.key: torch.full(p.shape, float("nan"), dtype=DTYPE, device=self.dev)
                     for p in self.params}
            self.local[kind] = local
            named = {p.key: as_ws(p, local[p.key]) for p in self.params}
            self.dsts[kind] = ws.Destination(group, rank=0, tensors=named, mode="inplace", timeout=300,
                                             push_timeout=300,
                                             delta_bytes=int(nbytes * inbox) if kind != "dense" else 0)
        if "delta-torch" in self.dsts:  # its scatter by torch ops too
            self.dsts["delta-torch"]._delta.use_kernels = False

    def wait(self, version: int) -> list[int]:
        return [d.wait(version, timeout=300) for d in self.dsts.values()]

    def trace(self, path: str = "", device_events: bool = True) -> None:
        """Starts recording this GPU's timeline (``path`` empty), or stops and writes it to ``path``."""
        if not path:
            self._rec = _record(self.dev, device_events)
        elif self._rec is not None:
            self._rec.stop(path)
            self._rec = None

    def digests(self, kind: str) -> dict[str, int]:
        from scripts.bench_worker import local_view

        local = self.local[kind]
        return {pc[0]: digest(local_view(local[p.key], pc)) for p in self.params for pc in p.pieces}

    def close(self) -> None:
        for d in self.dsts.values():
            d.close()


def copy_bound_s(nbytes: int, cuda: bool, repeat: int = 5) -> tuple[float, str]:
    """Seconds to copy ``nbytes`` once: GPU 0 -> GPU 1 on the copy engines (measured on 1 GiB and scaled),
    or a host memcpy on CPU."""
    size = min(nbytes, 1 << 30)
    if cuda:
        from scripts.bench_push import copy_engine_gbps

        bw = copy_engine_gbps(size, repeat)
        return nbytes / (bw["gbps"] * 1e9), f"copy engine GPU 0 -> GPU 1 at {bw['gbps']:.1f} GB/s"
    a = torch.randint(0, 256, (size,), dtype=torch.uint8)
    b = torch.empty_like(a)
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        b.copy_(a)
        times.append(time.perf_counter() - t0)
    gbps = size / statistics.median(times) / 1e9
    return nbytes / (gbps * 1e9), f"host memcpy at {gbps:.1f} GB/s (for scale: the CPU pushes go over TCP)"


class _Recording:
    """This process's device timeline (torch.profiler: every thread's CUDA kernels and copies; the
    destination's scatter runs in its receiving thread) and weightsync.runtime.trace's host marks, from
    its making to :meth:`stop`."""

    def __init__(self, dev: Any, device_events: bool) -> None:
        from torch.profiler import ProfilerActivity, profile

        self.dev = dev
        self.prof = profile(activities=[ProfilerActivity.CUDA]) if device_events else None
        marks.take()
        marks.enable()
        if self.prof is not None:
            self.prof.start()

    def stop(self, path: str, **extra: Any) -> None:
        """Stops recording and writes what was recorded to ``path`` (:func:`_export`), with ``extra``."""
        _sync(self.dev)
        if self.prof is not None:
            self.prof.stop()
        marks.enable(False)
        _export(self.prof, path, marks=marks.take(), **extra)


def _record(dev: Any, device_events: bool = True) -> _Recording | None:
    """A recording started on a GPU (``device_events``: the profiler's kernels and copies too, which slow
    every CUDA call; else the host marks alone); None for device events on CPU."""
    return _Recording(dev, device_events) if dev.type == "cuda" or not device_events else None


def _export(prof: Any, path: str, **extra: Any) -> None:
    """The device events of ``prof`` (None: none recorded) as JSON rows (name, start and end in ns on the
    host's clock, stream, kind), with ``extra``."""
    import json

    rows: list[dict[str, Any]] = []
    if prof is not None:
        prof.export_chrome_trace(path + ".chrome.json")
        with open(path + ".chrome.json") as f:
            trace = json.load(f)
        base = int(trace.get("baseTimeNanoseconds", 0))
        rows = [{"name": e["name"], "start": base + int(e["ts"] * 1e3),
                 "end": base + int((e["ts"] + e["dur"]) * 1e3), "stream": e.get("args", {}).get("stream", -1),
                 "cat": e.get("cat", "")}
                for e in trace.get("traceEvents", [])
                if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
        os.unlink(path + ".chrome.json")
    with open(path, "w") as f:
        json.dump({"events": rows, **extra}, f)


def timeline(trainer_path: str, rollout_path: str) -> list[str]:
    """One traced push in time order: runs of the same kernel or copy on one stream merged, in ms from
    the push's start (host clock: both actors run on this host), the trainer's and the replica's."""
    import json

    with open(trainer_path) as f:
        tr = json.load(f)
    with open(rollout_path) as f:
        ro = json.load(f)
    t0, t1 = tr["push_ns"]
    runs: list[tuple[int, int, str, str, int]] = []  # start, end, who, name, count
    for who, events in (("trainer", tr["events"]), ("replica", ro["events"])):
        cur: list[Any] | None = None
        for e in sorted(events, key=lambda e: (e["stream"], e["start"])):
            if e["end"] < t0 - 5_000_000 or e["start"] > t1 + 5_000_000:
                continue
            name = e["name"].split("(")[0][:48]
            if cur is not None and cur[3] == name and cur[5] == e["stream"] and e["start"] - cur[1] < 200_000:
                cur[1] = max(cur[1], e["end"])
                cur[4] += 1
                continue
            if cur is not None:
                runs.append(tuple(cur[:5]))  # type: ignore[arg-type]
            cur = [e["start"], e["end"], f"{who} s{e['stream']}", name, 1, e["stream"]]
        if cur is not None:
            runs.append(tuple(cur[:5]))  # type: ignore[arg-type]
        for t, label in (tr if who == "trainer" else ro).get("marks", []):  # weightsync.runtime.trace
            runs.append((t, t, f"{who} host", label, 1))
    lines = [f"push {(t1 - t0) / 1e6:.2f} ms (host clock); device work from its start, ms:"]
    for a, b, who, name, n in sorted(runs):
        times = f"  {(a - t0) / 1e6:8.2f} {(b - t0) / 1e6:8.2f}"
        lines.append(f"{times}  {who:<12} {name}{f' x{n}' if n > 1 else ''}")
    return lines


def _med(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def _summary(lr: float, kind: str, d: list[dict[str, Any]], x: list[dict[str, Any]], fractions: list[float],
             bound: float) -> dict[str, Any]:
    """Medians of one delta group's pushes at one learning rate, against the dense group's."""
    res = {
        "lr": lr, "kind": kind, "path": x[-1]["path"] if x else "", "changed_fraction": _med(fractions),
        "push_changed_fraction": _med([r["changed_fraction"] for r in x]),
        "dense_ms": _med([r["seconds"] for r in d]) * 1e3,
        "delta_ms": _med([r["seconds"] for r in x]) * 1e3,
        "encode_ms": _med([r["encode_s"] for r in x]) * 1e3,
        "apply_ms": _med([r["apply_s"] for r in x]) * 1e3,
        # the rest of the push after the source's encode (the finish, the reference's update, overlaps
        # it): the last part's transfer, what the destination has not applied by then, the ack. The
        # destination applies the earlier parts while the source encodes, so the apply is not subtracted.
        "after_ms": _med([r["seconds"] - (r["encode_s"] - r["phases"].get("finish", 0.0)) for r in x]) * 1e3,
        "wire_gb": _med([r["wire_bytes"] for r in x]) / 1e9,
        # of it, writes sent as planned for want of inbox room (--inbox too small for these changes)
        "overflow_gb": _med([r.get("overflow_bytes", 0) for r in x]) / 1e9,
        "dense_gb": _med([r["dense_bytes"] for r in x]) / 1e9,
        "ref_gb": x[-1]["ref_bytes"] / 1e9 if x else 0.0,
        "scratch_mb": max((r["scratch_bytes"] for r in x), default=0) / 1e6,
        "all_delta": all(r["delta"] for r in x), "bound_ms": bound * 1e3,
    }
    for p in PHASES:
        res[p + "_ms"] = _med([r["phases"].get(p, 0.0) for r in x]) * 1e3
    res["delta_over_dense"] = res["delta_ms"] / res["dense_ms"]
    # the simulator's inputs (scripts/simulate_delta.py): GB/s of dense bytes encoded / applied; the
    # encode on the push's path (the finish overlaps the destination's apply)
    res["encode_gbs"] = res["dense_gb"] / max((res["encode_ms"] - res["finish_ms"]) * 1e-3, 1e-9)
    res["apply_gbs"] = res["dense_gb"] / max(res["apply_ms"] * 1e-3, 1e-9)
    res["delta_over_bound"] = res["delta_ms"] / res["bound_ms"]
    return res


def _cuda_env() -> dict[str, str]:
    """CUDA settings of this process that the actors must share: how many hardware queues a GPU's
    streams are spread over (CUDA_DEVICE_MAX_CONNECTIONS; fewer than the streams in use serialize some of
    them behind each other)."""
    return {k: os.environ[k] for k in ("CUDA_DEVICE_MAX_CONNECTIONS",) if k in os.environ}


def run(args: argparse.Namespace) -> dict[str, Any]:
    cuda = args.device == "cuda"
    if cuda and torch.cuda.device_count() < 2:
        raise SystemExit(f"--device cuda needs 2 GPUs, found {torch.cuda.device_count()}")
    ray.init(address="local", num_cpus=4, num_gpus=2 if cuda else 0, include_dashboard=False,
             log_to_driver=args.verbose,
             runtime_env={"env_vars": {"PYTHONPATH": ROOT, **NO_MULTICAST, **_cuda_env(),
                                       "WEIGHTSYNC_SECRET": secrets.token_hex(16)}})
    kinds = ("dense", "delta", "delta-torch") if args.ab else ("dense", "delta")
    groups = {kind: f"bench-delta-{kind}-{os.getpid()}" for kind in kinds}
    handles: list[Any] = []
    actors: list[Any] = []
    results: list[dict[str, Any]] = []
    try:
        handles = [ws.Group.create(g, num_sources=1, num_destinations=1) for g in groups.values()]
        opts = {"num_gpus": 1, "num_cpus": 0} if cuda else {"num_cpus": 0}
        rollout = ray.remote(**opts)(Rollout).remote(groups, args.model, args.inbox)
        trainer = ray.remote(**opts)(Trainer).remote(groups, args.model, args.adam, max(args.lrs))
        actors = [trainer, rollout]
        info = ray.get(trainer.info.remote(), timeout=1200)
        bound, how = copy_bound_s(info["bytes"], cuda)
        print(f"{info.get('gpu', 'CPU')}: {args.model} {info['bytes'] / 1e9:.3f} GB in {info['tensors']} "
              f"tensors; copy bound {bound * 1e3:.2f} ms ({how}); delta inbox {args.inbox:.0%} of the model",
              flush=True)
        floor: dict[str, Any] = {}
        if not cuda:
            floor = ray.get(trainer.compare_floor.remote(), timeout=1200)
            print(f"  compare floor: {floor['seconds'] * 1e3:.2f} ms (the host compare of the unchanged "
                  f"model: current and reference, {floor['read_bytes'] / 1e9:.3f} GB, read at "
                  f"{floor['read_bytes'] / floor['seconds'] / 1e9:.1f} GB/s on {floor['threads']} threads)",
                  flush=True)
        version = 1
        for kind in groups:  # first pushes: dense everywhere (no reference yet), and warm-up
            ray.get(trainer.push.remote(kind, version), timeout=1200)
        ray.get(rollout.wait.remote(version), timeout=600)
        untimed = untimed_steps(args.adam, args.adam_warmup, args.warmup)
        for lr in args.lrs:
            rows: dict[str, list[dict[str, Any]]] = {kind: [] for kind in kinds}
            fractions, all_fractions, adam_steps, step_s = [], [], [], []
            for n in range(untimed + args.steps):
                # kept: a fresh optimizer per learning rate, so each one's timed pushes are its steps
                # untimed + 1 on; every step (warm-up ones too) pushed to every group, dense and delta alike
                st = ray.get(trainer.adam_step.remote(lr, n == 0), timeout=1200)
                all_fractions.append(st["changed_fraction"])
                step_s.append(st["step_s"])
                if n == 0 and args.adam == "kept" and "moments_host_bytes" in st:
                    print(f"  lr {lr:g}: Adam kept, moments {st['moments_gpu_bytes'] / 1e9:.1f} GB on the "
                          f"trainer's GPU and {st['moments_host_bytes'] / 1e9:.1f} GB in host memory (set up "
                          f"in {st['setup_s']:.1f} s); one step {st['step_s']:.2f} s", flush=True)
                version += 1
                deltas = [k for k in kinds if k != "dense"]
                for kind in ["dense", *(deltas if n % 2 else deltas[::-1])]:
                    trace = ""
                    last = n == untimed + args.steps - 1 and lr == args.lrs[0]
                    # --profile: the last timed push, device events too; --marks: every timed one, host
                    # marks alone (they cost a clock read each: the pushes stay in the medians)
                    marked = args.marks and n >= untimed and lr == args.lrs[0]
                    folder = args.profile or args.marks
                    events = bool(args.profile and cuda and last)
                    if kind == "delta" and (events or marked):
                        os.makedirs(folder, exist_ok=True)
                        trace = os.path.join(folder, f"trainer-{version}.json")
                        ray.get(rollout.trace.remote("", events), timeout=600)
                    r = ray.get(trainer.push.remote(kind, version, trace, events), timeout=1200)
                    if trace:
                        ray.get(rollout.wait.remote(version), timeout=600)
                        replica = os.path.join(folder, f"replica-{version}.json")
                        ray.get(rollout.trace.remote(replica), timeout=600)
                        print("\n".join(timeline(trace, replica)), flush=True)
                    if n >= untimed:
                        rows[kind].append(r)
                if n >= untimed:
                    fractions.append(st["changed_fraction"])
                    adam_steps.append(st["step"])
                ray.get(rollout.wait.remote(version), timeout=600)
                if n >= untimed or n == untimed + args.steps - 1:
                    check_replicas(trainer, rollout, groups, lr, version)
            print(f"  lr {lr:g}: Adam {args.adam}, {len(all_fractions)} steps changed "
                  f"{percents(all_fractions)} of BF16 values (timed: steps "
                  f"{adam_steps}); one Adam step {_med(step_s):.2f} s (median)", flush=True)
            d = rows["dense"]
            for kind in kinds[1:]:
                res = _summary(lr, kind, d, rows[kind], fractions, bound)
                res.update(adam=args.adam, adam_steps=adam_steps, step_fractions=all_fractions,
                           adam_step_s=_med(step_s))
                results.append(res)
                print(f"  lr {lr:g} {kind} ({res['path']} compare, Adam {adam_what(args.adam, adam_steps)}): "
                      f"{res['changed_fraction']:.2%} of BF16 "
                      f"values changed (push saw {res['push_changed_fraction']:.2%}); dense "
                      f"{res['dense_ms']:.2f} ms, delta {res['delta_ms']:.2f} ms "
                      f"({res['delta_over_dense']:.3f}x dense, {res['delta_over_bound']:.3f}x bound "
                      f"{res['bound_ms']:.2f} ms); encode {res['encode_ms']:.2f} ms ("
                      + ", ".join(f"{p} {res[p + '_ms']:.2f}" for p in PHASES)
                      + f"), after the encode {res['after_ms']:.2f} ms, apply {res['apply_ms']:.2f} ms "
                      "(summed over parts); wire "
                      f"{res['wire_gb']:.3f} of {res['dense_gb']:.3f} GB (of it {res['overflow_gb']:.3f} GB "
                      f"of writes as planned for want of inbox room); reference {res['ref_gb']:.2f} GB, "
                      f"kernel scratch {res['scratch_mb']:.0f} MB (bytes checked)", flush=True)
    finally:
        for a in actors:
            try:
                ray.get(a.close.remote(), timeout=60)
            except Exception as exc:  # an actor that failed: killed below all the same
                print(f"  (closing an actor: {type(exc).__name__})", flush=True)
            ray.kill(a)
        for h in handles:
            h.shutdown()
        ray.shutdown()
    out = {"card": info.get("gpu", "CPU"), "device": args.device, "model": args.model,
           "model_bytes": info["bytes"], "steps": args.steps, "inbox": args.inbox, "ab": args.ab,
           "adam": args.adam, "untimed_steps": untimed, "compare_floor": floor,
           "results": results,
           "date": time.strftime("%Y-%m-%d", time.gmtime())}
    goals = []
    for r in results:
        if cuda and abs(r["lr"] - 1e-6) < 1e-12:
            x = r["delta_over_dense"]
            goals.append(f"goal: delta push <= {DELTA_GOAL:g}x dense at lr 1e-6 ({r['kind']}, {r['path']} "
                         f"compare, Adam {adam_what(r['adam'], r['adam_steps'])}, "
                         f"{r['changed_fraction']:.2%} changed): {x:.3f}x ({met(x <= DELTA_GOAL)})")
        if not cuda and abs(r["lr"] - 1e-6) < 1e-12:
            # no delta push can be faster than its compare's reads: dense / floor is the most it can gain
            most = r["dense_ms"] / (floor["seconds"] * 1e3) if floor else float("nan")
            goals.append(f"goal (CPU): delta >= 5x faster than dense at lr {r['lr']:g} ({r['kind']}): "
                         f"{1 / r['delta_over_dense']:.1f}x ({met(r['delta_over_dense'] <= 0.2)}); at most "
                         f"{most:.1f}x here: dense {r['dense_ms']:.1f} ms against the compare floor "
                         f"{floor.get('seconds', float('nan')) * 1e3:.1f} ms")
    out["goals"] = goals
    if results:
        r = results[0]
        out["simulate"] = ("python scripts/simulate_delta.py --model ../shared/models/kimi-k2.json "
                           f"--changed 0.01 0.02 0.05 --encode-gbs {r['encode_gbs']:.0f} "
                           f"--apply-gbs {r['apply_gbs']:.0f}")
    return out


def check_replicas(trainer: Any, rollout: Any, groups: dict[str, str], lr: float, version: int) -> None:
    """Every replica's bytes equal the trainer's weights (position-weighted digests per tensor)."""
    want = ray.get(trainer.digests.remote(), timeout=1200)
    for kind in groups:
        got = ray.get(rollout.digests.remote(kind), timeout=1200)
        bad = [k for k in want if got.get(k) != want[k]]
        if bad:
            raise SystemExit(f"lr {lr}: the {kind} replica's version {version} differs from the trainer's "
                             f"weights in {len(bad)} tensors, e.g. {bad[:3]}")


def _delta_classes(path: str) -> tuple[Any, Any]:
    """DeltaSender and DeltaReceiver of a delta module file (an older weightsync/delta/sender.py)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_delta_baseline", path)
    if spec is None or spec.loader is None:
        raise SystemExit(f"--baseline {path}: not a Python file")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # its dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod.DeltaSender, mod.DeltaReceiver


def micro(args: argparse.Namespace) -> dict[str, Any]:
    """``--micro``: one source and one fused destination in this process; per learning rate and step, the
    push's encode and apply seconds (PushStats) and its changed fraction; the bytes checked after every
    push. With ``--baseline FILE``, a second group over the same trainer tensors whose source and
    destination use that file's delta classes; each step pushes both, in alternating order."""
    from concurrent.futures import ThreadPoolExecutor

    import weightsync.runtime.destination as dmod
    import weightsync.runtime.source as smod
    from scripts.bench_worker import DTYPE, as_ws, local_view, rollout_params

    if args.device != "cpu":
        # one process: a cuda lane would have to open its own CUDA IPC handles; on GPUs the full benchmark
        # reports the same encode and apply seconds
        raise SystemExit("--micro runs on CPU (--device cpu); on GPUs run the benchmark without --micro")
    dev = torch.device("cpu")
    kinds = {"tree": (smod.DeltaSender, dmod.DeltaReceiver)}
    if args.baseline:
        kinds["baseline"] = _delta_classes(args.baseline)
    secret = os.environ.setdefault("WEIGHTSYNC_SECRET", secrets.token_hex(16))
    ray.init(address="local", num_cpus=1, include_dashboard=False, log_to_driver=args.verbose,
             runtime_env={"env_vars": {"PYTHONPATH": ROOT, "WEIGHTSYNC_SECRET": secret}})
    results: list[dict[str, Any]] = []
    teams: dict[str, tuple[Any, Any, Any, dict[str, torch.Tensor]]] = {}
    try:
        master, weights = init_weights(args.model, dev)
        nbytes = sum(t.numel() * t.element_size() for t in weights.values())
        params = rollout_params(model_config(args.model), 1, 0)
        for kind, (sender, receiver) in kinds.items():
            # the classes a Source and a Destination take are looked up when they are made
            smod.DeltaSender, dmod.DeltaReceiver = sender, receiver
            name = f"bench-delta-micro-{kind}-{os.getpid()}"
            group = ws.Group.create(name, num_sources=1, num_destinations=1)
            local = {p.key: torch.full(p.shape, float("nan"), dtype=DTYPE, device=dev) for p in params}
            teams[kind] = (group, None, None, local)
            with ThreadPoolExecutor(2) as ex:
                fs = ex.submit(ws.Source, name, rank=0, tensors=weights, timeout=300, delta=True)
                named = {p.key: as_ws(p, local[p.key]) for p in params}
                fd = ex.submit(ws.Destination, name, rank=0, tensors=named, mode="inplace", timeout=300,
                               push_timeout=300, delta_bytes=int(nbytes * args.inbox))
                teams[kind] = (group, fs.result(timeout=600), fd.result(timeout=600), local)
        smod.DeltaSender, dmod.DeltaReceiver = kinds["tree"]
        print(f"micro: {args.model} {nbytes / 1e9:.3f} GB in {len(weights)} tensors on {dev}, 1 source -> 1 "
              f"fused destination in one process ({', '.join(kinds)}); inbox {args.inbox:.0%} of the model",
              flush=True)
        gen = torch.Generator(device=dev).manual_seed(2)

        def push(kind: str, version: int) -> ws.PushStats:
            _, src, dst, local = teams[kind]
            stats = ws.push(src, version, timeout=300)
            assert dst.wait(version, timeout=300) == version
            for p in params:
                for pc in p.pieces:
                    got, want = local_view(local[p.key], pc), weights[pc[0]]
                    if not torch.equal(got.reshape(want.shape).view(torch.int16), want.view(torch.int16)):
                        raise SystemExit(f"{kind} version {version}: {p.key} ({pc[0]}) differs from the "
                                         "source's")
            return stats

        version = 1
        for kind in kinds:
            push(kind, version)  # dense: no reference yet
        untimed = untimed_steps(args.adam, args.adam_warmup, args.warmup)
        kept = KeptAdamState(master, dev) if args.adam == "kept" else None
        for lr in args.lrs:
            rows: dict[str, list[dict[str, Any]]] = {kind: [] for kind in kinds}
            fractions, adam_steps = [], []
            if kept is not None:
                kept.adam.reset()  # a fresh optimizer per learning rate
            for n in range(untimed + args.steps):
                if kept is None:
                    frac = adam_step(master, weights, gen, lr, dev)
                else:
                    frac = kept.step(weights, gen, lr, dev)
                version += 1
                for kind in (list(kinds) if n % 2 else list(kinds)[::-1]):
                    s = push(kind, version)
                    if not s.delta_destinations:
                        raise SystemExit(f"{kind} version {version} was not sent as a delta")
                    if n >= untimed:
                        rows[kind].append({"push_s": s.seconds, "encode_s": s.encode_seconds,
                                           "apply_s": s.apply_seconds, "wire_bytes": s.wire_bytes})
                if n >= untimed:
                    fractions.append(frac)
                    adam_steps.append(kept.adam.steps if kept is not None else 1)
            for kind, r in rows.items():
                res = {"lr": lr, "kind": kind, "changed_fraction": _med(fractions), "adam": args.adam,
                       "adam_steps": adam_steps, "step_fractions": fractions,
                       "push_ms": _med([x["push_s"] for x in r]) * 1e3,
                       "encode_ms": _med([x["encode_s"] for x in r]) * 1e3,
                       "apply_ms": _med([x["apply_s"] for x in r]) * 1e3,
                       "encode_all_ms": [round(x["encode_s"] * 1e3, 1) for x in r],
                       "apply_all_ms": [round(x["apply_s"] * 1e3, 1) for x in r],
                       "wire_gb": _med([x["wire_bytes"] for x in r]) / 1e9, "dense_gb": nbytes / 1e9}
                results.append(res)
                print(f"  lr {lr:g} {kind} (Adam {adam_what(args.adam, adam_steps)}): "
                      f"{res['changed_fraction']:.2%} changed; push "
                      f"{res['push_ms']:.1f} ms, encode {res['encode_ms']:.1f} ms {res['encode_all_ms']}, "
                      f"apply {res['apply_ms']:.1f} ms {res['apply_all_ms']}; wire {res['wire_gb']:.4f} of "
                      f"{res['dense_gb']:.3f} GB (bytes checked)", flush=True)
    finally:
        for group, src, dst, _ in teams.values():
            for p in (src, dst):
                if p is not None:
                    p.close()
            group.shutdown()
        ray.shutdown()
    return {"micro": True, "device": str(dev), "model": args.model, "model_bytes": nbytes, "adam": args.adam,
            "steps": args.steps, "baseline": args.baseline, "results": results,
            "torch_threads": torch.get_num_threads(), "load_average": os.getloadavg(),
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}


def compare_only(args: argparse.Namespace) -> dict[str, Any]:
    """``--compare``: the sender's compare alone on one device (no group, no transfer), the kernel path
    against the torch path from the same reference each step: a fraction ``--changed`` of the BF16 words
    flipped in their lowest bit (uniformly at random), then per path the compare (``start``: changed
    words found, values gathered; on the kernel path the reference updated too) and ``finish`` (the torch
    path's reference update) timed, the positions, values and reference after it checked equal; then per
    encoding of ``--encodings`` those changes written as one stream per word size (``encode_into`` from
    the ordered changes: the index writer, a kernel for a bitmap's bits on CUDA) and the receiver's
    scatter of it (one entry per tensor) into the previous version, by the kernels and the torch ops on
    alternate steps, timed and checked."""
    from scripts.bench_worker import DTYPE, checkpoint_tensors
    from weightsync.delta.sender import DeltaSender

    dev = _device() if args.device == "cuda" else torch.device("cpu")
    g = torch.Generator(device=dev).manual_seed(1)
    weights = {name: (torch.randn(shape, generator=g, device=dev, dtype=torch.float32) * 0.02).to(DTYPE)
               for name, shape in checkpoint_tensors(model_config(args.model))}
    nbytes = sum(t.numel() * t.element_size() for t in weights.values())
    engine = ws.TransferEngine()
    sender = DeltaSender(engine, weights, dev, 0, True)
    paths = ["kernel", "torch"] if sender.use_kernels else ["torch"]
    print(f"compare: {args.model} {nbytes / 1e9:.3f} GB in {len(weights)} tensors on "
          f"{torch.cuda.get_device_name(dev) if dev.type == 'cuda' else 'CPU'}; paths {paths}; "
          f"{args.changed:.2%} of words changed per step", flush=True)
    sender.start()  # the first reference: a copy
    sender.finish(1, True)
    encodings = list(args.encodings)
    times: dict[str, dict[str, list[float]]] = {
        p: {"compare": [], "finish": [], **{f"{x}_{e}": [] for e in encodings for x in ("encode", "apply")}}
        for p in paths}
    scratch = 0
    version = 1
    try:
        for n in range(args.warmup + args.steps):
            for t in weights.values():
                iv = t.view(torch.int16).reshape(-1)
                flip = torch.rand(iv.numel(), generator=g, device=dev) < args.changed
                iv ^= flip.to(torch.int16)
                del flip
            version += 1
            before = {w: sp.ref.clone() for w, sp in sender._spaces.items()}
            found: dict[str, Any] = {}
            for i, path in enumerate(paths if n % 2 == 0 else paths[::-1]):
                if i:  # the same push again from the same reference
                    for w, sp in sender._spaces.items():
                        sp.ref.copy_(before[w])
                sender.use_kernels = path == "kernel"
                sender.ref_version = version - 1
                _sync(dev)
                t0 = time.perf_counter()
                sender.start()
                sender.compare_all()
                _sync(dev)
                t1 = time.perf_counter()
                got = {w: (sp.idx.clone(), sp.vals.clone()) for w, sp in sender._spaces.items()}
                sender.finish(version, True)
                _sync(dev)
                t2 = time.perf_counter()
                scratch = max(scratch, sender.scratch_bytes)
                for sp in sender._spaces.values():  # the reference is the tensors now, on either path
                    for key, a, b in zip(sp.keys, sp.starts[:-1].tolist(), sp.starts[1:].tolist(),
                                         strict=True):
                        if not torch.equal(sp.ref[a:b], sender._views[key]):
                            raise SystemExit(f"step {n}, {path} path: the reference of {key} is not the "
                                             "tensor")
                found[path] = got
                if n >= args.warmup:
                    times[path]["compare"].append(t1 - t0)
                    times[path]["finish"].append(t2 - t1)
                del got
            if len(paths) > 1:
                ga, gb = found["kernel"], found["torch"]
                for w in ga:
                    if not (torch.equal(ga[w][0], gb[w][0]) and torch.equal(ga[w][1], gb[w][1])):
                        raise SystemExit(f"step {n}: the kernel and torch paths found different changes "
                                         f"(word size {w})")
            # the receiver's side: the changes as one stream per word size in each encoding, scattered
            # into the previous version (``before``) by the kernels or the torch ops (alternately), checked
            apply_path = paths[n % len(paths)]
            for enc in encodings:
                copy = {w: b.clone() for w, b in before.items()} if enc != encodings[-1] else before
                de, da = _apply_once(engine, sender, copy, found[paths[0]], dev, apply_path == "kernel", enc)
                if n >= args.warmup:
                    times[apply_path][f"encode_{enc}"].append(de)
                    times[apply_path][f"apply_{enc}"].append(da)
                del copy
            del before, found
    finally:
        engine.close()
    out: dict[str, Any] = {"compare_only": True, "device": str(dev), "model": args.model,
                           "model_bytes": nbytes, "changed": args.changed, "steps": args.steps,
                           "scratch_bytes": scratch, "ref_bytes": sender.ref_bytes, "results": {}}
    for path in paths:
        c, f = _med(times[path]["compare"]), _med(times[path]["finish"])
        out["results"][path] = {"compare_ms": c * 1e3, "finish_ms": f * 1e3,
                                "compare_all_ms": [round(x * 1e3, 2) for x in times[path]["compare"]],
                                "read_gbs": 2 * nbytes / c / 1e9}
        streams = []
        for enc in encodings:
            e, a = _med(times[path][f"encode_{enc}"]), _med(times[path][f"apply_{enc}"])
            out["results"][path][f"encode_{enc}_ms"] = e * 1e3
            out["results"][path][f"apply_{enc}_ms"] = a * 1e3
            streams.append(f"{enc}: encode {e * 1e3:.2f} ms, apply {a * 1e3:.2f} ms")
        print(f"  {path}: compare {c * 1e3:.2f} ms (tensors and reference read at {2 * nbytes / c / 1e9:.0f} "
              f"GB/s), finish {f * 1e3:.2f} ms; streams (encode from the ordered changes, the receiver's "
              f"scatter) {'; '.join(streams)}; all compares {out['results'][path]['compare_all_ms']}",
              flush=True)
    print(f"  kernel scratch {scratch / 2**20:.0f} MiB; reference {sender.ref_bytes / 1e9:.2f} GB"
          + ("; positions, values and reference equal on both paths every step" if len(paths) > 1 else ""),
          flush=True)
    return out


def _apply_once(engine: Any, sender: Any, before: dict[int, torch.Tensor],
                found: dict[int, tuple[torch.Tensor, torch.Tensor]], dev: torch.device,
                kernel: bool, encoding: str) -> tuple[float, float]:
    """Seconds of writing ``found`` (per space of the sender the changed positions and values) as one
    stream per space in ``encoding`` (``encode_into``; one entry per key; each space as a part of its
    own, as a push sends its parts), and of one receiver scatter (``DeltaReceiver._scatter_all``) of
    them into ``before`` (the previous version's words, one tensor per space), which must equal the
    sender's tensors after it."""
    from weightsync.delta.codec import (
        ENC_BITMAP,
        ENC_IDX16,
        ENC_STREAM,
        ENTRY_DTYPE,
        STREAM_DTYPE,
        WORDS,
        data_at,
        encode_into,
        sparse_sizes,
    )
    from weightsync.delta.receiver import DeltaReceiver
    from weightsync.delta.units import _align

    enc = {"idx16": ENC_IDX16, "bitmap": ENC_BITMAP}[encoding]
    spaces = sender._spaces
    keys = [k for sp in spaces.values() for k in sp.keys]
    places = {}
    at = 0
    for s, sp in spaces.items():  # per space: its entries, its stream table, its stream
        n, k = int(sp.starts[-1]), int(found[s][0].numel())
        start = at
        at += data_at(len(sp.keys))
        size = sparse_sizes(n, k, sp.word)[enc]
        places[s] = (start, at - start, size)
        at += _align(size)
    buffers = {key: [before[s][a:b]] for s, sp in spaces.items()
               for key, a, b in zip(sp.keys, sp.starts[:-1].tolist(), sp.starts[1:].tolist(), strict=True)}
    recv = DeltaReceiver(engine, buffers, "inplace", dev, at, 0)
    try:
        order = {key: i for i, key in enumerate(recv.keys)}
        parts = []
        _sync(dev)
        t0 = time.perf_counter()
        for s, sp in spaces.items():
            start, data, size = places[s]
            idx, vals = found[s]
            encode_into(recv.payload[start + data:start + data + size], enc, idx, vals, int(sp.starts[-1]))
        _sync(dev)
        de = time.perf_counter() - t0
        for s, sp in spaces.items():
            w = sp.word
            start, data, size = places[s]
            idx, vals = found[s]
            streams = np.zeros(len(WORDS), STREAM_DTYPE)
            streams["word"] = WORDS
            streams[WORDS.index(w)] = (w, enc, int(sp.starts[-1]), int(idx.numel()), data, (0, 0, 0))
            cut = torch.searchsorted(idx, torch.from_numpy(sp.starts).to(dev)).cpu().numpy()
            entries = np.zeros(len(sp.keys), ENTRY_DTYPE)
            for i, key in enumerate(sp.keys):
                a, b = int(sp.starts[i]), int(sp.starts[i + 1])
                entries[i] = (order[key], ENC_STREAM, w, 0, 1, (b - a) * w, (b - a) * w,
                              int(cut[i + 1] - cut[i]), a)
            parts.append((entries, streams, start))
        recv.use_kernels = kernel
        _sync(dev)
        t0 = time.perf_counter()
        recv._scatter_all(0, parts)
        _sync(dev)
        recv._check_refused()
        dt = time.perf_counter() - t0
        for key in keys:
            if not torch.equal(buffers[key][0], sender._views[key]):
                raise SystemExit(f"apply ({'kernel' if kernel else 'torch'}, {encoding}): {key} differs from "
                                 "the source")
    finally:
        engine.deregister(recv.payload_region)
        engine.deregister(recv.header_region)
    return de, dt


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    ap.add_argument("--model", default=None, help="a config of scripts/bench_worker.py (default: llama-3-8b "
                    "on cuda, llama-small on cpu)")
    ap.add_argument("--lrs", type=float, nargs="+", default=[1e-6, 1e-5])
    ap.add_argument("--steps", type=int, default=None,
                    help="timed steps per learning rate (default 5; cpu 3)")
    ap.add_argument("--warmup", type=int, default=1, help="untimed steps per learning rate (--adam first)")
    add_adam_options(ap)  # kept: a fresh optimizer per learning rate, --adam-warmup steps of each untimed
    ap.add_argument("--inbox", type=float, default=0.125,
                    help="the delta inbox, a fraction of the model bytes")
    ap.add_argument("--out", default="", help="write the JSON result here too")
    ap.add_argument("--verbose", action="store_true", help="show the actors' logs")
    ap.add_argument("--marks", default="", help="record the host marks (weightsync.runtime.trace, no "
                    "profiler) of every timed delta push of the first lr into this folder and print them")
    ap.add_argument("--profile", default="", help="trace the last timed delta push of the first lr on both "
                    "GPUs (torch.profiler) into this folder and print its timeline")
    ap.add_argument("--compare", action="store_true", help="the sender's compare alone on one device, kernel "
                    "and torch paths from the same reference, checked equal (one GPU)")
    ap.add_argument("--changed", type=float, default=0.0423, help="--compare: fraction of words changed")
    ap.add_argument("--encodings", nargs="+", choices=["idx16", "bitmap"], default=["idx16", "bitmap"],
                    help="--compare: the stream encodings written and scattered")
    ap.add_argument("--ab", action="store_true", help="also a delta group whose sender compares with torch "
                    "ops (delta-torch), pushed alternately with the kernel one")
    ap.add_argument("--micro", action="store_true",
                    help="source and destination in this process: encode and apply seconds only")
    ap.add_argument("--baseline", default="", help="--micro: also push through a second group using the "
                    "delta classes of this file (an older weightsync/delta/sender.py), interleaved")
    args = ap.parse_args(argv)
    gpu = args.device == "cuda"
    for key, on_gpu, on_cpu in (("model", "llama-3-8b", "llama-small"), ("steps", 5, 3)):
        if getattr(args, key) is None:
            setattr(args, key, on_gpu if gpu else on_cpu)
    return args


def emit(out: dict[str, Any], path: str) -> None:
    """The result as the last printed line (one JSON object), and to ``path`` too where one is given."""
    print(json.dumps(out), flush=True)
    if path:
        with open(path, "w") as f:
            json.dump(out, f, indent=1)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.compare:
        out = compare_only(args)
        emit(out, args.out)
        return
    if args.device == "cpu" and args.adam == "kept":
        from scripts.bench_push import adam_self_check

        print(adam_self_check(), flush=True)  # the kept-moment Adam against torch.optim.Adam, bitwise
    if args.micro:
        out = micro(args)
        emit(out, args.out)
        return
    out = run(args)
    print()
    print(f"{out['card']}, {out['model']} ({out['model_bytes'] / 1e9:.3f} GB), 1 trainer -> 1 fused replica, "
          f"median of {out['steps']} steps, {out['date']}:")
    print("  lr      group        path   adam         changed   dense ms   delta ms  delta/dense  bound ms  "
          "encode ms  compare  finalize  finish  after ms  apply ms  wire GB")
    for r in out["results"]:
        print(f"  {r['lr']:<7g} {r['kind']:<12} {r['path']:<6} {adam_what(r['adam'], r['adam_steps']):<11} "
              f"{r['changed_fraction']:8.2%} "
              f"{r['dense_ms']:10.2f} {r['delta_ms']:10.2f} {r['delta_over_dense']:11.3f}x "
              f"{r['bound_ms']:9.2f} "
              f"{r['encode_ms']:10.2f} {r['compare_ms']:8.2f} {r['finalize_ms']:9.2f} {r['finish_ms']:7.2f} "
              f"{r['after_ms']:9.2f} {r['apply_ms']:9.2f} {r['wire_gb']:8.3f}")
    for line in out["goals"]:
        print(line)
    if "simulate" in out:
        print(f"simulator inputs at lr {out['results'][0]['lr']:g}: {out['simulate']}")
    emit(out, args.out)


if __name__ == "__main__":
    main()
