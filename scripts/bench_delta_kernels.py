"""Variants of the delta compare and scatter kernels (issue 18), timed in one run on one GPU.

Data: a BF16 space of ``--words`` words cut into Llama-3-8B's 291 checkpoint tensors (scaled down with
``--words``), the reference random, the current a copy with a fraction ``--changed`` of its words changed
(XOR with a nonzero value at random positions, so each one differs). Every variant's outputs are checked
against torch (positions, values, the reference after its update; the destination after a scatter) as
integer views. Times: median of ``--reps`` after warm-up (CUDA events); the reference is restored, untimed,
before each rep. GB/s counts the bytes that must move: current + reference read, plus outputs (positions
8 B, values 2 B, reference update 2 B per changed word); a scatter: index 2 B + value 2 B read, 2 B written
per changed word.

GPU: ``python3 scripts/bench_delta_kernels.py`` (8.03e9 words, needs about 50 GB).
CPU smoke test: ``TRITON_INTERPRET=1 python scripts/bench_delta_kernels.py --device cpu --words 200000``.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
import triton
import triton.language as tl

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

# delta_kernels imports nothing of the package at import time: loaded from its file so that this script
# runs where the C++ engine is not built
_spec = importlib.util.spec_from_file_location("delta_kernels",
                                               os.path.join(ROOT, "weightsync/delta/triton_kernels.py"))
assert _spec is not None and _spec.loader is not None
dk = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(dk)

INTERPRET = os.environ.get("TRITON_INTERPRET", "") == "1"
BLOCK = 65536  # the idx16 stream's block (weightsync.delta.sender.BLOCK)
LLAMA_WORDS = 8_030_261_248
_tile = dk._tile  # a JITFunction global: the compiled kernels below call it


def llama3_8b_sizes() -> list[int]:
    """Words of Llama-3-8B's checkpoint tensors in checkpoint order (bench_worker's CONFIGS['llama-3-8b']
    where importable, else the same shapes written out)."""
    try:
        from scripts.bench_worker import CONFIGS, checkpoint_tensors

        return [int(np.prod(s)) for _, s in checkpoint_tensors(CONFIGS["llama-3-8b"])]
    except Exception:
        H, KV, FF, V = 4096, 1024, 14336, 128256
        layer = [H * H, KV * H, KV * H, H * H, FF * H, FF * H, H * FF, H, H]
        return [V * H] + layer * 32 + [H, V * H]


def key_sizes(words: int) -> list[int]:
    """The Llama sizes scaled to ``words`` in all (multiples of 8 words, at least 8)."""
    sizes = llama3_8b_sizes()
    total = sum(sizes)
    return [max(8, round(s * words / total / 8) * 8) for s in sizes]


# ---------------------------------------------------------------------------------------------- kernels


@triton.jit
def _count_flat(cur, ref, counts, n, TILE: tl.constexpr):
    """Ceiling: reads a tile of both, writes only its count (no tables, no compaction)."""
    pid = tl.program_id(0)
    start = pid.to(tl.int64) * TILE
    o = tl.arange(0, TILE)
    if start + TILE <= n:
        x = tl.load(cur + start + o)
        r = tl.load(ref + start + o)
        c = tl.sum((x != r).to(tl.int32), axis=0)
    else:
        m = start + o < n
        x = tl.load(cur + start + o, mask=m, other=0)
        r = tl.load(ref + start + o, mask=m, other=0)
        c = tl.sum(((x != r) & m).to(tl.int32), axis=0)
    tl.store(counts + pid, c)


@triton.jit
def _count_persistent(cur, ref, counts, n, ntiles, ITERS, TILE: tl.constexpr):
    """Ceiling, persistent grid: program p takes tiles p, p + P, ... (ITERS of them at most)."""
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    o = tl.arange(0, TILE)
    for i in range(0, ITERS):
        t = pid + i * nprog
        if t < ntiles:
            start = t.to(tl.int64) * TILE
            if start + TILE <= n:
                x = tl.load(cur + start + o)
                r = tl.load(ref + start + o)
                c = tl.sum((x != r).to(tl.int32), axis=0)
            else:
                m = start + o < n
                x = tl.load(cur + start + o, mask=m, other=0)
                r = tl.load(ref + start + o, mask=m, other=0)
                c = tl.sum(((x != r) & m).to(tl.int32), axis=0)
            tl.store(counts + t, c)


@triton.jit
def _count_tables(key_at, key_start, key_end, tile_key, tile_start, ref_ptr, counts, TILE: tl.constexpr,
                  VEC: tl.constexpr):
    """Ceiling with the compact kernel's tile tables (the cost of finding a tile's words)."""
    pid = tl.program_id(0)
    start, n, cur = _tile(key_at, key_start, key_end, tile_key, tile_start, ref_ptr, pid, TILE, VEC)
    o = tl.arange(0, TILE)
    if n == TILE:
        x = tl.load(cur + o)
        r = tl.load(ref_ptr + start + o)
        c = tl.sum((x != r).to(tl.int32), axis=0)
    else:
        m = o < n
        x = tl.load(cur + o, mask=m, other=0)
        r = tl.load(ref_ptr + start + o, mask=m, other=0)
        c = tl.sum(((x != r) & m).to(tl.int32), axis=0)
    tl.store(counts + pid, c)


@triton.jit
def _compact_tile(key_at, key_start, key_end, tile_key, tile_start, ref_ptr, counts_ptr, slot_idx, slot_val,
                  t, TILE: tl.constexpr, SLOT: tl.constexpr, VEC: tl.constexpr, STORE: tl.constexpr):
    """_compact's work for tile ``t``, with the reference's update as ``STORE``: 0 the changed words
    (as _compact), 1 the whole tile when anything changed, 2 each 32-byte sector holding a change (full
    sectors: no partial-sector writes)."""
    start, n, cur = _tile(key_at, key_start, key_end, tile_key, tile_start, ref_ptr, t, TILE, VEC)
    o = tl.arange(0, TILE)
    inside = o < n
    if n == TILE:
        x = tl.load(cur + o)
        r = tl.load(ref_ptr + start + o)
    else:
        x = tl.load(cur + o, mask=inside, other=0)
        r = tl.load(ref_ptr + start + o, mask=inside, other=0)
    changed = (x != r) & inside
    c = changed.to(tl.int32)
    count = tl.sum(c, axis=0)
    tl.store(counts_ptr + t, count)
    if (count > 0) & (count <= SLOT):
        at = t.to(tl.int64) * SLOT + (tl.cumsum(c, axis=0) - c)
        tl.store(slot_idx + at, o.to(tl.int16), mask=changed)
        tl.store(slot_val + at, x, mask=changed)
        if STORE == 0:
            tl.store(ref_ptr + start + o, x, mask=changed)
        elif STORE == 1:
            tl.store(ref_ptr + start + o, x, mask=inside)
        else:
            sector = tl.max(tl.reshape(c, (TILE // 16, 16)), axis=1)
            wide = tl.reshape(tl.broadcast_to(sector[:, None], (TILE // 16, 16)), (TILE,))
            tl.store(ref_ptr + start + o, x, mask=(wide > 0) & inside)


@triton.jit
def _compact2(key_at, key_start, key_end, tile_key, tile_start, ref_ptr, counts_ptr, slot_idx, slot_val,
              TILE: tl.constexpr, SLOT: tl.constexpr, VEC: tl.constexpr, STORE: tl.constexpr):
    _compact_tile(key_at, key_start, key_end, tile_key, tile_start, ref_ptr, counts_ptr, slot_idx, slot_val,
                  tl.program_id(0), TILE, SLOT, VEC, STORE)


@triton.jit
def _compact_persistent(key_at, key_start, key_end, tile_key, tile_start, ref_ptr, counts_ptr, slot_idx,
                        slot_val, ntiles, ITERS, TILE: tl.constexpr, SLOT: tl.constexpr, VEC: tl.constexpr,
                        STORE: tl.constexpr):
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    for i in range(0, ITERS):
        t = pid + i * nprog
        if t < ntiles:
            _compact_tile(key_at, key_start, key_end, tile_key, tile_start, ref_ptr, counts_ptr, slot_idx,
                          slot_val, t, TILE, SLOT, VEC, STORE)


@triton.jit
def _compact_2d(key_at, key_start, key_end, tile_key, tile_start, ref_ptr, counts_ptr, slot_idx, slot_val,
                TILE: tl.constexpr, SLOT: tl.constexpr, VEC: tl.constexpr, ROW: tl.constexpr):
    """As _compact2 (STORE 0) with the in-tile prefix taken in two levels: within rows of ROW words
    (``cumsum`` along the row) and over the TILE // ROW row totals, instead of one scan over the tile."""
    pid = tl.program_id(0)
    R: tl.constexpr = TILE // ROW
    start, n, cur = _tile(key_at, key_start, key_end, tile_key, tile_start, ref_ptr, pid, TILE, VEC)
    o = tl.arange(0, TILE)
    inside = o < n
    if n == TILE:
        x = tl.load(cur + o)
        r = tl.load(ref_ptr + start + o)
    else:
        x = tl.load(cur + o, mask=inside, other=0)
        r = tl.load(ref_ptr + start + o, mask=inside, other=0)
    changed = (x != r) & inside
    c2 = tl.reshape(changed.to(tl.int32), (R, ROW))
    rows = tl.sum(c2, axis=1)
    count = tl.sum(rows, axis=0)
    tl.store(counts_ptr + pid, count)
    if (count > 0) & (count <= SLOT):
        before = tl.cumsum(rows, axis=0) - rows
        within = tl.cumsum(c2, axis=1) - c2
        at = pid.to(tl.int64) * SLOT + tl.reshape(before[:, None] + within, (TILE,))
        tl.store(slot_idx + at, o.to(tl.int16), mask=changed)
        tl.store(slot_val + at, x, mask=changed)
        tl.store(ref_ptr + start + o, x, mask=changed)


@triton.jit
def _compact_pairs(key_at, key_start, key_end, tile_key, tile_start, ref32, counts_ptr, slot_idx, slot_val,
                   TILE: tl.constexpr, SLOT: tl.constexpr, VEC: tl.constexpr):
    """As _compact2 (STORE 0) on 32-bit views of word pairs (every key an even number of words at an even
    word): two words compared per load element, then split into their 16-bit halves in word order."""
    pid = tl.program_id(0)
    HALF: tl.constexpr = TILE // 2
    start2, n2, cur = _tile(key_at, key_start, key_end, tile_key, tile_start, ref32, pid, HALF, VEC)
    p = tl.arange(0, HALF)
    inside2 = p < n2
    if n2 == HALF:
        x = tl.load(cur + p)
        r = tl.load(ref32 + start2 + p)
    else:
        x = tl.load(cur + p, mask=inside2, other=0)
        r = tl.load(ref32 + start2 + p, mask=inside2, other=0)
    d = x ^ r
    lo = ((d & 0xFFFF) != 0) & inside2
    hi = ((d >> 16) != 0) & inside2  # arithmetic shift: nonzero exactly where the high half differs
    c = tl.reshape(tl.join(lo.to(tl.int32), hi.to(tl.int32)), (TILE,))  # int32: joins of i1 are avoided
    changed = c != 0
    count = tl.sum(c, axis=0)
    tl.store(counts_ptr + pid, count)
    if (count > 0) & (count <= SLOT):
        o = tl.arange(0, TILE)
        vals = tl.reshape(tl.join(x.to(tl.int16), (x >> 16).to(tl.int16)), (TILE,))
        at = pid.to(tl.int64) * SLOT + (tl.cumsum(c, axis=0) - c)
        tl.store(slot_idx + at, o.to(tl.int16), mask=changed)
        tl.store(slot_val + at, vals, mask=changed)
        tl.store(ref32 + start2 + p, x, mask=(lo | hi))


@triton.jit
def _scatter_block(ends, low_ptr, vals_ptr, dst_ptr, BLOCK: tl.constexpr, CH: tl.constexpr):
    """One program per 65536-word block: its changes (ends[b]:ends[b+1] of the stream) loaded CH at a
    time (unrolled, skipped past the block's count) and stored at block * BLOCK + low16."""
    b = tl.program_id(0).to(tl.int64)
    lo = tl.load(ends + b)
    hi = tl.load(ends + b + 1)
    for s in tl.static_range(0, BLOCK, CH):
        if lo + s < hi:
            j = lo + s + tl.arange(0, CH)
            m = j < hi
            low = tl.load(low_ptr + j, mask=m, other=0).to(tl.int32) & 0xFFFF
            tl.store(dst_ptr + b * BLOCK + low, tl.load(vals_ptr + j, mask=m, other=0), mask=m)


@triton.jit
def _scatter_grid(ends, low_ptr, vals_ptr, dst_ptr, BLOCK: tl.constexpr, CH: tl.constexpr):
    """Grid (block, chunk): program (b, c) stores the block's changes c*CH .. (c+1)*CH, if it has them."""
    b = tl.program_id(0).to(tl.int64)
    lo = tl.load(ends + b) + tl.program_id(1) * CH
    hi = tl.load(ends + b + 1)
    if lo < hi:
        j = lo + tl.arange(0, CH)
        m = j < hi
        low = tl.load(low_ptr + j, mask=m, other=0).to(tl.int32) & 0xFFFF
        tl.store(dst_ptr + b * BLOCK + low, tl.load(vals_ptr + j, mask=m, other=0), mask=m)


# ------------------------------------------------------------------------------------------- the bench


class Bench:
    def __init__(self, words: int, device: torch.device, reps: int, warm: int) -> None:
        self.device, self.reps, self.warm = device, reps, warm
        self.sizes = key_sizes(words)
        self.starts = np.concatenate([[0], np.cumsum(self.sizes)]).astype(np.int64)
        self.n = int(self.starts[-1])
        self.rows: list[tuple[str, str, float, float, str]] = []  # group, name, ms, GB/s, check
        g = torch.Generator(device=device)
        g.manual_seed(18)
        self.gen = g
        self.ref = torch.randint(-32768, 32767, (self.n,), dtype=torch.int16, device=device, generator=g)
        self.cur = torch.empty_like(self.ref)
        self.views = [self.cur[a:b] for a, b in zip(self.starts[:-1], self.starts[1:], strict=True)]

    # data
    def make_changes(self, f: float) -> None:
        """current = reference with a fraction f changed; the expected positions and values, and the
        reference's old values there (to restore it)."""
        self.cur.copy_(self.ref)
        pos = []
        step = 1 << 27
        for a in range(0, self.n, step):
            m = torch.rand(min(step, self.n - a), device=self.device, generator=self.gen) < f
            p = m.nonzero().flatten()
            d = torch.randint(-32768, 32767, (p.numel(),), dtype=torch.int16, device=self.device,
                              generator=self.gen)
            d[d == 0] = 1
            seg = self.cur[a:a + m.numel()]
            seg[p] = seg[p] ^ d
            pos.append(p + a)
            del m
        self.f = f
        self.pos = torch.cat(pos)
        self.k = self.pos.numel()
        self.new_vals = self.cur[self.pos]
        self.old_vals = self.ref[self.pos]
        # the idx16 stream of the changes (the space as one key): block counts' cumsum, low 16 bits
        nb = -(-self.n // BLOCK)
        self.nb = nb
        self.ends = torch.zeros(nb + 1, dtype=torch.int64, device=self.device)
        torch.cumsum(torch.bincount(self.pos >> 16, minlength=nb), 0, out=self.ends[1:])
        self.low = (self.pos & 0xFFFF).to(torch.int32).view(torch.int16)[0::2].contiguous()

    def restore(self) -> None:
        """The reference as it was before the compare (or the destination before the scatter)."""
        self.ref.copy_(self.cur)
        self.ref[self.pos] = self.old_vals

    # timing
    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def timed(self, fn: Callable[[], Any], reset: Callable[[], None] | None) -> tuple[float, Any]:
        ts = []
        out = None
        for i in range(self.warm + self.reps):
            if reset is not None:
                reset()
            self.sync()
            if self.device.type == "cuda":
                e0 = torch.cuda.Event(enable_timing=True)
                e1 = torch.cuda.Event(enable_timing=True)
                e0.record()
                out = fn()
                e1.record()
                e1.synchronize()
                t = e0.elapsed_time(e1)
            else:
                t0 = time.perf_counter()
                out = fn()
                t = (time.perf_counter() - t0) * 1e3
            if i >= self.warm:
                ts.append(t)
        return statistics.median(ts), out

    def record(self, group: str, name: str, fn: Callable[[], Any], nbytes: float,
               reset: Callable[[], None] | None, check: Callable[[Any], str]) -> None:
        try:
            ms, out = self.timed(fn, reset)
            verdict = check(out)
        except Exception as e:  # one failing variant must not cost the run (one GPU call)
            ms, verdict = float("nan"), f"ERROR {type(e).__name__}: {str(e).splitlines()[0][:90]}"
        gbs = nbytes / (ms * 1e6) if ms == ms and ms > 0 else float("nan")
        self.rows.append((group, name, ms, gbs, verdict))
        print(f"  {group:8s} {name:44s} {ms:9.3f} ms {gbs:8.1f} GB/s  {verdict}", flush=True)

    # checks
    def ref_updated(self) -> bool:
        step = 1 << 28
        return all(torch.equal(self.ref[a:a + step], self.cur[a:a + step]) for a in range(0, self.n, step))

    def check_compact(self, out: Any) -> str:
        idx, val = out
        bad = []
        if idx.numel() != self.k or not torch.equal(idx, self.pos):
            bad.append(f"positions ({idx.numel()} vs {self.k})")
        if val.numel() != self.k or not torch.equal(val.view(torch.int16), self.new_vals):
            bad.append("values")
        if not self.ref_updated():
            bad.append("reference")
        return "ok" if not bad else "WRONG " + ",".join(bad)

    def check_found(self, out: Any) -> str:
        """check_compact for a compare that leaves the reference to its caller (delta_cuda.compare)."""
        self.ref[out[0]] = out[1]
        return self.check_compact(out)

    def check_counts(self, counts: Any) -> str:
        return "ok" if int(counts.sum()) == self.k else f"WRONG count {int(counts.sum())} vs {self.k}"

    def check_scatter(self, _: Any) -> str:
        ok = self.ref_updated()
        return "ok" if ok else "WRONG destination"

    # tables (as Compactor._tables, for any TILE) on the flat space
    def tables(self, tile: int, word_div: int = 1) -> tuple[tuple[Any, ...], int, int]:
        ref = self.ref if word_div == 1 else self.ref.view(torch.int32)
        starts = self.starts // word_div
        tl_ = tile // word_div
        dist = (int(self.cur.data_ptr()) - int(self.ref.data_ptr())) // (2 * word_div) + starts[:-1]
        sizes = np.diff(starts)
        ntiles = -(-sizes // tl_)
        tile_key = np.repeat(np.arange(len(sizes), dtype=np.int32), ntiles)
        first = np.concatenate([[0], np.cumsum(ntiles)])[:-1]
        within = np.arange(int(ntiles.sum()), dtype=np.int64) - np.repeat(first, ntiles)
        tile_start = starts[:-1][tile_key] + within * tl_
        d = self.device
        tabs = tuple(torch.from_numpy(np.ascontiguousarray(a)).to(d) for a in
                     (dist.astype(np.int64), starts[:-1], starts[1:], tile_key, tile_start))
        aligned = self.cur.data_ptr() % 16 == 0 and self.ref.data_ptr() % 16 == 0
        vec = 16 // (2 * word_div) if aligned else 1
        del ref
        return tabs, len(tile_key), vec

    # pipelines
    def compact_pipeline(self, tile: int, slot: int, warps: int, kernel: str, store: int = 0,
                         per_sm: int = 0, row: int = 32, alone: bool = False) -> Callable[[], Any]:
        """compact kernel over every tile (one grid), cumsum, one host sync, dk._place."""
        pairs = kernel == "pairs"
        tabs, nt, vec = self.tables(tile, 2 if pairs else 1)
        ptabs, _, pvec = self.tables(tile) if pairs else (tabs, nt, vec)
        counts = torch.empty(nt, dtype=torch.int32, device=self.device)
        slot_idx = torch.empty(nt * slot, dtype=torch.int16, device=self.device)
        slot_val = torch.empty(nt * slot, dtype=torch.int16, device=self.device)
        out_idx = torch.empty(self.k + 1024, dtype=torch.int64, device=self.device)
        out_val = torch.empty(self.k + 1024, dtype=torch.int16, device=self.device)
        ref32 = self.ref.view(torch.int32)
        sms = torch.cuda.get_device_properties(self.device).multi_processor_count \
            if self.device.type == "cuda" else 4

        def run() -> Any:
            if kernel == "orig":
                dk._compact[(nt,)](*tabs, self.ref, counts, slot_idx, slot_val, 0, TILE=tile, SLOT=slot,
                                   VEC=vec, num_warps=warps)
            elif kernel == "v2":
                _compact2[(nt,)](*tabs, self.ref, counts, slot_idx, slot_val, TILE=tile, SLOT=slot, VEC=vec,
                                 STORE=store, num_warps=warps)
            elif kernel == "persist":
                grid = min(nt, per_sm * sms)
                _compact_persistent[(grid,)](*tabs, self.ref, counts, slot_idx, slot_val, nt, -(-nt // grid),
                                             TILE=tile, SLOT=slot, VEC=vec, STORE=store, num_warps=warps)
            elif kernel == "2d":
                _compact_2d[(nt,)](*tabs, self.ref, counts, slot_idx, slot_val, TILE=tile, SLOT=slot, VEC=vec,
                                   ROW=row, num_warps=warps)
            else:
                _compact_pairs[(nt,)](*tabs, ref32, counts, slot_idx, slot_val, TILE=tile, SLOT=slot,
                                      VEC=vec, num_warps=warps)
            if alone:  # the compact kernel's time by itself: checked by its counts
                return counts
            ends = torch.cumsum(counts, 0)
            m = int(ends[-1])
            if m:
                dk._place[(nt,)](*ptabs, self.ref, counts, ends, slot_idx, slot_val, out_idx, out_val, 0,
                                 TILE=tile, SLOT=slot, VEC=pvec, num_warps=4)
            return out_idx[:m], out_val[:m]

        return run

    def torch_compare(self) -> Any:
        """The torch path's shape: per slice a mask and nonzero, the values gathered, the reference
        updated with an indexed copy."""
        pos = []
        step = dk.COMPARE_SLICE
        for a in range(0, self.n, step):
            p = (self.cur[a:a + step] != self.ref[a:a + step]).nonzero().flatten()
            pos.append(p + a)
        p = torch.cat(pos)
        v = self.cur[p]
        self.ref[p] = v
        return p, v


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--words", type=int, default=LLAMA_WORDS)
    ap.add_argument("--changed", type=float, nargs="+", default=[0.0423, 0.02])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--reps", type=int, default=None, help="timed reps (default 5 on GPU, 1 on CPU)")
    ap.add_argument("--warm", type=int, default=None, help="warm-up reps (default 2 on GPU, 0 on CPU)")
    ap.add_argument("--quick", action="store_true", help="fewer variants (the default on CPU)")
    ap.add_argument("--all", action="store_true", help="every variant, on CPU too")
    ap.add_argument("--only", default="", help="compare variants whose label contains this (several: "
                    "comma-separated; and skip the ceiling and scatter groups)")
    args = ap.parse_args()

    def skip(label: str) -> bool:  # --only: comma-separated parts of labels
        return bool(args.only) and not any(o in label for o in args.only.split(","))

    device = torch.device(args.device)
    gpu = device.type == "cuda"
    if gpu:
        device = torch.device("cuda", torch.cuda.current_device())  # an index: set_device wants one
        torch.cuda.set_device(device)
    reps = args.reps or (5 if gpu else 1)
    warm = args.warm if args.warm is not None else (2 if gpu else 0)
    b = Bench(args.words, device, reps, warm)
    name = torch.cuda.get_device_name(device) if gpu else "cpu (interpreter)" if INTERPRET else "cpu"
    print(f"device {name}, triton {triton.__version__}, torch {torch.__version__}; {b.n} words "
          f"({2 * b.n / 1e9:.2f} GB) in {len(b.sizes)} keys; reps {reps} after {warm} warm-up", flush=True)
    N = b.n
    quick = args.quick or (not gpu and not args.all)
    for fi, f in enumerate(args.changed):
        b.make_changes(f)
        k = b.k
        print(f"\n== changed {f} ({k} words) ==", flush=True)
        rd = 4.0 * N  # current + reference read
        cmp_bytes = rd + 12.0 * k
        if fi == 0 and not args.only:  # the ceilings do not depend on f
            b.record("ceiling", "torch copy_ (16 GB-class: read+write)", lambda: b.ref.copy_(b.cur), rd,
                     b.restore, lambda _: "ok" if b.ref_updated() else "WRONG")
            step = 1 << 30
            b.record("ceiling", "torch (a != b).sum() (1 GiW chunks)",
                     lambda step=step: sum(int((b.cur[a:a + step] != b.ref[a:a + step]).sum())
                                           for a in range(0, N, step)), rd, b.restore,
                     lambda c, k=k: "ok" if c == k else f"WRONG {c} vs {k}")
            tiles = [4096, 16384] if quick else [2048, 4096, 8192, 16384]
            warps_l = [8] if quick else [4, 8, 16]
            for tile in tiles:
                counts = torch.empty(-(-N // tile), dtype=torch.int32, device=device)
                for w in warps_l:
                    b.record("ceiling", f"count flat TILE={tile} warps={w}",
                             lambda c=counts, t=tile, w=w: (_count_flat[(c.numel(),)](
                                 b.cur, b.ref, c, N, TILE=t, num_warps=w), c)[1],
                             rd, b.restore, b.check_counts)
            sms = torch.cuda.get_device_properties(device).multi_processor_count if gpu else 4
            for tile in [4096] if quick else [4096, 8192]:
                nt = -(-N // tile)
                counts = torch.empty(nt, dtype=torch.int32, device=device)
                for per in [4] if quick else [2, 8]:
                    for w in [8] if quick else [8, 16]:
                        grid = min(nt, per * sms)
                        b.record("ceiling", f"count persistent TILE={tile} {per}/SM warps={w}",
                                 lambda c=counts, t=tile, w=w, g=grid, nt=nt: (_count_persistent[(g,)](
                                     b.cur, b.ref, c, N, nt, -(-nt // g), TILE=t, num_warps=w), c)[1],
                                 rd, b.restore, b.check_counts)
            for w in [8] if quick else [8, 16]:
                tabs, nt, vec = b.tables(4096)
                counts = torch.empty(nt, dtype=torch.int32, device=device)
                b.record("ceiling", f"count with tile tables TILE=4096 warps={w}",
                         lambda c=counts, w=w, tabs=tabs, nt=nt, vec=vec: (_count_tables[(nt,)](
                             *tabs, b.ref, c, TILE=4096, VEC=vec, num_warps=w), c)[1],
                         rd, b.restore, b.check_counts)

        if not args.only:
            b.record("compare", "torch nonzero path", b.torch_compare, cmp_bytes, b.restore, b.check_compact)
        # as a push runs it: the CUDA C++ kernels (weightsync.delta.cuda; the reference left to the
        # caller: also timed with its update as DeltaSender.finish does it) and the Triton kernels (slices of
        # slots, the reference updated); hint = this push's count, as a push after one alike
        for backend in ("cuda", "triton"):
            label = f"Compactor.compare {backend}"
            if skip(label):
                continue
            os.environ["WEIGHTSYNC_DELTA_KERNELS"] = backend
            comp = dk.Compactor(2, b.starts, device)
            b.record("compare", label, lambda comp=comp, k=k: comp.compare(b.views, b.ref, k + k // 8),
                     cmp_bytes, b.restore, lambda out, comp=comp: (b.check_compact(out) if comp.ref_updated
                                                                   else b.check_found(out)))
            if comp.backend != backend:
                print(f"  compare  {label}: ran on {comp.backend or 'nothing'}", flush=True)
            if not comp.ref_updated:

                def with_ref(comp: Any = comp, k: int = k) -> Any:
                    idx, vals = comp.compare(b.views, b.ref, k + k // 8)
                    b.ref[idx] = vals
                    return idx, vals

                b.record("compare", label + " + ref[idx] = vals", with_ref, cmp_bytes, b.restore,
                         b.check_compact)
            del comp
        os.environ.pop("WEIGHTSYNC_DELTA_KERNELS", None)
        # the CUDA kernels' compile-time choices (weightsync/delta/cuda.py's macros): rounds of
        # 16-byte chunks per tile, blocks per SM the collect kernel's registers are limited for
        if gpu:
            from weightsync.delta import cuda as delta_cuda
            from weightsync.delta import nvrtc

            for rounds, blocks in [(8, 0), (8, 3), (4, 0), (4, 4), (16, 0), (2, 0)]:
                label = f"cuda compare ROUNDS={rounds} MIN_BLOCKS={blocks}"
                if skip(label):
                    continue
                try:
                    mod = nvrtc.load(f"bench{rounds}.{blocks}", delta_cuda.SOURCE, delta_cuda.SIGNATURES,
                                     device, [f"-DROUNDS={rounds}", f"-DMIN_BLOCKS={blocks}"])
                except nvrtc.NvrtcUnavailable as e:
                    print(f"  compare  {label}: {e}", flush=True)
                    continue
                comp = dk.Compactor(2, b.starts, device)
                comp._tables(b.views, b.ref)
                tile_key, tile_start = comp._tiles(delta_cuda.tile_words(2, rounds))
                tabs = (*comp.keys, torch.from_numpy(tile_key).to(device),
                        torch.from_numpy(tile_start).to(device))

                def run(mod: Any = mod, tabs: Any = tabs, starts: Any = tile_start, k: int = k,
                        vec: bool = comp.vec > 1) -> Any:
                    return delta_cuda.compare(mod, tabs, starts, vec, 2, b.ref, k + k // 8, N)

                b.record("compare", label, run, cmp_bytes, b.restore, b.check_found)
                del comp, tabs
        variants: list[tuple[str, dict[str, Any]]] = []
        orig = [(4096, 512, 8), (4096, 512, 4), (4096, 512, 16), (8192, 1024, 8), (8192, 1024, 16),
                (16384, 2048, 16), (2048, 256, 4)]
        for t, s, w in orig[:2] if quick else orig:
            variants.append((f"orig _compact T={t} S={s} w={w}",
                             dict(tile=t, slot=s, warps=w, kernel="orig")))
        for store in (1, 2):
            for t, s, w in [(4096, 512, 8)] if quick else [(4096, 512, 8), (8192, 1024, 16)]:
                variants.append((f"v2 store={'tile' if store == 1 else 'sector'} T={t} S={s} w={w}",
                                 dict(tile=t, slot=s, warps=w, kernel="v2", store=store)))
        for store in (0, 2):
            for per in [4] if quick else [2, 8]:
                variants.append((f"persistent store={store} T=4096 {per}/SM w=8",
                                 dict(tile=4096, slot=512, warps=8, kernel="persist", store=store,
                                      per_sm=per)))
        for t, s, w in [(4096, 512, 8)] if quick else [(4096, 512, 8), (8192, 1024, 8)]:
            variants.append((f"pairs int32 T={t} S={s} w={w}",
                             dict(tile=t, slot=s, warps=w, kernel="pairs")))
        for t, s, w, row in [(4096, 512, 8, 32)] if quick else [
                (4096, 512, 8, 32), (4096, 512, 4, 32), (4096, 512, 8, 64), (4096, 512, 8, 128),
                (8192, 1024, 8, 32), (2048, 256, 4, 32)]:
            variants.append((f"2-level scan T={t} S={s} w={w} row={row}",
                             dict(tile=t, slot=s, warps=w, kernel="2d", row=row)))
        alone = [(f"{lab} (compact kernel alone)", dict(k, alone=True)) for lab, k in variants
                 if k["kernel"] in ("orig", "2d") and k["tile"] == 4096 and k["warps"] == 8]
        for label, kw in alone + variants:
            if skip(label):
                continue
            try:
                fn = b.compact_pipeline(**kw)
            except Exception as e:
                print(f"  compare  {label}: setup failed: {e}", flush=True)
                continue
            b.record("compare", label, fn, cmp_bytes, b.restore,
                     b.check_counts if kw.get("alone") else b.check_compact)
            del fn
            if gpu:
                torch.cuda.empty_cache()

        # the receiver's scatter into the previous version (the reference restored), checked against cur
        if not args.only:
            sc_bytes = 6.0 * k
            b.record("scatter", "torch target[idx] = vals", lambda: b.ref.index_put_((b.pos,), b.new_vals),
                     sc_bytes, b.restore, b.check_scatter)
            nb = b.nb
            if not INTERPRET:  # its loop bounds come from tl.load: the 3.6 interpreter cannot run it
                pair_run = torch.zeros(nb, dtype=torch.int32, device=device)
                pair_block = torch.arange(nb, dtype=torch.int32, device=device)
                run_at = torch.tensor([(b.ref.data_ptr() - b.new_vals.data_ptr()) // 2], device=device)
                run_lo = torch.tensor([0], device=device)
                run_hi = torch.tensor([k], device=device)
                for ch, w in [(1024, 4)] if quick else [(256, 4), (1024, 4), (4096, 4), (256, 8), (1024, 8),
                                                           (4096, 8)]:
                    b.record("scatter", f"_scatter16 CH={ch} w={w}",
                             lambda ch=ch, w=w, nb=nb, tabs=(pair_run, pair_block, run_at, run_lo, run_hi):
                                 dk._scatter16[(nb,)](*tabs, b.ends, b.low, b.new_vals, BLOCK=BLOCK, CH=ch,
                                                      num_warps=w),
                             sc_bytes, b.restore, b.check_scatter)
            for ch, w in [(4096, 4)] if quick else [(2048, 4), (4096, 4), (4096, 8), (8192, 8)]:
                b.record("scatter", f"block (1 program/65536 words) CH={ch} w={w}",
                         lambda ch=ch, w=w, nb=nb: _scatter_block[(nb,)](b.ends, b.low, b.new_vals, b.ref,
                                                                         BLOCK=BLOCK, CH=ch, num_warps=w),
                         sc_bytes, b.restore, b.check_scatter)
            for ch, w in [(1024, 4)] if quick else [(1024, 4), (2048, 4), (4096, 8)]:
                b.record("scatter", f"grid (block, chunk) CH={ch} w={w}",
                         lambda ch=ch, w=w, nb=nb: _scatter_grid[(nb, BLOCK // ch)](
                             b.ends, b.low, b.new_vals, b.ref, BLOCK=BLOCK, CH=ch, num_warps=w),
                         sc_bytes, b.restore, b.check_scatter)
            b.restore()

        # summary for this f
        copy = [r for r in b.rows if r[1].startswith("torch copy_")]
        copy_gbs = copy[0][3] if copy else float("nan")
        for group in ("compare", "scatter"):
            ok = [r for r in b.rows
                  if r[0] == group and r[4] == "ok" and r[2] == r[2] and "alone" not in r[1]]
            best = min(ok, key=lambda r: r[2], default=None)
            if best is not None:
                print(f"BEST {group} (changed {f}): {best[1]}: {best[2]:.3f} ms, {best[3]:.1f} GB/s "
                      f"= {best[3] / copy_gbs:.2f} x torch copy_ ({copy_gbs:.1f} GB/s)", flush=True)
        wrong = [r for r in b.rows if r[4] != "ok"]
        print(f"checks: {len(b.rows) - len(wrong)} ok, {len(wrong)} not ok", flush=True)
        b.rows = [r for r in b.rows if r[0] == "ceiling"]  # the next f's best among its own rows


if __name__ == "__main__":
    main()
