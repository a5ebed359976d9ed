"""The planner: from what every source holds and every destination needs to per-source write lists.

``plan(sources, destinations)`` intersects every needed region with the held ones, picks one source per
piece (balancing bytes per source GPU and per NIC, preferring sources on the destination's host),
turns every piece into 2-D byte blocks inside the local tensors, coalesces adjacent writes, orders each
source's writes in rounds so that every destination has as few simultaneous writers as possible, and
validates the result before any byte moves.

Everything is columnar (numpy): a plan for a trillion-parameter model has millions of writes, and the
coordinator computes it at start-up. Ranks whose layouts are equal (HSDP nodes, inference replicas)
are planned as one *class*, so the work grows with the number of distinct layouts, not with the
number of GPUs times the number of tensors.

Ops (one row of :data:`OP_DTYPE` per write):

``src_rank``, ``dst_rank``
    source (trainer) and destination (rollout) rank, i.e. index in the lists given to :func:`plan`.
``round``
    position of the write's round in its source's schedule: a round is the source's writes to one
    destination (a visit); the source runs its rounds in this order. The schedule starts every source
    on a different destination (T/R sources per destination) and orders visits with a list schedule so
    that each destination has T/R writers at a time (one when sources and destinations are as many),
    never none while work for it is left. ``not_before`` holds each round's planned start.
``src_key``, ``dst_key``
    indices into ``Plan.keys``: the user's dict keys of the local tensors (one registered region each).
``src_offset``, ``dst_offset``
    byte offsets of the block's first byte inside those local tensors.
``rows``, ``row_bytes``, ``src_pitch``, ``dst_pitch``
    a 2-D block: ``rows`` rows of ``row_bytes`` bytes; row ``i`` starts at ``offset + i * pitch``.
    ``rows == 1`` for a contiguous write (pitches then equal ``row_bytes``).
``pack``
    1 when the block is not contiguous (``rows > 1``). Where ``src_pitch != row_bytes`` the sender packs
    the rows (``cuMemcpy2DAsync`` into staging) and writes them as one; where ``dst_pitch != row_bytes``
    the rows land apart, which the cuda lane does with one 2-D copy and a NIC with one write per row (or
    the destination unpacks from staging). The planner merges rows wherever both sides allow, so these
    are slices of row-parallel tensors and fused columns, not the bulk of the bytes.
``transform``
    0 none, 1 dtype cast, 2 FP8 block quantization, 3 FP8 block scales (see :data:`TRANSFORMS`). For
    casts ``row_bytes``/``dst_pitch`` count destination bytes and ``src_offset``/``src_pitch`` source
    bytes (source dtype) in the local tensor ``src_key``. FP8 and scale ops read what the sender
    produces: ``src_key`` is a box (``Plan.boxes``: the whole tiles the sender owns), and
    ``src_offset``/``src_pitch`` are destination bytes in that box quantized into a dense row-major
    buffer (FP8 values) or in the dense grid of its tile scales (float32). Rows of owned tiles that the
    sender does not hold are first gathered to it, as listed in ``Plan.gathers``.
``tensor``
    index into ``Plan.tensors`` of the (first) logical tensor the write carries, for diagnostics.
``not_before``
    the round's planned start, as a fraction of the planned push (the largest destination's bytes at
    link speed, ``Plan.stats['dest_bytes_max']``). For engines that pace rounds; the simulator does not
    need it by default (see weightsync/simulate.py: a sender keeping a few rounds in flight absorbs
    timing noise better than pacing).
"""

from __future__ import annotations

import difflib
import heapq
import itertools
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import msgpack
import numpy as np

from .errors import LayoutError, PlanError
from .layout import DTYPE_CODE, DTYPE_SIZES, DTYPES, UNKNOWN, Layout, as_layout, is_float8

OP_DTYPE = np.dtype([
    ("src_offset", "<i8"), ("dst_offset", "<i8"), ("rows", "<i8"), ("row_bytes", "<i8"),
    ("src_pitch", "<i8"), ("dst_pitch", "<i8"),
    ("src_rank", "<i4"), ("dst_rank", "<i4"), ("round", "<i4"), ("src_key", "<i4"), ("dst_key", "<i4"),
    ("tensor", "<i4"), ("transform", "u1"), ("pack", "u1"), ("not_before", "<f4"),
], align=True)  # aligned fields: numpy is several times slower on unaligned int64 columns


def gather_dtype(width: int) -> np.dtype:
    """Rows of ``Plan.gathers`` for a plan whose boxes have ``width`` dimensions: ``provider`` writes the
    logical box ``lo``/``shape`` of ``tensor`` (``nbytes`` in the source dtype), read from its box
    ``pbox``, dense and row-major into the receive buffer of ``gatherer`` at byte ``offset``, for the
    gatherer's box ``box`` (indices into ``Plan.boxes``)."""
    return np.dtype([("provider", "<i4"), ("gatherer", "<i4"), ("tensor", "<i4"), ("nbytes", "<i8"),
                     ("box", "<i8"), ("pbox", "<i8"), ("offset", "<i8"), ("lo", "<i8", (width,)),
                     ("shape", "<i8", (width,))])


def box_dtype(width: int) -> np.dtype:
    """Rows of ``Plan.boxes``: a source row of an FP8 tensor. ``lo``/``shape`` is the box it holds,
    at byte ``boff`` of local tensor ``key`` (index into ``Plan.keys``) with element ``strides``;
    ``own_lo``/``own_shape`` the whole tiles it quantizes (its held box with edges moved to the nearest
    tile edge; rows it lacks come through ``Plan.gathers``)."""
    return np.dtype([("id", "<i8"), ("tensor", "<i4"), ("key", "<i4"), ("boff", "<i8"),
                     ("lo", "<i8", (width,)), ("shape", "<i8", (width,)), ("strides", "<i8", (width,)),
                     ("own_lo", "<i8", (width,)), ("own_shape", "<i8", (width,))])


GATHER_DTYPE = gather_dtype(1)

TRANSFORMS = ("none", "cast", "fp8", "fp8_scale")
T_NONE, T_CAST, T_FP8, T_SCALE = 0, 1, 2, 3
SCALE_SUFFIX = "_scale_inv"
ROUND_BYTES = 256 << 20  # a round over a NIC: ~10 ms at 25 GB/s
# A round between GPUs of one host (copy engines at ~390 GB/s on H100): measured on 4 x H100 with
# 256 MiB rounds, two FSDP trainers writing two replicas drifted into each other's destination at
# some of the 60 round changes and a push took 43-60 ms instead of 43.
LOCAL_ROUND_BYTES = 4 << 30
_ITEMSIZE = np.array([DTYPE_SIZES[d] for d in DTYPES], dtype=np.int64)
_BIG = np.int64(1) << np.int64(40)  # > any extent; tensor ids ride above it in composite sort keys


# ==================================================================================================
# Plan


@dataclass
class Expected:
    """What one destination receives: its incoming ops (sorted by source) and their totals."""

    ops: np.ndarray
    count: int
    nbytes: int

    def immediates(self, nics: int = 1, stripe_threshold: int = 1 << 20, max_piece: int = 16 << 20,
                   imm_count: Callable[[int], int] | None = None) -> int:
        """Immediates this destination's counter will see when every op is one engine write (packed
        blocks are written as one contiguous piece of rows*row_bytes). ``imm_count`` (for example a
        ``TransferEngine.imm_count``) is used when given; otherwise the engine's documented rule: one
        piece up to ``stripe_threshold``, else pieces of min(max_piece, ceil(n/nics) rounded up to
        4 KiB)."""
        b = (self.ops["rows"] * self.ops["row_bytes"]).astype(np.int64)
        if imm_count is not None:
            sizes, counts = np.unique(b, return_counts=True)
            return int(sum(int(imm_count(int(n))) * int(c) for n, c in zip(sizes, counts, strict=True)))
        per_nic = (b + max(nics, 1) - 1) // max(nics, 1)
        piece = np.minimum(max_piece, (per_nic + 4095) // 4096 * 4096)
        pieces = np.where(b <= stripe_threshold, 1, -(-b // np.maximum(piece, 1)))
        return int(pieces.sum())


class Plan:
    """A validated, static schedule of one-sided writes. See the module docstring for the op columns."""

    def __init__(self, ops: np.ndarray, num_sources: int, num_destinations: int, keys: list[str],
                 tensors: list[str], src_dtype: list[str], dst_dtype: list[str],
                 gathers: np.ndarray | None = None, needed_bytes: np.ndarray | None = None,
                 stats: dict[str, Any] | None = None, boxes: np.ndarray | None = None,
                 fp8_block: tuple[int, int] | None = None) -> None:
        self.ops = _sorted_ops(np.ascontiguousarray(ops, dtype=OP_DTYPE))
        self.num_sources = int(num_sources)
        self.num_destinations = int(num_destinations)
        self.keys = keys
        self.tensors = tensors
        self.src_dtype = src_dtype
        self.dst_dtype = dst_dtype
        self.gathers = np.zeros(0, GATHER_DTYPE) if gathers is None else np.ascontiguousarray(gathers)
        self.boxes = np.zeros(0, box_dtype(1)) if boxes is None else np.ascontiguousarray(boxes)
        self.fp8_block = None if fp8_block is None else (int(fp8_block[0]), int(fp8_block[1]))
        self.needed_bytes = (np.zeros(num_destinations, np.int64) if needed_bytes is None
                             else np.asarray(needed_bytes, np.int64))
        self.stats = dict(stats or {})
        self._src_bounds = np.searchsorted(self.ops["src_rank"], np.arange(self.num_sources + 1))
        self._by_dst: np.ndarray | None = None  # built on first use: the coordinator may never need it
        self._dst_bounds = np.zeros(0, np.int64)

    # -- views ------------------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self.ops)

    def for_source(self, rank: int) -> np.ndarray:
        """This source's ops in execution order (by round), as a structured array (columns by name)."""
        if not 0 <= rank < self.num_sources:
            raise PlanError(f"source rank {rank} out of range (the plan has {self.num_sources} sources)")
        return self.ops[self._src_bounds[rank]:self._src_bounds[rank + 1]]

    def expected_for_destination(self, rank: int) -> Expected:
        """The ops that write into destination ``rank``: count, bytes and the ops themselves."""
        if not 0 <= rank < self.num_destinations:
            raise PlanError(f"destination rank {rank} out of range (the plan has "
                            f"{self.num_destinations} destinations)")
        if self._by_dst is None:
            self._by_dst = np.argsort(self.ops["dst_rank"], kind="stable")
            self._dst_bounds = np.searchsorted(self.ops["dst_rank"][self._by_dst],
                                               np.arange(self.num_destinations + 1))
        ops = self.ops[self._by_dst[self._dst_bounds[rank]:self._dst_bounds[rank + 1]]]
        return Expected(ops=ops, count=len(ops), nbytes=int((ops["rows"] * ops["row_bytes"]).sum()))

    def part(self, sources: Sequence[int] = (), destinations: Sequence[int] = ()) -> Plan:
        """The plan restricted to the writes of ``sources`` and into ``destinations`` (same ranks, keys and
        tables): what the coordinator sends one participant, small enough for the wire at any scale
        (``part(sources=[i]).to_msgpack()``)."""
        keep = np.zeros(len(self.ops), bool)
        if len(sources):
            keep |= np.isin(self.ops["src_rank"], np.asarray(sources, np.int64))
        if len(destinations):
            keep |= np.isin(self.ops["dst_rank"], np.asarray(destinations, np.int64))
        g = self.gathers
        if len(sources) and len(g):
            gk = np.isin(g["gatherer"], np.asarray(sources)) | np.isin(g["provider"], np.asarray(sources))
            g = g[gk]
        else:
            g = g[:0]
        ops = self.ops[keep]
        boxes = self.boxes
        if len(boxes):
            boxed = (ops["transform"] == T_FP8) | (ops["transform"] == T_SCALE)
            used = np.concatenate([ops["src_key"][boxed].astype(np.int64), g["box"], g["pbox"]])
            boxes = boxes[np.isin(boxes["id"], used)]
        return Plan(ops, self.num_sources, self.num_destinations, self.keys, self.tensors,
                    self.src_dtype, self.dst_dtype, g, self.needed_bytes, self.stats, boxes, self.fp8_block)

    def op_bytes(self) -> np.ndarray:
        return self.ops["rows"] * self.ops["row_bytes"]

    @property
    def nbytes(self) -> int:
        return int(self.op_bytes().sum())

    def bytes_per_source(self) -> np.ndarray:
        return np.bincount(self.ops["src_rank"], weights=self.op_bytes(),
                           minlength=self.num_sources).astype(np.int64)

    def bytes_per_destination(self) -> np.ndarray:
        return np.bincount(self.ops["dst_rank"], weights=self.op_bytes(),
                           minlength=self.num_destinations).astype(np.int64)

    def writes_per_source(self) -> np.ndarray:
        return np.bincount(self.ops["src_rank"], minlength=self.num_sources)

    def max_writers_per_round(self) -> int:
        """Largest number of sources writing one destination in the same round."""
        if len(self.ops) == 0:
            return 0
        pairs = np.unique(np.stack([self.ops["round"].astype(np.int64), self.ops["dst_rank"],
                                    self.ops["src_rank"]], axis=1), axis=0)
        _, counts = np.unique(pairs[:, :2], axis=0, return_counts=True)
        return int(counts.max())

    # -- checks -----------------------------------------------------------------------------------
    def validate(self) -> None:
        """Check the plan on its own: every destination receives exactly the bytes it needs and no two
        writes touch the same destination byte. Raises :class:`PlanError`."""
        got = self.bytes_per_destination()
        bad = np.nonzero(got != self.needed_bytes)[0]
        if len(bad):
            r = int(bad[0])
            raise PlanError(f"destination rank {r} would receive {int(got[r])} bytes but needs "
                            f"{int(self.needed_bytes[r])}")
        ops = self.ops
        if len(ops) == 0:
            return
        # No two writes may touch the same destination byte. Compare byte spans first (one interval per
        # write); only writes whose spans overlap another's (interleaved 2-D blocks) are expanded row by
        # row and compared exactly.
        rows = ops["rows"].astype(np.int64)
        start = ops["dst_offset"]
        end = start + (rows - 1) * ops["dst_pitch"] + ops["row_bytes"]
        dk = ops["dst_rank"].astype(np.int64) * (int(ops["dst_key"].max()) + 2) + ops["dst_key"]
        order = np.lexsort((start, dk))
        s_, e_, k_ = start[order], end[order], dk[order]
        run_end = np.maximum.accumulate(e_ + k_ * _BIG)
        hit = np.nonzero((k_[1:] == k_[:-1]) & (s_[1:] + k_[1:] * _BIG < run_end[:-1]))[0]
        if len(hit) == 0:
            return
        # every write of a (destination, tensor) group that has a span clash is checked row by row
        groups = np.unique(k_[hit + 1])
        sel = np.nonzero(np.isin(dk, groups))[0]
        if int(rows[sel].sum()) > 50_000_000:
            return  # too many interleaved rows to expand here; construction keeps pieces disjoint
        idx = np.repeat(sel, rows[sel])
        first = np.cumsum(rows[sel]) - rows[sel]
        i = np.arange(len(idx)) - np.repeat(first, rows[sel])
        rs = start[idx] + i * ops["dst_pitch"][idx]
        re = rs + ops["row_bytes"][idx]
        o2 = np.lexsort((rs, dk[idx]))
        rs, re, rk = rs[o2], re[o2], dk[idx][o2]
        clash = np.nonzero((rk[1:] == rk[:-1]) & (rs[1:] < re[:-1]))[0]
        if len(clash):
            j = int(clash[0])
            a, b = ops[idx[o2][j]], ops[idx[o2][j + 1]]
            raise PlanError(
                f"two writes overlap in destination rank {int(a['dst_rank'])} tensor "
                f"{self.keys[int(a['dst_key'])]!r} at byte {int(rs[j + 1])}: from source ranks "
                f"{int(a['src_rank'])} and {int(b['src_rank'])}")

    # -- wire format ------------------------------------------------------------------------------
    def to_msgpack(self) -> bytes:
        return msgpack.packb({
            "v": 1, "num_sources": self.num_sources, "num_destinations": self.num_destinations,
            "keys": self.keys, "tensors": self.tensors, "src_dtype": self.src_dtype,
            "dst_dtype": self.dst_dtype, "ops": self.ops.tobytes(), "gathers": self.gathers.tobytes(),
            "gathers_width": self.gathers.dtype["lo"].shape[0], "boxes": self.boxes.tobytes(),
            "boxes_width": self.boxes.dtype["lo"].shape[0],
            "fp8_block": list(self.fp8_block) if self.fp8_block else None,
            "needed_bytes": self.needed_bytes.tobytes(), "stats": _plain(self.stats),
        }, use_bin_type=True)

    @staticmethod
    def from_msgpack(data: bytes) -> Plan:
        d = msgpack.unpackb(data, raw=False)
        return Plan(np.frombuffer(d["ops"], OP_DTYPE).copy(), d["num_sources"], d["num_destinations"],
                    list(d["keys"]), list(d["tensors"]), list(d["src_dtype"]), list(d["dst_dtype"]),
                    np.frombuffer(d["gathers"], gather_dtype(d["gathers_width"])).copy(),
                    np.frombuffer(d["needed_bytes"], np.int64).copy(), d.get("stats"),
                    np.frombuffer(d["boxes"], box_dtype(d["boxes_width"])).copy(),
                    tuple(d["fp8_block"]) if d.get("fp8_block") else None)

    def __eq__(self, other: object) -> bool:
        return (isinstance(other, Plan) and self.num_sources == other.num_sources
                and self.num_destinations == other.num_destinations and self.keys == other.keys
                and self.tensors == other.tensors and np.array_equal(self.ops, other.ops)
                and np.array_equal(self.gathers, other.gathers) and np.array_equal(self.boxes, other.boxes))

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return (f"Plan({len(self.ops)} writes, {self.nbytes} bytes, {self.num_sources} sources -> "
                f"{self.num_destinations} destinations)")


def _sorted_ops(ops: np.ndarray) -> np.ndarray:
    """Ops in execution order: by source, then round (stable: the planner's order inside a round)."""
    if len(ops) == 0:
        return ops
    span = int(ops["round"].max()) + 1
    k = ops["src_rank"].astype(np.int64) * span + ops["round"]
    if np.all(k[1:] >= k[:-1]):
        return ops
    if int(k.max()) < 1 << 16:
        k = k.astype(np.uint16)  # numpy sorts 16-bit keys stably by radix sort, in linear time
    return ops[np.argsort(k, kind="stable")]


def _plain(x: Any) -> Any:
    if isinstance(x, dict):
        return {str(k): _plain(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_plain(v) for v in x]
    if isinstance(x, np.generic):
        return x.item()
    return x


# ==================================================================================================
# Helpers on boxes


def _pad(a: np.ndarray, width: int, fill: int) -> np.ndarray:
    if a.shape[1] == width:
        return a
    out = np.full((a.shape[0], width), fill, dtype=a.dtype)
    out[:, width - a.shape[1]:] = a
    return out


def _classes(layouts: Sequence[Layout]) -> tuple[list[Layout], np.ndarray]:
    """Distinct layouts and the class of every rank (equal layouts are planned once)."""
    by_id: dict[int, int] = {}
    by_fp: dict[str, int] = {}
    classes: list[Layout] = []
    class_of = np.zeros(len(layouts), np.int32)
    for r, lay in enumerate(layouts):
        c = by_id.get(id(lay))
        if c is None:
            fp = lay.fingerprint()
            c = by_fp.get(fp)
            if c is None:
                c = by_fp[fp] = len(classes)
                classes.append(lay)
            by_id[id(lay)] = c
        class_of[r] = c
    return classes, class_of


def _ranks_text(ranks: np.ndarray | Sequence[int], limit: int = 8) -> str:
    ranks = [int(x) for x in ranks]
    s = ", ".join(str(x) for x in ranks[:limit])
    return f"[{s}{', ...' if len(ranks) > limit else ''}]"


def _group_bounds(sorted_keys: np.ndarray) -> np.ndarray:
    """Start indices of runs of equal values in a sorted array, plus len at the end."""
    if len(sorted_keys) == 0:
        return np.zeros(1, np.int64)
    change = np.nonzero(sorted_keys[1:] != sorted_keys[:-1])[0] + 1
    return np.concatenate([[0], change, [len(sorted_keys)]]).astype(np.int64)


def _split_dims(tensor: np.ndarray, lo: np.ndarray, shape: np.ndarray, ntensors: int) -> np.ndarray:
    """Per tensor: the one dimension along which its boxes differ (0 if none), -1 if several."""
    width = lo.shape[1]
    mn_lo = np.full((ntensors, width), np.iinfo(np.int64).max)
    mx_lo = np.full((ntensors, width), np.iinfo(np.int64).min)
    mn_sh = mn_lo.copy()
    mx_sh = mx_lo.copy()
    for d in range(width):
        np.minimum.at(mn_lo[:, d], tensor, lo[:, d])
        np.maximum.at(mx_lo[:, d], tensor, lo[:, d])
        np.minimum.at(mn_sh[:, d], tensor, shape[:, d])
        np.maximum.at(mx_sh[:, d], tensor, shape[:, d])
    varies = (mn_lo != mx_lo) | (mn_sh != mx_sh)
    nvar = varies.sum(axis=1)
    split = np.where(nvar == 0, 0, np.argmax(varies, axis=1))
    return np.where(nvar > 1, -1, split).astype(np.int64)


def _tensors_with_overlap(tensor: np.ndarray, lo: np.ndarray, shape: np.ndarray,
                          ntensors: int) -> np.ndarray:
    """Ids of tensors two of whose (non-empty) boxes share an element."""
    keep = np.all(shape > 0, axis=1)
    t, lo, shape = tensor[keep].astype(np.int64), lo[keep], shape[keep]
    if len(t) < 2:
        return np.zeros(0, np.int64)
    split = _split_dims(t, lo, shape, ntensors)
    sd = split[t]
    simple = sd >= 0
    bad: list[np.ndarray] = []
    # Boxes of a tensor that differ in one dimension only: sort along it; a box starting before the
    # furthest end seen so far in its tensor overlaps an earlier one.
    si = np.nonzero(simple)[0]
    if len(si) > 1:
        k = sd[si]
        start = lo[si, k]
        end = start + shape[si, k]
        order = np.lexsort((start, t[si]))
        ts, ss, es = t[si][order], start[order], end[order]
        run_end = np.maximum.accumulate(es + ts * _BIG)
        hit = np.nonzero((ts[1:] == ts[:-1]) & (ss[1:] + ts[1:] * _BIG < run_end[:-1]))[0]
        bad.append(ts[hit + 1])
    # Boxes cut along several dimensions: pairwise inside each such tensor (small in practice).
    gi = np.nonzero(~simple)[0]
    if len(gi):
        order = gi[np.argsort(t[gi], kind="stable")]
        bounds = _group_bounds(t[order])
        for a, b in itertools.pairwise(bounds):
            idx = order[a:b]
            if _pairwise(lo[idx], shape[idx]):
                bad.append(t[idx[:1]])
    return np.unique(np.concatenate(bad)) if bad else np.zeros(0, np.int64)


def _pairwise(lo: np.ndarray, shape: np.ndarray) -> list[tuple[int, int]]:
    hi = lo + shape
    inter = np.all(np.maximum(lo[:, None, :], lo[None, :, :]) < np.minimum(hi[:, None, :], hi[None, :, :]),
                   axis=2)
    ii, jj = np.nonzero(np.triu(inter, k=1))
    return [(int(a), int(b)) for a, b in zip(ii, jj, strict=True)]


def _first_overlap(tensor: np.ndarray, lo: np.ndarray, shape: np.ndarray,
                   ntensors: int) -> tuple[int, int] | None:
    """A pair (i, j) of rows whose boxes of the same tensor share an element, or None."""
    bad = _tensors_with_overlap(tensor, lo, shape, ntensors)
    if len(bad) == 0:
        return None
    idx = np.nonzero((tensor == bad[0]) & np.all(shape > 0, axis=1))[0]
    pairs = _pairwise(lo[idx], shape[idx])
    return (int(idx[pairs[0][0]]), int(idx[pairs[0][1]])) if pairs else None


def _row_hash(a: np.ndarray) -> np.ndarray:
    """A 64-bit hash per row of an int64 matrix (FNV-style mixing): one key that sorts fast."""
    h = np.zeros(len(a), np.uint64)
    with np.errstate(over="ignore"):
        for j in range(a.shape[1]):
            h = (h ^ a[:, j].astype(np.uint64)) * np.uint64(0x100000001B3)
            h ^= h >> np.uint64(29)
    return h


def _unique_rows(a: np.ndarray) -> np.ndarray:
    """Distinct rows of an int64 matrix (sorted by a 64-bit hash of the row; much faster than
    ``np.unique(axis=0)``; rows that collide stay distinct only if they differ, so the result is exact
    up to duplicates surviving a collision, which is harmless where it is used)."""
    if len(a) == 0:
        return a
    o = np.argsort(_row_hash(a), kind="stable")
    b = a[o]
    keep = np.ones(len(b), bool)
    keep[1:] = np.any(b[1:] != b[:-1], axis=1)
    return b[keep]


def _box_minus(alo: np.ndarray, ahi: np.ndarray, blo: np.ndarray, bhi: np.ndarray
               ) -> list[tuple[np.ndarray, np.ndarray]]:
    """Box a minus box b as at most 2*ndim disjoint boxes."""
    if not np.all(np.maximum(alo, blo) < np.minimum(ahi, bhi)):
        return [(alo.copy(), ahi.copy())]
    out = []
    lo, hi = alo.copy(), ahi.copy()
    for d in range(len(alo)):
        if lo[d] < blo[d]:
            h = hi.copy()
            h[d] = blo[d]
            out.append((lo.copy(), h))
            lo[d] = blo[d]
        if hi[d] > bhi[d]:
            lo2 = lo.copy()
            lo2[d] = bhi[d]
            out.append((lo2, hi.copy()))
            hi[d] = bhi[d]
    return out


# ==================================================================================================
# Holder boxes: distinct source boxes, each with the (class, row) pairs that hold it


@dataclass
class _Holders:
    tensor: np.ndarray   # [H]
    lo: np.ndarray       # [H, W]
    shape: np.ndarray    # [H, W]
    ent_hb: np.ndarray   # [E] holder box of each entry, sorted by (hb, class)
    ent_class: np.ndarray
    ent_row: np.ndarray  # global source row index
    split: np.ndarray    # per tensor: the one dim its boxes are cut along, or -1


def _build_holders(tensor: np.ndarray, lo: np.ndarray, shape: np.ndarray, cls: np.ndarray,
                   row: np.ndarray, ntensors: int) -> _Holders:
    width = lo.shape[1]
    keep = np.all(shape > 0, axis=1)
    tensor, lo, shape, cls, row = tensor[keep], lo[keep], shape[keep], cls[keep], row[keep]
    if len(tensor) == 0:
        z = np.zeros(0, np.int64)
        return _Holders(z.astype(np.int32), np.zeros((0, width), np.int64), np.zeros((0, width), np.int64),
                        z, z.astype(np.int32), z, np.zeros(ntensors, np.int64))
    boxes = np.concatenate([tensor[:, None].astype(np.int64), lo, shape], axis=1)
    # group equal boxes: sort by a 64-bit hash (one key sorts fast), then split runs where the box
    # itself changes; a hash collision only splits a group, which the overlap check below repairs
    order0 = np.argsort(_row_hash(boxes), kind="stable")
    bs = boxes[order0]
    new = np.ones(len(bs), bool)
    new[1:] = np.any(bs[1:] != bs[:-1], axis=1)
    gid = np.cumsum(new) - 1
    inv = np.empty(len(bs), np.int64)
    inv[order0] = gid
    uniq = bs[new]
    h_t, h_lo, h_sh = uniq[:, 0].astype(np.int32), uniq[:, 1:1 + width], uniq[:, 1 + width:]
    nc = int(cls.max()) + 1
    order = np.argsort(inv * nc + cls, kind="stable")  # by (box, class), rows in input order
    e_hb, e_cls, e_row = inv[order], cls[order], row[order]
    # one entry per (box, class): a class holding the same box twice adds no choice
    first = np.ones(len(e_hb), bool)
    first[1:] = (e_hb[1:] != e_hb[:-1]) | (e_cls[1:] != e_cls[:-1])
    e_hb, e_cls, e_row = e_hb[first], e_cls[first], e_row[first]
    hold = _Holders(h_t, h_lo, h_sh, e_hb.astype(np.int64), e_cls.astype(np.int32), e_row.astype(np.int64),
                    np.zeros(ntensors, np.int64))
    # Distinct boxes of one tensor must not overlap, otherwise a destination byte would be sent twice.
    bad_t = _tensors_with_overlap(h_t, h_lo, h_sh, ntensors)
    if len(bad_t):
        hold = _disjointify(hold, [int(x) for x in bad_t])
    hold.split = _split_dims(hold.tensor, hold.lo, hold.shape, ntensors)
    return hold


def _disjointify(h: _Holders, bad_tensors: list[int]) -> _Holders:
    """Rewrite the boxes of tensors whose source boxes overlap (one source holds the full tensor, others
    shards, ...) into disjoint boxes, each held by every class that holds all of it."""
    bad = np.isin(h.tensor, bad_tensors)
    new_t: list[int] = []
    new_lo: list[np.ndarray] = []
    new_hi: list[np.ndarray] = []
    new_ent: list[list[tuple[int, int]]] = []
    ent_bounds = np.searchsorted(h.ent_hb, np.arange(len(h.tensor) + 1))
    for t in bad_tensors:
        pieces: list[tuple[np.ndarray, np.ndarray, list[tuple[int, int]]]] = []
        for b in np.nonzero(h.tensor == t)[0]:
            holders = [(int(h.ent_class[e]), int(h.ent_row[e]))
                       for e in range(ent_bounds[b], ent_bounds[b + 1])]
            rest = [(h.lo[b].copy(), h.lo[b] + h.shape[b])]
            updated = []
            for plo, phi, ph in pieces:
                ilo, ihi = np.maximum(plo, h.lo[b]), np.minimum(phi, h.lo[b] + h.shape[b])
                if np.all(ilo < ihi):
                    for mlo, mhi in _box_minus(plo, phi, ilo, ihi):
                        updated.append((mlo, mhi, ph))
                    updated.append((ilo, ihi, ph + [x for x in holders if x[0] not in {c for c, _ in ph}]))
                    nxt = []
                    for rlo, rhi in rest:
                        nxt.extend(_box_minus(rlo, rhi, ilo, ihi))
                    rest = nxt
                else:
                    updated.append((plo, phi, ph))
            pieces = updated + [(rlo, rhi, list(holders)) for rlo, rhi in rest if np.all(rlo < rhi)]
        for plo, phi, ph in pieces:
            new_t.append(t)
            new_lo.append(plo)
            new_hi.append(phi)
            new_ent.append(sorted(ph))
    keep_b = np.nonzero(~bad)[0]
    remap = np.full(len(h.tensor), -1, np.int64)
    remap[keep_b] = np.arange(len(keep_b))
    ek = remap[h.ent_hb] >= 0
    base = len(keep_b)
    width = h.lo.shape[1]
    t_all = np.concatenate([h.tensor[keep_b], np.array(new_t, np.int32)])
    lo_all = np.concatenate([h.lo[keep_b], np.array(new_lo, np.int64).reshape(-1, width)])
    sh_all = np.concatenate([h.shape[keep_b], (np.array(new_hi, np.int64) - np.array(new_lo, np.int64)
                                               ).reshape(-1, width)])
    e_hb = [remap[h.ent_hb[ek]]]
    e_c = [h.ent_class[ek]]
    e_r = [h.ent_row[ek]]
    for i, ents in enumerate(new_ent):
        e_hb.append(np.full(len(ents), base + i, np.int64))
        e_c.append(np.array([c for c, _ in ents], np.int32))
        e_r.append(np.array([r for _, r in ents], np.int64))
    return _Holders(t_all, lo_all, sh_all, np.concatenate(e_hb), np.concatenate(e_c), np.concatenate(e_r),
                    h.split)


def _join(q_tensor: np.ndarray, q_lo: np.ndarray, q_shape: np.ndarray, h: _Holders
          ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """All non-empty intersections of query boxes with holder boxes of the same tensor.

    Returns (query index, holder box index, intersection lo, intersection shape). Tensors whose holder
    boxes are cut along one dimension (FSDP shards, TP slices) are found by binary search, so a query
    meets only the boxes it overlaps, not every shard of its tensor.
    """
    nh = len(h.tensor)
    width = q_lo.shape[1]
    if nh == 0 or len(q_tensor) == 0:
        z = np.zeros(0, np.int64)
        return z, z, np.zeros((0, width), np.int64), np.zeros((0, width), np.int64)
    sd_h = np.maximum(h.split[h.tensor], 0)
    hstart = h.lo[np.arange(nh), sd_h]
    hend = hstart + h.shape[np.arange(nh), sd_h]
    order = np.lexsort((hstart, h.tensor))
    ht = h.tensor[order].astype(np.int64)
    key_start = ht * _BIG + hstart[order]
    key_end = ht * _BIG + hend[order]
    qt = q_tensor.astype(np.int64)
    sd_q = h.split[q_tensor]
    general = sd_q < 0
    k = np.maximum(sd_q, 0)
    qs = q_lo[np.arange(len(qt)), k]
    qe = qs + q_shape[np.arange(len(qt)), k]
    first = np.searchsorted(key_end, qt * _BIG + qs, side="right")
    last = np.searchsorted(key_start, qt * _BIG + qe, side="left")
    if general.any():
        t_first = np.searchsorted(ht, qt[general], side="left")
        t_last = np.searchsorted(ht, qt[general], side="right")
        first[general] = t_first
        last[general] = t_last
    count = np.maximum(last - first, 0)
    qi = np.repeat(np.arange(len(qt)), count)
    offs = np.arange(int(count.sum())) - np.repeat(np.cumsum(count) - count, count)
    hb = order[np.repeat(first, count) + offs]
    ilo = np.maximum(q_lo[qi], h.lo[hb])
    ihi = np.minimum(q_lo[qi] + q_shape[qi], h.lo[hb] + h.shape[hb])
    ok = np.all(ihi > ilo, axis=1)
    return qi[ok], hb[ok], ilo[ok], (ihi - ilo)[ok]


# ==================================================================================================
# Local-memory overlap of destination pieces


def _local_overlap(lay: Layout, boff: np.ndarray, esize: np.ndarray) -> tuple[int, int] | None:
    """First pair of regions of one layout whose local bytes overlap (same local tensor)."""
    nonempty = np.all(lay.shape > 0, axis=1)
    idx = np.nonzero(nonempty)[0]
    if len(idx) < 2:
        return None
    span = (np.sum((lay.shape[idx] - 1) * lay.strides[idx], axis=1) + 1) * esize[idx]
    start = boff[idx]
    end = start + span
    key = lay.key[idx].astype(np.int64)
    order = np.lexsort((start, key))
    s, e, k = start[order], end[order], key[order]
    run = np.maximum.accumulate(e + k * _BIG)
    cand = np.nonzero((k[1:] == k[:-1]) & (s[1:] + k[1:] * _BIG < run[:-1]))[0] + 1
    for c in cand:
        j = int(idx[order[c]])
        for b in range(c - 1, -1, -1):
            if k[b] != k[c]:
                break
            i = int(idx[order[b]])
            if e[b] > s[c] and _strided_overlap(lay, i, j, boff, esize):
                return (i, j)
    return None


def _strided_overlap(lay: Layout, i: int, j: int, boff: np.ndarray, esize: np.ndarray) -> bool:
    si, sj = lay.strides[i], lay.strides[j]
    ni, nj = lay.shape[i], lay.shape[j]
    aligned = boff[i] % esize[i] == 0 and boff[j] % esize[j] == 0
    if esize[i] == esize[j] and np.array_equal(si, sj) and aligned:
        # Same strides: both are boxes of one local index space; decompose the start offsets along
        # the strides (largest first) and compare as boxes. Exact for strides of a dense tensor.
        order = np.argsort(-si, kind="stable")
        a, b = boff[i] // esize[i], boff[j] // esize[j]
        ai, bi = np.zeros(len(si), np.int64), np.zeros(len(si), np.int64)
        for d in order:
            if si[d] > 0:
                ai[d], a = divmod(a, si[d])
                bi[d], b = divmod(b, si[d])
        if a == 0 and b == 0:
            return bool(np.all(np.maximum(ai, bi) < np.minimum(ai + ni, bi + nj)))
    if np.prod(ni) + np.prod(nj) <= 4_000_000:
        def addrs(k: int) -> np.ndarray:
            axes = [np.arange(n) * s for n, s in zip(lay.shape[k], lay.strides[k], strict=True)]
            grids = np.meshgrid(*axes, indexing="ij")
            el = np.sum(grids, axis=0).reshape(-1) * esize[k] + boff[k]
            return (el[:, None] + np.arange(esize[k])[None, :]).reshape(-1)
        return len(np.intersect1d(addrs(i), addrs(j))) > 0
    return True  # cannot prove them disjoint cheaply: refuse rather than risk a torn write


# ==================================================================================================
# The planner


def plan(sources: Sequence[Any], destinations: Sequence[Any], *,
         source_hosts: Sequence[Any] | None = None, destination_hosts: Sequence[Any] | None = None,
         source_nics: Sequence[Any] | None = None, allow_cast: bool = False,
         fp8_block: tuple[int, int] | None = None, round_bytes: int = ROUND_BYTES,
         local_round_bytes: int = LOCAL_ROUND_BYTES, coalesce: bool = True, validate: bool = True) -> Plan:
    """Plan the writes that bring every destination up to date from the sources.

    ``sources[i]`` / ``destinations[j]`` are layouts (:class:`~weightsync.layout.Layout`, or anything
    :func:`~weightsync.layout.as_layout` reads); their list index is the rank. ``source_hosts`` and
    ``destination_hosts`` give a host id per rank: a destination takes a piece from a source on its own
    host whenever one holds it (the ``cuda`` transport). ``source_nics`` gives a NIC id per source rank
    (default: one NIC per GPU); bytes are balanced per NIC, then per GPU.

    ``allow_cast`` lets a destination hold a different float dtype than the sources (cast on the
    sender). ``fp8_block=(128, 128)`` lets destinations hold FP8 weights with block scales: a
    destination tensor ``W`` in ``float8_*`` with a ``W_scale_inv`` (float32) beside it; each tile is
    quantized by one sender, rows of a tile held by another shard are gathered to it first.

    ``round_bytes`` bounds the bytes of one round of one source (finer rounds let the scheduler keep
    every destination fed by one writer at a time); ``local_round_bytes`` is the same for a source and
    destination on one host (copy engines, about 16x a NIC's bytes per second: rounds of about the same
    time, so that sources a little out of step collide on a destination as rarely over NVLink).

    Raises :class:`LayoutError` for inconsistent layouts, :class:`PlanError` when the sources do not
    cover what the destinations need.
    """
    return _Planner(sources, destinations, source_hosts, destination_hosts, source_nics, allow_cast,
                    fp8_block, round_bytes, local_round_bytes, coalesce, validate).run()


class _Planner:
    def __init__(self, sources: Sequence[Any], destinations: Sequence[Any], source_hosts: Any,
                 destination_hosts: Any, source_nics: Any, allow_cast: bool,
                 fp8_block: tuple[int, int] | None, round_bytes: int, local_round_bytes: int, coalesce: bool,
                 validate: bool) -> None:
        self.src_layouts = [as_layout(x) for x in sources]
        self.dst_layouts = [as_layout(x) for x in destinations]
        self.T = len(self.src_layouts)
        self.R = len(self.dst_layouts)
        if self.T == 0:
            raise PlanError("no sources")
        self.allow_cast = allow_cast
        self.fp8_block = fp8_block
        self.round_bytes = int(round_bytes)
        self.local_round_bytes = int(local_round_bytes)
        if self.round_bytes < 1 or self.local_round_bytes < 1:
            raise PlanError(f"round_bytes ({self.round_bytes}) and local_round_bytes "
                            f"({self.local_round_bytes}) must be at least 1")
        self.coalesce = coalesce
        self.validate = validate
        hosts = list(source_hosts) if source_hosts is not None else [("src", i) for i in range(self.T)]
        dhosts = (list(destination_hosts) if destination_hosts is not None
                  else [("dst", j) for j in range(self.R)])
        if len(hosts) != self.T or len(dhosts) != self.R:
            raise PlanError("source_hosts/destination_hosts must have one entry per rank")
        host_ids: dict[Any, int] = {}
        self.src_host = np.array([host_ids.setdefault(h, len(host_ids)) for h in hosts], np.int64)
        self.dst_host = np.array([host_ids.setdefault(h, len(host_ids)) for h in dhosts], np.int64)
        nics = list(source_nics) if source_nics is not None else list(range(self.T))
        if len(nics) != self.T:
            raise PlanError("source_nics must have one entry per source rank")
        nic_ids: dict[Any, int] = {}
        self.src_nic = np.array([nic_ids.setdefault(n, len(nic_ids)) for n in nics], np.int64)
        self.stats: dict[str, Any] = {}

    # ----------------------------------------------------------------------------------------------
    def run(self) -> Plan:
        times: dict[str, float] = {}
        t0 = time.perf_counter()

        def lap(name: str) -> None:
            nonlocal t0
            t1 = time.perf_counter()
            times[name] = round(t1 - t0, 3)
            t0 = t1

        self._classes()
        self._tensor_table()
        self._rows()
        lap("tables")
        self._check_bounds()
        self._check_destinations()
        lap("checks")
        self._holders()
        lap("holders")
        self._pieces()
        lap("pieces")
        self._choose_sources()
        lap("choose")
        ops = self._blocks()
        lap("blocks")
        if self.coalesce:
            ops = _coalesce(ops)
        lap("coalesce")
        ops["round"] = self._rounds(ops)
        lap("rounds")
        gathers = self._gathers()
        lap("gathers")
        self.stats["writes"] = len(ops)
        self.stats["dest_bytes_max"] = int(self.needed_bytes.max(initial=0))
        self.stats["seconds"] = times
        p = Plan(ops, self.T, self.R, self.keys, self.names,
                 [DTYPES[int(c)] for c in self.g_dtype], [DTYPES[int(c)] for c in self.g_dst_dtype],
                 gathers, self.needed_bytes, self.stats, self._boxes(), self.fp8_block)
        lap("index")
        if self.validate:
            p.validate()
            lap("validate")
        return p

    # ----------------------------------------------------------------------------------------------
    def _classes(self) -> None:
        self.src_classes, self.src_class_of = _classes(self.src_layouts)
        self.dst_classes, self.dst_class_of = _classes(self.dst_layouts)
        self.src_ranks_of = [np.nonzero(self.src_class_of == c)[0] for c in range(len(self.src_classes))]
        self.dst_ranks_of = [np.nonzero(self.dst_class_of == c)[0] for c in range(len(self.dst_classes))]
        self.W = max([lay.width for lay in self.src_classes + self.dst_classes] + [1])
        self.stats["source_classes"] = len(self.src_classes)
        self.stats["destination_classes"] = len(self.dst_classes)

    def _tensor_table(self) -> None:
        """Global tensor ids; shapes and dtypes agreed between all sources and every destination."""
        W = self.W
        self.names: list[str] = []
        index: dict[str, int] = {}
        cache: dict[int, np.ndarray] = {}

        def map_table(lay: Layout) -> np.ndarray:
            got = cache.get(id(lay.table))
            if got is None:
                got = np.empty(len(lay.table), np.int32)
                for i, n in enumerate(lay.table.names):
                    g = index.get(n)
                    if g is None:
                        g = index[n] = len(self.names)
                        self.names.append(n)
                    got[i] = g
                cache[id(lay.table)] = got
            return got

        self.src_tmap = [map_table(lay) for lay in self.src_classes]
        nsrc_names = len(self.names)
        src_index = dict(index)
        G = np.full((nsrc_names, W), -2, np.int64)
        nd = np.full(nsrc_names, -1, np.int64)
        dt = np.full(nsrc_names, -1, np.int64)
        seen_by = np.full(nsrc_names, -1, np.int64)
        for c, lay in enumerate(self.src_classes):
            gids = self.src_tmap[c]
            gs = _pad(lay.table.gshape, W, 1)
            for arr, val, what in ((nd, lay.table.ndim.astype(np.int64), "rank"),
                                   (dt, lay.table.dtype.astype(np.int64), "dtype")):
                cur = arr[gids]
                new = cur < 0
                arr[gids[new]] = val[new]
                bad = np.nonzero(~new & (cur != val))[0]
                if len(bad):
                    i = int(bad[0])
                    self._raise_src_mismatch(gids[i], c, int(seen_by[gids[i]]), what)
            cur = G[gids]
            unknown_cur = cur < 0
            unknown_new = gs == UNKNOWN
            bad = np.nonzero(np.any(~unknown_cur & ~unknown_new & (cur != gs), axis=1))[0]
            if len(bad):
                i = int(bad[0])
                self._raise_src_mismatch(gids[i], c, int(seen_by[gids[i]]), "global shape")
            G[gids] = np.where(unknown_cur, gs, cur)
            seen_by[gids] = np.where(seen_by[gids] < 0, c, seen_by[gids])
        unknown = np.nonzero(np.any(G < 0, axis=1))[0]
        if len(unknown):
            t = int(unknown[0])
            raise LayoutError(f"no source states the global shape of tensor {self.names[t]!r} "
                              f"(Fused parts without global_shape on every source holding it)")
        self.g_shape = G
        self.g_ndim = nd
        self.g_dtype = dt
        # Destinations: every name must be a source tensor, or the FP8 scales of one. Classes that
        # share a tensor table (all ranks built by one layout builder) are checked once.
        by_table: dict[int, list[int]] = defaultdict(list)
        for c, lay in enumerate(self.dst_classes):
            by_table[id(lay.table)].append(c)
        self.dst_tmap = [np.empty(0, np.int32)] * len(self.dst_classes)
        scale_of: dict[int, int] = {}  # scale tensor id -> weight tensor id
        unknown_names: dict[str, list[int]] = defaultdict(list)
        table_groups: list[tuple[Any, list[int], np.ndarray, np.ndarray]] = []
        for cs in by_table.values():
            tb = self.dst_classes[cs[0]].table
            ranks = np.sort(np.concatenate([self.dst_ranks_of[c] for c in cs]))
            gids = np.empty(len(tb), np.int32)
            for i, n in enumerate(tb.names):
                g = src_index.get(n)
                if g is None:
                    base = n[: -len(SCALE_SUFFIX)] if n.endswith(SCALE_SUFFIX) else None
                    if self.fp8_block is not None and base is not None and base in src_index:
                        g = index.get(n)
                        if g is None:
                            g = index[n] = len(self.names)
                            self.names.append(n)
                            scale_of[g] = src_index[base]
                    else:
                        unknown_names[n].extend(int(r) for r in ranks)
                        g = -1
                gids[i] = g
            for c in cs:
                self.dst_tmap[c] = gids
            table_groups.append((tb, cs, ranks, gids))
        if unknown_names:
            lines = []
            src_names = self.names[:nsrc_names]
            for n, ranks in list(unknown_names.items())[:5]:
                close = difflib.get_close_matches(n, src_names, n=3, cutoff=0.6)
                hint = f"; did you mean {', '.join(repr(x) for x in close)}?" if close else ""
                lines.append(f"{n!r} (destination ranks {_ranks_text(sorted(set(ranks)))}){hint}")
            more = f" and {len(unknown_names) - 5} more" if len(unknown_names) > 5 else ""
            raise LayoutError("destinations need tensors no source holds: " + "; ".join(lines) + more)
        nall = len(self.names)
        grow = nall - nsrc_names
        self.g_shape = np.concatenate([self.g_shape, np.ones((grow, W), np.int64)])
        self.g_ndim = np.concatenate([self.g_ndim, np.zeros(grow, np.int64)])
        self.g_dtype = np.concatenate([self.g_dtype, np.full(grow, DTYPE_CODE["float32"])])
        self.g_dst_dtype = np.concatenate([self.g_dtype[:nsrc_names], np.full(grow, DTYPE_CODE["float32"])])
        self.g_transform = np.concatenate([np.zeros(nsrc_names, np.int64), np.full(grow, T_SCALE)])
        dst_set = np.zeros(nall, bool)
        self.scale_of = scale_of
        is_scale_id = np.zeros(nall, bool)
        if scale_of:
            sids = np.array(list(scale_of.keys()), np.int64)
            wids = np.array(list(scale_of.values()), np.int64)
            is_scale_id[sids] = True
            bm, bn = self.fp8_block  # type: ignore[misc]
            shp = self.g_shape[wids].copy()
            shp[:, W - 2] = -(-shp[:, W - 2] // bm)
            shp[:, W - 1] = -(-shp[:, W - 1] // bn)
            self.g_shape[sids] = shp
            self.g_ndim[sids] = np.maximum(self.g_ndim[wids], 2)
        # dtype / shape agreement of destinations with the sources (vectorized per table)
        for tb, _cs, ranks, gids in table_groups:
            g = gids.astype(np.int64)
            ddt = tb.dtype.astype(np.int64)
            dnd = tb.ndim.astype(np.int64)
            dgs = _pad(tb.gshape, W, 1)
            ns = ~is_scale_id[g]
            bad = ns & ((dnd != self.g_ndim[g])
                        | np.any((dgs != UNKNOWN) & (dgs != self.g_shape[g]), axis=1))
            if bad.any():
                i = int(np.nonzero(bad)[0][0])
                gi = int(g[i])
                w = self.g_shape[gi][W - int(self.g_ndim[gi]):]
                raise LayoutError(
                    f"shape mismatch for tensor {self.names[gi]!r}: destination ranks {_ranks_text(ranks)} "
                    f"say {tuple(int(x) for x in dgs[i][W - int(dnd[i]):])}, the sources hold "
                    f"{tuple(int(x) for x in w)}")
            tr = np.zeros(len(g), np.int64)
            diff = np.nonzero(ns & (ddt != self.g_dtype[g]))[0]
            if len(diff):
                pairs = np.unique(np.stack([self.g_dtype[g[diff]], ddt[diff]], axis=1), axis=0)
                for sdt, dd in pairs:
                    m = diff[(self.g_dtype[g[diff]] == sdt) & (ddt[diff] == dd)]
                    tr[m] = self._transform_for(int(sdt), int(dd), self.names[int(g[m[0]])], ranks)
            nsi = np.nonzero(ns)[0]
            gn = g[nsi]
            clash = dst_set[gn] & ((self.g_dst_dtype[gn] != ddt[nsi]) | (self.g_transform[gn] != tr[nsi]))
            if clash.any():
                i = int(nsi[np.nonzero(clash)[0][0]])
                gi = int(g[i])
                raise LayoutError(f"destinations disagree on the dtype of tensor {self.names[gi]!r} "
                                  f"(destination ranks {_ranks_text(ranks)} want {DTYPES[int(ddt[i])]}, "
                                  f"others "
                                  f"{DTYPES[int(self.g_dst_dtype[gi])]})")
            dst_set[gn] = True
            self.g_dst_dtype[gn] = ddt[nsi]
            self.g_transform[gn] = tr[nsi]
            sc = np.nonzero(~ns)[0]
            if len(sc):
                gs = g[sc]
                bad = ((ddt[sc] != DTYPE_CODE["float32"]) | (dnd[sc] != self.g_ndim[gs])
                       | np.any((dgs[sc] != UNKNOWN) & (dgs[sc] != self.g_shape[gs]), axis=1))
                if bad.any():
                    i = int(sc[np.nonzero(bad)[0][0]])
                    gi = int(g[i])
                    raise LayoutError(
                        f"FP8 scales {self.names[gi]!r} on destination ranks {_ranks_text(ranks)} must be "
                        f"float32 of shape "
                        f"{tuple(int(x) for x in self.g_shape[gi][W - int(self.g_ndim[gi]):])}")
        for gsc, w in scale_of.items():
            if self.g_transform[w] != T_FP8:
                raise LayoutError(f"destinations need {self.names[gsc]!r}, the FP8 block scales of "
                                  f"{self.names[w]!r}, but no destination holds that tensor in FP8")
        scaled = set(scale_of.values())
        for w in np.nonzero(self.g_transform == T_FP8)[0].tolist():
            if self.g_ndim[w] < 2:
                raise LayoutError(f"tensor {self.names[w]!r} has {int(self.g_ndim[w])} dimension(s): FP8 "
                                  f"block quantization needs at least 2 (destinations want it in "
                                  f"{DTYPES[int(self.g_dst_dtype[w])]})")
            if w not in scaled:
                raise LayoutError(f"destinations hold tensor {self.names[w]!r} in "
                                  f"{DTYPES[int(self.g_dst_dtype[w])]} but none holds its block scales "
                                  f"{self.names[w] + SCALE_SUFFIX!r} (float32): FP8 values mean nothing "
                                  f"without them")

    def _transform_for(self, src_dt: int, dst_dt: int, name: str, ranks: np.ndarray) -> int:
        if src_dt == dst_dt:
            return T_NONE
        s, d = DTYPES[src_dt], DTYPES[dst_dt]
        floats = ("float", "bfloat")
        if is_float8(d) and self.fp8_block is not None and s.startswith(floats) and not is_float8(s):
            return T_FP8
        if self.allow_cast and s.startswith(floats) and d.startswith(floats) and not is_float8(d):
            return T_CAST
        raise LayoutError(f"dtype mismatch for tensor {name!r}: destination ranks {_ranks_text(ranks)} hold "
                          f"{d}, the sources {s} (pass allow_cast=True for float casts, fp8_block for FP8)")

    def _raise_src_mismatch(self, g: int, c1: int, c0: int, what: str) -> None:
        r1 = self.src_ranks_of[c1]
        r0 = self.src_ranks_of[c0] if c0 >= 0 else []
        raise LayoutError(f"sources disagree on the {what} of tensor {self.names[g]!r}: source ranks "
                          f"{_ranks_text(r0)} vs {_ranks_text(r1)}")

    # ----------------------------------------------------------------------------------------------
    def _rows(self) -> None:
        """Concatenate the rows of every class into global tables (global tensor ids, padded width)."""
        W = self.W

        def cat(classes: list[Layout], tmaps: list[np.ndarray]) -> dict[str, np.ndarray]:
            parts: dict[str, list[np.ndarray]] = defaultdict(list)
            key_base = 0
            for c, lay in enumerate(classes):
                n = len(lay)
                parts["tensor"].append(tmaps[c][lay.tensor])
                parts["lo"].append(_pad(lay.offsets, W, 0))
                parts["shape"].append(_pad(lay.shape, W, 1))
                parts["strides"].append(_pad(lay.strides, W, 0))
                parts["boff"].append(lay.byte_offset)
                parts["class"].append(np.full(n, c, np.int32))
                parts["lrow"].append(np.arange(n, dtype=np.int64))
                parts["key"].append(lay.key.astype(np.int64) + key_base)
                key_base += len(lay.keys)
            if not classes:
                return {k: np.zeros((0, W) if k in ("lo", "shape", "strides") else 0, np.int64)
                        for k in ("tensor", "lo", "shape", "strides", "boff", "class", "lrow", "key")}
            return {k: np.concatenate(v) for k, v in parts.items()}

        self.S = cat(self.src_classes, self.src_tmap)
        self.D = cat(self.dst_classes, self.dst_tmap)
        # global key table: class-local key ids are offset per class; map them to strings once
        self.keys: list[str] = []
        kidx: dict[str, int] = {}
        for side in (self.src_classes, self.dst_classes):
            ids = []
            for lay in side:
                ids.extend(kidx.setdefault(k, len(kidx)) for k in lay.keys)
            if side is self.src_classes:
                self.src_key_map = np.array(ids, np.int64)
            else:
                self.dst_key_map = np.array(ids, np.int64)
        self.keys = list(kidx)

    def _check_bounds(self) -> None:
        W = self.W
        for side, _T, classes, ranks_of, name in (
                (self.S, self.src_tmap, self.src_classes, self.src_ranks_of, "source"),
                (self.D, self.dst_tmap, self.dst_classes, self.dst_ranks_of, "destination")):
            t = side["tensor"]
            G = self.g_shape[t]
            lo, sh = side["lo"], side["shape"]
            bad = np.any((lo < 0) | (sh < 0) | (lo + sh > G), axis=1)
            if bad.any():
                i = int(np.nonzero(bad)[0][0])
                c = int(side["class"][i])
                nd = int(self.g_ndim[t[i]])
                raise LayoutError(
                    f"{name} ranks {_ranks_text(ranks_of[c])}: box offsets "
                    f"{tuple(int(x) for x in lo[i][W - nd:])} shape {tuple(int(x) for x in sh[i][W - nd:])} "
                    f"of tensor {self.names[int(t[i])]!r} leaves its global shape "
                    f"{tuple(int(x) for x in G[i][W - nd:])}")
            dtc = (self.g_dtype if name == "source" else self.g_dst_dtype)[t]
            esize = _ITEMSIZE[dtc]
            side["esize"] = esize
            nonempty = np.all(sh > 0, axis=1)
            span = (np.sum((sh - 1) * side["strides"], axis=1) + 1) * esize
            limit = np.concatenate([lay.key_nbytes for lay in classes]) if classes else np.zeros(0, np.int64)
            kl = limit[side["key"]] if len(limit) else np.zeros(0, np.int64)
            bad = nonempty & ((side["boff"] < 0) | ((kl >= 0) & (side["boff"] + span > kl))
                              | np.any(side["strides"] < 0, axis=1))
            if bad.any():
                i = int(np.nonzero(bad)[0][0])
                c = int(side["class"][i])
                raise LayoutError(
                    f"{name} ranks {_ranks_text(ranks_of[c])}: the region of tensor "
                    f"{self.names[int(t[i])]!r} spans bytes {int(side['boff'][i])}.."
                    f"{int(side['boff'][i] + span[i])}"
                    f" of local tensor {classes[c].keys[int(classes[c].key[side['lrow'][i]])]!r}, which has "
                    f"{int(kl[i])} bytes")

    def _check_destinations(self) -> None:
        """A destination may need each logical byte once, and its pieces must not share local bytes."""
        ntens = len(self.names)
        for c, lay in enumerate(self.dst_classes):
            sel = self.D["class"] == c
            t = self.D["tensor"][sel]
            pair = _first_overlap(t, self.D["lo"][sel], self.D["shape"][sel], ntens)
            if pair is not None:
                i, _ = pair
                raise LayoutError(
                    f"bytes covered twice: destination ranks {_ranks_text(self.dst_ranks_of[c])} need "
                    f"parts of "
                    f"tensor {self.names[int(t[i])]!r} twice (two of their pieces overlap in the logical "
                    f"tensor)")
            hit = _local_overlap(lay, lay.byte_offset, self.D["esize"][sel])
            if hit is not None:
                i, j = hit
                ri, rj = lay.region(i), lay.region(j)
                raise LayoutError(
                    f"overlapping destination pieces: on destination ranks "
                    f"{_ranks_text(self.dst_ranks_of[c])} "
                    f"pieces of {ri.name!r} and {rj.name!r} share bytes of local tensor {ri.key!r}")

    # ----------------------------------------------------------------------------------------------
    def _holders(self) -> None:
        S = self.S
        lo, sh = S["lo"].copy(), S["shape"].copy()
        self.fp8_tensors = np.nonzero(self.g_transform == T_FP8)[0]
        if len(self.fp8_tensors):
            # Each 128x128 tile gets one owner: the shard holding most of its rows (columns); boundaries
            # inside a tile move to the nearer tile edge. The owner gathers the rest of the tile.
            bm, bn = self.fp8_block  # type: ignore[misc]
            is8 = np.isin(S["tensor"], self.fp8_tensors)
            G = self.g_shape[S["tensor"][is8]]
            for d, b in ((self.W - 2, bm), (self.W - 1, bn)):
                a = lo[is8, d]
                e = a + sh[is8, d]
                g = G[:, d]

                t8 = S["tensor"][is8].astype(np.int64)

                def snap(x: np.ndarray, g: np.ndarray = g, b: int = b, t8: np.ndarray = t8) -> np.ndarray:
                    # nearest tile edge; a boundary in the middle of a tile goes up or down by the
                    # parity of tile and tensor, so that over many tensors no shard owns more tiles
                    k, r = np.divmod(x, b)
                    up = (r > b // 2) | ((r * 2 == b) & ((k + t8) % 2 == 0))
                    s = np.minimum((k + up) * b, g)
                    return np.where((x == 0) | (x == g), x, s)

                na, ne = snap(a), snap(e)
                lo[is8, d] = na
                sh[is8, d] = np.maximum(ne - na, 0)
        self.S["own_lo"], self.S["own_shape"] = lo, sh
        # Every source row of an FP8 tensor is a *box*: the tiles it owns (snapped edges) and where its
        # held part lives locally. FP8 and scale ops read from the owner's box, gathers name boxes.
        self.box_rows = np.nonzero(np.isin(S["tensor"], self.fp8_tensors))[0] if len(self.fp8_tensors) \
            else np.zeros(0, np.int64)
        self.box_of_row = np.full(len(S["tensor"]), -1, np.int64)
        self.box_of_row[self.box_rows] = np.arange(len(self.box_rows))
        h = _build_holders(S["tensor"], lo, sh, S["class"], np.arange(len(S["tensor"])), len(self.names))
        if self.scale_of:
            bm, bn = self.fp8_block  # type: ignore[misc]
            W = self.W
            parts_t, parts_lo, parts_sh, e_hb, e_c, e_r = [h.tensor], [h.lo], [h.shape], [h.ent_hb], \
                [h.ent_class], [h.ent_row]
            base = len(h.tensor)
            scale_for = np.full(len(self.names), -1, np.int64)
            for g, w in self.scale_of.items():
                scale_for[w] = g
            sel = np.nonzero(scale_for[h.tensor] >= 0)[0]
            slo = h.lo[sel].copy()
            shi = h.lo[sel] + h.shape[sel]
            for d, b in ((W - 2, bm), (W - 1, bn)):
                slo[:, d] = slo[:, d] // b
                shi[:, d] = -(-shi[:, d] // b)
            parts_t.append(scale_for[h.tensor[sel]].astype(np.int32))
            parts_lo.append(slo)
            parts_sh.append(shi - slo)
            remap = np.full(len(h.tensor), -1, np.int64)
            remap[sel] = base + np.arange(len(sel))
            m = remap[h.ent_hb] >= 0
            e_hb.append(remap[h.ent_hb[m]])
            e_c.append(h.ent_class[m])
            e_r.append(h.ent_row[m])
            h = _Holders(np.concatenate(parts_t), np.concatenate(parts_lo), np.concatenate(parts_sh),
                         np.concatenate(e_hb), np.concatenate(e_c), np.concatenate(e_r), h.split)
            o = np.lexsort((h.ent_class, h.ent_hb))
            h.ent_hb, h.ent_class, h.ent_row = h.ent_hb[o], h.ent_class[o], h.ent_row[o]
            h.split = _split_dims(h.tensor, h.lo, h.shape, len(self.names))
        self.H = h

    def _own_box(self, srow: np.ndarray, scale: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Owned tile box of source rows (element coordinates), or its tile grid where ``scale``."""
        S, W = self.S, self.W
        olo = S["own_lo"][srow].copy()
        ohi = olo + S["own_shape"][srow]
        if scale.any() and self.fp8_block is not None:
            for d, b in ((W - 2, self.fp8_block[0]), (W - 1, self.fp8_block[1])):
                olo[scale, d] = olo[scale, d] // b
                ohi[scale, d] = -(-ohi[scale, d] // b)
        return olo, ohi - olo

    def _boxes(self) -> np.ndarray:
        rows = self.box_rows
        S = self.S
        b = np.zeros(len(rows), box_dtype(self.W))
        b["id"] = np.arange(len(rows))
        b["tensor"] = S["tensor"][rows]
        b["key"] = self.src_key_map[S["key"][rows]]
        b["boff"] = S["boff"][rows]
        for f, col in (("lo", "lo"), ("shape", "shape"), ("strides", "strides"), ("own_lo", "own_lo"),
                       ("own_shape", "own_shape")):
            b[f] = S[col][rows]
        return b

    def _pieces(self) -> None:
        D, h = self.D, self.H
        qi, hb, ilo, ish = _join(D["tensor"], D["lo"], D["shape"], h)
        vol = np.prod(ish, axis=1).astype(np.float64)
        need = np.prod(D["shape"], axis=1).astype(np.float64)
        got = np.bincount(qi, weights=vol, minlength=len(need))
        short = np.nonzero(got < need)[0]
        if len(short):
            i = int(short[0])
            c = int(D["class"][i])
            t = int(D["tensor"][i])
            nd = int(self.g_ndim[t])
            W = self.W
            raise PlanError(
                f"uncovered bytes: destination ranks {_ranks_text(self.dst_ranks_of[c])} need "
                f"{int(need[i] - got[i])} elements of tensor {self.names[t]!r} (box offsets "
                f"{tuple(int(x) for x in D['lo'][i][W - nd:])} shape "
                f"{tuple(int(x) for x in D['shape'][i][W - nd:])})"
                f" that no source holds")
        over = np.nonzero(got > need)[0]
        if len(over):  # cannot happen with disjoint holder boxes; guard the invariant anyway
            i = int(over[0])
            raise PlanError(f"bytes covered twice: tensor {self.names[int(D['tensor'][i])]!r} on "
                            f"destination ranks "
                            f"{_ranks_text(self.dst_ranks_of[int(D['class'][i])])}")
        # expand each piece over the ranks of its destination class
        cls = D["class"][qi]
        nr = np.array([len(r) for r in self.dst_ranks_of], np.int64)[cls]
        rank_base = np.concatenate([[0], np.cumsum([len(r) for r in self.dst_ranks_of])])
        all_ranks = np.concatenate(self.dst_ranks_of) if self.dst_ranks_of else np.zeros(0, np.int64)
        p = np.repeat(np.arange(len(qi)), nr)
        within = np.arange(len(p)) - np.repeat(np.cumsum(nr) - nr, nr)
        self.P = {
            "drow": qi[p], "hb": hb[p], "lo": ilo[p], "shape": ish[p], "base": p,
            "dst": all_ranks[rank_base[cls[p]] + within].astype(np.int64),
        }
        t = D["tensor"][qi[p]]
        self.P["tensor"] = t
        self.P["nbytes"] = np.prod(ish[p], axis=1) * D["esize"][qi[p]]
        self.needed_bytes = np.bincount(self.P["dst"], weights=self.P["nbytes"],
                                        minlength=self.R).astype(np.int64)

    def _choose_sources(self) -> None:
        """One source rank per piece: same host first, then water-filling of bytes per NIC and GPU."""
        P, h = self.P, self.H
        n = len(P["hb"])
        nsc = len(self.src_classes)
        ent_bounds = np.searchsorted(h.ent_hb, np.arange(len(h.tensor) + 1))
        ecount = np.diff(ent_bounds)
        # candidate group of each holder box: its class when one class holds it, else the class set
        grp_of_hb = np.where(ecount == 1, h.ent_class[np.minimum(ent_bounds[:-1], len(h.ent_class) - 1)], -1)
        sigs: dict[tuple[int, ...], int] = {}
        group_classes: list[tuple[int, ...]] = [(c,) for c in range(nsc)]
        for b in np.nonzero(ecount > 1)[0]:
            sig = tuple(int(x) for x in h.ent_class[ent_bounds[b]:ent_bounds[b + 1]])
            g = sigs.get(sig)
            if g is None:
                g = sigs[sig] = len(group_classes)
                group_classes.append(sig)
            grp_of_hb[b] = g
        grp = grp_of_hb[P["hb"]]
        load = np.zeros(self.T, np.float64)
        nic_load = np.zeros(int(self.src_nic.max()) + 1, np.float64)
        src = np.full(n, -1, np.int64)
        # sub-groups (group, restricted host); order by size so that big shard groups go first and
        # widely replicated small tensors fill in the gaps
        dh = self.dst_host[P["dst"]]
        order_g = np.argsort(grp, kind="stable")
        bounds = _group_bounds(grp[order_g])
        work: list[tuple[float, np.ndarray, np.ndarray]] = []
        for a, b in itertools.pairwise(bounds):
            idx = order_g[a:b]
            g = int(grp[idx[0]])
            ranks = np.concatenate([self.src_ranks_of[c] for c in group_classes[g]])
            ranks.sort()
            rhosts = self.src_host[ranks]
            local = np.isin(dh[idx], rhosts)
            if local.any():
                li = idx[local]
                for hval in np.unique(dh[li]):
                    sub = li[dh[li] == hval]
                    work.append((float(P["nbytes"][sub].sum()), sub, ranks[rhosts == hval]))
            rem = idx[~local]
            if len(rem):
                work.append((float(P["nbytes"][rem].sum()), rem, ranks))
        src = np.full(n, -1, np.int64)
        drow_span = int(P["drow"].max()) + 1 if n else 1
        work.sort(key=lambda x: -x[0] / max(len(x[2]), 1))
        for _, idx, ranks in work:
            # Every destination's bytes from this group are cut into one contiguous share per rank (by
            # bytes, proportional to the rank's water-filled capacity per NIC): every source of the
            # group then writes about the same to every destination, which is what lets the rounds
            # (see _rounds) keep two writers on every destination at all times. The cut is rotated
            # per destination so that rounding does not always favour the same rank.
            dst_i = P["dst"][idx]
            o = np.argsort(dst_i * drow_span + P["drow"][idx], kind="stable")
            idx, dst_i = idx[o], dst_i[o]
            nb = P["nbytes"][idx].astype(np.float64)
            total = nb.sum()
            un, inv = np.unique(self.src_nic[ranks], return_inverse=True)
            nl = nic_load[un]
            level = _water_level(nl, total)
            cap = np.maximum(level - nl, 0.0)[inv] / np.bincount(inv, minlength=len(un))[inv]
            if cap.sum() <= 0:
                cap = np.ones(len(ranks))
            edges = np.cumsum(cap) / cap.sum()
            cum = np.cumsum(nb)
            first = np.ones(len(idx), bool)
            first[1:] = dst_i[1:] != dst_i[:-1]
            base = np.maximum.accumulate(np.where(first, cum - nb, 0.0))
            gid = np.cumsum(first) - 1
            dtot = np.bincount(gid, weights=nb)[gid]
            frac = (cum - nb / 2 - base) / np.maximum(dtot, 1e-300)
            frac = (frac + dst_i * 0.6180339887498949) % 1.0
            which = np.minimum(np.searchsorted(edges, frac, side="right"), len(ranks) - 1)
            chosen = ranks[which]
            src[idx] = chosen
            np.add.at(load, chosen, nb)
            np.add.at(nic_load, self.src_nic[chosen], nb)
        P["src"] = src
        # the holder entry (class, row) of the chosen rank's class gives the local address
        cls = self.src_class_of[src].astype(np.int64)
        ekey = h.ent_hb * nsc + h.ent_class
        pos = np.searchsorted(ekey, P["hb"] * nsc + cls)
        P["srow"] = h.ent_row[pos]
        self.stats["pieces"] = int(n)

    def _rounds(self, ops: np.ndarray) -> np.ndarray:
        """Rounds: a round is one source's visit to one destination; a source visits each destination it
        serves ``cycles`` times (about ``round_bytes`` per visit, at least once).

        Priority comes from one cyclic order shared by all sources (destination d owns the arc
        [d/R, (d+1)/R) of the cycle), each source starting at its own phase: rank n of the m ranks of
        a class of equal layouts starts n/m of the way round, and class c of C adds c/(C m). So the
        sources start on different destinations, T/R of them on each, and move on in step.

        Start times come from a list schedule in bytes-as-time on that priority: a destination takes
        up to T/R writers at a time (one where sources and destinations are as many), each at 1/(T/R)
        of its link; whenever a destination has room and a source is free, the destination takes the
        free source's unit with the earliest arc. A source delayed by a large unit does not leave its
        next destination idle: another source's unit goes first. Rounds are numbered per source in
        order of planned start, which is also stored (as a fraction of the push) in ``not_before``
        for engines that pace their rounds.
        """
        n = len(ops)
        if n == 0:
            return np.zeros(0, np.int32)
        R = max(self.R, 1)
        nb = (ops["rows"] * ops["row_bytes"]).astype(np.float64)
        pair = ops["src_rank"].astype(np.int64) * R + ops["dst_rank"]
        # dense relabelling of the (source, destination) pairs without sorting millions of ops
        seen = np.bincount(pair, minlength=self.T * R) > 0
        pu = np.nonzero(seen)[0]
        relabel = np.cumsum(seen) - 1
        pinv = relabel[pair]
        pb = np.bincount(pinv, weights=nb, minlength=len(pu))
        local = self.src_host[pu // R] == self.dst_host[pu % R]
        unit = np.where(local, max(self.local_round_bytes, 1), max(self.round_bytes, 1))
        cycles = max(1, round(float((pb / unit).mean())))
        self.stats["cycles"] = cycles
        if cycles == 1:
            unit_of_op = pinv
            u_pair = np.arange(len(pu))
            u_visit = np.zeros(len(pu), np.int64)
            u_bytes = pb
        else:
            # split each pair's ops (in their order) into `cycles` visits by bytes
            o = np.argsort(pinv, kind="stable")
            cum = np.cumsum(nb[o])
            first = np.ones(n, bool)
            first[1:] = pinv[o][1:] != pinv[o][:-1]
            base = np.maximum.accumulate(np.where(first, cum - nb[o], 0.0))
            frac = (cum - nb[o] / 2 - base) / np.maximum(pb[pinv[o]], 1e-300)
            visit = np.empty(n, np.int64)
            visit[o] = np.minimum((frac * cycles).astype(np.int64), cycles - 1)
            dense = pinv * cycles + visit
            ub = np.bincount(dense, weights=nb, minlength=len(pu) * cycles)
            used = np.nonzero(ub > 0)[0]
            remap = np.full(len(pu) * cycles, -1, np.int64)
            remap[used] = np.arange(len(used))
            unit_of_op = remap[dense]
            u_pair, u_visit, u_bytes = used // cycles, used % cycles, ub[used]
        u_src = pu[u_pair] // R
        u_dst = pu[u_pair] % R
        ncls = len(self.src_classes)
        phase = np.zeros(self.T)
        for c, ranks in enumerate(self.src_ranks_of):
            m = len(ranks)
            phase[ranks] = (np.arange(m) + c / ncls) / m
        arc = (u_dst / R - phase[u_src]) % 1.0
        arc = np.where(arc > 1.0 - 1.0 / R + 1e-12, arc - 1.0, arc)  # the arc the source starts inside
        u_begin = (arc + u_visit) / cycles
        share = max(1, round(self.T / R))  # writers per destination at a time
        u_start = _list_schedule(u_src, u_dst, u_bytes, u_begin, self.T, R, share)
        horizon = max(float(self.needed_bytes.max(initial=0)), 1.0)
        self.stats["planned_makespan"] = round(float((u_start + u_bytes * share).max()) / horizon, 4)
        # rounds: each source's units in order of planned start
        uo = np.lexsort((np.arange(len(u_src)), u_start, u_src))
        new_src = np.ones(len(uo), bool)
        new_src[1:] = u_src[uo][1:] != u_src[uo][:-1]
        k = np.arange(len(uo))
        u_round = np.empty(len(uo), np.int64)
        u_round[uo] = k - np.maximum.accumulate(np.where(new_src, k, 0))
        ops["not_before"] = (u_start / horizon).astype(np.float32)[unit_of_op]
        return u_round[unit_of_op].astype(np.int32)

    # ----------------------------------------------------------------------------------------------
    def _geometry(self, sel: np.ndarray) -> tuple[dict[str, np.ndarray], np.ndarray]:
        """Byte blocks of the pieces ``sel`` (indices into the piece arrays): merge trailing dimensions
        contiguous on both sides into a run, the next dimension(s) into rows with a pitch, and
        enumerate what is left as separate blocks. Returns the block columns (blocks of one piece
        consecutive) and the number of blocks per piece."""
        P, S, D, W = self.P, self.S, self.D, self.W
        n = len(sel)
        tensor = P["tensor"][sel]
        tr = self.g_transform[tensor]
        sr, dr = P["srow"][sel], P["drow"][sel]
        shape = P["shape"][sel]
        lo = P["lo"][sel]
        ss, ds = S["strides"][sr].copy(), D["strides"][dr]
        is_scale = tr == T_SCALE
        is_fp8 = tr == T_FP8
        s_es = _ITEMSIZE[self.g_dtype[tensor]]
        d_es = D["esize"][dr]
        # element offsets of the piece's first element
        s_el = np.sum((lo - S["lo"][sr]) * ss, axis=1)
        d_el = np.sum((lo - D["lo"][dr]) * ds, axis=1)
        # FP8 values and scales are read from what the sender produces: its owned tile box quantized
        # into a dense row-major buffer (values) and the dense grid of that box's tile scales, both in
        # destination bytes. See Plan.boxes.
        q = np.nonzero(is_fp8 | is_scale)[0]
        if len(q):
            olo, osh = self._own_box(sr[q], is_scale[q])
            dense = np.ones((len(q), W), np.int64)
            for d in range(W - 2, -1, -1):
                dense[:, d] = dense[:, d + 1] * osh[:, d + 1]
            ss[q] = dense
            s_el[q] = np.sum((lo[q] - olo) * dense, axis=1)
            s_es = s_es.copy()
            s_es[q] = d_es[q]
        run = np.ones(n, np.int64)
        active = np.ones(n, bool)
        phase = np.zeros(n, np.int8)  # 0 run, 1 rows, 2 outer
        rows = np.ones(n, np.int64)
        sp = np.zeros(n, np.int64)
        dp = np.zeros(n, np.int64)
        outer = np.zeros((n, W), bool)
        for d in range(W - 1, -1, -1):
            sd_, dd_, sh = ss[:, d], ds[:, d], shape[:, d]
            trivial = sh == 1
            in_run = (phase == 0) & (trivial | ((sd_ == run) & (dd_ == run)))
            run = np.where(in_run, run * sh, run)
            start_rows = (phase == 0) & ~in_run
            sp = np.where(start_rows, sd_, sp)
            dp = np.where(start_rows, dd_, dp)
            rows = np.where(start_rows, sh, rows)
            merge_rows = (phase == 1) & (trivial | ((sd_ == sp * rows) & (dd_ == dp * rows)))
            rows = np.where(merge_rows, rows * sh, rows)
            to_outer = ((phase == 1) & ~merge_rows) | (phase == 2)
            outer[:, d] = to_outer & ~trivial
            phase = np.where(start_rows, 1, np.where(to_outer, 2, phase)).astype(np.int8)
        del active
        # per piece first; expand into several blocks only where outer dimensions remain
        boxed = is_fp8 | is_scale
        src_key = np.where(boxed, self.box_of_row[sr], self.src_key_map[S["key"][sr]])
        dst_key = self.dst_key_map[D["key"][dr]]
        src_off = np.where(boxed, 0, S["boff"][sr]) + s_el * s_es
        dst_off = D["boff"][dr] + d_el * d_es
        single = rows == 1
        src_pitch = np.where(single, run, sp) * s_es
        dst_pitch = np.where(single, run, dp) * d_es
        row_bytes = run * d_es
        nblk = np.prod(np.where(outer, shape, 1), axis=1)
        if (nblk > 1).any():
            k = np.repeat(np.arange(n), nblk)
            rem = np.arange(len(k)) - np.repeat(np.cumsum(nblk) - nblk, nblk)
            s_add = np.zeros(len(k), np.int64)
            d_add = np.zeros(len(k), np.int64)
            for d in range(W - 1, -1, -1):
                radix = np.where(outer[k, d], shape[k, d], 1)
                i_d = rem % radix
                rem //= radix
                s_add += i_d * ss[k, d]
                d_add += i_d * ds[k, d]
            src_off = src_off[k] + s_add * s_es[k]
            dst_off = dst_off[k] + d_add * d_es[k]
            src_key, dst_key, src_pitch, dst_pitch = src_key[k], dst_key[k], src_pitch[k], dst_pitch[k]
            row_bytes, rows, single, tr, tensor = row_bytes[k], rows[k], single[k], tr[k], tensor[k]
        geo = {"src_key": src_key, "dst_key": dst_key, "tensor": tensor, "transform": tr,
               "pack": (~single).astype(np.uint8), "src_offset": src_off, "dst_offset": dst_off, "rows": rows,
               "row_bytes": row_bytes, "src_pitch": src_pitch, "dst_pitch": dst_pitch}
        return geo, nblk

    def _blocks(self) -> np.ndarray:
        """Pieces to 2-D byte blocks (see :meth:`_geometry`). The replicas of a destination class need
        the same blocks from the same holder rows, so the geometry is computed once per class-level
        piece and holder row and then handed to every (source, destination) pair that uses it."""
        P = self.P
        base = P["base"]
        n = len(base)
        nbase = int(base.max()) + 1 if n else 0
        first = np.searchsorted(base, np.arange(nbase))
        srow0 = P["srow"][first]
        odd = np.nonzero(P["srow"] != srow0[base])[0]  # replicas served by another class's layout
        g_of_op = base.copy()
        g_of_op[odd] = nbase + np.arange(len(odd))
        geo, nblk = self._geometry(np.concatenate([first, odd]))
        if (nblk > 1).any():
            gstart = np.cumsum(nblk) - nblk
            cnt = nblk[g_of_op]
            k = np.repeat(np.arange(n), cnt)
            bidx = gstart[g_of_op][k] + (np.arange(len(k)) - np.repeat(np.cumsum(cnt) - cnt, cnt))
        else:
            k = None
            bidx = g_of_op
        ops = np.empty(len(bidx), OP_DTYPE)
        ops["src_rank"] = P["src"] if k is None else P["src"][k]
        ops["dst_rank"] = P["dst"] if k is None else P["dst"][k]
        ops["round"] = 0
        for name in ("src_key", "dst_key", "tensor", "transform", "pack", "src_offset", "dst_offset", "rows",
                     "row_bytes", "src_pitch", "dst_pitch"):
            ops[name] = geo[name][bidx]
        self.stats["blocks"] = len(ops)
        return ops

    # ----------------------------------------------------------------------------------------------
    def _gathers(self) -> np.ndarray:
        """FP8: rows of a tile that its owner does not hold are gathered to it, from a holder on its host
        when there is one. Per (sender, box) the gathered part is the bounding box of the whole tiles
        its FP8 and scale writes touch, less what the sender holds: every row once, however many
        destinations need the tile. Each gather lands dense (row-major, source dtype) at ``offset`` of
        the gatherer's receive buffer; the provider reads it from its box ``pbox``."""
        W = self.W
        gd = gather_dtype(W)
        if not len(self.fp8_tensors):
            return np.zeros(0, gd)
        P, S = self.P, self.S
        tr = self.g_transform[P["tensor"]]
        sel = np.nonzero((tr == T_FP8) | (tr == T_SCALE))[0]
        if len(sel) == 0:
            return np.zeros(0, gd)
        bm, bn = self.fp8_block  # type: ignore[misc]
        srow, src = P["srow"][sel], P["src"][sel]
        is_sc = tr[sel] == T_SCALE
        plo = P["lo"][sel].copy()
        phi = plo + P["shape"][sel]
        G = self.g_shape[S["tensor"][srow]]  # the weight's shape (a scale piece's row is the weight's)
        for d, b in ((W - 2, bm), (W - 1, bn)):
            lo_d = np.where(is_sc, plo[:, d] * b, plo[:, d])
            hi_d = np.where(is_sc, phi[:, d] * b, phi[:, d])
            plo[:, d] = lo_d // b * b
            phi[:, d] = np.minimum(-(-hi_d // b) * b, G[:, d])
        nbox = max(len(self.box_rows), 1)
        key = src.astype(np.int64) * nbox + self.box_of_row[srow]
        uk, inv = np.unique(key, return_inverse=True)
        blo = np.full((len(uk), W), np.iinfo(np.int64).max, np.int64)
        bhi = np.full((len(uk), W), -1, np.int64)
        np.minimum.at(blo, inv, plo)
        np.maximum.at(bhi, inv, phi)
        src_u, box_u = uk // nbox, uk % nbox
        row_u = self.box_rows[box_u]
        olo = S["lo"][row_u]
        ohi = olo + S["shape"][row_u]
        # bounding box minus the held box, dimension by dimension (at most 2W slabs each)
        m_i, m_lo, m_hi = [], [], []
        cur_lo, cur_hi = blo.copy(), bhi.copy()
        for d in range(W):
            below = cur_lo[:, d] < np.minimum(olo[:, d], cur_hi[:, d])
            lo_b, hi_b = cur_lo.copy(), cur_hi.copy()
            hi_b[:, d] = np.minimum(olo[:, d], cur_hi[:, d])
            m_i.append(np.nonzero(below)[0])
            m_lo.append(lo_b[below])
            m_hi.append(hi_b[below])
            above = cur_hi[:, d] > np.maximum(ohi[:, d], cur_lo[:, d])
            lo_a, hi_a = cur_lo.copy(), cur_hi.copy()
            lo_a[:, d] = np.maximum(ohi[:, d], cur_lo[:, d])
            m_i.append(np.nonzero(above)[0])
            m_lo.append(lo_a[above])
            m_hi.append(hi_a[above])
            cur_lo[:, d] = np.clip(cur_lo[:, d], olo[:, d], ohi[:, d])
            cur_hi[:, d] = np.clip(cur_hi[:, d], olo[:, d], ohi[:, d])
        mi = np.concatenate(m_i)
        if len(mi) == 0:
            self.stats["gather_bytes"] = 0
            return np.zeros(0, gd)
        mlo = np.concatenate(m_lo)
        msh = np.concatenate(m_hi) - mlo
        t = S["tensor"][row_u]
        # who holds those rows (original, unsnapped boxes)
        rows8 = self.box_rows
        ho = _build_holders(S["tensor"][rows8], S["lo"][rows8], S["shape"][rows8], S["class"][rows8], rows8,
                            len(self.names))
        qi, hb, ilo, ish = _join(t[mi].astype(np.int32), mlo, msh, ho)
        got = np.bincount(qi, weights=np.prod(ish, axis=1).astype(np.float64), minlength=len(mi))
        short = np.nonzero(got < np.prod(msh, axis=1))[0]
        if len(short):
            raise PlanError(f"FP8 tiles of tensor {self.names[int(t[mi[short[0]]])]!r}: rows the owner "
                            f"(source rank {int(src_u[mi[short[0]]])}) lacks are held by no source")
        gatherer = src_u[mi][qi]
        ghost = self.src_host[gatherer]
        # provider: a rank of a holding class on the gatherer's host, else the class's first rank
        ent_bounds = np.searchsorted(ho.ent_hb, np.arange(len(ho.tensor) + 1))
        nhosts = int(max(self.src_host.max(), self.dst_host.max(initial=0))) + 1
        rank_at = np.full((len(self.src_classes), nhosts), -1, np.int64)
        for c, ranks in enumerate(self.src_ranks_of):
            rank_at[c, self.src_host[ranks[::-1]]] = ranks[::-1]
        cnt = ent_bounds[hb + 1] - ent_bounds[hb]
        rep = np.repeat(np.arange(len(qi)), cnt)
        e = np.repeat(ent_bounds[hb], cnt) + (np.arange(len(rep)) - np.repeat(np.cumsum(cnt) - cnt, cnt))
        cand = rank_at[ho.ent_class[e], ghost[rep]]
        o = np.lexsort((cand < 0, rep))
        firsts = o[np.searchsorted(rep[o], np.arange(len(qi)))]
        first_rank = np.array([int(r[0]) for r in self.src_ranks_of], np.int64)
        provider = np.where(cand[firsts] >= 0, cand[firsts], first_rank[ho.ent_class[e[firsts]]])
        g = np.zeros(len(qi), gd)
        g["provider"] = provider
        g["gatherer"] = gatherer
        g["tensor"] = t[mi][qi]
        g["nbytes"] = np.prod(ish, axis=1) * _ITEMSIZE[self.g_dtype[t[mi][qi]]]
        g["box"] = box_u[mi][qi]
        g["pbox"] = self.box_of_row[ho.ent_row[e[firsts]]]
        g["lo"] = ilo
        g["shape"] = ish
        # receive buffer offsets: per gatherer, in (box, position) order, each gather 16-byte aligned
        order = np.lexsort((*(ilo[:, d] for d in range(W - 1, -1, -1)), g["box"], g["gatherer"]))
        g = g[order]
        size = (g["nbytes"] + 15) // 16 * 16
        first = np.ones(len(g), bool)
        first[1:] = g["gatherer"][1:] != g["gatherer"][:-1]
        cum = np.cumsum(size) - size
        g["offset"] = cum - np.maximum.accumulate(np.where(first, cum, 0))
        self.stats["gather_bytes"] = int(g["nbytes"].sum())
        return g


def _list_schedule(u_src: np.ndarray, u_dst: np.ndarray, u_bytes: np.ndarray, prio: np.ndarray,
                   T: int, R: int, k: int = 1) -> np.ndarray:
    """Start times of units (bytes as time, every link of speed 1, a destination shared by up to ``k``
    writers at 1/k each): a destination with a free place takes, among its pending units whose source
    is free, the one of lowest ``prio``; a freed source offers its pending units, lowest ``prio``
    first, to destinations with a free place."""
    nu = len(u_src)
    order = np.lexsort((np.arange(nu), prio))
    by_dst: list[list[int]] = [[] for _ in range(R)]
    by_src: list[list[int]] = [[] for _ in range(T)]
    for u in order.tolist():
        by_dst[int(u_dst[u])].append(u)
        by_src[int(u_src[u])].append(u)
    done = np.zeros(nu, bool)
    d_busy = np.zeros(R, bool)
    d_active = np.zeros(R, np.int64)
    s_busy = np.zeros(T, bool)
    d_ptr = [0] * R
    s_ptr = [0] * T
    start = np.zeros(nu)
    heap: list[tuple[float, int]] = []
    us, ud, ub = u_src.tolist(), u_dst.tolist(), u_bytes.tolist()

    def launch(u: int, now: float) -> None:
        done[u] = True
        d_active[ud[u]] += 1
        d_busy[ud[u]] = d_active[ud[u]] >= k
        s_busy[us[u]] = True
        start[u] = now
        heapq.heappush(heap, (now + ub[u] * k, u))

    def try_next(lst: list[int], ptr: list[int], i: int, now: float, other_busy: Any, other: Any) -> None:
        # Launch the first unit of queue i (a destination's or a source's) whose other end is free.
        while ptr[i] < len(lst) and done[lst[ptr[i]]]:
            ptr[i] += 1
        for k in range(ptr[i], min(len(lst), ptr[i] + 64)):
            u = lst[k]
            if not done[u] and not other_busy[other[u]]:
                launch(u, now)
                return

    for u in order.tolist():
        if not d_busy[ud[u]] and not s_busy[us[u]]:
            launch(u, 0.0)
    while heap:
        now, u = heapq.heappop(heap)
        d, s = ud[u], us[u]
        d_active[d] -= 1
        d_busy[d] = False
        s_busy[s] = False
        try_next(by_dst[d], d_ptr, d, now, s_busy, us)
        if not s_busy[s]:
            try_next(by_src[s], s_ptr, s, now, d_busy, ud)
    if not done.all():  # units never reachable within the scan window: run them after the rest
        t = float((start + u_bytes).max(initial=0.0))
        for u in np.nonzero(~done)[0]:
            start[u] = t
            t += ub[u]
    return start


def _water_level(loads: np.ndarray, total: float) -> float:
    """Level L with sum(max(0, L - loads)) == total."""
    s = np.sort(loads)
    csum = np.cumsum(s)
    m = np.arange(1, len(s) + 1)
    lv = (total + csum) / m  # level if the lowest m bins are filled
    nxt = np.append(s[1:], np.inf)
    ok = np.nonzero(lv <= nxt)[0]
    return float(lv[ok[0]]) if len(ok) else float(lv[-1])


# ==================================================================================================
# Coalescing and rounds


def _coalesce(ops: np.ndarray) -> np.ndarray:
    """Merge writes that continue each other on both sides (same source, destination, local tensors)."""
    if len(ops) < 2:
        return ops
    # group by (source, destination, local tensors, transform), then by destination offset: merges
    # happen where both sides advance together. One composite int64 key keeps the sort cheap.
    nk = int(max(ops["src_key"].max(), ops["dst_key"].max())) + 2
    nr = int(ops["dst_rank"].max()) + 1
    if int(ops["src_rank"].max() + 1) * nr * nk * nk * 4 >= 2**62:
        raise PlanError("too many ranks and local tensors to coalesce with one sort key")
    k = ((ops["src_rank"].astype(np.int64) * nr + ops["dst_rank"]) * nk + ops["src_key"] + 1) * nk
    k = (k + ops["dst_key"]) * 4 + ops["transform"]
    o2 = np.argsort(k, kind="stable")
    ks, offs = k[o2], ops["dst_offset"][o2]
    if np.any((ks[1:] == ks[:-1]) & (offs[1:] < offs[:-1])):  # pieces came out of offset order
        o2 = np.lexsort((ops["dst_offset"], k))
        ks = k[o2]
    # only neighbours with equal keys can merge; test the byte arithmetic on those alone, and leave
    # the ops where they are (no copy of millions of records) when nothing merges
    cand = np.nonzero((ks[1:] == ks[:-1]) & (ops["src_key"][o2[:-1]] >= 0))[0]
    if len(cand) == 0:
        return ops
    a, b = ops[o2[cand]], ops[o2[cand + 1]]
    same = (a["transform"] == T_NONE) | (a["tensor"] == b["tensor"])
    contiguous = (same & (a["rows"] == 1) & (b["rows"] == 1)
                  & (a["transform"] == T_NONE)
                  & (b["src_offset"] == a["src_offset"] + a["row_bytes"])
                  & (b["dst_offset"] == a["dst_offset"] + a["row_bytes"]))
    stacked = (same & (a["rows"] > 1) & (b["rows"] > 1) & (a["row_bytes"] == b["row_bytes"])
               & (a["src_pitch"] == b["src_pitch"]) & (a["dst_pitch"] == b["dst_pitch"])
               & (b["src_offset"] == a["src_offset"] + a["rows"] * a["src_pitch"])
               & (b["dst_offset"] == a["dst_offset"] + a["rows"] * a["dst_pitch"]))
    kind = np.zeros(len(ops) - 1, np.int64)
    kind[cand] = np.where(contiguous, 1, np.where(stacked, 2, 0))
    if not kind.any():
        return ops
    ops = ops[o2]
    # a chain must be all-contiguous or all-stacked: break where the kind changes
    prev_kind = np.concatenate([[0], kind[:-1]])
    join = (kind > 0) & ((prev_kind == 0) | (prev_kind == kind))
    start = np.concatenate([[True], ~join])
    seg = np.cumsum(start) - 1
    heads = np.nonzero(start)[0]
    out = ops[heads].copy()
    rb = np.bincount(seg, weights=ops["row_bytes"]).astype(np.int64)
    rows = np.bincount(seg, weights=ops["rows"]).astype(np.int64)
    nxt_kind = np.concatenate([kind, [0]])
    seg_kind = nxt_kind[heads]
    merged = np.bincount(seg, minlength=len(heads)) > 1
    c = merged & (seg_kind == 1)
    out["row_bytes"] = np.where(c, rb, out["row_bytes"])
    out["src_pitch"] = np.where(c, out["row_bytes"], out["src_pitch"])
    out["dst_pitch"] = np.where(c, out["row_bytes"], out["dst_pitch"])
    s = merged & (seg_kind == 2)
    out["rows"] = np.where(s, rows, out["rows"])
    return out
