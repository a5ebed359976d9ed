"""FP8 tiles: the whole tiles each source row owns (its held box moved out to tile edges) and the rows
of those tiles other sources hold, gathered to the owner before it quantizes."""

from __future__ import annotations

import numpy as np

from weightsync.errors import PlanError
from weightsync.plan.intersect import (
    _build_holders,
    _join,
)
from weightsync.plan.ops import (
    _ITEMSIZE,
    T_FP8,
    T_SCALE,
    box_dtype,
    gather_dtype,
)


class _Fp8Tiles:
    """The planner's FP8 tile steps (a mixin of ``_Planner``)."""

    def _own_box(self, srow: np.ndarray, scale: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Owned tile box of source rows (element coordinates), or its tile grid where ``scale``."""
        S, W = self.S, self.W
        olo = S["own_lo"][srow].copy()
        ohi = olo + S["own_shape"][srow]
        if scale.any() and self.fp8_block is not None:
            for d, b in ((W - 2, self.fp8_block[0]), (W - 1, self.fp8_block[1])):
                olo[scale, d] = olo[scale, d] // b
                ohi[scale, d] = -(-ohi[scale, d] // b)
        return olo, ohi - olo

    def _boxes(self) -> np.ndarray:
        rows = self.box_rows
        S = self.S
        b = np.zeros(len(rows), box_dtype(self.W))
        b["id"] = np.arange(len(rows))
        b["tensor"] = S["tensor"][rows]
        b["key"] = self.src_key_map[S["key"][rows]]
        b["boff"] = S["boff"][rows]
        for f, col in (("lo", "lo"), ("shape", "shape"), ("strides", "strides"), ("own_lo", "own_lo"),
                       ("own_shape", "own_shape")):
            b[f] = S[col][rows]
        return b

    def _gathers(self) -> np.ndarray:
        """FP8: rows of a tile that its owner does not hold are gathered to it, from a holder on its host
        when there is one. Per (sender, box) the gathered part is the bounding box of the whole tiles
        its FP8 and scale writes touch, less what the sender holds: every row once, however many
        destinations need the tile. Each gather lands dense (row-major, source dtype) at ``offset`` of
        the gatherer's receive buffer; the provider reads it from its box ``pbox``."""
        W = self.W
        gd = gather_dtype(W)
        if not len(self.fp8_tensors):
            return np.zeros(0, gd)
        P, S = self.P, self.S
        tr = self.g_transform[P["tensor"]]
        sel = np.nonzero((tr == T_FP8) | (tr == T_SCALE))[0]
        if len(sel) == 0:
            return np.zeros(0, gd)
        bm, bn = self.fp8_block  # type: ignore[misc]
        srow, src = P["srow"][sel], P["src"][sel]
        is_sc = tr[sel] == T_SCALE
        plo = P["lo"][sel].copy()
        phi = plo + P["shape"][sel]
        G = self.g_shape[S["tensor"][srow]]  # the weight's shape (a scale piece's row is the weight's)
        for d, b in ((W - 2, bm), (W - 1, bn)):
            lo_d = np.where(is_sc, plo[:, d] * b, plo[:, d])
            hi_d = np.where(is_sc, phi[:, d] * b, phi[:, d])
            plo[:, d] = lo_d // b * b
            phi[:, d] = np.minimum(-(-hi_d // b) * b, G[:, d])
        nbox = max(len(self.box_rows), 1)
        key = src.astype(np.int64) * nbox + self.box_of_row[srow]
        uk, inv = np.unique(key, return_inverse=True)
        blo = np.full((len(uk), W), np.iinfo(np.int64).max, np.int64)
        bhi = np.full((len(uk), W), -1, np.int64)
        np.minimum.at(blo, inv, plo)
        np.maximum.at(bhi, inv, phi)
        src_u, box_u = uk // nbox, uk % nbox
        row_u = self.box_rows[box_u]
        olo = S["lo"][row_u]
        ohi = olo + S["shape"][row_u]
        # bounding box minus the held box, dimension by dimension (at most 2W slabs each)
        m_i, m_lo, m_hi = [], [], []
        cur_lo, cur_hi = blo.copy(), bhi.copy()
        for d in range(W):
            below = cur_lo[:, d] < np.minimum(olo[:, d], cur_hi[:, d])
            lo_b, hi_b = cur_lo.copy(), cur_hi.copy()
            hi_b[:, d] = np.minimum(olo[:, d], cur_hi[:, d])
            m_i.append(np.nonzero(below)[0])
            m_lo.append(lo_b[below])
            m_hi.append(hi_b[below])
            above = cur_hi[:, d] > np.maximum(ohi[:, d], cur_lo[:, d])
            lo_a, hi_a = cur_lo.copy(), cur_hi.copy()
            lo_a[:, d] = np.maximum(ohi[:, d], cur_lo[:, d])
            m_i.append(np.nonzero(above)[0])
            m_lo.append(lo_a[above])
            m_hi.append(hi_a[above])
            cur_lo[:, d] = np.clip(cur_lo[:, d], olo[:, d], ohi[:, d])
            cur_hi[:, d] = np.clip(cur_hi[:, d], olo[:, d], ohi[:, d])
        mi = np.concatenate(m_i)
        if len(mi) == 0:
            self.stats["gather_bytes"] = 0
            return np.zeros(0, gd)
        mlo = np.concatenate(m_lo)
        msh = np.concatenate(m_hi) - mlo
        t = S["tensor"][row_u]
        # who holds those rows (original, unsnapped boxes)
        rows8 = self.box_rows
        ho = _build_holders(S["tensor"][rows8], S["lo"][rows8], S["shape"][rows8], S["class"][rows8], rows8,
                            len(self.names))
        qi, hb, ilo, ish = _join(t[mi].astype(np.int32), mlo, msh, ho)
        got = np.bincount(qi, weights=np.prod(ish, axis=1).astype(np.float64), minlength=len(mi))
        short = np.nonzero(got < np.prod(msh, axis=1))[0]
        if len(short):
            raise PlanError(f"FP8 tiles of tensor {self.names[int(t[mi[short[0]]])]!r}: rows the owner "
                            f"(source rank {int(src_u[mi[short[0]]])}) lacks are held by no source")
        gatherer = src_u[mi][qi]
        ghost = self.src_host[gatherer]
        # provider: a rank of a holding class on the gatherer's host, else the class's first rank
        ent_bounds = np.searchsorted(ho.ent_hb, np.arange(len(ho.tensor) + 1))
        nhosts = int(max(self.src_host.max(), self.dst_host.max(initial=0))) + 1
        rank_at = np.full((len(self.src_classes), nhosts), -1, np.int64)
        for c, ranks in enumerate(self.src_ranks_of):
            rank_at[c, self.src_host[ranks[::-1]]] = ranks[::-1]
        cnt = ent_bounds[hb + 1] - ent_bounds[hb]
        rep = np.repeat(np.arange(len(qi)), cnt)
        e = np.repeat(ent_bounds[hb], cnt) + (np.arange(len(rep)) - np.repeat(np.cumsum(cnt) - cnt, cnt))
        cand = rank_at[ho.ent_class[e], ghost[rep]]
        o = np.lexsort((cand < 0, rep))
        firsts = o[np.searchsorted(rep[o], np.arange(len(qi)))]
        first_rank = np.array([int(r[0]) for r in self.src_ranks_of], np.int64)
        provider = np.where(cand[firsts] >= 0, cand[firsts], first_rank[ho.ent_class[e[firsts]]])
        g = np.zeros(len(qi), gd)
        g["provider"] = provider
        g["gatherer"] = gatherer
        g["tensor"] = t[mi][qi]
        g["nbytes"] = np.prod(ish, axis=1) * _ITEMSIZE[self.g_dtype[t[mi][qi]]]
        g["box"] = box_u[mi][qi]
        g["pbox"] = self.box_of_row[ho.ent_row[e[firsts]]]
        g["lo"] = ilo
        g["shape"] = ish
        # receive buffer offsets: per gatherer, in (box, position) order, each gather 16-byte aligned
        order = np.lexsort((*(ilo[:, d] for d in range(W - 1, -1, -1)), g["box"], g["gatherer"]))
        g = g[order]
        size = (g["nbytes"] + 15) // 16 * 16
        first = np.ones(len(g), bool)
        first[1:] = g["gatherer"][1:] != g["gatherer"][:-1]
        cum = np.cumsum(size) - size
        g["offset"] = cum - np.maximum.accumulate(np.where(first, cum, 0))
        self.stats["gather_bytes"] = int(g["nbytes"].sum())
        return g
