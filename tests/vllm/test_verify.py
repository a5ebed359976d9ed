"""The verification mode's checksums: a tensor's sum is the same however its elements are split into
boxes, and moving bytes to other places changes it. Needs torch only."""

from __future__ import annotations

import torch

from weightsync.integrations.vllm.verify import add, box_checksum


def test_the_sum_over_any_box_cover_is_the_whole_tensors() -> None:
    g = torch.Generator().manual_seed(0)
    for dtype in (torch.bfloat16, torch.float32, torch.float8_e4m3fn):
        x = torch.randn(37, 20, generator=g).to(dtype)
        whole = box_checksum(x, x.shape, (0, 0))
        rows = add(box_checksum(x[a:b], x.shape, (a, 0)) for a, b in [(0, 19), (19, 37)])
        tiles = add(box_checksum(x[a:b, c:d], x.shape, (a, c))
                    for a, b in [(0, 5), (5, 37)] for c, d in [(0, 7), (7, 20)])
        assert whole == rows == tiles, dtype


def test_misplaced_bytes_change_the_sum() -> None:
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    whole = box_checksum(x, x.shape, (0, 0))
    swapped = x[[1, 0, *range(2, 8)]]
    assert box_checksum(swapped, x.shape, (0, 0)) != whole
    # the right bytes at the wrong offset (a shard placed one row off)
    assert add([box_checksum(x[:4], x.shape, (0, 0)), box_checksum(x[4:], x.shape, (3, 0))]) != whole
    assert box_checksum(torch.zeros(3, 3), (3, 3), (0, 0)) == 0
