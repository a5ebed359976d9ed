"""Validation: bounds of every box in its local tensor, destinations that do not overlap themselves,
and the local-memory overlap checks the ``Plan`` runs before any byte moves."""

from __future__ import annotations

import numpy as np

from weightsync.errors import LayoutError
from weightsync.plan.intersect import (
    _first_overlap,
    _ranks_text,
)
from weightsync.plan.layout import Layout
from weightsync.plan.ops import (
    _BIG,
    _ITEMSIZE,
)

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


class _Checks:
    """The planner's checks on its inputs (a mixin of ``_Planner``)."""

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
                ri, rj = lay.box(i), lay.box(j)
                raise LayoutError(
                    f"overlapping destination pieces: on destination ranks "
                    f"{_ranks_text(self.dst_ranks_of[c])} "
                    f"pieces of {ri.name!r} and {rj.name!r} share bytes of local tensor {ri.key!r}")
