"""A plan executor for tests: runs a plan over in-memory arrays, byte for byte as the data plane would.

It is slow on purpose (one numpy copy per block row group) and exists to check plans: the tests build
random layouts, fill the sources with a known global tensor, execute the plan and compare every
destination with the slice it should hold.
"""

from __future__ import annotations

import ctypes
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from weightsync.errors import PlanError
from weightsync.plan.ops import T_CAST, T_NONE, TRANSFORMS, Plan
from weightsync.runtime.describe import local_info


def byte_view(t: Any) -> np.ndarray:
    """A writable uint8 view of the bytes a local tensor spans (numpy array or CPU torch tensor)."""
    _, _, _, span = local_info(t)
    if span == 0:
        return np.zeros(0, np.uint8)
    if isinstance(t, np.ndarray):
        ptr = t.__array_interface__["data"][0]
    else:
        if t.device.type != "cpu":
            raise PlanError("the plan executor runs on CPU tensors only")
        ptr = t.data_ptr()
    buf = (ctypes.c_uint8 * span).from_address(ptr)
    return np.frombuffer(buf, dtype=np.uint8)


def _blocks(view: np.ndarray, offset: int, rows: int, row_bytes: int, pitch: int) -> np.ndarray:
    if rows == 1:
        return view[offset:offset + row_bytes].reshape(1, row_bytes)
    return np.lib.stride_tricks.as_strided(view[offset:], shape=(rows, row_bytes), strides=(pitch, 1))


def execute(plan: Plan, sources: Sequence[Mapping[str, Any]],
            destinations: Sequence[Mapping[str, Any]]) -> None:
    """Copy bytes as the plan's ops say. ``sources[i]`` / ``destinations[j]`` map local tensor keys
    to numpy arrays or CPU torch tensors (the same dicts the layouts were described from).

    Casts go through torch (bfloat16 has no numpy dtype); FP8 quantization is not executed here.
    """
    if len(sources) != plan.num_sources or len(destinations) != plan.num_destinations:
        raise PlanError(f"the plan is for {plan.num_sources} sources and {plan.num_destinations} "
                        f"destinations, got {len(sources)} and {len(destinations)}")
    src_views = [{k: byte_view(v) for k, v in s.items()} for s in sources]
    dst_views = [{k: byte_view(v) for k, v in d.items()} for d in destinations]
    for rank in range(plan.num_sources):
        for op in plan.for_source(rank):
            tr = int(op["transform"])
            skey, dkey = plan.keys[int(op["src_key"])], plan.keys[int(op["dst_key"])]
            try:
                sv = src_views[rank][skey]
                dv = dst_views[int(op["dst_rank"])][dkey]
            except KeyError as e:
                raise PlanError(f"op of source rank {rank} names local tensor {e.args[0]!r} the executor "
                                f"was not given") from None
            rows, rb = int(op["rows"]), int(op["row_bytes"])
            dst = _blocks(dv, int(op["dst_offset"]), rows, rb, int(op["dst_pitch"]))
            if tr == T_NONE:
                src = _blocks(sv, int(op["src_offset"]), rows, rb, int(op["src_pitch"]))
                dst[...] = src
            elif tr == T_CAST:
                t = int(op["tensor"])
                sdt, ddt = plan.src_dtype[t], plan.dst_dtype[t]
                import torch

                ssz = torch.empty(0, dtype=getattr(torch, sdt)).element_size()
                dsz = torch.empty(0, dtype=getattr(torch, ddt)).element_size()
                n = rb // dsz
                src = _blocks(sv, int(op["src_offset"]), rows, n * ssz, int(op["src_pitch"]))
                vals = torch.from_numpy(np.ascontiguousarray(src)).view(getattr(torch, sdt))
                out = vals.to(getattr(torch, ddt)).view(torch.uint8).numpy()
                dst[...] = out.reshape(rows, rb)
            else:
                raise PlanError(f"the reference executor does not run {TRANSFORMS[tr]!r} ops")
