"""The delta codec alone: the sender's compare and encode and the receiver's scatter, without the wire.

The delta push itself (dense and delta pushes of the same scenario in one run, on GPUs or CPU actors) is
``scripts/bench_push.py --delta-lr``; this script times its parts in one process, where a change to them
shows without the noise of a whole push.

``--compare`` (one device; default one GPU, Llama-3-8B shapes): BF16 weights of a model's checkpoint
tensors (``0.02 * randn``) and a reference, a fraction ``--changed`` of the words flipped in their lowest
bit each step; per compare path (``kernel``: weightsync.delta's CUDA or C++ kernels, unless
WEIGHTSYNC_DELTA_KERNELS=0; ``torch``: torch ops) the compare from the same reference, timed and its
positions, values and reference checked equal between the paths; then per encoding (``--encodings``:
idx16, bitmap) the changes written as one stream per word size and the receiver's scatter of it into the
previous version, by the kernels and the torch ops on alternate steps, timed and checked.

``--micro`` (CPU): one source and one fused destination in this process (threads; only the coordinator is
a Ray actor), one delta group; per learning rate (``--lrs``) an Adam step of fp32 masters on random
gradients (``--adam kept``, the default: moments kept across steps as a trainer's optimizer keeps them,
checked bitwise against torch.optim.Adam first; ``--adam first``: a fresh optimizer each step), the BF16
weights the rounded masters, then a delta push; it prints the push's encode and apply seconds
(``PushStats``) and the changed fraction, and checks the bytes after every push. ``--baseline
OLD_SENDER.py`` (an older weightsync/delta/sender.py, e.g. from ``git show``) adds a second group whose
source and destination use that file's delta classes, over the same tensors, pushed in alternating order
after every step: a before/after comparison under the same load.

    python scripts/bench_delta.py --compare                                # 1 GPU, both paths
    python scripts/bench_delta.py --compare --device cpu --model llama-small
    python scripts/bench_delta.py --micro --model llama-500m --lrs 1e-6    # CPU encode and apply
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

# The device choice of the non-blocking push benchmark (importing it also turns NVLink multicast off in
# this process).
from scripts.bench_async import _device, _sync  # noqa: E402
from scripts.bench_common import (  # noqa: E402
    add_adam_options,
    round_into,
    step_span,
    untimed_steps,
)


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
    KeptAdam over chunks of at most ADAM_CHUNK elements of each tensor), in host memory.
    ``adam.reset()`` starts a fresh optimizer on the same masters."""

    def __init__(self, master: dict[str, torch.Tensor], dev: torch.device) -> None:
        from scripts.bench_push import ADAM_CHUNK, KeptAdam

        self.chunks: list[tuple[str, int, int]] = []
        views = []
        for name, m in master.items():
            flat = m.view(-1)
            for a in range(0, flat.numel(), ADAM_CHUNK):
                b = min(flat.numel(), a + ADAM_CHUNK)
                self.chunks.append((name, a, b))
                views.append(flat[a:b])
        self.adam = KeptAdam(views, dev, 0)

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
    """The fp32 masters and their BF16 copy on ``dev``, Hugging Face names in checkpoint order."""
    from scripts.bench_worker import DTYPE, checkpoint_tensors

    g = torch.Generator(device=dev).manual_seed(1)
    master: dict[str, torch.Tensor] = {}
    weights: dict[str, torch.Tensor] = {}
    for name, shape in checkpoint_tensors(model_config(model)):
        m = torch.randn(shape, generator=g, device=dev, dtype=torch.float32) * 0.02
        if name.endswith("norm.weight"):
            m += 1.0  # RMSNorm scales start at 1
        weights[name] = m.to(DTYPE)
        master[name] = m
    return master, weights


PHASES = ("compare", "begin", "staged", "finalize", "finish")


def _med(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


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
        # one process: a cuda lane would have to open its own CUDA IPC handles; on GPUs bench_push.py
        # --delta-lr reports the same encode and apply seconds
        raise SystemExit("--micro runs on CPU; on GPUs run scripts/bench_push.py --scenarios 5 --delta-lr LR")
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
    mode = ap.add_mutually_exclusive_group(required=True)
    mode.add_argument("--compare", action="store_true", help="the sender's compare, the streams' encode and "
                      "the receiver's scatter alone on one device, kernel and torch paths, checked equal")
    mode.add_argument("--micro", action="store_true",
                      help="source and destination in this process (CPU): encode and apply seconds per push")
    ap.add_argument("--device", choices=["cuda", "cpu"], default=None,
                    help="--compare: default cuda; --micro runs on cpu")
    ap.add_argument("--model", default=None, help="a config of scripts/bench_worker.py or llama-500m "
                    "(default: llama-3-8b on cuda, llama-small on cpu)")
    ap.add_argument("--steps", type=int, default=None, help="timed steps (default 5; cpu 3)")
    ap.add_argument("--warmup", type=int, default=1,
                    help="untimed steps (--compare; --micro with --adam first)")
    ap.add_argument("--changed", type=float, default=0.0423, help="--compare: fraction of words changed")
    ap.add_argument("--encodings", nargs="+", choices=["idx16", "bitmap"], default=["idx16", "bitmap"],
                    help="--compare: the stream encodings written and scattered")
    ap.add_argument("--lrs", type=float, nargs="+", default=[1e-6, 1e-5], help="--micro: learning rates")
    add_adam_options(ap, when="--micro: ")  # kept: a fresh optimizer per learning rate
    ap.add_argument("--inbox", type=float, default=0.125,
                    help="--micro: the delta inbox, a fraction of the model bytes")
    ap.add_argument("--baseline", default="", help="--micro: also push through a second group using the "
                    "delta classes of this file (an older weightsync/delta/sender.py), interleaved")
    ap.add_argument("--out", default="", help="write the JSON result here too")
    ap.add_argument("--verbose", action="store_true", help="show the actors' logs")
    args = ap.parse_args(argv)
    if args.device is None:
        args.device = "cuda" if args.compare else "cpu"
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
        emit(compare_only(args), args.out)
        return
    if args.adam == "kept":
        from scripts.bench_push import adam_self_check

        print(adam_self_check(), flush=True)  # the kept-moment Adam against torch.optim.Adam, bitwise
    emit(micro(args), args.out)


if __name__ == "__main__":
    main()
