"""Regions and layouts: what a participant holds (a source) or needs (a destination).

A *region* is a box of a logical tensor ``(name, global_shape, dtype, offsets, shape)`` together with
where it lives locally: the key of a local tensor, a byte offset into it and the element strides of the
box's dimensions inside it. Every way of holding weights (plain tensors, ``Sharded`` boxes, ``Fused``
concatenations, DTensor shards on any mesh, vLLM's tensor-parallel layouts built in ``models.py``)
reduces to regions.

A participant's regions are stored as a :class:`Layout`, a columnar table (numpy arrays), because the
planner handles millions of regions at cluster scale and one Python object per region would not fit
the time and memory budget. :class:`Region` is the row view, for humans and tests.

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

from .errors import LayoutError

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
class Region:
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
# Layout helpers of the public contract


def _shape_of(t: Any) -> tuple[int, ...]:
    return tuple(int(x) for x in t.shape)


class Sharded:
    """A box of a logical tensor held in ``local_tensor``: ``global[offsets : offsets + local.shape]``.

    The logical tensor's name is the key under which the ``Sharded`` is passed to
    :func:`describe_tensors` (or ``ws.Source``/``ws.Destination``).
    """

    def __init__(self, local_tensor: Any, global_shape: Sequence[int], offsets: Sequence[int]) -> None:
        self.local_tensor = local_tensor
        self.global_shape = tuple(int(x) for x in global_shape)
        self.offsets = tuple(int(x) for x in offsets)
        shape = _shape_of(local_tensor)
        if not (len(self.global_shape) == len(self.offsets) == len(shape)):
            raise LayoutError(
                f"Sharded: local shape {shape}, global_shape {self.global_shape} and offsets "
                f"{self.offsets} must have the same number of dimensions")
        for d, (o, n, g) in enumerate(zip(self.offsets, shape, self.global_shape, strict=True)):
            if o < 0 or o + n > g:
                raise LayoutError(
                    f"Sharded: box {self.offsets}+{shape} leaves global shape {self.global_shape} "
                    f"in dimension {d}")

    def __repr__(self) -> str:
        return f"Sharded(shape={_shape_of(self.local_tensor)}, global_shape={self.global_shape}, " \
               f"offsets={self.offsets})"


class Fused:
    """A local tensor that is the concatenation along ``dim`` of boxes of several logical tensors.

    ``parts`` is a list of ``(name, offsets, shape)`` or ``(name, offsets, shape, global_shape)``;
    the parts are laid out along ``dim`` in the order given (vLLM ``qkv_proj`` = ``[q; k; v]``).
    Without ``global_shape`` the logical tensor's shape is taken from the sources at planning time.
    """

    def __init__(self, local_tensor: Any, dim: int,
                 parts: Sequence[tuple[Any, ...]]) -> None:
        self.local_tensor = local_tensor
        shape = _shape_of(local_tensor)
        nd = len(shape)
        if not -nd <= dim < nd:
            raise LayoutError(f"Fused: dim {dim} out of range for a local tensor of shape {shape}")
        self.dim = dim % nd
        self.parts: list[tuple[str, tuple[int, ...], tuple[int, ...], tuple[int, ...] | None]] = []
        total = 0
        for p in parts:
            if len(p) not in (3, 4):
                raise LayoutError(f"Fused: a part is (name, offsets, shape[, global_shape]), got {p!r}")
            name, offs, pshape = str(p[0]), tuple(int(x) for x in p[1]), tuple(int(x) for x in p[2])
            gshape = tuple(int(x) for x in p[3]) if len(p) == 4 and p[3] is not None else None
            if len(offs) != nd or len(pshape) != nd or (gshape is not None and len(gshape) != nd):
                raise LayoutError(f"Fused part {name!r}: offsets {offs} / shape {pshape} must have "
                                  f"{nd} dimensions like the local tensor {shape}")
            for d in range(nd):
                if d != self.dim and pshape[d] != shape[d]:
                    raise LayoutError(
                        f"Fused part {name!r}: shape {pshape} differs from the local tensor {shape} "
                        f"in dimension {d}, which is not the fused dimension {self.dim}")
            total += pshape[self.dim]
            self.parts.append((name, offs, pshape, gshape))
        if total != shape[self.dim]:
            raise LayoutError(f"Fused: parts add up to {total} along dim {self.dim}, the local tensor "
                              f"has {shape[self.dim]}")

    def __repr__(self) -> str:
        return f"Fused(shape={_shape_of(self.local_tensor)}, dim={self.dim}, " \
               f"parts={[p[0] for p in self.parts]})"


class Placed:
    """Boxes of logical tensors placed anywhere in one local tensor, for layouts ``Fused`` cannot say.

    ``pieces`` is a list of ``(name, global_shape, offsets, shape, at)``: the box
    ``name[offsets : offsets + shape]`` sits in the local tensor with its first element at local index
    ``at`` (one entry per local dimension); the box's dimensions are the local tensor's last
    ``len(shape)`` dimensions. Example, vLLM's fused MoE weight ``w13_weight[e_local, 2*I, H]`` holding
    ``[gate; up]`` of Hugging Face's per-expert ``experts.{e}.gate_proj.weight [I, H]``::

        Placed(w13, [(f"experts.{e}.gate_proj.weight", (I, H), (0, 0), (I, H), (j, 0, 0)),
                     (f"experts.{e}.up_proj.weight", (I, H), (0, 0), (I, H), (j, I, 0)), ...])
    """

    def __init__(self, local_tensor: Any, pieces: Sequence[tuple[Any, ...]]) -> None:
        self.local_tensor = local_tensor
        lshape = _shape_of(local_tensor)
        self.pieces: list[tuple[str, tuple[int, ...], tuple[int, ...], tuple[int, ...], tuple[int, ...]]] = []
        for p in pieces:
            if len(p) != 5:
                raise LayoutError(f"Placed: a piece is (name, global_shape, offsets, shape, at), got {p!r}")
            name = str(p[0])
            g, o, sh, at = (tuple(int(x) for x in v) for v in p[1:])
            if not (len(g) == len(o) == len(sh)) or len(sh) > len(lshape) or len(at) != len(lshape):
                raise LayoutError(f"Placed piece {name!r}: global_shape {g}, offsets {o}, shape {sh} must "
                                  f"have one rank, at most the local tensor's {len(lshape)}, and at {at} one "
                                  f"index per local dimension")
            for d, (oo, n, gg) in enumerate(zip(o, sh, g, strict=True)):
                if oo < 0 or oo + n > gg:
                    raise LayoutError(f"Placed piece {name!r}: box {o}+{sh} leaves global shape {g} in "
                                      f"dimension {d}")
            k = len(lshape) - len(sh)
            ext = tuple(a + (sh[d - k] if d >= k else 1) for d, a in enumerate(at))
            if any(a < 0 for a in at) or any(e > n for e, n in zip(ext, lshape, strict=True)):
                raise LayoutError(f"Placed piece {name!r}: a box of shape {sh} at {at} leaves the local "
                                  f"tensor of shape {lshape}")
            self.pieces.append((name, g, o, sh, at))

    def __repr__(self) -> str:
        return f"Placed(shape={_shape_of(self.local_tensor)}, {len(self.pieces)} pieces)"


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
    """All regions of one participant, as columns.

    Columns (one entry per region): ``tensor`` (index into ``table``), ``offsets``/``shape``/``strides``
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

    def region(self, i: int) -> Region:
        t = int(self.tensor[i])
        nd = int(self.table.ndim[t])
        w = self.width
        return Region(
            name=self.table.names[t],
            global_shape=tuple(int(x) for x in self.table.gshape[t, w - nd:]),
            dtype=DTYPES[int(self.table.dtype[t])],
            offsets=tuple(int(x) for x in self.offsets[i, w - nd:]),
            shape=tuple(int(x) for x in self.shape[i, w - nd:]),
            key=self.keys[int(self.key[i])],
            byte_offset=int(self.byte_offset[i]),
            strides=tuple(int(x) for x in self.strides[i, w - nd:]),
        )

    def regions(self) -> list[Region]:
        return [self.region(i) for i in range(len(self))]

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
    def from_regions(regions: Iterable[Region], key_nbytes: Mapping[str, int] | None = None) -> Layout:
        regions = list(regions)
        width = max([len(r.shape) for r in regions] + [1])
        names: list[str] = []
        tindex: dict[str, int] = {}
        gsh: list[list[int]] = []
        nds: list[int] = []
        dts: list[int] = []
        keys: list[str] = []
        kindex: dict[str, int] = {}
        n = len(regions)
        tensor = np.zeros(n, np.int32)
        offs = np.zeros((n, width), np.int64)
        shp = np.ones((n, width), np.int64)
        strd = np.zeros((n, width), np.int64)
        key = np.zeros(n, np.int32)
        boff = np.zeros(n, np.int64)
        for i, r in enumerate(regions):
            nd = len(r.shape)
            if not (len(r.offsets) == len(r.global_shape) == len(r.strides) == nd):
                raise LayoutError(f"region of {r.name!r}: offsets {r.offsets}, shape {r.shape}, "
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
        return f"Layout({len(self)} regions, {len(self.table)} tensors, {len(self.keys)} local tensors)"


# --------------------------------------------------------------------------------------------------
# Describing a participant's tensors


def _is_torch_tensor(x: Any) -> bool:
    mod = type(x).__module__
    return mod.startswith("torch") and hasattr(x, "untyped_storage")


def _is_dtensor(x: Any) -> bool:
    return type(x).__name__ == "DTensor" and hasattr(x, "placements") and hasattr(x, "device_mesh")


def local_info(t: Any) -> tuple[tuple[int, ...], tuple[int, ...], str, int]:
    """(shape, element strides, dtype name, byte span) of a local numpy array or torch tensor.

    The byte span runs from the tensor's first element to one past its last one; it is what the
    control plane registers with the engine for that key.
    """
    if not isinstance(t, np.ndarray) and not _is_torch_tensor(t):
        raise LayoutError(f"expected a torch tensor, a numpy array, Sharded or Fused, got {type(t).__name__}")
    shape = _shape_of(t)
    if isinstance(t, np.ndarray):
        dt = dtype_name(t.dtype)
        isz = t.dtype.itemsize
        if any(s % isz for s in t.strides):
            raise LayoutError(f"array strides {t.strides} are not a multiple of its item size {isz}")
        strides = tuple(int(s) // isz for s in t.strides)
    elif _is_torch_tensor(t):
        dt = dtype_name(t.dtype)
        strides = tuple(int(s) for s in t.stride())
    else:
        raise LayoutError(f"expected a torch tensor, a numpy array, Sharded or Fused, got {type(t).__name__}")
    if any(s < 0 for s in strides):
        raise LayoutError(f"negative strides {strides} are not supported; make the tensor contiguous")
    if 0 in shape:
        span = 0
    else:
        span = (sum((n - 1) * s for n, s in zip(shape, strides, strict=True)) + 1) * DTYPE_SIZES[dt]
    return shape, strides, dt, span


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


def _dtensor_regions(key: str, dt: Any) -> tuple[Any, list[tuple[str, tuple[int, ...], tuple[int, ...],
                                                                 tuple[int, ...], int]]]:
    mesh = dt.device_mesh
    coord = mesh.get_coordinate()
    if coord is None:
        raise LayoutError(f"DTensor {key!r}: this rank is not part of its device mesh")
    offs, shape = dtensor_box(tuple(dt.shape), tuple(mesh.shape), coord, dt.placements)
    local = dt.to_local()
    if tuple(local.shape) != shape:
        raise LayoutError(f"DTensor {key!r}: local shape {tuple(local.shape)} differs from {shape}, the "
                          f"shard its placements {dt.placements} give mesh coordinate {coord}")
    return local, [(key, tuple(int(x) for x in dt.shape), offs, shape, 0)]


def describe_tensors(named: Mapping[str, Any]) -> Layout:
    """The layout of one participant from ``{key: tensor}``.

    Values: a plain torch tensor or numpy array (the whole logical tensor named ``key``), a DTensor
    (its local shard, placed as torch places it), :class:`Sharded` (a box of logical tensor ``key``),
    or :class:`Fused` (boxes of several logical tensors concatenated along a dimension). In every
    case ``key`` also names the local tensor the control plane registers and the ops address.
    """
    regions: list[Region] = []
    spans: dict[str, int] = {}
    for key, value in named.items():
        key = str(key)
        pieces: list[tuple[str, tuple[int, ...], tuple[int, ...], tuple[int, ...], int]]
        if isinstance(value, Sharded):
            local = value.local_tensor
            pieces = [(key, value.global_shape, value.offsets, _shape_of(local), 0)]
        elif isinstance(value, Fused):
            local = value.local_tensor
            shape, strides, _, _ = local_info(local)
            pieces = []
            along = 0
            for name, offs, pshape, gshape in value.parts:
                g = gshape if gshape is not None else tuple([UNKNOWN] * len(pshape))
                pieces.append((name, g, offs, pshape, along * strides[value.dim]))
                along += pshape[value.dim]
        elif isinstance(value, Placed):
            local = value.local_tensor
            _, lstrides, _, _ = local_info(local)
            plist: list[tuple[str, tuple[int, ...], tuple[int, ...], tuple[int, ...], int,
                              tuple[int, ...]]] = []
            for name, g, o, sh, at in value.pieces:
                k = len(lstrides) - len(sh)
                plist.append((name, g, o, sh, sum(a * st for a, st in zip(at, lstrides, strict=True)),
                              tuple(lstrides[k:])))
            shape, strides, dt, span = local_info(local)
            spans[key] = span
            for name, g, o, sh, elem_off, st in plist:
                regions.append(Region(name=name, global_shape=g, dtype=dt, offsets=o, shape=sh, key=key,
                                      byte_offset=elem_off * DTYPE_SIZES[dt], strides=st))
            continue
        elif _is_dtensor(value):
            local, pieces = _dtensor_regions(key, value)
        else:
            local = value
            shape = local_info(value)[0]
            pieces = [(key, shape, tuple([0] * len(shape)), shape, 0)]
        shape, strides, dt, span = local_info(local)
        spans[key] = span
        isz = DTYPE_SIZES[dt]
        for name, gshape, offs, pshape, elem_off in pieces:
            regions.append(Region(name=name, global_shape=tuple(gshape), dtype=dt, offsets=tuple(offs),
                                  shape=tuple(pshape), key=key, byte_offset=elem_off * isz,
                                  strides=tuple(strides)))
    return Layout.from_regions(regions, spans)


def as_layout(x: Any) -> Layout:
    """Accept a Layout, its msgpack bytes or dict, a list of Regions or a ``{key: tensor}`` mapping."""
    if isinstance(x, Layout):
        return x
    if isinstance(x, (bytes, bytearray, memoryview)):
        return Layout.from_msgpack(bytes(x))
    if isinstance(x, Mapping):
        if "width" in x and "names" in x and "tensor" in x:
            return Layout.from_dict(x)
        return describe_tensors(x)
    if isinstance(x, (list, tuple)) and all(isinstance(r, Region) for r in x):
        return Layout.from_regions(x)
    raise LayoutError(f"cannot read a layout from {type(x).__name__}")
