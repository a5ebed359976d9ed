"""Copy-engine schedule of scenario 2 of scripts/bench_push.py: where do its 2-3 ms above the bound go?

Not part of the package: an experiment kept so the figures quoted in docs/BENCHMARKS.md can be rerun
(it was first run as scratch/exp_sc2.py on 4 x H100).

Four GPUs in one process: Llama-3-8B FSDP-2 trainers on cuda:0/1, a fused TP-2 rollout (vLLM layout)
on cuda:2/3. Each trainer issues the 420 copies of scenario 2 with the driver API, as the engine's cuda
lane does (cuMemcpyAsync / cuMemcpy2DAsync_v2, event per copy, round robin over streams), behind a gate
(torch.cuda._sleep on a side stream) so the CPU is never what the GPU waits for. GPU time from an event
after the gate to the last copy of the slower trainer, median of ``--reps``; every full variant is
verified byte for byte (rollout poisoned with NaN before the checked repetition). Measured, in order:

* the bound: one copy of the same bytes 0->2; two such copies at once (0->2, 1->3); fan-in (0->2 +
  1->2) and fan-out (0->2 + 0->3), half the bytes each;
* the 420 copies as one sequence per trainer: the plan's order (16 visits per destination) vs 1, 2 or
  4 visits, own or cross writes only, writes >= 64 KiB only, with or without an event per copy, on 1
  or 2 streams (or small writes on a stream of their own), one trainer alone, and runs of 1-D copies
  as batched copies (cuMemcpyBatchAsync, when the driver has it);
* per-copy cost: N copies of 4 KiB to 8 MiB back to back on one stream, with and without an event each;
* 2-D vs 1-D copies of the same bytes (2048 rows of 4 KiB or 14 KiB).

Run on a host with 4 NVLink-connected GPUs (needs torch and the CUDA driver)::

    PYTHONPATH=$PWD python3 scripts/bench_copy_schedule.py

Writes the medians (ms) to ``--json``: $OUT/exp_sc2.json if OUT is set, else /tmp/exp_sc2.json.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import statistics
import sys
from collections.abc import Callable
from typing import Any

import torch

P = ctypes.c_void_p
U64 = ctypes.c_uint64

H, FF, V, KV, L = 4096, 14336, 128256, 1024, 32  # hidden, FFN intermediate, vocab, KV width, layers
E = 2  # bf16

# (dst rank, src ptr, dst ptr, width in bytes, rows, src pitch, dst pitch)
Write = tuple[int, int, int, int, int, int, int]


def ck(rc: int, what: str) -> None:
    if rc != 0:
        raise SystemExit(f"{what}: CUresult {rc}")


class M2D(ctypes.Structure):
    _fields_ = [("srcXInBytes", ctypes.c_size_t), ("srcY", ctypes.c_size_t), ("srcMemoryType", ctypes.c_int),
                ("srcHost", P), ("srcDevice", U64), ("srcArray", P), ("srcPitch", ctypes.c_size_t),
                ("dstXInBytes", ctypes.c_size_t), ("dstY", ctypes.c_size_t), ("dstMemoryType", ctypes.c_int),
                ("dstHost", P), ("dstDevice", U64), ("dstArray", P), ("dstPitch", ctypes.c_size_t),
                ("WidthInBytes", ctypes.c_size_t), ("Height", ctypes.c_size_t)]


class Loc(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class Attr(ctypes.Structure):
    _fields_ = [("srcAccessOrder", ctypes.c_int), ("srcLocHint", Loc), ("dstLocHint", Loc),
                ("flags", ctypes.c_uint)]


def load_driver() -> tuple[ctypes.CDLL, Any]:
    """libcuda with the argtypes used here, and cuMemcpyBatchAsync_v2 (None where the driver lacks it)."""
    cu = ctypes.CDLL("libcuda.so.1")
    cu.cuMemcpyAsync.argtypes = [U64, U64, ctypes.c_size_t, P]
    cu.cuMemcpy2DAsync_v2.argtypes = [ctypes.POINTER(M2D), P]
    cu.cuEventRecord.argtypes = [P, P]
    cu.cuEventCreate.argtypes = [ctypes.POINTER(P), ctypes.c_uint]
    try:
        batch = cu.cuMemcpyBatchAsync_v2
        batch.argtypes = [ctypes.POINTER(U64), ctypes.POINTER(U64), ctypes.POINTER(ctypes.c_size_t),
                          ctypes.c_size_t, ctypes.POINTER(Attr), ctypes.POINTER(ctypes.c_size_t),
                          ctypes.c_size_t, P]
    except AttributeError:
        batch = None
    return cu, batch


class Bench:
    """Both sides' tensors, the trainers' streams and event pools, and the timing harness."""

    def __init__(self, cu: ctypes.CDLL, batch: Any, reps: int) -> None:
        self.cu = cu
        self.batch = batch
        self.reps = reps
        # rollout tensors (rank r on cuda:2+r): embed, per layer qkv, o, gate_up, down, 2 norms,
        # final norm, lm_head
        self.roll: list[dict[str, Any]] = []
        for r in range(2):
            d = f"cuda:{2 + r}"
            self.roll.append({
                "embed": torch.empty(V // 2, H, dtype=torch.bfloat16, device=d),
                "lm_head": torch.empty(V // 2, H, dtype=torch.bfloat16, device=d),
                "norm": torch.empty(H, dtype=torch.bfloat16, device=d),
                "layers": [{"qkv": torch.empty(H // 2 + KV, H, dtype=torch.bfloat16, device=d),
                            "o": torch.empty(H, H // 2, dtype=torch.bfloat16, device=d),
                            "gate_up": torch.empty(FF, H, dtype=torch.bfloat16, device=d),
                            "down": torch.empty(H, FF // 2, dtype=torch.bfloat16, device=d),
                            "n1": torch.empty(H, dtype=torch.bfloat16, device=d),
                            "n2": torch.empty(H, dtype=torch.bfloat16, device=d)} for _ in range(L)]})
        # trainer shards (trainer t on cuda:t): FSDP-2 row halves of the full tensors
        self.trn: list[dict[str, Any]] = []
        for t in range(2):
            d = f"cuda:{t}"
            g = torch.Generator(device=d).manual_seed(100 + t)

            def rnd(*s: int, d: str = d, g: torch.Generator = g) -> torch.Tensor:
                return torch.randn(*s, dtype=torch.bfloat16, device=d, generator=g)

            self.trn.append({
                "embed": rnd(V // 2, H), "lm_head": rnd(V // 2, H), "norm": rnd(H // 2),
                "layers": [{"q": rnd(H // 2, H), "k": rnd(KV // 2, H), "v": rnd(KV // 2, H),
                            "o": rnd(H // 2, H), "gate": rnd(FF // 2, H), "up": rnd(FF // 2, H),
                            "down": rnd(H // 2, FF), "n1": rnd(H // 2), "n2": rnd(H // 2)}
                           for _ in range(L)]})
        self.streams = {t: [torch.cuda.Stream(device=t) for _ in range(4)] for t in range(2)}
        self.pool: dict[int, list[ctypes.c_void_p]] = {}
        for t in range(2):
            with torch.cuda.device(t):
                torch.cuda.current_stream(t).synchronize()
                self.pool[t] = [self.ev() for _ in range(1024)]

    def ev(self) -> ctypes.c_void_p:
        """A driver event in the current device's context."""
        e = P()
        ck(self.cu.cuEventCreate(ctypes.byref(e), 2), "cuEventCreate")  # CU_EVENT_DISABLE_TIMING
        return e

    def writes(self, t: int) -> dict[int, list[Write]]:
        """(dst rank, src ptr, dst ptr, width, rows, spitch, dpitch) of trainer t, grouped by destination
        rank in the planner's per-layer order."""
        T, out = self.trn[t], {0: [], 1: []}
        roll = self.roll
        rt = roll[t]

        def w(r: int, s: int, dptr: int, width: int, rows: int = 1, sp: int = 0, dp: int = 0) -> None:
            out[r].append((r, s, dptr, width, rows, sp or width, dp or width))

        w(t, T["embed"].data_ptr(), roll[t]["embed"].data_ptr(), T["embed"].numel() * E)
        for li in range(L):
            a, b = T["layers"][li], rt["layers"][li]
            w(t, a["q"].data_ptr(), b["qkv"].data_ptr(), a["q"].numel() * E)
            w(t, a["k"].data_ptr(), b["qkv"][H // 2:].data_ptr(), a["k"].numel() * E)
            w(t, a["v"].data_ptr(), b["qkv"][H // 2 + KV // 2:].data_ptr(), a["v"].numel() * E)
            w(t, a["gate"].data_ptr(), b["gate_up"].data_ptr(), a["gate"].numel() * E)
            w(t, a["up"].data_ptr(), b["gate_up"][FF // 2:].data_ptr(), a["up"].numel() * E)
            for r in range(2):
                br = roll[r]["layers"][li]
                # o: trainer rows [t*H/2, ...) x cols [r*H/2, ...) -> rollout r rows [t*H/2...] (contiguous)
                w(r, a["o"][:, r * H // 2:].data_ptr(), br["o"][t * H // 2:].data_ptr(), H // 2 * E, H // 2,
                  H * E, H // 2 * E)
                w(r, a["down"][:, r * FF // 2:].data_ptr(), br["down"][t * H // 2:].data_ptr(), FF // 2 * E,
                  H // 2, FF * E, FF // 2 * E)
                w(r, a["n1"].data_ptr(), br["n1"][t * H // 2:].data_ptr(), H // 2 * E)
                w(r, a["n2"].data_ptr(), br["n2"][t * H // 2:].data_ptr(), H // 2 * E)
        w(t, T["lm_head"].data_ptr(), roll[t]["lm_head"].data_ptr(), T["lm_head"].numel() * E)
        for r in range(2):
            w(r, T["norm"].data_ptr(), roll[r]["norm"][t * H // 2:].data_ptr(), H // 2 * E)
        return out

    def order(self, t: int, cycles: int, only: str = "") -> list[Write]:
        """The plan's schedule: `cycles` visits per destination by bytes, alternating, starting at rank t."""
        ws = self.writes(t)
        if only == "own":
            ws[1 - t] = []
        elif only == "cross":
            ws[t] = []
        elif only == "big":
            ws = {r: [x for x in lst if x[3] * x[4] >= 1 << 16] for r, lst in ws.items()}
        visits: dict[int, list[list[Write]]] = {}
        for r, lst in ws.items():
            tot = max(sum(x[3] * x[4] for x in lst), 1)
            acc, cur = 0.0, [[] for _ in range(cycles)]
            for x in lst:
                nb = x[3] * x[4]
                k = min(int((acc + nb / 2) / tot * cycles), cycles - 1)
                cur[k].append(x)
                acc += nb
            visits[r] = cur
        seq: list[Write] = []
        for k in range(cycles):
            seq += visits[t][k] + visits[1 - t][k]
        return seq

    def issue(self, t: int, seq: list[Write], nstreams: int = 2, per_copy_event: bool = True,
              small_stream: bool = False, use_batch: bool = False, small_below: int = 1 << 16) -> None:
        """Trainer t's copies of `seq`, round robin over its first `nstreams` streams."""
        cu, pool = self.cu, self.pool
        ss = [s.cuda_stream for s in self.streams[t][:nstreams]]
        k = 0
        if use_batch:
            # consecutive 1-D copies go as one batch call on the next stream; 2-D as before
            i = 0
            while i < len(seq):
                j = i
                while j < len(seq) and seq[j][4] == 1:
                    j += 1
                if j > i:
                    n = j - i
                    dsts = (U64 * n)(*[x[2] for x in seq[i:j]])
                    srcs = (U64 * n)(*[x[1] for x in seq[i:j]])
                    sizes = (ctypes.c_size_t * n)(*[x[3] for x in seq[i:j]])
                    at = Attr()
                    at.srcAccessOrder = 1  # CU_MEMCPY_SRC_ACCESS_ORDER_STREAM
                    idx = (ctypes.c_size_t * 1)(0)
                    s = ss[k % len(ss)]
                    k += 1
                    ck(self.batch(dsts, srcs, sizes, n, ctypes.byref(at), idx, 1, P(s)),
                       "cuMemcpyBatchAsync_v2")
                    ck(cu.cuEventRecord(pool[t][k % 1024], P(s)), "cuEventRecord")
                    i = j
                if i < len(seq):
                    x = seq[i]
                    s = ss[k % len(ss)]
                    k += 1
                    self.c2(x, s)
                    ck(cu.cuEventRecord(pool[t][k % 1024], P(s)), "cuEventRecord")
                    i += 1
            return
        for x in seq:
            if small_stream and x[3] * x[4] < small_below:
                s = self.streams[t][3].cuda_stream
            else:
                s = ss[k % len(ss)]
                k += 1
            if x[4] == 1:
                ck(cu.cuMemcpyAsync(x[2], x[1], x[3], P(s)), "cuMemcpyAsync")
            else:
                self.c2(x, s)
            if per_copy_event:
                ck(cu.cuEventRecord(pool[t][k % 1024], P(s)), "cuEventRecord")

    def c2(self, x: Write, s: int) -> None:
        """One 2-D copy on stream handle s."""
        m = M2D()
        m.srcMemoryType = m.dstMemoryType = 4  # CU_MEMORYTYPE_UNIFIED
        m.srcDevice, m.dstDevice = x[1], x[2]
        m.srcPitch, m.dstPitch, m.WidthInBytes, m.Height = x[5], x[6], x[3], x[4]
        ck(self.cu.cuMemcpy2DAsync_v2(ctypes.byref(m), P(s)), "cuMemcpy2DAsync_v2")

    def poison(self) -> None:
        for r in self.roll:
            for k in ("embed", "lm_head", "norm"):
                r[k].fill_(float("nan"))
            for ly in r["layers"]:
                for v in ly.values():
                    v.fill_(float("nan"))
        for d in range(4):
            torch.cuda.synchronize(d)

    def verify(self) -> int:
        """Number of rollout tensors that differ from the trainers' shards."""
        for d in range(4):
            torch.cuda.synchronize(d)
        trn = self.trn
        bad = 0
        # full check by reassembling: rollout r must equal the TP-r slice of the full tensors
        for r in range(2):
            R, dev = self.roll[r], f"cuda:{2 + r}"

            def cat(key: str, dim: int = 0, li: int | None = None, dev: str = dev) -> torch.Tensor:
                parts = [(trn[t]["layers"][li][key] if li is not None else trn[t][key]).to(dev)
                         for t in range(2)]
                return torch.cat(parts, dim)

            if not torch.equal(R["embed"], trn[r]["embed"].to(dev)):
                bad += 1
            if not torch.equal(R["lm_head"], trn[r]["lm_head"].to(dev)):
                bad += 1
            if not torch.equal(R["norm"], cat("norm")):
                bad += 1
            for li in range(L):
                ly = R["layers"][li]
                q, k, v = cat("q", li=li), cat("k", li=li), cat("v", li=li)
                qkv = torch.cat([q[r * H // 2:(r + 1) * H // 2], k[r * KV // 2:(r + 1) * KV // 2],
                                 v[r * KV // 2:(r + 1) * KV // 2]])
                g, u = cat("gate", li=li), cat("up", li=li)
                gu = torch.cat([g[r * FF // 2:(r + 1) * FF // 2], u[r * FF // 2:(r + 1) * FF // 2]])
                o, dn = cat("o", li=li), cat("down", li=li)
                checks = [(ly["qkv"], qkv), (ly["gate_up"], gu), (ly["o"], o[:, r * H // 2:(r + 1) * H // 2]),
                          (ly["down"], dn[:, r * FF // 2:(r + 1) * FF // 2]), (ly["n1"], cat("n1", li=li)),
                          (ly["n2"], cat("n2", li=li))]
                bad += sum(not torch.equal(a, b) for a, b in checks)
        return bad

    def timed(self, fn_per_trainer: Callable[[int], None], check: bool = True) -> tuple[float, list[float]]:
        """GPU ms from the gate's end to the last copy of the slower trainer; median of self.reps (after
        one untimed warm-up). With check, the rollout is poisoned before the last repetition and verified
        after it."""
        reps = self.reps
        ts = []
        for i in range(reps + 1):
            if check and i == reps:
                self.poison()
            starts, ends = {}, {}
            for t in range(2):
                with torch.cuda.device(t):
                    gate = torch.cuda.Stream(device=t)
                    with torch.cuda.stream(gate):
                        torch.cuda._sleep(40_000_000)  # ~20 ms: the CPU queues everything meanwhile
                        e0 = torch.cuda.Event(enable_timing=True)
                        e0.record(gate)
                    for s in self.streams[t]:
                        s.wait_event(e0)
                    starts[t] = e0
            for t in range(2):
                with torch.cuda.device(t):
                    fn_per_trainer(t)
            for t in range(2):
                with torch.cuda.device(t):
                    e1 = torch.cuda.Event(enable_timing=True)
                    cur = torch.cuda.current_stream(t)
                    for s in self.streams[t]:
                        cur.wait_stream(s)
                    e1.record(cur)
                    ends[t] = e1
            for t in range(2):
                torch.cuda.synchronize(t)
            ms = max(starts[t].elapsed_time(ends[t]) for t in range(2))
            if i:
                ts.append(ms)
            if check and i == reps:
                bad = self.verify()
                if bad:
                    raise SystemExit(f"MISMATCH: {bad} tensors wrong")
        return statistics.median(ts), ts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=7,
                    help="timed repetitions per measurement, median reported (default 7; one warm-up before)")
    ap.add_argument("--json", default=os.path.join(os.environ.get("OUT", "/tmp"), "exp_sc2.json"),
                    help="where to write the medians (default: $OUT/exp_sc2.json, else /tmp/exp_sc2.json)")
    args = ap.parse_args()
    if args.reps < 1:
        ap.error("--reps must be >= 1")

    cu, batch = load_driver()
    ver = ctypes.c_int()
    ck(cu.cuDriverGetVersion(ctypes.byref(ver)), "cuDriverGetVersion")
    print("driver", ver.value, "batch api", batch is not None, torch.cuda.get_device_name(0), flush=True)

    bench = Bench(cu, batch, args.reps)
    streams, pool, timed = bench.streams, bench.pool, bench.timed

    # enable peer access both ways for every trainer -> rollout pair
    for t in range(2):
        for r in range(2):
            torch.empty(4, device=f"cuda:{2 + r}").copy_(torch.ones(4, device=f"cuda:{t}"))
    for d in range(4):
        torch.cuda.synchronize(d)

    nbytes = [sum(x[3] * x[4] for lst in bench.writes(t).values() for x in lst) for t in range(2)]
    print(f"trainer bytes {nbytes[0] / 1e9:.3f} GB, writes {sum(len(v) for v in bench.writes(0).values())}",
          flush=True)

    # bound: one copy of the same bytes, 0 -> 2, event-timed
    big = {"s": torch.empty(nbytes[0], dtype=torch.uint8, device="cuda:0").random_(),
           "d": torch.empty(nbytes[0], dtype=torch.uint8, device="cuda:2")}
    res: dict[str, float] = {}

    def bigcopy(t: int) -> None:
        if t == 0:
            s = streams[0][0].cuda_stream
            ck(cu.cuMemcpyAsync(big["d"].data_ptr(), big["s"].data_ptr(), nbytes[0], P(s)), "big")

    ms, _ = timed(bigcopy, check=False)
    res["one copy 0->2 (bound)"] = ms
    print(f"one {nbytes[0] / 1e9:.2f} GB copy 0->2: {ms:.3f} ms = {nbytes[0] / ms / 1e6:.1f} GB/s",
          flush=True)
    bound = ms

    def bigcopy2(t: int) -> None:
        s = streams[t][0].cuda_stream
        if t == 0:
            ck(cu.cuMemcpyAsync(big["d"].data_ptr(), big["s"].data_ptr(), nbytes[0], P(s)), "big")
        else:
            ck(cu.cuMemcpyAsync(big["d2"].data_ptr(), big["s2"].data_ptr(), nbytes[0], P(s)), "big")

    big["s2"] = torch.empty(nbytes[0], dtype=torch.uint8, device="cuda:1").random_()
    big["d2"] = torch.empty(nbytes[0], dtype=torch.uint8, device="cuda:3")
    ms, _ = timed(bigcopy2, check=False)
    res["two copies 0->2, 1->3 at once"] = ms
    print(f"two copies at once 0->2, 1->3: {ms:.3f} ms", flush=True)

    def fanin(t: int) -> None:  # 0->2 and 1->2 at once, half the bytes each
        s = streams[t][0].cuda_stream
        h = nbytes[0] // 2
        src_ = big["s"] if t == 0 else big["s2"]
        ck(cu.cuMemcpyAsync(big["d"].data_ptr() + t * h, src_.data_ptr(), h, P(s)), "fanin")

    def fanout(t: int) -> None:  # 0->2 and 0->3 at once on two streams, half the bytes each
        if t:
            return
        h = nbytes[0] // 2
        ck(cu.cuMemcpyAsync(big["d"].data_ptr(), big["s"].data_ptr(), h, P(streams[0][0].cuda_stream)), "fo")
        ck(cu.cuMemcpyAsync(big["d2"].data_ptr(), big["s"].data_ptr() + h, h, P(streams[0][1].cuda_stream)),
           "fo")

    for nm, fn in (("fan-in 0->2 + 1->2, half each", fanin), ("fan-out 0->2 + 0->3, half each", fanout)):
        ms, _ = timed(fn, check=False)
        res[nm] = ms
        print(f"{nm}: {ms:.3f} ms (one copy of all: {bound:.3f})", flush=True)
    # the second pair's buffers are not needed any more; big["s"] / big["d"] stay allocated as before
    del big["s2"], big["d2"]
    torch.cuda.empty_cache()

    variants: list[tuple[str, dict[str, Any]]] = [
        ("A engine today: plan order (16 visits), 2 streams, event per copy", dict(cycles=16)),
        ("B plan order, 1 stream, event per copy", dict(cycles=16, nstreams=1)),
        ("C plan order, 1 stream, no events", dict(cycles=16, nstreams=1, per_copy_event=False)),
        ("D plan order, 1 stream, trainer 0 alone", dict(cycles=16, nstreams=1, solo=True)),
        ("E 2 visits (own, then cross), 1 stream", dict(cycles=1, nstreams=1)),
        ("F 2 visits, 1 stream, trainer 0 alone", dict(cycles=1, nstreams=1, solo=True)),
        ("G own writes only, 1 stream", dict(cycles=1, nstreams=1, only="own")),
        ("H cross writes only, 1 stream", dict(cycles=1, nstreams=1, only="cross")),
        ("I writes >= 64 KiB only, plan order, 1 stream", dict(cycles=16, nstreams=1, only="big")),
        ("J plan order, 1 stream + writes < 64 KiB on a 2nd stream",
         dict(cycles=16, nstreams=1, small_stream=True)),
        ("K plan order, 2 streams, no events", dict(cycles=16, per_copy_event=False)),
        ("L 4 visits, 1 stream", dict(cycles=4, nstreams=1)),
    ]
    if batch is not None:
        variants.append(("M plan order, batch API for runs of 1-D copies, 1 stream",
                         dict(cycles=16, nstreams=1, use_batch=True)))
    variants.append(("N again A (noise)", dict(cycles=16)))
    variants.append(("O again C (noise)", dict(cycles=16, nstreams=1, per_copy_event=False)))
    for name, kw in variants:
        cyc = kw.pop("cycles")
        only = kw.pop("only", "")
        solo = kw.pop("solo", False)
        seqs = {t: bench.order(t, cyc, only) for t in range(2)}
        if solo:
            seqs[1] = []
        nb = max(sum(x[3] * x[4] for x in seqs[t]) for t in range(2))
        try:
            # subsets (own, cross, big) and solo runs leave part of the rollout unwritten: no byte check
            ms, ts = timed(lambda t, seqs=seqs, kw=kw: bench.issue(t, seqs[t], **kw),
                           check=not (only or solo))
        except SystemExit as exc:
            print(f"{name}: FAILED {exc}", flush=True)
            continue
        res[name] = ms
        ideal = nb / (nbytes[0] / bound) + len(seqs[0]) * 2.6e-3
        print(f"{name}: {ms:.3f} ms = {ms / bound:.3f} x one copy; {nb / 1e9:.2f} GB, {len(seqs[0])} writes, "
              f"bytes at one-copy speed + 2.6 us each = {ideal:.3f} ms (spread {min(ts):.3f}-{max(ts):.3f})",
              flush=True)

    # per-copy cost: N copies of size S back to back on one stream 0 -> 2
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda:0").random_()
    dst = torch.empty(1 << 30, dtype=torch.uint8, device="cuda:2")
    for S in (4096, 1 << 16, 1 << 20, 8 << 20):
        N = min(512, (1 << 30) // S)
        for evs in (False, True):
            def f(t: int, S: int = S, N: int = N, evs: bool = evs) -> None:
                if t:
                    return
                s = streams[0][0].cuda_stream
                for i in range(N):
                    ck(cu.cuMemcpyAsync(dst.data_ptr() + i * S, src.data_ptr() + i * S, S, P(s)), "c")
                    if evs:
                        ck(cu.cuEventRecord(pool[0][i % 1024], P(s)), "e")

            ms, _ = timed(f, check=False)
            per = ms * 1e3 / N - S * bound * 1e3 / nbytes[0]
            res[f"{N} x {S} B, events={evs}"] = ms
            print(f"{N} copies of {S} B{' + event each' if evs else ''}: {ms:.3f} ms, {ms * 1e3 / N:.2f} us "
                  f"each, {per:.2f} us above the bytes", flush=True)
    # 2-D vs 1-D same bytes: 2048 rows of 4 KiB (pitch 8 KiB) and of 14 KiB (pitch 28 KiB)
    for width, pitch in ((4096, 8192), (14336, 28672)):
        rows = 2048
        n = 16
        for two_d in (True, False):
            def f2(t: int, width: int = width, pitch: int = pitch, two_d: bool = two_d, rows: int = rows,
                   n: int = n) -> None:
                if t:
                    return
                s = streams[0][0].cuda_stream
                for i in range(n):
                    base_s = src.data_ptr() + i * rows * pitch
                    base_d = dst.data_ptr() + i * rows * width
                    if two_d:
                        bench.c2((0, base_s, base_d, width, rows, pitch, width), s)
                    else:
                        ck(cu.cuMemcpyAsync(base_d, base_s, width * rows, P(s)), "c")

            ms, _ = timed(f2, check=False)
            gb = n * rows * width / ms / 1e6
            res[f"{'2-D' if two_d else '1-D'} {n} x {rows} x {width}"] = ms
            print(f"{'2-D' if two_d else '1-D'} {n} copies of {rows} rows x {width} B (pitch {pitch}): "
                  f"{ms:.3f} ms {gb:.1f} GB/s", flush=True)
    with open(args.json, "w") as fh:
        json.dump(res, fh, indent=1)
    print(torch.cuda.get_device_name(0), file=sys.stderr)


if __name__ == "__main__":
    main()
