"""What the planner emits: the ops table (one row per write), the ``Plan`` holding it, and the
constants every room agrees on (transforms, round sizes).

``plan(sources, destinations)`` (weightsync.plan.planner) intersects every needed box with the held
ones, picks one source per piece (balancing bytes per source GPU and per NIC, preferring sources on
the destination's host), turns every piece into 2-D byte blocks inside the local tensors, coalesces
adjacent writes, orders each source's writes in rounds so that every destination has as few
simultaneous writers as possible, and validates the result before any byte moves.

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
    need it by default (see weightsync/sim/simulate.py: a sender keeping a few rounds in flight absorbs
    timing noise better than pacing).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import msgpack
import numpy as np

from weightsync.errors import PlanError
from weightsync.plan.layout import DTYPE_SIZES, DTYPES
from weightsync.wire import imm_counts

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
        ``TransferEngine.imm_count``) is used when given; otherwise the engine's own rule for an engine
        with these NICs, threshold and largest piece (weightsync.wire.imm_counts)."""
        b = (self.ops["rows"] * self.ops["row_bytes"]).astype(np.int64)
        if imm_count is not None:
            sizes, counts = np.unique(b, return_counts=True)
            return int(sum(int(imm_count(int(n))) * int(c) for n, c in zip(sizes, counts, strict=True)))
        return int(imm_counts(b, np.ones(len(b), np.int64), nics, stripe_threshold, max_piece).sum())


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
