"""A check the delta kernel tests share: one push of a DeltaSender's tensors compared by its kernels, then
again from the same reference by the torch ops, both bit for bit alike."""

from __future__ import annotations

from typing import Any

import torch


def push_both_ways(sender: Any, version: int, where: Any = None,
                   ref_done: bool | None = None) -> dict[int, Any]:
    """``sender`` (a DeltaSender whose reference holds ``version - 1``) pushes ``version`` comparing with
    its kernels, then, its reference restored, with the torch ops: both must find the same positions
    (int64) and values and leave the same reference, equal to the tensors' words. ``ref_done``: whether
    the kernels must have put the changes into the reference themselves (the torch ops never do).
    ``where`` names the case in assertion messages. Returns the kernels' (positions, values) by word
    size."""
    before = {w: sp.ref.clone() for w, sp in sender._spaces.items()}
    sender.use_kernels = True
    sender.start()
    sender.compare_all()
    if ref_done is not None:
        assert all(sp.ref_done == ref_done for sp in sender._spaces.values()), where
    got = {w: (sp.idx.clone(), sp.vals.clone()) for w, sp in sender._spaces.items()}
    sender.finish(version, True)
    sender.settle()  # the reference's update on a GPU's side stream
    after = {w: sp.ref.clone() for w, sp in sender._spaces.items()}
    for w, sp in sender._spaces.items():
        sp.ref.copy_(before[w])
    sender.use_kernels = False
    sender.ref_version = version - 1
    sender.start()
    sender.compare_all()
    assert not any(sp.ref_done for sp in sender._spaces.values()), where
    for w, sp in sender._spaces.items():
        idx, vals = got[w]
        assert idx.dtype == sp.idx.dtype == torch.int64, (where, w)
        assert torch.equal(idx, sp.idx), (where, w)
        assert torch.equal(vals, sp.vals), (where, w)
    sender.finish(version, True)
    sender.settle()  # the reference's update on a GPU's side stream
    for w, sp in sender._spaces.items():
        assert torch.equal(after[w], sp.ref), (where, w)
        assert torch.equal(sp.ref, torch.cat([sender._views[k] for k in sp.keys])), (where, w)
    assert sender.ref_version == version, where
    return got
