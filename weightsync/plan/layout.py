"""Regions and layouts: what a participant holds (a source) or needs (a destination).

A *region* is a box of a logical tensor ``(name, global_shape, dtype, offsets, shape)`` together with
where it lives locally: the key of a local tensor, a byte offset into it and the element strides of the
box's dimensions inside it. Every way of holding weights (plain tensors, ``Sharded`` boxes, ``Fused``
concatenations, DTensor shards on any mesh, vLLM's tensor-parallel layouts built in ``models.py``)
reduces to regions.

A participant's regions are stored as a :class:`Layout`, a columnar table (numpy arrays), because the
planner handles millions of regions at cluster scale and one Python object per region would not fit
the time and memory budget. :class:`Box` is the row view, for humans and tests.

Nothing here needs torch: tensors are only inspected through duck typing, DTensor support imports
torch lazily.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import msgpack
import numpy as np

from weightsync.errors import LayoutError

# Element sizes of the dtypes weightsync understands, by canonical name (torch's spelling).
DTYPE_SIZES: dict[str, int] = {
    "float64": 8,
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "float8_e4m3fn": 1,
    "float8_e4m3fnuz": 1,
    "float8_e5m2": 1,
    "float8_e5m2fnuz": 1,
    "float8_e8m0fnu": 1,
    "int64": 8,
    "int32": 4,
    "int16": 2,
    "int8": 1,
    "uint64": 8,
    "uint32": 4,
    "uint16": 2,
    "uint8": 1,
    "bool": 1,
    "complex64": 8,
    "complex128": 16,
}
DTYPES: list[str] = sorted(DTYPE_SIZES)
DTYPE_CODE: dict[str, int] = {d: i for i, d in enumerate(DTYPES)}
_ITEMSIZE_BY_CODE = np.array([DTYPE_SIZES[d] for d in DTYPES], dtype=np.int64)

UNKNOWN = -1  # a global extent a destination did not state; the sources' shape fills it in


def dtype_name(dtype: Any) -> str:
    """Canonical dtype name of a numpy dtype, a torch dtype or a string (``'bf16'`` style aliases too)."""
    s = str(dtype)
    s = s.removeprefix("torch.")
    aliases = {"bf16": "bfloat16", "fp32": "float32", "fp16": "float16", "half": "float16",
               "float": "float32", "double": "float64", "fp8": "float8_e4m3fn", "long": "int64",
               "int": "int32", "float8_e4m3": "float8_e4m3fn"}
    s = aliases.get(s, s)
    if s not in DTYPE_SIZES:
        raise LayoutError(f"unsupported dtype {dtype!r}; known: {', '.join(DTYPES)}")
    return s


def itemsize(dtype: str) -> int:
    return DTYPE_SIZES[dtype_name(dtype)]


def is_float8(dtype: str) -> bool:
    return dtype.startswith("float8")


# --------------------------------------------------------------------------------------------------
# Row view


@dataclass(frozen=True)
class Box:
    """One box of a logical tensor and where it lives in a local tensor.

    ``strides`` are element strides of the box's dimensions inside the local tensor, ``byte_offset``
    is where the box's first element sits, counted from the local tensor's first byte.
    """

    name: str
    global_shape: tuple[int, ...]
    dtype: str
    offsets: tuple[int, ...]
    shape: tuple[int, ...]
    key: str
    byte_offset: int
    strides: tuple[int, ...]

    @property
    def numel(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))

    @property
    def nbytes(self) -> int:
        return self.numel * itemsize(self.dtype)


# --------------------------------------------------------------------------------------------------
# Columnar layout


class TensorTable:
    """Logical tensors a layout talks about: names, global shapes (padded to ``ndim_max`` on the
    left with 1), true ranks and dtype codes. Layouts of many ranks may share one table."""

    __slots__ = ("_index", "dtype", "gshape", "names", "ndim")

    def __init__(self, names: list[str], gshape: np.ndarray, ndim: np.ndarray, dtype: np.ndarray) -> None:
        self.names = names
        self.gshape = np.ascontiguousarray(gshape, dtype=np.int64)
        self.ndim = np.ascontiguousarray(ndim, dtype=np.int8)
        self.dtype = np.ascontiguousarray(dtype, dtype=np.int16)
        self._index: dict[str, int] | None = None

    def index(self) -> dict[str, int]:
        if self._index is None:
            self._index = {n: i for i, n in enumerate(self.names)}
        return self._index

    def __len__(self) -> int:
        return len(self.names)


class Layout:
    """All boxes of one participant, as columns.

    Columns (one entry per box): ``tensor`` (index into ``table``), ``offsets``/``shape``/``strides``
    (``[n, D]``, left-padded to the table's width with 0/1/0), ``key`` (index into ``keys``) and
    ``byte_offset``. ``key_nbytes[k]`` is the byte span of local tensor ``keys[k]`` (-1 unknown).

    Layouts are immutable by convention: the planner groups ranks whose layouts are equal (the same
    object, or the same fingerprint) and plans each distinct layout once, which is what makes
    replicated sources (HSDP) and inference replicas cheap.
    """

    __slots__ = (
        "_fp",
        "byte_offset",
        "key",
        "key_nbytes",
        "keys",
        "offsets",
        "shape",
        "strides",
        "table",
        "tensor",
    )

    def __init__(self, table: TensorTable, tensor: np.ndarray, offsets: np.ndarray, shape: np.ndarray,
                 strides: np.ndarray, key: np.ndarray, byte_offset: np.ndarray, keys: list[str],
                 key_nbytes: np.ndarray | None = None) -> None:
        d = table.gshape.shape[1] if table.gshape.ndim == 2 else 1
        n = len(tensor)
        self.table = table
        self.tensor = np.ascontiguousarray(tensor, dtype=np.int32)
        self.offsets = np.ascontiguousarray(np.asarray(offsets, dtype=np.int64).reshape(n, d))
        self.shape = np.ascontiguousarray(np.asarray(shape, dtype=np.int64).reshape(n, d))
        self.strides = np.ascontiguousarray(np.asarray(strides, dtype=np.int64).reshape(n, d))
        self.key = np.ascontiguousarray(key, dtype=np.int32)
        self.byte_offset = np.ascontiguousarray(byte_offset, dtype=np.int64)
        self.keys = keys
        self.key_nbytes = (np.full(len(keys), -1, dtype=np.int64) if key_nbytes is None
                           else np.ascontiguousarray(key_nbytes, dtype=np.int64))
        self._fp: str | None = None

    # -- basic views ------------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self.tensor)

    @property
    def width(self) -> int:
        return int(self.offsets.shape[1])

    def box(self, i: int) -> Box:
        t = int(self.tensor[i])
        nd = int(self.table.ndim[t])
        w = self.width
        return Box(
            name=self.table.names[t],
            global_shape=tuple(int(x) for x in self.table.gshape[t, w - nd:]),
            dtype=DTYPES[int(self.table.dtype[t])],
            offsets=tuple(int(x) for x in self.offsets[i, w - nd:]),
            shape=tuple(int(x) for x in self.shape[i, w - nd:]),
            key=self.keys[int(self.key[i])],
            byte_offset=int(self.byte_offset[i]),
            strides=tuple(int(x) for x in self.strides[i, w - nd:]),
        )

    def boxes(self) -> list[Box]:
        return [self.box(i) for i in range(len(self))]

    def nbytes(self) -> int:
        size = _ITEMSIZE_BY_CODE[self.table.dtype[self.tensor]]
        return int((np.prod(self.shape, axis=1) * size).sum())

    def fingerprint(self) -> str:
        """Content hash: equal layouts (replicas, HSDP nodes) plan once."""
        if self._fp is None:
            h = hashlib.blake2b(digest_size=16)
            h.update("\x00".join(self.table.names).encode())
            for a in (self.table.gshape, self.table.ndim, self.table.dtype, self.tensor, self.offsets,
                      self.shape, self.strides, self.key, self.byte_offset, self.key_nbytes):
                h.update(a.tobytes())
                h.update(b"|")
            h.update("\x00".join(self.keys).encode())
            self._fp = h.hexdigest()
        return self._fp

    # -- construction ------------------------------------------------------------------------------
    @staticmethod
    def from_boxes(boxes: Iterable[Box], key_nbytes: Mapping[str, int] | None = None) -> Layout:
        boxes = list(boxes)
        width = max([len(r.shape) for r in boxes] + [1])
        names: list[str] = []
        tindex: dict[str, int] = {}
        gsh: list[list[int]] = []
        nds: list[int] = []
        dts: list[int] = []
        keys: list[str] = []
        kindex: dict[str, int] = {}
        n = len(boxes)
        tensor = np.zeros(n, np.int32)
        offs = np.zeros((n, width), np.int64)
        shp = np.ones((n, width), np.int64)
        strd = np.zeros((n, width), np.int64)
        key = np.zeros(n, np.int32)
        boff = np.zeros(n, np.int64)
        for i, r in enumerate(boxes):
            nd = len(r.shape)
            if not (len(r.offsets) == len(r.global_shape) == len(r.strides) == nd):
                raise LayoutError(f"box of {r.name!r}: offsets {r.offsets}, shape {r.shape}, "
                                  f"global_shape {r.global_shape} and strides {r.strides} differ in rank")
            dt = DTYPE_CODE[dtype_name(r.dtype)]
            t = tindex.get(r.name)
            if t is None:
                t = tindex[r.name] = len(names)
                names.append(r.name)
                gsh.append([1] * (width - nd) + list(r.global_shape))
                nds.append(nd)
                dts.append(dt)
            else:
                known = gsh[t][width - nd:]
                same = nds[t] == nd and dts[t] == dt and all(
                    a == b or UNKNOWN in (a, b) for a, b in zip(known, r.global_shape, strict=True))
                if same:
                    # A Fused part may leave the global shape open; a later region may state it.
                    gsh[t][width - nd:] = [b if a == UNKNOWN else a
                                           for a, b in zip(known, r.global_shape, strict=True)]
                else:
                    raise LayoutError(
                        f"tensor {r.name!r} is described twice with different global shape or dtype: "
                        f"{tuple(gsh[t][width - nds[t]:])} {DTYPES[dts[t]]} vs {r.global_shape} {r.dtype}")
            k = kindex.get(r.key)
            if k is None:
                k = kindex[r.key] = len(keys)
                keys.append(r.key)
            tensor[i] = t
            offs[i, width - nd:] = r.offsets
            shp[i, width - nd:] = r.shape
            strd[i, width - nd:] = r.strides
            key[i] = k
            boff[i] = r.byte_offset
        table = TensorTable(names, np.array(gsh, np.int64).reshape(len(names), width),
                            np.array(nds, np.int8), np.array(dts, np.int16))
        kn = None
        if key_nbytes is not None:
            kn = np.array([int(key_nbytes.get(k, -1)) for k in keys], np.int64)
        return Layout(table, tensor, offs, shp, strd, key, boff, keys, kn)

    # -- wire format ------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        t = self.table
        return {
            "v": 1, "width": self.width, "names": t.names, "gshape": t.gshape.tobytes(),
            "ndim": t.ndim.tobytes(), "dtype": [DTYPES[int(c)] for c in t.dtype],
            "tensor": self.tensor.tobytes(), "offsets": self.offsets.tobytes(),
            "shape": self.shape.tobytes(), "strides": self.strides.tobytes(), "key": self.key.tobytes(),
            "byte_offset": self.byte_offset.tobytes(), "keys": self.keys,
            "key_nbytes": self.key_nbytes.tobytes(),
        }

    @staticmethod
    def from_dict(d: Mapping[str, Any]) -> Layout:
        w = int(d["width"])
        nt = len(d["names"])
        table = TensorTable(list(d["names"]), np.frombuffer(d["gshape"], np.int64).reshape(nt, w).copy(),
                            np.frombuffer(d["ndim"], np.int8).copy(),
                            np.array([DTYPE_CODE[dtype_name(x)] for x in d["dtype"]], np.int16))
        return Layout(table, np.frombuffer(d["tensor"], np.int32).copy(),
                      np.frombuffer(d["offsets"], np.int64).copy(),
                      np.frombuffer(d["shape"], np.int64).copy(),
                      np.frombuffer(d["strides"], np.int64).copy(), np.frombuffer(d["key"], np.int32).copy(),
                      np.frombuffer(d["byte_offset"], np.int64).copy(), list(d["keys"]),
                      np.frombuffer(d["key_nbytes"], np.int64).copy())

    def to_msgpack(self) -> bytes:
        return msgpack.packb(self.to_dict(), use_bin_type=True)

    @staticmethod
    def from_msgpack(data: bytes) -> Layout:
        return Layout.from_dict(msgpack.unpackb(data, raw=False))

    def __repr__(self) -> str:
        return f"Layout({len(self)} boxes, {len(self.table)} tensors, {len(self.keys)} local tensors)"


# --------------------------------------------------------------------------------------------------
# DTensor placement arithmetic


def dtensor_box(global_shape: Sequence[int], mesh_shape: Sequence[int], coordinate: Sequence[int],
                placements: Sequence[Any]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(offsets, shape) of the shard a mesh coordinate holds, placed as torch places DTensor shards.

    ``placements`` may be torch placements or ``("shard", dim)`` / ``("replicate",)`` tuples. Shards
    are applied left to right over mesh dimensions; each uses ``torch.chunk`` sizes (ceil division,
    trailing shards short or empty), which is what DTensor does for uneven shapes.
    """
    offs = [0] * len(global_shape)
    shape = [int(x) for x in global_shape]
    for mdim, p in enumerate(placements):
        kind, dim = _placement_kind(p)
        if kind == "replicate":
            continue
        if kind != "shard":
            raise LayoutError(f"placement {p!r} is not supported (only Shard and Replicate are): a "
                              f"Partial tensor holds no bytes of the logical tensor yet")
        d = dim % len(global_shape)
        n = int(mesh_shape[mdim])
        c = int(coordinate[mdim])
        size = shape[d]
        chunk = -(-size // n) if n else 0
        start = min(c * chunk, size)
        end = min(start + chunk, size)
        offs[d] += start
        shape[d] = end - start
    return tuple(offs), tuple(shape)


def _placement_kind(p: Any) -> tuple[str, int]:
    if isinstance(p, tuple):
        return (str(p[0]), int(p[1]) if len(p) > 1 else -1)
    name = type(p).__name__
    if name == "Shard":
        return ("shard", int(p.dim))
    if name == "Replicate":
        return ("replicate", -1)
    return (name, -1)


def as_layout(x: Any) -> Layout:
    """Accept a Layout, its msgpack bytes or dict, or a list of Boxes. Tensors are described by the
    runtime (``weightsync.describe_tensors``): the planner sees plain numbers only."""
    if isinstance(x, Layout):
        return x
    if isinstance(x, (bytes, bytearray, memoryview)):
        return Layout.from_msgpack(bytes(x))
    if isinstance(x, Mapping):
        if "width" in x and "names" in x and "tensor" in x:
            return Layout.from_dict(x)
        raise LayoutError("the planner takes layouts, not tensors: describe them first with "
                          "weightsync.describe_tensors")
    if isinstance(x, (list, tuple)) and all(isinstance(r, Box) for r in x):
        return Layout.from_boxes(x)
    raise LayoutError(f"cannot read a layout from {type(x).__name__}")
