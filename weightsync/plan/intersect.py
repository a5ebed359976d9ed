"""Intersection: boxes the destinations need against the boxes the sources hold (columnar helpers on
boxes, and the distinct holder boxes with the ranks that hold them)."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from weightsync.errors import PlanError
from weightsync.plan.layout import Layout
from weightsync.plan.ops import (
    _BIG,
    T_FP8,
)

# ==================================================================================================
# Helpers on boxes


def _pad(a: np.ndarray, width: int, fill: int) -> np.ndarray:
    if a.shape[1] == width:
        return a
    out = np.full((a.shape[0], width), fill, dtype=a.dtype)
    out[:, width - a.shape[1]:] = a
    return out


def _classes(layouts: Sequence[Layout]) -> tuple[list[Layout], np.ndarray]:
    """Distinct layouts and the class of every rank (equal layouts are planned once)."""
    by_id: dict[int, int] = {}
    by_fp: dict[str, int] = {}
    classes: list[Layout] = []
    class_of = np.zeros(len(layouts), np.int32)
    for r, lay in enumerate(layouts):
        c = by_id.get(id(lay))
        if c is None:
            fp = lay.fingerprint()
            c = by_fp.get(fp)
            if c is None:
                c = by_fp[fp] = len(classes)
                classes.append(lay)
            by_id[id(lay)] = c
        class_of[r] = c
    return classes, class_of


def _ranks_text(ranks: np.ndarray | Sequence[int], limit: int = 8) -> str:
    ranks = [int(x) for x in ranks]
    s = ", ".join(str(x) for x in ranks[:limit])
    return f"[{s}{', ...' if len(ranks) > limit else ''}]"


def _group_bounds(sorted_keys: np.ndarray) -> np.ndarray:
    """Start indices of runs of equal values in a sorted array, plus len at the end."""
    if len(sorted_keys) == 0:
        return np.zeros(1, np.int64)
    change = np.nonzero(sorted_keys[1:] != sorted_keys[:-1])[0] + 1
    return np.concatenate([[0], change, [len(sorted_keys)]]).astype(np.int64)


def _split_dims(tensor: np.ndarray, lo: np.ndarray, shape: np.ndarray, ntensors: int) -> np.ndarray:
    """Per tensor: the one dimension along which its boxes differ (0 if none), -1 if several."""
    width = lo.shape[1]
    mn_lo = np.full((ntensors, width), np.iinfo(np.int64).max)
    mx_lo = np.full((ntensors, width), np.iinfo(np.int64).min)
    mn_sh = mn_lo.copy()
    mx_sh = mx_lo.copy()
    for d in range(width):
        np.minimum.at(mn_lo[:, d], tensor, lo[:, d])
        np.maximum.at(mx_lo[:, d], tensor, lo[:, d])
        np.minimum.at(mn_sh[:, d], tensor, shape[:, d])
        np.maximum.at(mx_sh[:, d], tensor, shape[:, d])
    varies = (mn_lo != mx_lo) | (mn_sh != mx_sh)
    nvar = varies.sum(axis=1)
    split = np.where(nvar == 0, 0, np.argmax(varies, axis=1))
    return np.where(nvar > 1, -1, split).astype(np.int64)


def _tensors_with_overlap(tensor: np.ndarray, lo: np.ndarray, shape: np.ndarray,
                          ntensors: int) -> np.ndarray:
    """Ids of tensors two of whose (non-empty) boxes share an element."""
    keep = np.all(shape > 0, axis=1)
    t, lo, shape = tensor[keep].astype(np.int64), lo[keep], shape[keep]
    if len(t) < 2:
        return np.zeros(0, np.int64)
    split = _split_dims(t, lo, shape, ntensors)
    sd = split[t]
    simple = sd >= 0
    bad: list[np.ndarray] = []
    # Boxes of a tensor that differ in one dimension only: sort along it; a box starting before the
    # furthest end seen so far in its tensor overlaps an earlier one.
    si = np.nonzero(simple)[0]
    if len(si) > 1:
        k = sd[si]
        start = lo[si, k]
        end = start + shape[si, k]
        order = np.lexsort((start, t[si]))
        ts, ss, es = t[si][order], start[order], end[order]
        run_end = np.maximum.accumulate(es + ts * _BIG)
        hit = np.nonzero((ts[1:] == ts[:-1]) & (ss[1:] + ts[1:] * _BIG < run_end[:-1]))[0]
        bad.append(ts[hit + 1])
    # Boxes cut along several dimensions: pairwise inside each such tensor (small in practice).
    gi = np.nonzero(~simple)[0]
    if len(gi):
        order = gi[np.argsort(t[gi], kind="stable")]
        bounds = _group_bounds(t[order])
        for a, b in itertools.pairwise(bounds):
            idx = order[a:b]
            if _pairwise(lo[idx], shape[idx]):
                bad.append(t[idx[:1]])
    return np.unique(np.concatenate(bad)) if bad else np.zeros(0, np.int64)


def _pairwise(lo: np.ndarray, shape: np.ndarray) -> list[tuple[int, int]]:
    hi = lo + shape
    inter = np.all(np.maximum(lo[:, None, :], lo[None, :, :]) < np.minimum(hi[:, None, :], hi[None, :, :]),
                   axis=2)
    ii, jj = np.nonzero(np.triu(inter, k=1))
    return [(int(a), int(b)) for a, b in zip(ii, jj, strict=True)]


def _first_overlap(tensor: np.ndarray, lo: np.ndarray, shape: np.ndarray,
                   ntensors: int) -> tuple[int, int] | None:
    """A pair (i, j) of rows whose boxes of the same tensor share an element, or None."""
    bad = _tensors_with_overlap(tensor, lo, shape, ntensors)
    if len(bad) == 0:
        return None
    idx = np.nonzero((tensor == bad[0]) & np.all(shape > 0, axis=1))[0]
    pairs = _pairwise(lo[idx], shape[idx])
    return (int(idx[pairs[0][0]]), int(idx[pairs[0][1]])) if pairs else None


def _row_hash(a: np.ndarray) -> np.ndarray:
    """A 64-bit hash per row of an int64 matrix (FNV-style mixing): one key that sorts fast."""
    h = np.zeros(len(a), np.uint64)
    with np.errstate(over="ignore"):
        for j in range(a.shape[1]):
            h = (h ^ a[:, j].astype(np.uint64)) * np.uint64(0x100000001B3)
            h ^= h >> np.uint64(29)
    return h


def _unique_rows(a: np.ndarray) -> np.ndarray:
    """Distinct rows of an int64 matrix (sorted by a 64-bit hash of the row; much faster than
    ``np.unique(axis=0)``; rows that collide stay distinct only if they differ, so the result is exact
    up to duplicates surviving a collision, which is harmless where it is used)."""
    if len(a) == 0:
        return a
    o = np.argsort(_row_hash(a), kind="stable")
    b = a[o]
    keep = np.ones(len(b), bool)
    keep[1:] = np.any(b[1:] != b[:-1], axis=1)
    return b[keep]


def _box_minus(alo: np.ndarray, ahi: np.ndarray, blo: np.ndarray, bhi: np.ndarray
               ) -> list[tuple[np.ndarray, np.ndarray]]:
    """Box a minus box b as at most 2*ndim disjoint boxes."""
    if not np.all(np.maximum(alo, blo) < np.minimum(ahi, bhi)):
        return [(alo.copy(), ahi.copy())]
    out = []
    lo, hi = alo.copy(), ahi.copy()
    for d in range(len(alo)):
        if lo[d] < blo[d]:
            h = hi.copy()
            h[d] = blo[d]
            out.append((lo.copy(), h))
            lo[d] = blo[d]
        if hi[d] > bhi[d]:
            lo2 = lo.copy()
            lo2[d] = bhi[d]
            out.append((lo2, hi.copy()))
            hi[d] = bhi[d]
    return out


# ==================================================================================================
# Holder boxes: distinct source boxes, each with the (class, row) pairs that hold it


@dataclass
class _Holders:
    tensor: np.ndarray   # [H]
    lo: np.ndarray       # [H, W]
    shape: np.ndarray    # [H, W]
    ent_hb: np.ndarray   # [E] holder box of each entry, sorted by (hb, class)
    ent_class: np.ndarray
    ent_row: np.ndarray  # global source row index
    split: np.ndarray    # per tensor: the one dim its boxes are cut along, or -1


def _build_holders(tensor: np.ndarray, lo: np.ndarray, shape: np.ndarray, cls: np.ndarray,
                   row: np.ndarray, ntensors: int) -> _Holders:
    width = lo.shape[1]
    keep = np.all(shape > 0, axis=1)
    tensor, lo, shape, cls, row = tensor[keep], lo[keep], shape[keep], cls[keep], row[keep]
    if len(tensor) == 0:
        z = np.zeros(0, np.int64)
        return _Holders(z.astype(np.int32), np.zeros((0, width), np.int64), np.zeros((0, width), np.int64),
                        z, z.astype(np.int32), z, np.zeros(ntensors, np.int64))
    boxes = np.concatenate([tensor[:, None].astype(np.int64), lo, shape], axis=1)
    # group equal boxes: sort by a 64-bit hash (one key sorts fast), then split runs where the box
    # itself changes; a hash collision only splits a group, which the overlap check below repairs
    order0 = np.argsort(_row_hash(boxes), kind="stable")
    bs = boxes[order0]
    new = np.ones(len(bs), bool)
    new[1:] = np.any(bs[1:] != bs[:-1], axis=1)
    gid = np.cumsum(new) - 1
    inv = np.empty(len(bs), np.int64)
    inv[order0] = gid
    uniq = bs[new]
    h_t, h_lo, h_sh = uniq[:, 0].astype(np.int32), uniq[:, 1:1 + width], uniq[:, 1 + width:]
    nc = int(cls.max()) + 1
    order = np.argsort(inv * nc + cls, kind="stable")  # by (box, class), rows in input order
    e_hb, e_cls, e_row = inv[order], cls[order], row[order]
    # one entry per (box, class): a class holding the same box twice adds no choice
    first = np.ones(len(e_hb), bool)
    first[1:] = (e_hb[1:] != e_hb[:-1]) | (e_cls[1:] != e_cls[:-1])
    e_hb, e_cls, e_row = e_hb[first], e_cls[first], e_row[first]
    hold = _Holders(h_t, h_lo, h_sh, e_hb.astype(np.int64), e_cls.astype(np.int32), e_row.astype(np.int64),
                    np.zeros(ntensors, np.int64))
    # Distinct boxes of one tensor must not overlap, otherwise a destination byte would be sent twice.
    bad_t = _tensors_with_overlap(h_t, h_lo, h_sh, ntensors)
    if len(bad_t):
        hold = _disjointify(hold, [int(x) for x in bad_t])
    hold.split = _split_dims(hold.tensor, hold.lo, hold.shape, ntensors)
    return hold


def _disjointify(h: _Holders, bad_tensors: list[int]) -> _Holders:
    """Rewrite the boxes of tensors whose source boxes overlap (one source holds the full tensor, others
    shards, ...) into disjoint boxes, each held by every class that holds all of it."""
    bad = np.isin(h.tensor, bad_tensors)
    new_t: list[int] = []
    new_lo: list[np.ndarray] = []
    new_hi: list[np.ndarray] = []
    new_ent: list[list[tuple[int, int]]] = []
    ent_bounds = np.searchsorted(h.ent_hb, np.arange(len(h.tensor) + 1))
    for t in bad_tensors:
        pieces: list[tuple[np.ndarray, np.ndarray, list[tuple[int, int]]]] = []
        for b in np.nonzero(h.tensor == t)[0]:
            holders = [(int(h.ent_class[e]), int(h.ent_row[e]))
                       for e in range(ent_bounds[b], ent_bounds[b + 1])]
            rest = [(h.lo[b].copy(), h.lo[b] + h.shape[b])]
            updated = []
            for plo, phi, ph in pieces:
                ilo, ihi = np.maximum(plo, h.lo[b]), np.minimum(phi, h.lo[b] + h.shape[b])
                if np.all(ilo < ihi):
                    for mlo, mhi in _box_minus(plo, phi, ilo, ihi):
                        updated.append((mlo, mhi, ph))
                    updated.append((ilo, ihi, ph + [x for x in holders if x[0] not in {c for c, _ in ph}]))
                    nxt = []
                    for rlo, rhi in rest:
                        nxt.extend(_box_minus(rlo, rhi, ilo, ihi))
                    rest = nxt
                else:
                    updated.append((plo, phi, ph))
            pieces = updated + [(rlo, rhi, list(holders)) for rlo, rhi in rest if np.all(rlo < rhi)]
        for plo, phi, ph in pieces:
            new_t.append(t)
            new_lo.append(plo)
            new_hi.append(phi)
            new_ent.append(sorted(ph))
    keep_b = np.nonzero(~bad)[0]
    remap = np.full(len(h.tensor), -1, np.int64)
    remap[keep_b] = np.arange(len(keep_b))
    ek = remap[h.ent_hb] >= 0
    base = len(keep_b)
    width = h.lo.shape[1]
    t_all = np.concatenate([h.tensor[keep_b], np.array(new_t, np.int32)])
    lo_all = np.concatenate([h.lo[keep_b], np.array(new_lo, np.int64).reshape(-1, width)])
    sh_all = np.concatenate([h.shape[keep_b], (np.array(new_hi, np.int64) - np.array(new_lo, np.int64)
                                               ).reshape(-1, width)])
    e_hb = [remap[h.ent_hb[ek]]]
    e_c = [h.ent_class[ek]]
    e_r = [h.ent_row[ek]]
    for i, ents in enumerate(new_ent):
        e_hb.append(np.full(len(ents), base + i, np.int64))
        e_c.append(np.array([c for c, _ in ents], np.int32))
        e_r.append(np.array([r for _, r in ents], np.int64))
    return _Holders(t_all, lo_all, sh_all, np.concatenate(e_hb), np.concatenate(e_c), np.concatenate(e_r),
                    h.split)


def _join(q_tensor: np.ndarray, q_lo: np.ndarray, q_shape: np.ndarray, h: _Holders
          ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """All non-empty intersections of query boxes with holder boxes of the same tensor.

    Returns (query index, holder box index, intersection lo, intersection shape). Tensors whose holder
    boxes are cut along one dimension (FSDP shards, TP slices) are found by binary search, so a query
    meets only the boxes it overlaps, not every shard of its tensor.
    """
    nh = len(h.tensor)
    width = q_lo.shape[1]
    if nh == 0 or len(q_tensor) == 0:
        z = np.zeros(0, np.int64)
        return z, z, np.zeros((0, width), np.int64), np.zeros((0, width), np.int64)
    sd_h = np.maximum(h.split[h.tensor], 0)
    hstart = h.lo[np.arange(nh), sd_h]
    hend = hstart + h.shape[np.arange(nh), sd_h]
    order = np.lexsort((hstart, h.tensor))
    ht = h.tensor[order].astype(np.int64)
    key_start = ht * _BIG + hstart[order]
    key_end = ht * _BIG + hend[order]
    qt = q_tensor.astype(np.int64)
    sd_q = h.split[q_tensor]
    general = sd_q < 0
    k = np.maximum(sd_q, 0)
    qs = q_lo[np.arange(len(qt)), k]
    qe = qs + q_shape[np.arange(len(qt)), k]
    first = np.searchsorted(key_end, qt * _BIG + qs, side="right")
    last = np.searchsorted(key_start, qt * _BIG + qe, side="left")
    if general.any():
        t_first = np.searchsorted(ht, qt[general], side="left")
        t_last = np.searchsorted(ht, qt[general], side="right")
        first[general] = t_first
        last[general] = t_last
    count = np.maximum(last - first, 0)
    qi = np.repeat(np.arange(len(qt)), count)
    offs = np.arange(int(count.sum())) - np.repeat(np.cumsum(count) - count, count)
    hb = order[np.repeat(first, count) + offs]
    ilo = np.maximum(q_lo[qi], h.lo[hb])
    ihi = np.minimum(q_lo[qi] + q_shape[qi], h.lo[hb] + h.shape[hb])
    ok = np.all(ihi > ilo, axis=1)
    return qi[ok], hb[ok], ilo[ok], (ihi - ilo)[ok]




class _Intersection:
    """The planner's intersection steps (a mixin of ``_Planner``): holder boxes, then pieces."""

    def _holders(self) -> None:
        S = self.S
        lo, sh = S["lo"].copy(), S["shape"].copy()
        self.fp8_tensors = np.nonzero(self.g_transform == T_FP8)[0]
        if len(self.fp8_tensors):
            # Each 128x128 tile gets one owner: the shard holding most of its rows (columns); boundaries
            # inside a tile move to the nearer tile edge. The owner gathers the rest of the tile.
            bm, bn = self.fp8_block  # type: ignore[misc]
            is8 = np.isin(S["tensor"], self.fp8_tensors)
            G = self.g_shape[S["tensor"][is8]]
            for d, b in ((self.W - 2, bm), (self.W - 1, bn)):
                a = lo[is8, d]
                e = a + sh[is8, d]
                g = G[:, d]

                t8 = S["tensor"][is8].astype(np.int64)

                def snap(x: np.ndarray, g: np.ndarray = g, b: int = b, t8: np.ndarray = t8) -> np.ndarray:
                    # nearest tile edge; a boundary in the middle of a tile goes up or down by the
                    # parity of tile and tensor, so that over many tensors no shard owns more tiles
                    k, r = np.divmod(x, b)
                    up = (r > b // 2) | ((r * 2 == b) & ((k + t8) % 2 == 0))
                    s = np.minimum((k + up) * b, g)
                    return np.where((x == 0) | (x == g), x, s)

                na, ne = snap(a), snap(e)
                lo[is8, d] = na
                sh[is8, d] = np.maximum(ne - na, 0)
        self.S["own_lo"], self.S["own_shape"] = lo, sh
        # Every source row of an FP8 tensor is a *box*: the tiles it owns (snapped edges) and where its
        # held part lives locally. FP8 and scale ops read from the owner's box, gathers name boxes.
        self.box_rows = np.nonzero(np.isin(S["tensor"], self.fp8_tensors))[0] if len(self.fp8_tensors) \
            else np.zeros(0, np.int64)
        self.box_of_row = np.full(len(S["tensor"]), -1, np.int64)
        self.box_of_row[self.box_rows] = np.arange(len(self.box_rows))
        h = _build_holders(S["tensor"], lo, sh, S["class"], np.arange(len(S["tensor"])), len(self.names))
        if self.scale_of:
            bm, bn = self.fp8_block  # type: ignore[misc]
            W = self.W
            parts_t, parts_lo, parts_sh, e_hb, e_c, e_r = [h.tensor], [h.lo], [h.shape], [h.ent_hb], \
                [h.ent_class], [h.ent_row]
            base = len(h.tensor)
            scale_for = np.full(len(self.names), -1, np.int64)
            for g, w in self.scale_of.items():
                scale_for[w] = g
            sel = np.nonzero(scale_for[h.tensor] >= 0)[0]
            slo = h.lo[sel].copy()
            shi = h.lo[sel] + h.shape[sel]
            for d, b in ((W - 2, bm), (W - 1, bn)):
                slo[:, d] = slo[:, d] // b
                shi[:, d] = -(-shi[:, d] // b)
            parts_t.append(scale_for[h.tensor[sel]].astype(np.int32))
            parts_lo.append(slo)
            parts_sh.append(shi - slo)
            remap = np.full(len(h.tensor), -1, np.int64)
            remap[sel] = base + np.arange(len(sel))
            m = remap[h.ent_hb] >= 0
            e_hb.append(remap[h.ent_hb[m]])
            e_c.append(h.ent_class[m])
            e_r.append(h.ent_row[m])
            h = _Holders(np.concatenate(parts_t), np.concatenate(parts_lo), np.concatenate(parts_sh),
                         np.concatenate(e_hb), np.concatenate(e_c), np.concatenate(e_r), h.split)
            o = np.lexsort((h.ent_class, h.ent_hb))
            h.ent_hb, h.ent_class, h.ent_row = h.ent_hb[o], h.ent_class[o], h.ent_row[o]
            h.split = _split_dims(h.tensor, h.lo, h.shape, len(self.names))
        self.H = h

    def _pieces(self) -> None:
        D, h = self.D, self.H
        qi, hb, ilo, ish = _join(D["tensor"], D["lo"], D["shape"], h)
        vol = np.prod(ish, axis=1).astype(np.float64)
        need = np.prod(D["shape"], axis=1).astype(np.float64)
        got = np.bincount(qi, weights=vol, minlength=len(need))
        short = np.nonzero(got < need)[0]
        if len(short):
            i = int(short[0])
            c = int(D["class"][i])
            t = int(D["tensor"][i])
            nd = int(self.g_ndim[t])
            W = self.W
            raise PlanError(
                f"uncovered bytes: destination ranks {_ranks_text(self.dst_ranks_of[c])} need "
                f"{int(need[i] - got[i])} elements of tensor {self.names[t]!r} (box offsets "
                f"{tuple(int(x) for x in D['lo'][i][W - nd:])} shape "
                f"{tuple(int(x) for x in D['shape'][i][W - nd:])})"
                f" that no source holds")
        over = np.nonzero(got > need)[0]
        if len(over):  # cannot happen with disjoint holder boxes; guard the invariant anyway
            i = int(over[0])
            raise PlanError(f"bytes covered twice: tensor {self.names[int(D['tensor'][i])]!r} on "
                            f"destination ranks "
                            f"{_ranks_text(self.dst_ranks_of[int(D['class'][i])])}")
        # expand each piece over the ranks of its destination class
        cls = D["class"][qi]
        nr = np.array([len(r) for r in self.dst_ranks_of], np.int64)[cls]
        rank_base = np.concatenate([[0], np.cumsum([len(r) for r in self.dst_ranks_of])])
        all_ranks = np.concatenate(self.dst_ranks_of) if self.dst_ranks_of else np.zeros(0, np.int64)
        p = np.repeat(np.arange(len(qi)), nr)
        within = np.arange(len(p)) - np.repeat(np.cumsum(nr) - nr, nr)
        self.P = {
            "drow": qi[p], "hb": hb[p], "lo": ilo[p], "shape": ish[p], "base": p,
            "dst": all_ranks[rank_base[cls[p]] + within].astype(np.int64),
        }
        t = D["tensor"][qi[p]]
        self.P["tensor"] = t
        self.P["nbytes"] = np.prod(ish[p], axis=1) * D["esize"][qi[p]]
        self.needed_bytes = np.bincount(self.P["dst"], weights=self.P["nbytes"],
                                        minlength=self.R).astype(np.int64)
