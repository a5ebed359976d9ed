"""Regions and layout helpers: Sharded, Fused, plain tensors and DTensor shards reduce to regions."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from weightsync.errors import LayoutError
from weightsync.plan.layout import Box, Layout, dtensor_box
from weightsync.runtime.describe import Fused, Sharded, describe_tensors

torch = pytest.importorskip("torch")


def test_plain_tensor_is_one_full_region() -> None:
    t = torch.zeros(3, 5, dtype=torch.bfloat16)
    lay = describe_tensors({"w": t})
    (r,) = lay.boxes()
    assert r == Box("w", (3, 5), "bfloat16", (0, 0), (3, 5), "w", 0, (5, 1))
    assert lay.key_nbytes.tolist() == [30]


def test_sharded_and_numpy() -> None:
    a = np.zeros((2, 4), np.float16)
    lay = describe_tensors({"w": Sharded(a, (6, 4), (2, 0))})
    (r,) = lay.boxes()
    assert (r.name, r.global_shape, r.dtype, r.offsets, r.shape) == ("w", (6, 4), "float16", (2, 0), (2, 4))


def test_fused_parts_are_consecutive_along_dim() -> None:
    local = torch.zeros(4, 10)  # [q(4 rows of 8..); k; v] fused along dim 1 here to test strides
    f = Fused(local, 1, [("q", (0, 0), (4, 6), (4, 12)), ("k", (0, 2), (4, 2), (4, 4)),
                         ("v", (0, 0), (4, 2))])
    regs = describe_tensors({"qkv": f}).boxes()
    assert [(r.name, r.byte_offset, r.strides) for r in regs] == [("q", 0, (10, 1)), ("k", 24, (10, 1)),
                                                                  ("v", 32, (10, 1))]
    assert regs[2].global_shape == (-1, -1)  # unknown until planning (taken from the sources)


def test_fused_rejects_wrong_sizes() -> None:
    with pytest.raises(LayoutError, match="add up to 5"):
        Fused(torch.zeros(6, 3), 0, [("a", (0, 0), (2, 3)), ("b", (0, 0), (3, 3))])
    with pytest.raises(LayoutError, match="not the fused dimension"):
        Fused(torch.zeros(6, 3), 0, [("a", (0, 0), (6, 2))])


def test_sharded_rejects_box_outside() -> None:
    with pytest.raises(LayoutError, match="leaves global shape"):
        Sharded(torch.zeros(3, 3), (4, 3), (2, 0))
    with pytest.raises(LayoutError, match="same number of dimensions"):
        Sharded(torch.zeros(3, 3), (4,), (0,))


def test_non_contiguous_local_tensor_keeps_strides() -> None:
    base = torch.zeros(4, 8)
    view = base[:, 2:5]
    lay = describe_tensors({"w": view})
    (r,) = lay.boxes()
    assert r.strides == (8, 1)
    assert lay.key_nbytes.tolist() == [((4 - 1) * 8 + 2 + 1) * 4]


def test_layout_msgpack_round_trip() -> None:
    lay = describe_tensors({"a": torch.zeros(2, 3), "b": Sharded(torch.zeros(1, 3), (5, 3), (4, 0))})
    back = Layout.from_msgpack(lay.to_msgpack())
    assert back.boxes() == lay.boxes()
    assert back.fingerprint() == lay.fingerprint()


def test_describe_rejects_other_values() -> None:
    with pytest.raises(LayoutError, match="expected a torch tensor"):
        describe_tensors({"w": [1, 2, 3]})


@settings(max_examples=150, deadline=None)
@given(st.lists(st.integers(0, 9), min_size=1, max_size=3),
       st.lists(st.integers(1, 4), min_size=1, max_size=3), st.data())
def test_dtensor_box_matches_torch(shape: list[int], mesh: list[int], data: st.DataObject) -> None:
    """Boxes of uneven shards on meshes of any dimension, exactly where torch puts them."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset

    placements = [data.draw(st.sampled_from([Shard(d) for d in range(len(shape))] + [Replicate()]))
                  for _ in mesh]
    coord = [data.draw(st.integers(0, m - 1)) for m in mesh]
    want_shape, want_off = _compute_local_shape_and_global_offset(shape, mesh, coord, placements)
    offs, shp = dtensor_box(shape, mesh, coord, placements)
    assert shp == tuple(want_shape)
    if all(shp):
        assert offs == tuple(want_off)


def test_dtensor_on_2d_mesh_covers_the_tensor() -> None:
    """Real DTensors (fake process group, one rank at a time) on a 2x2 mesh with uneven Shard(0) twice
    and Shard(1) x Replicate: their regions tile the global tensor."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor, Replicate, Shard
    from torch.testing._internal.distributed.fake_pg import FakeStore

    g = torch.arange(7 * 5, dtype=torch.float32).reshape(7, 5)
    for placements in ([Shard(0), Shard(0)], [Shard(1), Replicate()], [Shard(0), Shard(1)]):
        covered = torch.zeros(7, 5)
        for r in range(4):
            dist.init_process_group("fake", store=FakeStore(), rank=r, world_size=4)
            try:
                mesh = DeviceMesh("cpu", torch.arange(4).reshape(2, 2))
                offs, shp = dtensor_box(g.shape, (2, 2), mesh.get_coordinate(), placements)
                local = g[offs[0]:offs[0] + shp[0], offs[1]:offs[1] + shp[1]].clone()
                dt = DTensor.from_local(local, mesh, placements, run_check=False, shape=g.shape,
                                        stride=g.stride())
                (reg,) = describe_tensors({"w": dt}).boxes()
            finally:
                dist.destroy_process_group()
            assert reg.global_shape == (7, 5) and reg.shape == tuple(local.shape)
            o = reg.offsets
            covered[o[0]:o[0] + reg.shape[0], o[1]:o[1] + reg.shape[1]] += 1
        replicas = 2 if Replicate() in placements else 1
        assert torch.all(covered == replicas), placements
