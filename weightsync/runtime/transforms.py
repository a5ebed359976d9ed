"""Sender-side transforms: dtype casts and FP8 e4m3 block quantization with per-tile scales.

Torch ops only, so they run wherever the tensor is (CPU or CUDA) and the sender needs no kernel of its
own. The FP8 format is the one Hugging Face FP8 checkpoints (DeepSeek-V3, Kimi-K2) use:

* the last two dimensions are cut into ``block`` tiles (128 x 128); a tile at the lower or right edge
  is smaller when the extent is not a multiple of the block;
* ``amax`` is the largest ``|x|`` of a tile after conversion to float32, raised to at least ``1e-4``
  (so an all-zero tile gets a tiny finite scale, not a division by zero);
* ``scale = amax / 448`` in float32 (448: the largest finite ``float8_e4m3fn``), optionally rounded up
  to a power of two (UE8M0 scales: ``2 ** ceil(log2(scale))``, what DeepGEMM's kernels on Blackwell
  read);
* the stored value is ``x * (1 / scale)`` in float32 (the reciprocal is taken once per tile, then
  multiplied), converted with torch's ``float8_e4m3fn`` cast (round to nearest even). The product
  exceeds 448 by at most a few float32 ulps, which the cast rounds to 448, so no clamp pass is needed;
* scales are stored as ``weight_scale_inv`` (the name says "inverse" because readers multiply by it
  to dequantize), one float32 per tile.

These are the rules of vLLM's own block quantizer (``per_block_cast_to_fp8`` in
vllm/utils/deep_gemm.py, which RL frameworks use to quantize for vLLM too), so a push gives the bytes a
vLLM user would get from quantizing the same weights themselves (tests/vllm/test_fp8.py checks it bit
for bit against vLLM's function on CPU).

Leading dimensions (stacked experts) are a batch: every 2-D slice has its own tiles.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from weightsync.errors import LayoutError, PlanError

if TYPE_CHECKING:
    from weightsync.plan.ops import Plan
    from weightsync.plan.writes import Writes

FP8_MAX = 448.0
# The smallest tile amax a scale is made from (an all-zero tile's): vLLM's per_block_cast_to_fp8 rule.
AMAX_MIN = 1e-4


def fp8_dtype() -> Any:
    import torch

    return torch.float8_e4m3fn


def quantize_fp8_blocks(x: Any, block: tuple[int, int] = (128, 128), *,
                        ue8m0: bool = False) -> tuple[Any, Any]:
    """FP8 e4m3 values and float32 tile scales of ``x`` (at least 2-D), on ``x``'s device.

    Returns ``(q, scale)``: ``q`` has ``x``'s shape in ``float8_e4m3fn``; ``scale`` has shape
    ``(*lead, ceil(rows / bm), ceil(cols / bn))``. ``ue8m0``: scales rounded up to powers of two.
    """
    import torch

    if x.dim() < 2:
        raise LayoutError(f"FP8 block quantization needs a tensor of at least 2 dimensions, got {x.dim()}")
    bm, bn = block
    *lead, rows, cols = x.shape
    tr, tc = -(-rows // bm), -(-cols // bn)
    if x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        x = x.to(torch.float32)
    # No float32 copy of the input: |x| and its maximum are exact in the input dtype, and the product of
    # a 16-bit tensor with a float32 tensor computes in float32, exactly as on converted values.
    x3 = x.reshape(-1, rows, cols)
    n = x3.shape[0]
    # Zero padding leaves every tile's amax unchanged (|x| >= 0) and makes the tiles a plain reshape.
    pr, pc = tr * bm - rows, tc * bn - cols
    if pr or pc:
        x3 = torch.nn.functional.pad(x3, (0, pc, 0, pr))
    tiles = x3.reshape(n, tr, bm, tc, bn)
    # max |x| per tile in one pass over the input (exact: no arithmetic but the absolute value)
    amax = torch.linalg.vector_norm(tiles, ord=float("inf"), dim=(2, 4)).to(torch.float32).clamp(min=AMAX_MIN)
    # Divide by a tensor, not a Python number: CUDA turns division by a host scalar into a multiplication
    # by its (inexact) reciprocal, which would make the scales differ from the CPU's in the last bit.
    scale = amax / torch.full_like(amax, FP8_MAX)
    if ue8m0:
        scale = torch.pow(2.0, torch.ceil(torch.log2(scale)))
    inverse = torch.ones_like(scale) / scale
    # |x * inverse| <= 448 up to a few float32 ulps, which the cast rounds to 448 (its NaN branch starts
    # at 480), so no clamp pass is needed: the result equals the clamped one on every device.
    q = torch.mul(tiles, inverse[:, :, None, :, None]).to(torch.float8_e4m3fn)
    q = q.reshape(n, tr * bm, tc * bn)
    if pr or pc:
        q = q[:, :rows, :cols]
    return q.reshape(*lead, rows, cols), scale.reshape(*lead, tr, tc)


def cast(x: Any, dtype: Any) -> Any:
    """``x`` in ``dtype`` (torch's conversion: round to nearest even), on ``x``'s device."""
    return x.to(dtype)


def torch_dtype(name: str) -> Any:
    import torch

    return getattr(torch, name)




# ------------------------------------------------------------------------------------------------
# The sender's preparation of staging chunks


class Preparer:
    """Fills a source's staging chunks (``weightsync.plan.writes.lower``) from its local tensors.

    ``tensors`` maps the plan's local keys to this source's (contiguous) local tensors; ``part`` is the
    plan, or this source's part of it (boxes, gathers, dtypes); ``recv`` is the receive buffer (uint8,
    on the tensors' device) the gathers into this source land in. Everything runs on the tensors'
    device: FP8 quantization and casts on the GPU when the tensors are there.
    """

    def __init__(self, tensors: Mapping[str, Any], part: Plan, lowered: Writes, rank: int,
                 recv: Any = None) -> None:
        import numpy as np

        self.tensors = tensors
        self.part = part
        self.lowered = lowered
        self.rank = rank
        self.recv = recv
        self.boxes = {int(b["id"]): b for b in part.boxes}
        g = part.gathers
        self.provided = g[g["provider"] == rank]
        self.received = g[g["gatherer"] == rank]
        self.recv_bytes = int((self.received["offset"] + self.received["nbytes"]).max()) \
            if len(self.received) else 0
        self._copy_bounds = np.searchsorted(lowered.copies["chunk"], np.arange(len(lowered.chunks) + 1))
        self._unit: tuple[int, Any, Any] | None = None
        self.unit_seconds = 0.0

    # -- views of local memory --------------------------------------------------------------------
    def _bytes(self, key: str) -> Any:
        import torch

        t = self.tensors[key]
        return t.reshape(-1).view(torch.uint8)

    def _box_view(self, box: Any, lo: Sequence[int], shape: Sequence[int]) -> Any:
        """The logical box ``lo``/``shape`` (inside the held part of ``box``) as a strided view of the
        local tensor, in the source dtype."""
        import torch

        key = self.part.keys[int(box["key"])]
        t = self.tensors[key]
        dt = torch_dtype(self.part.src_dtype[int(box["tensor"])])
        flat = t.reshape(-1)
        if flat.dtype != dt:
            flat = flat.view(torch.uint8).view(dt)
        es = flat.element_size()
        strides = [int(s) for s in box["strides"]]
        el = int(box["boff"]) // es + sum((int(a) - int(b)) * s
                                          for a, b, s in zip(lo, box["lo"], strides, strict=True))
        return torch.as_strided(flat, tuple(int(x) for x in shape), tuple(strides),
                                flat.storage_offset() + el)

    def reset(self) -> None:
        """Forget the last unit's output: the next push quantizes the tensors' new values."""
        self._unit = None
        self.unit_seconds = 0.0

    # -- FP8 units --------------------------------------------------------------------------------
    def unit(self, u: int) -> tuple[Any, Any]:
        """FP8 values and scales of unit ``u`` as flat byte tensors (cached for the unit's chunks)."""
        if self._unit is not None and self._unit[0] == u:
            return self._unit[1], self._unit[2]
        import time

        import numpy as np
        import torch

        t0 = time.perf_counter()
        un = self.lowered.units[u]
        box = self.boxes[int(un["box"])]
        name = self.part.tensors[int(box["tensor"])]
        W = len(box["lo"])
        own_lo = box["own_lo"].astype(np.int64)
        own_sh = box["own_shape"].astype(np.int64)
        ulo = own_lo.copy()
        if W > 2:
            ulo[:-2] += np.array(np.unravel_index(int(un["lead"]), tuple(own_sh[:-2])), np.int64)
        ulo[-2] += int(un["r0"])
        ulo[-1] += int(un["c0"])
        ush = np.ones(W, np.int64)
        ush[-2] = int(un["r1"] - un["r0"])
        ush[-1] = int(un["c1"] - un["c0"])
        uhi = ulo + ush
        some = next(iter(self.tensors.values()))
        dt = torch_dtype(self.part.src_dtype[int(box["tensor"])])
        hlo = box["lo"].astype(np.int64)
        hhi = hlo + box["shape"].astype(np.int64)
        assert self.part.fp8_block is not None
        if np.all(ulo >= hlo) and np.all(uhi <= hhi):
            # the whole unit is held: quantize straight from the local tensor, no assembled copy
            src = self._box_view(box, ulo, ush).reshape(int(ush[-2]), int(ush[-1]))
            return self._quantized(u, src, t0)
        dense = torch.empty((int(ush[-2]), int(ush[-1])), dtype=dt, device=some.device)
        filled = 0

        def place(src: Any, ilo: np.ndarray, ihi: np.ndarray) -> None:
            nonlocal filled
            r0, c0 = int(ilo[-2] - ulo[-2]), int(ilo[-1] - ulo[-1])
            r, c = int(ihi[-2] - ilo[-2]), int(ihi[-1] - ilo[-1])
            dense[r0:r0 + r, c0:c0 + c].copy_(src.reshape(r, c))
            filled += r * c

        ilo, ihi = np.maximum(ulo, hlo), np.minimum(uhi, hhi)
        if np.all(ihi > ilo):
            place(self._box_view(box, ilo, ihi - ilo), ilo, ihi)
        for g in self.received[self.received["box"] == int(un["box"])]:
            glo = g["lo"].astype(np.int64)
            ghi = glo + g["shape"].astype(np.int64)
            ilo, ihi = np.maximum(ulo, glo), np.minimum(uhi, ghi)
            if not np.all(ihi > ilo):
                continue
            off = int(g["offset"])
            view = self.recv[off:off + int(g["nbytes"])].view(dt).view(tuple(int(x) for x in g["shape"]))
            sl = tuple(slice(int(a - b), int(c - b)) for a, c, b in zip(ilo, ihi, glo, strict=True))
            place(view[sl], ilo, ihi)
        if filled != int(ush[-2] * ush[-1]):
            raise PlanError(f"source rank {self.rank}: FP8 tiles of tensor {name!r} at {tuple(ulo.tolist())} "
                            f"have {filled} of {int(ush[-2] * ush[-1])} elements (held plus gathered)")
        return self._quantized(u, dense, t0)

    def _quantized(self, u: int, src: Any, t0: float) -> tuple[Any, Any]:
        import time

        import torch

        assert self.part.fp8_block is not None
        q, s = quantize_fp8_blocks(src, self.part.fp8_block)
        qb = q.contiguous().view(torch.uint8).reshape(-1)
        sb = s.contiguous().view(torch.uint8).reshape(-1)
        self._unit = (u, qb, sb)
        self.unit_seconds += time.perf_counter() - t0
        return qb, sb

    # -- chunks -----------------------------------------------------------------------------------
    def fill(self, c: int, out: Any) -> None:
        """Fills chunk ``c`` into ``out`` (a uint8 tensor of at least the chunk's bytes)."""
        import torch

        from weightsync.plan.writes import C_CAST, C_FP8, C_GATHER, C_RAW, C_SCALE

        lw = self.lowered
        a, b = int(self._copy_bounds[c]), int(self._copy_bounds[c + 1])
        for cp in lw.copies[a:b]:
            kind = int(cp["kind"])
            rows, rb, off = int(cp["rows"]), int(cp["row_bytes"]), int(cp["staging_offset"])
            n = int(cp["nbytes"])
            dst = out[off:off + n]
            if kind == C_RAW:
                src = self._bytes(self.part.keys[int(cp["key"])])
                view = torch.as_strided(src, (rows, rb), (int(cp["src_pitch"]), 1),
                                        src.storage_offset() + int(cp["src_offset"]))
                dst.view(rows, rb).copy_(view)
            elif kind == C_CAST:
                t = int(cp["tensor"])
                sdt, ddt = torch_dtype(self.part.src_dtype[t]), torch_dtype(self.part.dst_dtype[t])
                flat = self.tensors[self.part.keys[int(cp["key"])]].reshape(-1)
                if flat.dtype != sdt:
                    flat = flat.view(torch.uint8).view(sdt)
                es = flat.element_size()
                view = torch.as_strided(flat, (rows, rb // es), (int(cp["src_pitch"]) // es, 1),
                                        flat.storage_offset() + int(cp["src_offset"]) // es)
                dst.copy_(cast(view, ddt).reshape(-1).view(torch.uint8))
            elif kind in (C_FP8, C_SCALE):
                qb, sb = self.unit(int(cp["unit"]))  # copies come in unit order: each quantized once
                src = qb if kind == C_FP8 else sb
                view = torch.as_strided(src, (rows, rb), (int(cp["src_pitch"]), 1),
                                        src.storage_offset() + int(cp["src_offset"]))
                dst.view(rows, rb).copy_(view)
            elif kind == C_GATHER:
                g = self.provided[int(cp["key"])]
                box = self.boxes[int(g["pbox"])]
                shape = [int(x) for x in g["shape"]]
                cols = shape[-1]
                view = self._box_view(box, g["lo"], shape).reshape(-1, cols)
                m0, c0 = int(cp["src_offset"]), int(cp["col"])
                piece = view[m0:m0 + rows, c0:c0 + rb // view.element_size()].contiguous()
                dst.copy_(piece.reshape(-1).view(torch.uint8))
            else:
                raise PlanError(f"unknown staging copy kind {kind}")


__all__ = ["AMAX_MIN", "FP8_MAX", "Preparer", "cast", "fp8_dtype", "quantize_fp8_blocks", "torch_dtype"]
