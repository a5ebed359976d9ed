"""Describing a participant's tensors as a layout (weightsync.plan.layout), and the layout helpers
of the public contract: ``Sharded``, ``Fused``, ``Placed``.

This is where tensors (torch, DTensor, numpy) meet the planner: it reads their shapes, strides and
dtypes (duck-typed, torch is never imported here) and hands the planner plain numbers.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from weightsync.errors import LayoutError
from weightsync.plan.layout import DTYPE_SIZES, UNKNOWN, Box, Layout, dtensor_box, dtype_name

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


def _dtensor_boxes(key: str, dt: Any) -> tuple[Any, list[tuple[str, tuple[int, ...], tuple[int, ...],
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
    boxes: list[Box] = []
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
                boxes.append(Box(name=name, global_shape=g, dtype=dt, offsets=o, shape=sh, key=key,
                                      byte_offset=elem_off * DTYPE_SIZES[dt], strides=st))
            continue
        elif _is_dtensor(value):
            local, pieces = _dtensor_boxes(key, value)
        else:
            local = value
            shape = local_info(value)[0]
            pieces = [(key, shape, tuple([0] * len(shape)), shape, 0)]
        shape, strides, dt, span = local_info(local)
        spans[key] = span
        isz = DTYPE_SIZES[dt]
        for name, gshape, offs, pshape, elem_off in pieces:
            boxes.append(Box(name=name, global_shape=tuple(gshape), dtype=dt, offsets=tuple(offs),
                                  shape=tuple(pshape), key=key, byte_offset=elem_off * isz,
                                  strides=tuple(strides)))
    return Layout.from_boxes(boxes, spans)
