"""Source choice and scheduling: one source per piece (bytes balanced per NIC and GPU, same-host
sources preferred), writes coalesced, and each source's writes ordered in rounds so that every
destination has as few writers at a time as possible."""

from __future__ import annotations

import heapq
import itertools
from typing import Any

import numpy as np

from weightsync.errors import PlanError
from weightsync.plan.intersect import (
    _group_bounds,
)
from weightsync.plan.ops import (
    T_NONE,
)


class _Scheduling:
    """The planner's source choice and round scheduling (a mixin of ``_Planner``)."""

    def _choose_sources(self) -> None:
        """One source rank per piece: same host first, then water-filling of bytes per NIC and GPU."""
        P, h = self.P, self.H
        n = len(P["hb"])
        nsc = len(self.src_classes)
        ent_bounds = np.searchsorted(h.ent_hb, np.arange(len(h.tensor) + 1))
        ecount = np.diff(ent_bounds)
        # candidate group of each holder box: its class when one class holds it, else the class set
        grp_of_hb = np.where(ecount == 1, h.ent_class[np.minimum(ent_bounds[:-1], len(h.ent_class) - 1)], -1)
        sigs: dict[tuple[int, ...], int] = {}
        group_classes: list[tuple[int, ...]] = [(c,) for c in range(nsc)]
        for b in np.nonzero(ecount > 1)[0]:
            sig = tuple(int(x) for x in h.ent_class[ent_bounds[b]:ent_bounds[b + 1]])
            g = sigs.get(sig)
            if g is None:
                g = sigs[sig] = len(group_classes)
                group_classes.append(sig)
            grp_of_hb[b] = g
        grp = grp_of_hb[P["hb"]]
        load = np.zeros(self.T, np.float64)
        nic_load = np.zeros(int(self.src_nic.max()) + 1, np.float64)
        src = np.full(n, -1, np.int64)
        # sub-groups (group, restricted host); order by size so that big shard groups go first and
        # widely replicated small tensors fill in the gaps
        dh = self.dst_host[P["dst"]]
        order_g = np.argsort(grp, kind="stable")
        bounds = _group_bounds(grp[order_g])
        work: list[tuple[float, np.ndarray, np.ndarray]] = []
        for a, b in itertools.pairwise(bounds):
            idx = order_g[a:b]
            g = int(grp[idx[0]])
            ranks = np.concatenate([self.src_ranks_of[c] for c in group_classes[g]])
            ranks.sort()
            rhosts = self.src_host[ranks]
            local = np.isin(dh[idx], rhosts)
            if local.any():
                li = idx[local]
                for hval in np.unique(dh[li]):
                    sub = li[dh[li] == hval]
                    work.append((float(P["nbytes"][sub].sum()), sub, ranks[rhosts == hval]))
            rem = idx[~local]
            if len(rem):
                work.append((float(P["nbytes"][rem].sum()), rem, ranks))
        src = np.full(n, -1, np.int64)
        drow_span = int(P["drow"].max()) + 1 if n else 1
        work.sort(key=lambda x: -x[0] / max(len(x[2]), 1))
        for _, idx, ranks in work:
            # Every destination's bytes from this group are cut into one contiguous share per rank (by
            # bytes, proportional to the rank's water-filled capacity per NIC): every source of the
            # group then writes about the same to every destination, which is what lets the rounds
            # (see _rounds) keep two writers on every destination at all times. The cut is rotated
            # per destination so that rounding does not always favour the same rank.
            dst_i = P["dst"][idx]
            o = np.argsort(dst_i * drow_span + P["drow"][idx], kind="stable")
            idx, dst_i = idx[o], dst_i[o]
            nb = P["nbytes"][idx].astype(np.float64)
            total = nb.sum()
            un, inv = np.unique(self.src_nic[ranks], return_inverse=True)
            nl = nic_load[un]
            level = _water_level(nl, total)
            cap = np.maximum(level - nl, 0.0)[inv] / np.bincount(inv, minlength=len(un))[inv]
            if cap.sum() <= 0:
                cap = np.ones(len(ranks))
            edges = np.cumsum(cap) / cap.sum()
            cum = np.cumsum(nb)
            first = np.ones(len(idx), bool)
            first[1:] = dst_i[1:] != dst_i[:-1]
            base = np.maximum.accumulate(np.where(first, cum - nb, 0.0))
            gid = np.cumsum(first) - 1
            dtot = np.bincount(gid, weights=nb)[gid]
            frac = (cum - nb / 2 - base) / np.maximum(dtot, 1e-300)
            frac = (frac + dst_i * 0.6180339887498949) % 1.0
            which = np.minimum(np.searchsorted(edges, frac, side="right"), len(ranks) - 1)
            chosen = ranks[which]
            src[idx] = chosen
            np.add.at(load, chosen, nb)
            np.add.at(nic_load, self.src_nic[chosen], nb)
        P["src"] = src
        # the holder entry (class, row) of the chosen rank's class gives the local address
        cls = self.src_class_of[src].astype(np.int64)
        ekey = h.ent_hb * nsc + h.ent_class
        pos = np.searchsorted(ekey, P["hb"] * nsc + cls)
        P["srow"] = h.ent_row[pos]
        self.stats["pieces"] = int(n)

    def _rounds(self, ops: np.ndarray) -> np.ndarray:
        """Rounds: a round is one source's visit to one destination; a source visits each destination it
        serves ``cycles`` times (about ``round_bytes`` per visit, at least once).

        Priority comes from one cyclic order shared by all sources (destination d owns the arc
        [d/R, (d+1)/R) of the cycle), each source starting at its own phase: rank n of the m ranks of
        a class of equal layouts starts n/m of the way round, and class c of C adds c/(C m). So the
        sources start on different destinations, T/R of them on each, and move on in step.

        Start times come from a list schedule in bytes-as-time on that priority: a destination takes
        up to T/R writers at a time (one where sources and destinations are as many), each at 1/(T/R)
        of its link; whenever a destination has room and a source is free, the destination takes the
        free source's unit with the earliest arc. A source delayed by a large unit does not leave its
        next destination idle: another source's unit goes first. Rounds are numbered per source in
        order of planned start, which is also stored (as a fraction of the push) in ``not_before``
        for engines that pace their rounds.
        """
        n = len(ops)
        if n == 0:
            return np.zeros(0, np.int32)
        R = max(self.R, 1)
        nb = (ops["rows"] * ops["row_bytes"]).astype(np.float64)
        pair = ops["src_rank"].astype(np.int64) * R + ops["dst_rank"]
        # dense relabelling of the (source, destination) pairs without sorting millions of ops
        seen = np.bincount(pair, minlength=self.T * R) > 0
        pu = np.nonzero(seen)[0]
        relabel = np.cumsum(seen) - 1
        pinv = relabel[pair]
        pb = np.bincount(pinv, weights=nb, minlength=len(pu))
        local = self.src_host[pu // R] == self.dst_host[pu % R]
        unit = np.where(local, max(self.local_round_bytes, 1), max(self.round_bytes, 1))
        cycles = max(1, round(float((pb / unit).mean())))
        self.stats["cycles"] = cycles
        if cycles == 1:
            unit_of_op = pinv
            u_pair = np.arange(len(pu))
            u_visit = np.zeros(len(pu), np.int64)
            u_bytes = pb
        else:
            # split each pair's ops (in their order) into `cycles` visits by bytes
            o = np.argsort(pinv, kind="stable")
            cum = np.cumsum(nb[o])
            first = np.ones(n, bool)
            first[1:] = pinv[o][1:] != pinv[o][:-1]
            base = np.maximum.accumulate(np.where(first, cum - nb[o], 0.0))
            frac = (cum - nb[o] / 2 - base) / np.maximum(pb[pinv[o]], 1e-300)
            visit = np.empty(n, np.int64)
            visit[o] = np.minimum((frac * cycles).astype(np.int64), cycles - 1)
            dense = pinv * cycles + visit
            ub = np.bincount(dense, weights=nb, minlength=len(pu) * cycles)
            used = np.nonzero(ub > 0)[0]
            remap = np.full(len(pu) * cycles, -1, np.int64)
            remap[used] = np.arange(len(used))
            unit_of_op = remap[dense]
            u_pair, u_visit, u_bytes = used // cycles, used % cycles, ub[used]
        u_src = pu[u_pair] // R
        u_dst = pu[u_pair] % R
        ncls = len(self.src_classes)
        phase = np.zeros(self.T)
        for c, ranks in enumerate(self.src_ranks_of):
            m = len(ranks)
            phase[ranks] = (np.arange(m) + c / ncls) / m
        arc = (u_dst / R - phase[u_src]) % 1.0
        arc = np.where(arc > 1.0 - 1.0 / R + 1e-12, arc - 1.0, arc)  # the arc the source starts inside
        u_begin = (arc + u_visit) / cycles
        share = max(1, round(self.T / R))  # writers per destination at a time
        u_start = _list_schedule(u_src, u_dst, u_bytes, u_begin, self.T, R, share)
        horizon = max(float(self.needed_bytes.max(initial=0)), 1.0)
        self.stats["planned_makespan"] = round(float((u_start + u_bytes * share).max()) / horizon, 4)
        # rounds: each source's units in order of planned start
        uo = np.lexsort((np.arange(len(u_src)), u_start, u_src))
        new_src = np.ones(len(uo), bool)
        new_src[1:] = u_src[uo][1:] != u_src[uo][:-1]
        k = np.arange(len(uo))
        u_round = np.empty(len(uo), np.int64)
        u_round[uo] = k - np.maximum.accumulate(np.where(new_src, k, 0))
        ops["not_before"] = (u_start / horizon).astype(np.float32)[unit_of_op]
        return u_round[unit_of_op].astype(np.int32)


def _list_schedule(u_src: np.ndarray, u_dst: np.ndarray, u_bytes: np.ndarray, prio: np.ndarray,
                   T: int, R: int, k: int = 1) -> np.ndarray:
    """Start times of units (bytes as time, every link of speed 1, a destination shared by up to ``k``
    writers at 1/k each): a destination with a free place takes, among its pending units whose source
    is free, the one of lowest ``prio``; a freed source offers its pending units, lowest ``prio``
    first, to destinations with a free place."""
    nu = len(u_src)
    order = np.lexsort((np.arange(nu), prio))
    by_dst: list[list[int]] = [[] for _ in range(R)]
    by_src: list[list[int]] = [[] for _ in range(T)]
    for u in order.tolist():
        by_dst[int(u_dst[u])].append(u)
        by_src[int(u_src[u])].append(u)
    done = np.zeros(nu, bool)
    d_busy = np.zeros(R, bool)
    d_active = np.zeros(R, np.int64)
    s_busy = np.zeros(T, bool)
    d_ptr = [0] * R
    s_ptr = [0] * T
    start = np.zeros(nu)
    heap: list[tuple[float, int]] = []
    us, ud, ub = u_src.tolist(), u_dst.tolist(), u_bytes.tolist()

    def launch(u: int, now: float) -> None:
        done[u] = True
        d_active[ud[u]] += 1
        d_busy[ud[u]] = d_active[ud[u]] >= k
        s_busy[us[u]] = True
        start[u] = now
        heapq.heappush(heap, (now + ub[u] * k, u))

    def try_next(lst: list[int], ptr: list[int], i: int, now: float, other_busy: Any, other: Any) -> None:
        # Launch the first unit of queue i (a destination's or a source's) whose other end is free.
        while ptr[i] < len(lst) and done[lst[ptr[i]]]:
            ptr[i] += 1
        for k in range(ptr[i], min(len(lst), ptr[i] + 64)):
            u = lst[k]
            if not done[u] and not other_busy[other[u]]:
                launch(u, now)
                return

    for u in order.tolist():
        if not d_busy[ud[u]] and not s_busy[us[u]]:
            launch(u, 0.0)
    while heap:
        now, u = heapq.heappop(heap)
        d, s = ud[u], us[u]
        d_active[d] -= 1
        d_busy[d] = False
        s_busy[s] = False
        try_next(by_dst[d], d_ptr, d, now, s_busy, us)
        if not s_busy[s]:
            try_next(by_src[s], s_ptr, s, now, d_busy, ud)
    if not done.all():  # units never reachable within the scan window: run them after the rest
        t = float((start + u_bytes).max(initial=0.0))
        for u in np.nonzero(~done)[0]:
            start[u] = t
            t += ub[u]
    return start


def _water_level(loads: np.ndarray, total: float) -> float:
    """Level L with sum(max(0, L - loads)) == total."""
    s = np.sort(loads)
    csum = np.cumsum(s)
    m = np.arange(1, len(s) + 1)
    lv = (total + csum) / m  # level if the lowest m bins are filled
    nxt = np.append(s[1:], np.inf)
    ok = np.nonzero(lv <= nxt)[0]
    return float(lv[ok[0]]) if len(ok) else float(lv[-1])


# ==================================================================================================
# Coalescing and rounds


def _coalesce(ops: np.ndarray) -> np.ndarray:
    """Merge writes that continue each other on both sides (same source, destination, local tensors)."""
    if len(ops) < 2:
        return ops
    # group by (source, destination, local tensors, transform), then by destination offset: merges
    # happen where both sides advance together. One composite int64 key keeps the sort cheap.
    nk = int(max(ops["src_key"].max(), ops["dst_key"].max())) + 2
    nr = int(ops["dst_rank"].max()) + 1
    if int(ops["src_rank"].max() + 1) * nr * nk * nk * 4 >= 2**62:
        raise PlanError("too many ranks and local tensors to coalesce with one sort key")
    k = ((ops["src_rank"].astype(np.int64) * nr + ops["dst_rank"]) * nk + ops["src_key"] + 1) * nk
    k = (k + ops["dst_key"]) * 4 + ops["transform"]
    o2 = np.argsort(k, kind="stable")
    ks, offs = k[o2], ops["dst_offset"][o2]
    if np.any((ks[1:] == ks[:-1]) & (offs[1:] < offs[:-1])):  # pieces came out of offset order
        o2 = np.lexsort((ops["dst_offset"], k))
        ks = k[o2]
    # only neighbours with equal keys can merge; test the byte arithmetic on those alone, and leave
    # the ops where they are (no copy of millions of records) when nothing merges
    cand = np.nonzero((ks[1:] == ks[:-1]) & (ops["src_key"][o2[:-1]] >= 0))[0]
    if len(cand) == 0:
        return ops
    a, b = ops[o2[cand]], ops[o2[cand + 1]]
    same = (a["transform"] == T_NONE) | (a["tensor"] == b["tensor"])
    contiguous = (same & (a["rows"] == 1) & (b["rows"] == 1)
                  & (a["transform"] == T_NONE)
                  & (b["src_offset"] == a["src_offset"] + a["row_bytes"])
                  & (b["dst_offset"] == a["dst_offset"] + a["row_bytes"]))
    stacked = (same & (a["rows"] > 1) & (b["rows"] > 1) & (a["row_bytes"] == b["row_bytes"])
               & (a["src_pitch"] == b["src_pitch"]) & (a["dst_pitch"] == b["dst_pitch"])
               & (b["src_offset"] == a["src_offset"] + a["rows"] * a["src_pitch"])
               & (b["dst_offset"] == a["dst_offset"] + a["rows"] * a["dst_pitch"]))
    kind = np.zeros(len(ops) - 1, np.int64)
    kind[cand] = np.where(contiguous, 1, np.where(stacked, 2, 0))
    if not kind.any():
        return ops
    ops = ops[o2]
    # a chain must be all-contiguous or all-stacked: break where the kind changes
    prev_kind = np.concatenate([[0], kind[:-1]])
    join = (kind > 0) & ((prev_kind == 0) | (prev_kind == kind))
    start = np.concatenate([[True], ~join])
    seg = np.cumsum(start) - 1
    heads = np.nonzero(start)[0]
    out = ops[heads].copy()
    rb = np.bincount(seg, weights=ops["row_bytes"]).astype(np.int64)
    rows = np.bincount(seg, weights=ops["rows"]).astype(np.int64)
    nxt_kind = np.concatenate([kind, [0]])
    seg_kind = nxt_kind[heads]
    merged = np.bincount(seg, minlength=len(heads)) > 1
    c = merged & (seg_kind == 1)
    out["row_bytes"] = np.where(c, rb, out["row_bytes"])
    out["src_pitch"] = np.where(c, out["row_bytes"], out["src_pitch"])
    out["dst_pitch"] = np.where(c, out["row_bytes"], out["dst_pitch"])
    s = merged & (seg_kind == 2)
    out["rows"] = np.where(s, rows, out["rows"])
    return out
