"""Delta pushes (issue 18, weightsync/delta/sender.py) on CPU over TCP loopback.

Two trainer ranks hold shards of a small model (a bf16 embedding by columns, fp32 projections by rows, a
replicated fp32 norm) and push into three destinations: two vLLM-style TP ranks (fused ``qkv_proj`` and
``gate_up_proj``, column shards of ``down``: strided source rows, packed into staging) and a full replica
(the embedding's column shards: strided destination writes). Every destination also holds ``xy``, ``x``
(row shards: contiguous writes) fused with ``y`` (column shards: strided writes) into one tensor.
Each version changes the previous one in a chosen way (random odd positions, nothing, everything, one
element, last elements, NaN payloads / -0.0 / denormals, strided blocks), and after every push every
destination byte must equal what a dense push gives (compared as integers: bitwise). Participants live
in this process (threads); the coordinator is a Ray actor.
"""

from __future__ import annotations

import logging
import re
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import pytest
import torch

import weightsync as ws
import weightsync.delta.codec as delta_codec
from weightsync.delta.codec import (
    ENC_BITMAP,
    ENC_DENSE,
    ENC_EMPTY,
    ENC_IDX16,
    choose,
    decode,
    encode_into,
    placed,
    sparse_sizes,
    write_word,
)
from weightsync.delta.sender import DeltaSender
from weightsync.delta.units import BLOCK, word_dtype

SHAPES = {"emb": (520, 136), "q": (16, 8), "k": (8, 8), "v": (8, 8), "gate": (12, 8), "up": (12, 8),
          "down": (8, 12), "norm": (8,), "x": (4, 8), "y": (6, 8)}
BY_COLUMNS = ("emb", "y")  # held by column shards on the sources (strided writes into full rows)
DTYPES = {"emb": torch.bfloat16}
INT = {torch.float32: torch.int32, torch.bfloat16: torch.int16}


# -- the codec alone ------------------------------------------------------------------------------------
@pytest.mark.parametrize("n,k,w", [(1, 1, 4), (1000, 3, 2), (BLOCK * 2 + 5, 7000, 2), (70000, 1, 4),
                                   (17, 17, 1), (BLOCK + 1, 1, 8), (BLOCK * 3, 0, 2), (96, 96, 2)])
def test_codec_round_trip(n: int, k: int, w: int) -> None:
    g = torch.Generator().manual_seed(n * 31 + k)
    local = torch.randperm(n, generator=g)[:k].sort().values
    if k:
        local[-1] = n - 1  # the last word of the write is one of them
        local = local.unique()
        k = int(local.numel())
    vals = torch.randint(0, 120, (k,), dtype=torch.int64, generator=g).to(word_dtype(w))
    for enc, size in sparse_sizes(n, k, w).items():
        buf = torch.full((size + 64,), 0xAB, dtype=torch.uint8)
        encode_into(buf[:size], enc, local, vals, n)
        got_local, got_vals = decode(buf, enc, n, k, w)
        assert torch.equal(got_local, local), enc
        assert torch.equal(got_vals, vals), enc


@pytest.mark.parametrize("n", [64, 1000, 1024, 64 * 7 + 63])
def test_bitmap_built_and_read_in_slices(monkeypatch: pytest.MonkeyPatch, n: int) -> None:
    # Read in slices of 128 words (a model's stream is read in slices of BITMAP_SLICE words): words changed
    # at both ends of slices, a slice with none, and the last word; the bytes do not depend on the slice.
    import weightsync.delta.codec as delta

    local = torch.tensor(sorted({0, 1, 127, 128, 129, 255, 640, n - 2, n - 1} & set(range(n))),
                         dtype=torch.int64)
    vals = torch.arange(1, local.numel() + 1, dtype=torch.int16)
    size = sparse_sizes(n, int(local.numel()), 2)[ENC_BITMAP]
    whole = torch.full((size,), 0xAB, dtype=torch.uint8)
    encode_into(whole, ENC_BITMAP, local, vals, n)
    monkeypatch.setattr(delta, "BITMAP_SLICE", 128)
    sliced = torch.full((size,), 0xAB, dtype=torch.uint8)  # the same poison: padding is left alone
    encode_into(sliced, ENC_BITMAP, local, vals, n)
    assert torch.equal(sliced, whole)
    got_local, got_vals = decode(sliced, ENC_BITMAP, n, int(local.numel()), 2)
    assert torch.equal(got_local, local) and torch.equal(got_vals, vals)


@pytest.mark.parametrize("enc", [ENC_IDX16, ENC_BITMAP])
def test_encoding_built_a_few_positions_at_a_time(monkeypatch: pytest.MonkeyPatch, enc: int) -> None:
    # The index section is built SCRATCH positions at a time (2**25 in a push): 3 at a time, across block
    # and bitmap-word ends, gives the same bytes.
    import weightsync.delta.codec as delta

    n = BLOCK * 2 + 100
    local = torch.tensor([0, 1, 31, 32, 63, BLOCK - 1, BLOCK, BLOCK + 31, 2 * BLOCK + 99], dtype=torch.int64)
    vals = torch.arange(1, local.numel() + 1, dtype=torch.int16)
    size = sparse_sizes(n, int(local.numel()), 2)[enc]
    whole = torch.full((size,), 0xAB, dtype=torch.uint8)
    encode_into(whole, enc, local, vals, n)
    monkeypatch.setattr(delta, "SCRATCH", 3)
    pieces = torch.full((size,), 0xAB, dtype=torch.uint8)
    encode_into(pieces, enc, local.to(torch.int32), vals, n)
    assert torch.equal(pieces, whole)
    got_local, got_vals = decode(pieces, enc, n, int(local.numel()), 2)
    assert torch.equal(got_local, local) and torch.equal(got_vals, vals)


@pytest.mark.parametrize("dtype,spans", [(torch.int64, False), (torch.int32, False), (torch.int64, True),
                                         (torch.int32, True)])
def test_idx16_from_pieces_with_shifts(dtype: torch.dtype, spans: bool) -> None:
    # A stream's positions come as pieces of another space's positions plus a shift per piece (a run of
    # writes): the low 16 bits and block counts are written from the pieces and shifts without widening
    # them (with ``spans``: only the blocks of each piece's stream words looked up), and must equal the
    # encoding of the shifted positions written at once.
    from weightsync.delta.codec import _IndexWriter

    g = torch.Generator().manual_seed(5)
    # each piece: its words' place in the stream (lengths across block edges) and in its own space
    lengths = [BLOCK + 5, 3, 2 * BLOCK - 7, 40_000, BLOCK + 11]
    firsts = [3 * BLOCK + 5, 0, 7 * BLOCK + 1000, 17, 2**30 + 3]  # shifts negative, zero and positive
    n = sum(lengths)
    pieces, shifted, base = [], [], 0
    for length, first in zip(lengths, firsts, strict=True):
        local = torch.randperm(length, generator=g)[: max(1, length // 9)]
        local = torch.cat([local, torch.tensor([length - 1])]).unique() + first  # sorted
        shift = base - first
        pieces.append((local.to(dtype), shift, (base, base + length)))
        shifted.append(local + shift)
        base += length
    allpos = torch.cat(shifted)
    assert int(allpos[-1]) < n and bool((allpos[1:] > allpos[:-1]).all())
    k = int(allpos.numel())
    size = sparse_sizes(n, k, 2)[ENC_IDX16]
    want = torch.full((size,), 0xAB, dtype=torch.uint8)
    encode_into(want, ENC_IDX16, allpos, torch.zeros(k, dtype=torch.int16), n)
    got = torch.full((size,), 0xAB, dtype=torch.uint8)
    got[-2 * k:].copy_(want[-2 * k:])  # the values section: not the writer's
    writer = _IndexWriter(got, ENC_IDX16, n, k, torch.device("cpu"))
    for local, shift, span in pieces:
        writer.add(local, shift, span if spans else None)
    writer.close()
    assert torch.equal(got, want)


def test_choose_break_even() -> None:
    assert choose(1000, 0, 2) == (ENC_EMPTY, 0)
    assert choose(1000, 1000, 2)[0] == ENC_DENSE  # everything changed: the write as planned
    assert choose(1 << 20, 20000, 2)[0] == ENC_IDX16  # ~2%: 16-bit indices
    assert choose(1 << 20, 150000, 2)[0] == ENC_BITMAP  # ~14%: the bitmap is smaller
    n, w = 1 << 20, 2
    for k in range(1, n, 9973):  # sparse exactly while smaller than the write
        enc, _ = choose(n, k, w)
        assert (enc == ENC_DENSE) == (min(sparse_sizes(n, k, w).values()) >= n * w)
    # the push decides for all its writes at once: the same choice
    from weightsync.delta.codec import ENC_STREAM, _choose_many

    rng = np.random.default_rng(3)
    for w in (1, 2, 4, 8):
        ns = rng.integers(1, 3 * BLOCK, 2000)
        ks = np.minimum(ns, rng.integers(0, 3 * BLOCK, 2000) // rng.integers(1, 200, 2000))
        want = [choose(int(n_), int(k_), w)[0] for n_, k_ in zip(ns, ks, strict=True)]
        want = [e if e in (ENC_EMPTY, ENC_DENSE) else ENC_STREAM for e in want]
        assert _choose_many(ns, ks, w).tolist() == want


def test_spans_cut_in_order() -> None:
    from weightsync.delta.codec import SPAN_SHARES, SPANS, span_of

    ten = np.full(10, 100)
    assert span_of(ten, 2, 1).tolist() == [0] * 5 + [1] * 5
    assert span_of(ten, 4, 1, (1, 1, 1, 1)).tolist() == [0, 0, 0, 1, 1, 2, 2, 2, 3, 3]
    assert span_of(ten, SPANS, 1).tolist() == span_of(ten, SPANS, 1, SPAN_SHARES).tolist()
    assert span_of(ten, 1, 1).tolist() == [0] * 10
    # a tensor goes with the span its first byte falls in: a dominant one alone in its span
    assert span_of(np.array([1, 1000, 1, 1]), 2, 1).tolist() == [0, 0, 1, 1]
    assert span_of(np.zeros(3, np.int64), 3, 1).tolist() == [0, 0, 0]
    # no span under min_bytes where that can be: fewer spans, the last ones empty
    assert span_of(ten, 4, 300).tolist() == [0, 0, 0, 0, 1, 1, 1, 2, 2, 2]
    assert span_of(ten, 4, 250).tolist() == span_of(ten, 4, 1).tolist()
    assert span_of(ten, 4, 10_000).tolist() == [0] * 10
    # spans in proportion to their shares: the last one smaller
    assert span_of(ten, 4, 1, (3, 3, 3, 1)).tolist() == [0, 0, 0, 1, 1, 1, 2, 2, 2, 3]
    assert span_of(ten, 2, 1, (4, 1)).tolist() == [0] * 8 + [1] * 2
    # shares for another count of spans than are used: equal ones
    assert span_of(ten, 4, 300, (3, 3, 3, 1)).tolist() == span_of(ten, 3, 1).tolist()


def test_placed_and_word() -> None:
    local = torch.tensor([0, 2, 3, 5])
    assert placed(local, 10, 3, 8, 2).tolist() == [10, 12, 18, 20]
    assert placed(local, 10, 3, 3, 2).tolist() == [10, 12, 13, 15]
    assert write_word(4, 8, 16, 12) == 4 and write_word(4, 8, 2, 12) == 2 and write_word(2, 3) == 1


# -- pushes -------------------------------------------------------------------------------------------
def initial() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return {k: torch.randn(s, generator=g).to(DTYPES.get(k, torch.float32)) for k, s in SHAPES.items()}


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(INT[t.dtype])


def view(layout: str, full: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """What a destination of ``layout`` holds of ``full``."""
    if layout == "replica":
        out = {k: v.clone() for k, v in full.items() if k not in ("x", "y")}
        return {**out, "xy": torch.cat([full["x"], full["y"]])}
    r = int(layout[-1])
    q, k, v = full["q"][r * 8:(r + 1) * 8], full["k"][r * 4:(r + 1) * 4], full["v"][r * 4:(r + 1) * 4]
    gate, up = full["gate"][r * 6:(r + 1) * 6], full["up"][r * 6:(r + 1) * 6]
    return {"qkv_proj": torch.cat([q, k, v]), "gate_up_proj": torch.cat([gate, up]),
            "down": full["down"][:, r * 6:(r + 1) * 6].contiguous(),
            "emb": full["emb"][:, r * 68:(r + 1) * 68].contiguous(), "norm": full["norm"].clone(),
            "xy": torch.cat([full["x"], full["y"]])}


def named(layout: str, tensors: dict[str, torch.Tensor]) -> dict[str, Any]:
    xy = ws.Fused(tensors["xy"], 0, [("x", (0, 0), (4, 8)), ("y", (0, 0), (6, 8))])
    if layout == "replica":
        return {**{k: v for k, v in tensors.items() if k != "xy"}, "xy": xy}
    r = int(layout[-1])
    return {"qkv_proj": ws.Fused(tensors["qkv_proj"], 0, [("q", (r * 8, 0), (8, 8)),
                                                          ("k", (r * 4, 0), (4, 8)),
                                                          ("v", (r * 4, 0), (4, 8))]),
            "gate_up_proj": ws.Fused(tensors["gate_up_proj"], 0, [("gate", (r * 6, 0), (6, 8)),
                                                                  ("up", (r * 6, 0), (6, 8))]),
            "down": ws.Sharded(tensors["down"], SHAPES["down"], (0, r * 6)),
            "emb": ws.Sharded(tensors["emb"], SHAPES["emb"], (0, r * 68)), "norm": tensors["norm"], "xy": xy}


class Team:
    """Two sources and len(layouts) destinations of one group, all in this process."""

    def __init__(self, name: str, layouts: list[str], modes: list[str],
                 delta_bytes: int | list[int] = 1 << 20, delta: bool = True,
                 push_timeout: float = 20.0, relay: bool | None = None, source_device: str = "cpu") -> None:
        self.name, self.layouts, self.modes = name, layouts, modes
        self.group = ws.Group.create(name, num_sources=2, num_destinations=len(layouts), relay=relay)
        self.full = initial()
        self.history: dict[int, dict[str, torch.Tensor]] = {}
        self.locals: list[dict[str, torch.Tensor]] = []
        for i in range(2):
            self.locals.append({k: (t if k == "norm" else t[self._box(k, i)]).clone().to(source_device)
                                for k, t in self.full.items()})
        self.dtensors: list[dict[str, torch.Tensor]] = []
        sizes = delta_bytes if isinstance(delta_bytes, list) else [delta_bytes] * len(layouts)
        with ThreadPoolExecutor(8) as ex:
            srcs = [ex.submit(self._source, i, delta) for i in range(2)]
            dsts = []
            for j, (layout, mode) in enumerate(zip(layouts, modes, strict=True)):
                poison = {k: torch.full_like(v, float("nan")) for k, v in view(layout, self.full).items()}
                self.dtensors.append(poison)
                dsts.append(ex.submit(ws.Destination, name, j, named(layout, poison), mode, timeout=60,
                                      push_timeout=push_timeout, delta_bytes=sizes[j]))
            self.srcs = [f.result(timeout=120) for f in srcs]
            self.dsts = [f.result(timeout=120) for f in dsts]
        self.version = -1
        self.mixed: list[str] = []
        self.reads: dict[int, set[int]] = {}
        self._stop = threading.Event()
        self._readers: list[threading.Thread] = []

    @staticmethod
    def _box(k: str, i: int) -> tuple[slice, slice]:
        """Source ``i``'s part of ``k``: the embedding and ``y`` by columns, the rest by rows."""
        if k in BY_COLUMNS:
            n = SHAPES[k][1] // 2
            return slice(None), slice(i * n, (i + 1) * n)
        n = SHAPES[k][0] // 2
        return slice(i * n, (i + 1) * n), slice(None)

    def _source(self, i: int, delta: bool) -> ws.Source:
        tensors = {k: (t if k == "norm" else
                       ws.Sharded(t, SHAPES[k], tuple(s.start or 0 for s in self._box(k, i))))
                   for k, t in self.locals[i].items()}
        return ws.Source(self.name, rank=i, tensors=tensors, timeout=60, delta=delta)

    def set(self, full: dict[str, torch.Tensor]) -> None:
        self.full = {k: v.clone() for k, v in full.items()}
        for i in range(2):
            for k, t in self.locals[i].items():
                t.copy_(full[k] if k == "norm" else full[k][self._box(k, i)])

    def push(self, timeout: float = 30.0) -> list[ws.PushStats]:
        self.version += 1
        self.history[self.version] = {k: v.clone() for k, v in self.full.items()}
        with ThreadPoolExecutor(2) as ex:
            futs = [ex.submit(ws.push, s, self.version, timeout) for s in self.srcs]
            return [f.result(timeout=timeout + 30) for f in futs]

    def check(self, ranks: list[int] | None = None) -> None:
        for j in ranks if ranks is not None else range(len(self.dsts)):
            d = self.dsts[j]
            assert d.wait(self.version, timeout=30) == self.version
            if self.modes[j] == "staged" and j not in self.reads:
                d.apply()
            elif self.modes[j] == "staged":
                deadline = time.monotonic() + 30
                while d.live_version < self.version and time.monotonic() < deadline:
                    time.sleep(0.005)
            want = view(self.layouts[j], self.full)
            for k, t in want.items():
                got = self.dtensors[j][k]
                assert torch.equal(bits(got), bits(t)), (
                    f"destination {j} ({self.layouts[j]}, {self.modes[j]}) {k} differs at version "
                    f"{self.version}")

    def push_after_readmission(self, j: int) -> list[ws.PushStats]:
        """Destination ``j`` was dropped: waits until it has joined again, then pushes a step at a time
        until a push reaches it (its first push back may still miss it, paths being re-established),
        and checks every destination."""
        d = self.dsts[j]
        deadline = time.monotonic() + 60
        while d.readmissions < 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert d.readmissions >= 1
        for attempt in range(3):
            self.set(step(self.full, "odd", seed=10 + attempt))
            stats = self.push()
            if all(j not in s.failed_destinations for s in stats):
                break
        self.check()
        return stats

    def start_reader(self, j: int) -> None:
        """A staged destination's generation loop: applies the newest version at each safe point and checks
        every tensor against that version (a mix of two versions is recorded)."""
        self.reads[j] = set()

        def loop() -> None:
            while not self._stop.is_set():
                v = self.dsts[j].apply()
                if v < 0:
                    time.sleep(0.001)
                    continue
                want = view(self.layouts[j], self.history[v])
                for k, t in want.items():
                    if not torch.equal(bits(self.dtensors[j][k]), bits(t)):
                        self.mixed.append(f"destination {j} {k} differs from version {v}")
                self.reads[j].add(v)

        th = threading.Thread(target=loop, daemon=True)
        th.start()
        self._readers.append(th)

    def close(self) -> None:
        self._stop.set()
        for th in self._readers:
            th.join(10)
        for p in self.srcs + self.dsts:
            p.close()
        self.group.shutdown()


@pytest.fixture(autouse=True)
def every_part_filled(monkeypatch: pytest.MonkeyPatch) -> None:
    # The models here are kilobytes: left to MIN_SPAN_BYTES every source would fill one span, and the
    # early spans' paths (scattered while the next is compared and sent) would go untested.
    monkeypatch.setattr(delta_codec, "MIN_SPAN_BYTES", 1)


@pytest.fixture
def team_factory(ray_cluster) -> Iterator[Callable[..., Team]]:
    teams: list[Team] = []

    def make(*args: Any, **kwargs: Any) -> Team:
        teams.append(Team(*args, **kwargs))
        return teams[-1]

    yield make
    for t in teams:
        t.close()


def _f32(x: int) -> float:
    return float(np.array([x], np.uint32).view(np.float32)[0])


def step(full: dict[str, torch.Tensor], case: str, seed: int) -> dict[str, torch.Tensor]:
    """The next version: ``full`` changed as ``case`` says."""
    g = torch.Generator().manual_seed(seed)
    out = {k: v.clone() for k, v in full.items()}
    if case == "odd":  # ~3% of each tensor at random odd flat positions, new random values
        for t in out.values():
            flat = t.view(-1)
            n = flat.numel()
            pos = torch.randperm(n // 2, generator=g)[:max(1, n * 3 // 200)] * 2 + 1
            flat[pos] = torch.randn(len(pos), generator=g).to(t.dtype)
        out["q"][0, 0] = 0.0  # +0.0: "special" turns it into -0.0
        out["emb"][0, 0] = 0.0
        out["q"][1, 1] = _f32(0x7FC00000)  # a NaN: "special" changes its payload only
    elif case == "tenth":  # ~15% of each tensor at random flat positions: the bitmap encoding is smaller
        for t in out.values():
            flat = t.view(-1)
            n = flat.numel()
            pos = torch.randperm(n, generator=g)[:max(1, n * 3 // 20)]
            flat[pos] = torch.randn(len(pos), generator=g).to(t.dtype)
    elif case == "none":
        pass
    elif case == "all":
        for k, t in out.items():
            out[k] = torch.randn(t.shape, generator=g).to(t.dtype)
        out["q"][0, 0] = 0.0
        out["emb"][0, 0] = 0.0
        out["q"][1, 1] = _f32(0x7FC00000)
        out["k"][3, 3] = _f32(0x00000001)  # the smallest denormal
    elif case == "one":
        out["emb"][300, 77] = out["emb"][300, 77] + 1
    elif case == "last":
        for t in out.values():
            t.view(-1)[-1] = t.view(-1)[-1] * 2 + 1
    elif case == "special":  # bitwise changes == does not see (or sees wrongly)
        out["q"][0, 0] = -0.0
        out["emb"][0, 0] = -0.0
        out["q"][1, 1] = _f32(0x7FC00001)  # NaN -> another NaN
        out["k"][3, 3] = _f32(0x00000002)  # denormal -> another denormal
        out["v"][2, 5] = float("nan")
    elif case == "strided":  # column blocks: the TP destinations' strided writes, across both sources
        out["down"][:, 4:9] = torch.randn(8, 5, generator=g)
        out["emb"][:, 60:75] = torch.randn(520, 15, generator=g).to(torch.bfloat16)
    else:
        raise AssertionError(case)
    return out


CASES = ["odd", "none", "all", "one", "last", "special", "strided", "tenth", "odd"]


def test_every_case_bitwise_on_inplace_and_staged_with_a_reader(team_factory) -> None:
    team = team_factory("delta-cases", ["tp0", "tp1", "replica"], ["inplace", "staged", "staged"])
    team.start_reader(2)
    stats = team.push()  # version 0: dense (no reference yet)
    team.check()
    assert all(s.delta_destinations == [] and s.wire_bytes >= s.dense_bytes for s in stats)
    assert all(s.delta_ref_bytes > 0 for s in stats)
    for v, case in enumerate(CASES, start=1):
        team.set(step(team.full, case, seed=v))
        stats = team.push()
        team.check()
        for s in stats:
            assert s.failed_destinations == [], s
            assert s.delta_destinations == [0, 1, 2], (case, s)
            wire, dense = s.wire_bytes, s.dense_bytes
            if case in ("none", "one", "last", "special"):
                assert wire < dense / 4, (case, wire, dense)
            if case == "all":
                assert wire >= dense, (case, wire, dense)  # every write as planned (plus the entries)
                assert s.changed_fraction > 0.99
            if case == "none":
                assert s.changed_fraction == 0.0
            if case == "tenth":  # a bit per word and the values: under a quarter of the dense bytes
                assert 0.1 < s.changed_fraction < 0.2 and wire < dense / 4, (case, wire, dense, s)
            assert 0.0 <= s.changed_fraction <= 1.0
        assert all(s.delta_scratch_bytes > 0 for s in stats), case  # the compare's outputs, kept
    time.sleep(0.2)
    assert team.mixed == []
    assert team.reads[2], "the reader applied no version"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_every_case_from_gpu_sources_with_the_compares_launched_ahead(team_factory, monkeypatch) -> None:
    # The sources' tensors on the GPU: every span's CUDA compare is launched on a stream of its own at the
    # push's start, and a launched compare must see the tensors as the caller last updated them on its
    # stream. (GPU destinations cannot share this process: it cannot open its own CUDA IPC handles; the
    # replica of scripts/bench_delta.py is one, its bytes checked after every push.)
    from weightsync.delta import cuda as delta_cuda
    from weightsync.delta.triton_kernels import Compactor

    if delta_cuda.module(torch.device("cuda")) is None:
        pytest.skip(f"no CUDA compare here: {delta_cuda.unavailable(torch.device('cuda'))}")
    launched: list[bool] = []
    launch = Compactor.launch

    def counted(self: Compactor, *args: Any, **kwargs: Any) -> bool:
        launched.append(launch(self, *args, **kwargs))
        return launched[-1]

    monkeypatch.setattr(Compactor, "launch", counted)
    team = team_factory("delta-gpu", ["tp0", "tp1", "replica"], ["inplace", "staged", "staged"],
                        source_device="cuda")
    team.push()
    team.check()
    team.start_reader(2)  # a generation loop applying each version as it completes: never a mix
    for v, case in enumerate(CASES, start=1):
        team.set(step(team.full, case, seed=v))
        stats = team.push()
        team.check()
        assert all(s.delta_destinations == [0, 1, 2] and s.failed_destinations == [] for s in stats), case
    assert any(launched), "no compare was launched ahead"
    time.sleep(0.2)
    assert team.mixed == []
    assert team.reads[2], "the reader applied no version"


def test_a_small_model_fills_one_part_and_sends_the_others_empty(team_factory, monkeypatch) -> None:
    monkeypatch.setattr(delta_codec, "MIN_SPAN_BYTES", 1 << 28)  # as shipped: these kilobytes, one span
    team = team_factory("delta-one-span", ["tp0", "replica"], ["inplace", "staged"])
    assert all(int(s._delta._key_span.max()) == 0 for s in team.srcs)
    team.push()
    team.check()
    for v, case in enumerate(("odd", "none", "one", "all"), start=1):
        team.set(step(team.full, case, seed=v))
        stats = team.push()
        team.check()
        assert all(s.delta_destinations == [0, 1] and s.failed_destinations == [] for s in stats), case


def test_strided_source_rows_written_directly_and_compared_in_slices(team_factory, monkeypatch) -> None:
    # As from a GPU source (its cuda lane copies strided rows in 2-D), the source-strided blocks (the TP
    # destinations' column shards of ``down``) go as direct 2-D writes, not packed into staging: their
    # changes are picked among the words of the rows they span. The compare runs in slices of 100 words,
    # which cut tensors anywhere.
    import dataclasses

    import weightsync.delta.compare as delta
    from weightsync.runtime.source import Source

    info = Source._engine_info
    monkeypatch.setattr(Source, "_engine_info",
                        lambda self: dataclasses.replace(info(self), pack_strided=False))
    monkeypatch.setattr(delta, "COMPARE_SLICE", 100)
    team = team_factory("delta-2d", ["tp0", "tp1", "replica"], ["inplace", "staged", "inplace"])
    team.push()
    team.check()
    assert any(f["strided"].any() for s in team.srcs for ib in s._delta.inboxes.values()
               for f in ib.flat.values()), "no source-strided direct write: the test misses its point"
    for v, case in enumerate(CASES, start=1):
        team.set(step(team.full, case, seed=300 + v))
        stats = team.push()
        team.check()
        assert all(s.delta_destinations == [0, 1, 2] for s in stats), (case, stats)
        if case == "none":
            assert all(s.changed_fraction == 0.0 for s in stats)


def test_a_header_that_lands_before_its_payload_waits_for_it(team_factory, monkeypatch) -> None:
    # A source posts each inbox destination's payload, then its header; nothing orders the two on the
    # wire (the header can take another NIC or copy stream than the payload's pieces, and a 64-byte write
    # finishes first: seen on 4 x H100, where a destination applied the previous version's entries and
    # flipped with the changes missing). Here every header lands, and is seen, before its payload is
    # even posted: each destination must still end every version with exactly its bytes.
    def header_first(self: DeltaSender, ranks: list[int], epoch: int, version: int, imm: int,
                     peers: dict[int, Any], failed: dict[int, str]) -> list[tuple[int, Any]]:
        out: list[tuple[int, Any]] = []
        for rank in sorted(r for r in ranks if r not in failed):
            work = self.finalize(rank)
            self.header(rank, epoch, version, work)
            header = self._post_header(rank, epoch, version, peers[rank])
            header.wait(10.0)
            time.sleep(0.2)  # the destination has the header now, and none of the payload's bytes
            out.append((rank, header))
            if work.final_bytes:
                ib = self.inboxes[rank]
                out.append((rank, self.engine.write(ib.region, work.final_at, peers[rank], ib.payload,
                                                    ib.offset + work.final_at, work.final_bytes, imm=imm)))
        return out

    monkeypatch.setattr(DeltaSender, "post_finals", header_first)
    team = team_factory("delta-late-payload", ["tp0", "replica"], ["inplace", "staged"])
    team.push()
    team.check()
    for v, case in enumerate(["odd", "one", "strided", "odd"], start=1):
        team.set(step(team.full, case, seed=700 + v))
        stats = team.push()
        team.check()
        assert all(s.delta_destinations == [0, 1] for s in stats), (case, stats)


def test_early_spans_are_scattered_before_the_final_span_is_sent(team_factory, monkeypatch) -> None:
    # A push sends its direct writes in spans, each scattered by the destination as soon as it has landed
    # (weightsync.delta.sender.SPANS): with every source's final span held back, each destination has
    # read the early spans' entries already, the inplace one shows their changes in its live tensors,
    # and none has taken the version yet (the final span completes it).
    team = team_factory("delta-spans", ["tp0", "replica"], ["inplace", "staged"])
    sends = DeltaSender.post_finals
    seen: list[tuple[list[int], list[int]]] = []

    def held_back(self: DeltaSender, ranks: list[int], epoch: int, version: int, imm: int,
                  peers: dict[int, Any], failed: dict[int, str]) -> list[tuple[int, Any]]:
        if ranks:
            time.sleep(0.5)
            seen.append(([len(d._delta._entries) for d in team.dsts], [d.version for d in team.dsts]))
        return sends(self, ranks, epoch, version, imm, peers, failed)

    team.push()
    team.check()
    assert all(len({sp.span for sp in s._delta._spaces.values()}) > 1 for s in team.srcs), \
        "every tensor in one span: the test misses its point"
    monkeypatch.setattr(DeltaSender, "post_finals", held_back)
    old = {k: v.clone() for k, v in team.dtensors[0].items()}
    team.set(step(team.full, "odd", seed=41))
    team.push()
    team.check()
    assert seen and all(min(entries) > 0 and versions == [0, 0] for entries, versions in seen), seen
    assert any(not torch.equal(bits(team.dtensors[0][k]), bits(old[k])) for k in old)


def test_a_part_header_that_lands_before_its_payload_waits_for_it(team_factory, monkeypatch) -> None:
    # As for the final span: each early span's header lands, and is seen, before its payload is posted.
    def header_first(self: DeltaSender, rank: int, epoch: int, version: int, span: int, peer: Any,
                     failed: dict[int, str]) -> list[tuple[int, Any]]:
        pt = self.encode_span(rank, span)
        self.header(rank, epoch, version, self._works[rank], span)
        header = self._post_header(rank, epoch, version, peer, span)
        header.wait(10.0)
        time.sleep(0.05)
        out = [(rank, header)]
        if pt.nbytes:
            from weightsync.wire import delta_part_imm

            ib = self.inboxes[rank]
            out.append((rank, self.engine.write(ib.region, pt.at, peer, ib.payload, ib.offset + pt.at,
                                                pt.nbytes, imm=delta_part_imm(epoch, version, span,
                                                                              header=False))))
        return out

    monkeypatch.setattr(DeltaSender, "post_span", header_first)
    team = team_factory("delta-late-span", ["tp1", "replica"], ["staged", "inplace"])
    team.push()
    team.check()
    for v, case in enumerate(["odd", "strided", "one"], start=1):
        team.set(step(team.full, case, seed=800 + v))
        stats = team.push()
        team.check()
        assert all(s.delta_destinations == [0, 1] for s in stats), (case, stats)


def test_small_inbox_sends_what_does_not_fit_as_planned(team_factory, caplog) -> None:
    # 2 sources: 8 KiB of destination 0's inbox each; ~15% changed: source 0's streams for it do not all
    # fit, and what does not goes as planned (counted in delta_overflow_bytes, logged once with the
    # delta_bytes that would have held them). A team whose destination 0 takes that advice sends the same
    # changes without overflow.
    def run(name: str, inbox: int) -> list[list[ws.PushStats]]:
        team = team_factory(name, ["tp0", "replica"], ["inplace", "staged"], delta_bytes=[inbox, 4 << 20])
        team.push()
        out = []
        for v in range(1, 4):
            team.set(step(team.full, "tenth", seed=100 + v))
            out.append(team.push())
            team.check()
        return out

    with caplog.at_level(logging.WARNING, logger="weightsync"):
        small = run("delta-small", 16384)
    for stats in small:
        assert all(s.delta_destinations == [0, 1] for s in stats)
        # what went as planned for want of room is counted (destination 0's share is the small one)
        assert any(s.delta_overflow_bytes > 0 for s in stats), stats
        assert all(s.delta_overflow_bytes < s.wire_bytes < s.dense_bytes for s in stats), stats
    said = r"destination 0's delta inbox had no room.*delta_bytes=(\d+)"
    advice = [int(m) for r in caplog.records for m in re.findall(said, r.getMessage())]
    assert advice and all(a > 16384 for a in advice), caplog.text
    for stats in run("delta-advised", max(advice)):
        assert all(s.delta_destinations == [0, 1] and s.delta_overflow_bytes == 0 for s in stats), stats


def test_source_without_delta_into_inboxes_is_dense_and_exact(team_factory) -> None:
    team = team_factory("delta-off", ["tp1", "replica"], ["staged", "inplace"], delta=False)
    for v in range(3):
        if v:
            team.set(step(team.full, "odd", seed=200 + v))
        stats = team.push()
        team.check()
        assert all(s.delta_destinations == [] and s.wire_bytes >= s.dense_bytes for s in stats)


# -- casts and FP8: compared with a destination that takes the same plan dense ---------------------------
FP8 = torch.float8_e4m3fn
T_SHAPES = {"w": (300, 260), "c": (64, 48), "n": (48,)}


class RefTeam:
    """Two fp32 sources (rows cut at 150 and 32: FP8 tiles across the cut are gathered) into FP8 ``w`` with
    its scales, a bf16 cast ``c`` and an fp32 ``n``: an inplace and a staged destination with inboxes, and
    one without (a dense push, the reference every byte is compared with)."""

    def __init__(self, name: str, relay: bool = False, delta_bytes: int = 1 << 20) -> None:
        self.name = name
        self.group = ws.Group.create(name, num_sources=2, num_destinations=3, allow_cast=True, relay=relay)
        g = torch.Generator().manual_seed(11)
        self.full = {k: torch.randn(s, generator=g) for k, s in T_SHAPES.items()}
        self.locals = [{k: t[self._rows(k, i)].clone() for k, t in self.full.items()} for i in range(2)]
        self.dtensors: list[dict[str, torch.Tensor]] = []
        with ThreadPoolExecutor(8) as ex:
            # small chunks: several staged chunks per push, each compared with its own reference
            srcs = [ex.submit(ws.Source, name, i, self._named(i), timeout=60, delta=True,
                              staging_bytes=1 << 20, chunk_bytes=64 << 10) for i in range(2)]
            dsts = []
            for j, (mode, inbox) in enumerate([("inplace", delta_bytes), ("staged", delta_bytes),
                                               ("inplace", 0)]):
                t = {"w": torch.full((300, 260), 0x7F, dtype=torch.uint8).view(FP8),
                     "w_scale_inv": torch.full((3, 3), float("nan")),
                     "c": torch.full((64, 48), float("nan"), dtype=torch.bfloat16),
                     "n": torch.full((48,), float("nan"))}
                self.dtensors.append(t)
                dsts.append(ex.submit(ws.Destination, name, j, dict(t), mode, timeout=60, delta_bytes=inbox))
            self.srcs = [f.result(timeout=120) for f in srcs]
            self.dsts = [f.result(timeout=120) for f in dsts]
        self.version = -1

    @staticmethod
    def _rows(k: str, i: int) -> slice:
        if k == "n":
            return slice(None)
        cut = {"w": 150, "c": 32}[k]
        return slice(0, cut) if i == 0 else slice(cut, None)

    def _named(self, i: int) -> dict[str, Any]:
        return {k: (t if k == "n" else ws.Sharded(t, T_SHAPES[k], (self._rows(k, i).start or 0, 0)))
                for k, t in self.locals[i].items()}

    def set(self, full: dict[str, torch.Tensor]) -> None:
        self.full = {k: v.clone() for k, v in full.items()}
        for i in range(2):
            for k, t in self.locals[i].items():
                t.copy_(full[k][self._rows(k, i)])

    def push(self) -> list[ws.PushStats]:
        self.version += 1
        with ThreadPoolExecutor(2) as ex:
            futs = [ex.submit(ws.push, s, self.version, 60.0) for s in self.srcs]
            return [f.result(timeout=90) for f in futs]

    def check(self) -> None:
        for d in self.dsts:
            assert d.wait(self.version, timeout=30) == self.version
            d.apply()
        ref = self.dtensors[2]
        for j in (0, 1):
            for k, t in self.dtensors[j].items():
                assert torch.equal(t.view(torch.uint8), ref[k].view(torch.uint8)), \
                    f"destination {j} {k} differs from the dense push at version {self.version}"

    def close(self) -> None:
        for p in self.srcs + self.dsts:
            p.close()
        self.group.shutdown()


def test_cast_and_fp8_destinations_get_deltas_of_what_is_sent(ray_cluster) -> None:
    team = RefTeam("delta-fp8")
    try:
        team.push()
        team.check()
        g = torch.Generator().manual_seed(5)
        for v in range(1, 6):
            full = {k: t.clone() for k, t in team.full.items()}
            if v == 2:
                pass  # nothing changed
            elif v == 4:
                full["w"][200, 7] = 1000.0  # one tile's amax: its scale and all its values change
            else:  # an optimizer-like step: every fp32 value moves a little
                for t in full.values():
                    t.add_(torch.randn(t.shape, generator=g) * 1e-3 * t.abs())
            team.set(full)
            stats = team.push()
            team.check()
            for s in stats:
                assert s.failed_destinations == []
                assert s.delta_destinations == [0, 1], s
                # fp32 moved by ~1e-3 relative: most bf16 and FP8 values stay, few are sent
                assert s.wire_bytes < s.dense_bytes * 0.8, (v, s.wire_bytes, s.dense_bytes)
            if v == 2:
                assert all(s.changed_fraction == 0.0 for s in stats)
    finally:
        team.close()


def test_delta_through_a_relay_chain_every_case(team_factory) -> None:
    # Three replicas in a chain (inplace head, staged members, a reader on the last): every member gets
    # the same entries and payload from each source directly, and the writes sent as planned (staged
    # packs among them) through the chain, forwarded as they land.
    team = team_factory("delta-chain", ["replica"] * 3, ["inplace", "staged", "staged"], relay=True)
    assert team.group.status()["relay"], "no relay chain: the test misses its point"
    team.start_reader(2)
    stats = team.push()
    team.check()
    assert all(s.delta_destinations == [] and s.relayed == [1, 2] for s in stats)
    for v, case in enumerate(CASES, start=1):
        team.set(step(team.full, case, seed=900 + v))
        stats = team.push()
        team.check()
        for s in stats:
            assert s.failed_destinations == [], s
            assert s.delta_destinations == [0, 1, 2], (case, s)
            if case in ("none", "one", "last", "special"):
                assert s.wire_bytes < s.dense_bytes / 4, (case, s.wire_bytes, s.dense_bytes)
            if case == "all":  # every write as planned, through the chain once, and three payloads
                assert s.wire_bytes >= s.dense_bytes, (case, s.wire_bytes, s.dense_bytes)
    time.sleep(0.2)
    assert team.mixed == []
    assert team.reads[2], "the reader applied no version"


def test_a_chain_member_that_missed_a_version_makes_the_chain_dense(team_factory) -> None:
    """The middle member of a chain forwards nothing through one push whose every write goes as planned:
    the last member misses that version, the sources report it, it joins again. The next push is dense
    for the whole chain (its members no longer hold one version) and exact everywhere; the one after it
    a delta again."""
    team = team_factory("delta-chain-missed", ["replica"] * 3, ["inplace", "staged", "staged"], relay=True)
    team.push()
    team.check()
    team.set(step(team.full, "odd", seed=1))
    team.push()
    team.check()
    middle, last = team.dsts[1], team.dsts[2]
    assert middle._relay is not None and middle._relay.successor is not None
    arm = middle._relay.arm
    middle._relay.arm = lambda succ_buffer: None  # type: ignore[method-assign]
    try:
        team.set(step(team.full, "all", seed=2))
        stats = team.push(timeout=3.0)
    finally:
        middle._relay.arm = arm  # type: ignore[method-assign]
    assert all(s.failed_destinations == [2] for s in stats), stats
    team.check([0, 1])
    assert last.version == 1
    stats = team.push_after_readmission(2)
    assert all(s.delta_destinations == [] for s in stats), stats
    team.set(step(team.full, "odd", seed=20))
    stats = team.push()
    team.check()
    assert all(s.delta_destinations == [0, 1, 2] for s in stats), stats


@pytest.mark.parametrize("inbox", [0, 1 << 20])
def test_a_chain_head_that_cannot_arm_its_forwards_still_lands(team_factory, inbox: int) -> None:
    """Arming the head's forwards fails (its successor unreachable): the head lands the version and acks
    it, forwarding nothing; the members after it miss it and are reported. Before, the error escaped the
    landing and left the head ``updating`` with the version neither landed nor abandoned."""
    from weightsync.errors import TransportError

    team = team_factory(f"chain-arm-{inbox}", ["replica"] * 3, ["inplace", "staged", "inplace"], relay=True,
                        delta_bytes=inbox, delta=bool(inbox), push_timeout=2.0)
    team.push()
    team.check()
    head = team.dsts[0]
    assert head._relay is not None and head._relay.successor is not None

    def fail(succ_buffer: int) -> None:
        raise TransportError("destination 0: arming relay to destination 1 failed: test")

    arm = head._relay.arm
    head._relay.arm = fail  # type: ignore[method-assign]
    try:
        team.set(step(team.full, "all", seed=5))
        stats = team.push(timeout=4.0)
    finally:
        head._relay.arm = arm  # type: ignore[method-assign]
    assert all(s.failed_destinations == [1, 2] for s in stats), stats
    team.check([0])
    assert not head.updating


def test_a_chain_with_a_member_without_inbox_is_dense_and_exact(ray_cluster) -> None:
    # FP8 and cast destinations in a chain whose last member has no inbox: no delta can reach it, so
    # the chain goes dense (the members with inboxes still land by their headers) and every byte equals
    # the dense push's.
    team = RefTeam("delta-chain-fp8", relay=True)
    try:
        assert team.group.status()["relay"]
        for v in range(4):
            if v:
                full = {k: t + 1e-3 * t.abs() for k, t in team.full.items()}
                team.set(full)
            stats = team.push()
            team.check()
            assert all(s.delta_destinations == [] and s.failed_destinations == [] for s in stats), stats
    finally:
        team.close()


def test_a_destination_that_missed_a_version_gets_it_dense_after_the_replan(team_factory) -> None:
    """Destination 1's receiving thread is held (its lock) through one push: the sources give up on it,
    report it, and the coordinator re-plans without it; it joins again (another re-plan). The next push
    is a delta for the destinations that hold the sources' last version and dense for it."""
    team = team_factory("delta-missed", ["tp0", "tp1", "replica"], ["inplace", "staged", "inplace"])
    team.push()
    team.check()
    team.set(step(team.full, "odd", seed=1))
    team.push()
    team.check()
    missed = team.dsts[1]
    before = missed.version
    with missed._lock:  # holds its grant back: it cannot take the next version
        team.set(step(team.full, "odd", seed=2))
        stats = team.push(timeout=3.0)
        assert all(s.failed_destinations == [1] for s in stats), stats
        assert all(s.delta_destinations == [0, 2] for s in stats), stats
    team.check([0, 2])
    assert missed.version == before
    stats = team.push_after_readmission(1)
    for s in stats:
        assert 1 not in s.delta_destinations and {0, 2} <= set(s.delta_destinations), s
    team.set(step(team.full, "last", seed=20))
    stats = team.push()  # now it holds the sources' version again: a delta for everyone
    team.check()
    assert all(s.delta_destinations == [0, 1, 2] for s in stats), stats


def test_a_payload_that_does_not_apply_abandons_its_version(team_factory) -> None:
    """Destination 0 (inplace) scatters part of a version's changes, then its apply fails (as the host
    scatter does on an entry outside its run or key: a corrupt stream): the version is abandoned like
    an incomplete one, so the destination is not left "updating" forever and says ``dirty`` (bytes of
    the failed version are in its live tensors); it does not take the version, the sources report it,
    and after it is back every push is exact again."""
    team = team_factory("delta-bad-apply", ["replica", "tp0"], ["inplace", "inplace"])
    team.push()
    team.check()
    team.set(step(team.full, "odd", seed=1))
    team.push()
    team.check()
    bad = team.dsts[0]
    receiver = bad._delta
    assert receiver is not None
    scatter = receiver._scatter_all
    failures: list[int] = []

    def scatter_then_fail(shadow: int, spans: Any) -> None:
        scatter(shadow, spans)  # the changes land in the live tensors, then the stream turns out corrupt
        if not failures:
            failures.append(shadow)
            raise ValueError("delta_scatter_idx16: entry 3 lies outside its run (a test's corrupt stream)")

    receiver._scatter_all = scatter_then_fail
    before = bad.version
    team.set(step(team.full, "odd", seed=2))
    stats = team.push(timeout=3.0)
    assert failures
    assert all(s.failed_destinations == [0] for s in stats), stats
    assert bad.version == before
    assert not bad.updating
    assert bad.dirty
    deadline = time.monotonic() + 60
    while bad.readmissions < 1 and time.monotonic() < deadline:
        time.sleep(0.05)
    for attempt in range(3):  # its first push back may still miss it (paths being re-established)
        team.set(step(team.full, "odd", seed=10 + attempt))
        stats = team.push()
        if all(0 not in s.failed_destinations for s in stats):
            break
    team.check()
    assert not bad.dirty
    assert all(0 not in s.delta_destinations for s in stats), stats  # its bytes were of no version: dense
    team.set(step(team.full, "last", seed=20))
    stats = team.push()
    team.check()
    assert all(s.delta_destinations == [0, 1] for s in stats), stats


def test_a_push_that_failed_its_check_is_followed_by_a_dense_one(team_factory) -> None:
    """A non-blocking push whose tensors change under it fails (no destination takes it) after the delta
    was encoded: the sources' reference is then of no version anyone holds, so the next push is dense,
    and the one after it a delta again; every byte right throughout."""
    team = team_factory("delta-changed", ["tp0", "replica"], ["staged", "inplace"])
    team.push()
    team.set(step(team.full, "odd", seed=1))
    team.push()
    team.check()
    team.set(step(team.full, "odd", seed=2))
    team.version += 1
    held = [d._lock for d in team.dsts]
    for lock in held:  # no grant yet: the pushes wait, their encodes done
        lock.acquire()
    try:
        handles = [ws.push_async(s, team.version, timeout=5.0) for s in team.srcs]
        time.sleep(0.3)
        with torch.no_grad():
            team.locals[0]["q"].mul_(2.0)  # an optimizer step that did not wait for the push
    finally:
        for lock in held:
            lock.release()
    errors = []
    for h in handles:
        try:
            h.wait(60)
        except ws.WeightSyncError as exc:
            errors.append(str(exc))
    assert errors and all("changed" in e for e in errors[:1]), errors
    assert all(d.version == team.version - 1 for d in team.dsts)
    team.set(step(team.full, "odd", seed=3))
    stats = team.push()
    team.check()
    assert all(s.delta_destinations == [] for s in stats), stats
    team.set(step(team.full, "one", seed=4))
    stats = team.push()
    team.check()
    assert all(s.delta_destinations == [0, 1] for s in stats), stats


# -- the simulator's delta model --------------------------------------------------------------------------
def test_simulated_delta_push_sends_the_encoded_bytes_and_adds_encode_and_apply() -> None:
    from weightsync.plan import plan
    from weightsync.runtime.describe import Sharded, describe_tensors
    from weightsync.sim.simulate import CostModel, delta_wire_ratio, simulate

    g = np.zeros((1 << 12, 1 << 12), np.float32)
    srcs = [describe_tensors({"w": Sharded(g[:2048], g.shape, (0, 0))}),
            describe_tensors({"w": Sharded(g[2048:], g.shape, (2048, 0))})]
    p = plan(srcs, [describe_tensors({"w": g}) for _ in range(2)], source_hosts=[0, 1],
             destination_hosts=[2, 3])
    dense = simulate(p, [0, 1], [2, 3], CostModel(msg_overhead_us=0.0))
    fast = CostModel(msg_overhead_us=0.0, changed_fraction=0.02, encode_gbs=1e9, apply_gbs=1e9)
    delta = simulate(p, [0, 1], [2, 3], fast)
    ratio = float(delta_wire_ratio(0.02, np.array([4.0]))[0])
    assert ratio == pytest.approx(0.02 * 6 / 4)  # 16-bit indices and fp32 values: 6 bytes a change
    assert delta.bound_s == pytest.approx(dense.bound_s * ratio)
    assert delta.bytes_total == dense.bytes_total  # what the destinations received
    everything = simulate(p, [0, 1], [2, 3], CostModel(msg_overhead_us=0.0, changed_fraction=1.0,
                                                       encode_gbs=1e9, apply_gbs=1e9))
    assert everything.bound_s == pytest.approx(dense.bound_s)  # never more than the writes
    slow = simulate(p, [0, 1], [2, 3], CostModel(msg_overhead_us=0.0, changed_fraction=0.02, encode_gbs=1.0,
                                                 apply_gbs=2.0))
    assert slow.encode_s_max == pytest.approx(g.nbytes / 2 / 1e9)  # each source's half, compared once
    assert slow.apply_s_max == pytest.approx(g.nbytes / 2e9)
    assert slow.sim_s >= delta.sim_s + slow.encode_s_max + slow.apply_s_max - 1e-9
