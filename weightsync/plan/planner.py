"""The planner: from what every source holds and every destination needs to per-source write lists.

Its steps live in their own modules: intersection (weightsync.plan.intersect), source choice and
rounds (schedule), FP8 tiles (tiles), checks (validate); the ops it emits are described in
weightsync.plan.ops. This module holds the driver (``plan``) and the tables and 2-D block geometry."""

from __future__ import annotations

import difflib
import time
from collections import defaultdict
from collections.abc import Sequence
from typing import Any

import numpy as np

from weightsync.errors import LayoutError, PlanError
from weightsync.plan.intersect import (
    _classes,
    _Intersection,
    _pad,
    _ranks_text,
)
from weightsync.plan.layout import DTYPE_CODE, DTYPES, UNKNOWN, Layout, as_layout, is_float8
from weightsync.plan.ops import (
    _ITEMSIZE,
    LOCAL_ROUND_BYTES,
    OP_DTYPE,
    ROUND_BYTES,
    SCALE_SUFFIX,
    T_CAST,
    T_FP8,
    T_NONE,
    T_SCALE,
    Plan,
)
from weightsync.plan.schedule import _coalesce, _Scheduling
from weightsync.plan.tiles import _Fp8Tiles
from weightsync.plan.validate import _Checks

# ==================================================================================================
# The planner


def plan(sources: Sequence[Any], destinations: Sequence[Any], *,
         source_hosts: Sequence[Any] | None = None, destination_hosts: Sequence[Any] | None = None,
         source_nics: Sequence[Any] | None = None, allow_cast: bool = False,
         fp8_block: tuple[int, int] | None = None, round_bytes: int = ROUND_BYTES,
         local_round_bytes: int = LOCAL_ROUND_BYTES, coalesce: bool = True, validate: bool = True) -> Plan:
    """Plan the writes that bring every destination up to date from the sources.

    ``sources[i]`` / ``destinations[j]`` are layouts (:class:`~weightsync.plan.layout.Layout`, or anything
    :func:`~weightsync.plan.layout.as_layout` reads); their list index is the rank. ``source_hosts`` and
    ``destination_hosts`` give a host id per rank: a destination takes a piece from a source on its own
    host whenever one holds it (the ``cuda`` transport). ``source_nics`` gives a NIC id per source rank
    (default: one NIC per GPU); bytes are balanced per NIC, then per GPU.

    ``allow_cast`` lets a destination hold a different float dtype than the sources (cast on the
    sender). ``fp8_block=(128, 128)`` lets destinations hold FP8 weights with block scales: a
    destination tensor ``W`` in ``float8_*`` with a ``W_scale_inv`` (float32) beside it; each tile is
    quantized by one sender, rows of a tile held by another shard are gathered to it first.

    ``round_bytes`` bounds the bytes of one round of one source (finer rounds let the scheduler keep
    every destination fed by one writer at a time); ``local_round_bytes`` is the same for a source and
    destination on one host (copy engines, about 16x a NIC's bytes per second: rounds of about the same
    time, so that sources a little out of step collide on a destination as rarely over NVLink).

    Raises :class:`LayoutError` for inconsistent layouts, :class:`PlanError` when the sources do not
    cover what the destinations need.
    """
    return _Planner(sources, destinations, source_hosts, destination_hosts, source_nics, allow_cast,
                    fp8_block, round_bytes, local_round_bytes, coalesce, validate).run()


class _Planner(_Intersection, _Checks, _Fp8Tiles, _Scheduling):
    def __init__(self, sources: Sequence[Any], destinations: Sequence[Any], source_hosts: Any,
                 destination_hosts: Any, source_nics: Any, allow_cast: bool,
                 fp8_block: tuple[int, int] | None, round_bytes: int, local_round_bytes: int, coalesce: bool,
                 validate: bool) -> None:
        self.src_layouts = [as_layout(x) for x in sources]
        self.dst_layouts = [as_layout(x) for x in destinations]
        self.T = len(self.src_layouts)
        self.R = len(self.dst_layouts)
        if self.T == 0:
            raise PlanError("no sources")
        self.allow_cast = allow_cast
        self.fp8_block = fp8_block
        self.round_bytes = int(round_bytes)
        self.local_round_bytes = int(local_round_bytes)
        if self.round_bytes < 1 or self.local_round_bytes < 1:
            raise PlanError(f"round_bytes ({self.round_bytes}) and local_round_bytes "
                            f"({self.local_round_bytes}) must be at least 1")
        self.coalesce = coalesce
        self.validate = validate
        hosts = list(source_hosts) if source_hosts is not None else [("src", i) for i in range(self.T)]
        dhosts = (list(destination_hosts) if destination_hosts is not None
                  else [("dst", j) for j in range(self.R)])
        if len(hosts) != self.T or len(dhosts) != self.R:
            raise PlanError("source_hosts/destination_hosts must have one entry per rank")
        host_ids: dict[Any, int] = {}
        self.src_host = np.array([host_ids.setdefault(h, len(host_ids)) for h in hosts], np.int64)
        self.dst_host = np.array([host_ids.setdefault(h, len(host_ids)) for h in dhosts], np.int64)
        nics = list(source_nics) if source_nics is not None else list(range(self.T))
        if len(nics) != self.T:
            raise PlanError("source_nics must have one entry per source rank")
        nic_ids: dict[Any, int] = {}
        self.src_nic = np.array([nic_ids.setdefault(n, len(nic_ids)) for n in nics], np.int64)
        self.stats: dict[str, Any] = {}


    # ----------------------------------------------------------------------------------------------
    def run(self) -> Plan:
        times: dict[str, float] = {}
        t0 = time.perf_counter()

        def lap(name: str) -> None:
            nonlocal t0
            t1 = time.perf_counter()
            times[name] = round(t1 - t0, 3)
            t0 = t1

        self._classes()
        self._tensor_table()
        self._rows()
        lap("tables")
        self._check_bounds()
        self._check_destinations()
        lap("checks")
        if self.R == 0:
            # Every destination is gone (all reported dead, replacements not joined yet): nothing to
            # write, and the sources must still get a plan (of no ops) rather than an error.
            self.stats.update(writes=0, dest_bytes_max=0, seconds=times)
            return Plan(np.zeros(0, OP_DTYPE), self.T, 0, self.keys, self.names,
                        [DTYPES[int(c)] for c in self.g_dtype], [DTYPES[int(c)] for c in self.g_dst_dtype],
                        stats=self.stats, fp8_block=self.fp8_block)
        self._holders()
        lap("holders")
        self._pieces()
        lap("pieces")
        self._choose_sources()
        lap("choose")
        ops = self._blocks()
        lap("blocks")
        if self.coalesce:
            ops = _coalesce(ops)
        lap("coalesce")
        ops["round"] = self._rounds(ops)
        lap("rounds")
        gathers = self._gathers()
        lap("gathers")
        self.stats["writes"] = len(ops)
        self.stats["dest_bytes_max"] = int(self.needed_bytes.max(initial=0))
        self.stats["seconds"] = times
        p = Plan(ops, self.T, self.R, self.keys, self.names,
                 [DTYPES[int(c)] for c in self.g_dtype], [DTYPES[int(c)] for c in self.g_dst_dtype],
                 gathers, self.needed_bytes, self.stats, self._boxes(), self.fp8_block)
        lap("index")
        if self.validate:
            p.validate()
            lap("validate")
        return p

    # ----------------------------------------------------------------------------------------------
    def _classes(self) -> None:
        self.src_classes, self.src_class_of = _classes(self.src_layouts)
        self.dst_classes, self.dst_class_of = _classes(self.dst_layouts)
        self.src_ranks_of = [np.nonzero(self.src_class_of == c)[0] for c in range(len(self.src_classes))]
        self.dst_ranks_of = [np.nonzero(self.dst_class_of == c)[0] for c in range(len(self.dst_classes))]
        self.W = max([lay.width for lay in self.src_classes + self.dst_classes] + [1])
        self.stats["source_classes"] = len(self.src_classes)
        self.stats["destination_classes"] = len(self.dst_classes)

    def _tensor_table(self) -> None:
        """Global tensor ids; shapes and dtypes agreed between all sources and every destination."""
        W = self.W
        self.names: list[str] = []
        index: dict[str, int] = {}
        cache: dict[int, np.ndarray] = {}

        def map_table(lay: Layout) -> np.ndarray:
            got = cache.get(id(lay.table))
            if got is None:
                got = np.empty(len(lay.table), np.int32)
                for i, n in enumerate(lay.table.names):
                    g = index.get(n)
                    if g is None:
                        g = index[n] = len(self.names)
                        self.names.append(n)
                    got[i] = g
                cache[id(lay.table)] = got
            return got

        self.src_tmap = [map_table(lay) for lay in self.src_classes]
        nsrc_names = len(self.names)
        src_index = dict(index)
        G = np.full((nsrc_names, W), -2, np.int64)
        nd = np.full(nsrc_names, -1, np.int64)
        dt = np.full(nsrc_names, -1, np.int64)
        seen_by = np.full(nsrc_names, -1, np.int64)
        for c, lay in enumerate(self.src_classes):
            gids = self.src_tmap[c]
            gs = _pad(lay.table.gshape, W, 1)
            for arr, val, what in ((nd, lay.table.ndim.astype(np.int64), "rank"),
                                   (dt, lay.table.dtype.astype(np.int64), "dtype")):
                cur = arr[gids]
                new = cur < 0
                arr[gids[new]] = val[new]
                bad = np.nonzero(~new & (cur != val))[0]
                if len(bad):
                    i = int(bad[0])
                    self._raise_src_mismatch(gids[i], c, int(seen_by[gids[i]]), what)
            cur = G[gids]
            unknown_cur = cur < 0
            unknown_new = gs == UNKNOWN
            bad = np.nonzero(np.any(~unknown_cur & ~unknown_new & (cur != gs), axis=1))[0]
            if len(bad):
                i = int(bad[0])
                self._raise_src_mismatch(gids[i], c, int(seen_by[gids[i]]), "global shape")
            G[gids] = np.where(unknown_cur, gs, cur)
            seen_by[gids] = np.where(seen_by[gids] < 0, c, seen_by[gids])
        unknown = np.nonzero(np.any(G < 0, axis=1))[0]
        if len(unknown):
            t = int(unknown[0])
            raise LayoutError(f"no source states the global shape of tensor {self.names[t]!r} "
                              f"(Fused parts without global_shape on every source holding it)")
        self.g_shape = G
        self.g_ndim = nd
        self.g_dtype = dt
        # Destinations: every name must be a source tensor, or the FP8 scales of one. Classes that
        # share a tensor table (all ranks built by one layout builder) are checked once.
        by_table: dict[int, list[int]] = defaultdict(list)
        for c, lay in enumerate(self.dst_classes):
            by_table[id(lay.table)].append(c)
        self.dst_tmap = [np.empty(0, np.int32)] * len(self.dst_classes)
        scale_of: dict[int, int] = {}  # scale tensor id -> weight tensor id
        unknown_names: dict[str, list[int]] = defaultdict(list)
        table_groups: list[tuple[Any, list[int], np.ndarray, np.ndarray]] = []
        for cs in by_table.values():
            tb = self.dst_classes[cs[0]].table
            ranks = np.sort(np.concatenate([self.dst_ranks_of[c] for c in cs]))
            gids = np.empty(len(tb), np.int32)
            for i, n in enumerate(tb.names):
                g = src_index.get(n)
                if g is None:
                    base = n[: -len(SCALE_SUFFIX)] if n.endswith(SCALE_SUFFIX) else None
                    if self.fp8_block is not None and base is not None and base in src_index:
                        g = index.get(n)
                        if g is None:
                            g = index[n] = len(self.names)
                            self.names.append(n)
                            scale_of[g] = src_index[base]
                    else:
                        unknown_names[n].extend(int(r) for r in ranks)
                        g = -1
                gids[i] = g
            for c in cs:
                self.dst_tmap[c] = gids
            table_groups.append((tb, cs, ranks, gids))
        if unknown_names:
            lines = []
            src_names = self.names[:nsrc_names]
            for n, ranks in list(unknown_names.items())[:5]:
                close = difflib.get_close_matches(n, src_names, n=3, cutoff=0.6)
                hint = f"; did you mean {', '.join(repr(x) for x in close)}?" if close else ""
                lines.append(f"{n!r} (destination ranks {_ranks_text(sorted(set(ranks)))}){hint}")
            more = f" and {len(unknown_names) - 5} more" if len(unknown_names) > 5 else ""
            raise LayoutError("destinations need tensors no source holds: " + "; ".join(lines) + more)
        nall = len(self.names)
        grow = nall - nsrc_names
        self.g_shape = np.concatenate([self.g_shape, np.ones((grow, W), np.int64)])
        self.g_ndim = np.concatenate([self.g_ndim, np.zeros(grow, np.int64)])
        self.g_dtype = np.concatenate([self.g_dtype, np.full(grow, DTYPE_CODE["float32"])])
        self.g_dst_dtype = np.concatenate([self.g_dtype[:nsrc_names], np.full(grow, DTYPE_CODE["float32"])])
        self.g_transform = np.concatenate([np.zeros(nsrc_names, np.int64), np.full(grow, T_SCALE)])
        dst_set = np.zeros(nall, bool)
        self.scale_of = scale_of
        is_scale_id = np.zeros(nall, bool)
        if scale_of:
            sids = np.array(list(scale_of.keys()), np.int64)
            wids = np.array(list(scale_of.values()), np.int64)
            is_scale_id[sids] = True
            bm, bn = self.fp8_block  # type: ignore[misc]
            shp = self.g_shape[wids].copy()
            shp[:, W - 2] = -(-shp[:, W - 2] // bm)
            shp[:, W - 1] = -(-shp[:, W - 1] // bn)
            self.g_shape[sids] = shp
            self.g_ndim[sids] = np.maximum(self.g_ndim[wids], 2)
        # dtype / shape agreement of destinations with the sources (vectorized per table)
        for tb, _cs, ranks, gids in table_groups:
            g = gids.astype(np.int64)
            ddt = tb.dtype.astype(np.int64)
            dnd = tb.ndim.astype(np.int64)
            dgs = _pad(tb.gshape, W, 1)
            ns = ~is_scale_id[g]
            bad = ns & ((dnd != self.g_ndim[g])
                        | np.any((dgs != UNKNOWN) & (dgs != self.g_shape[g]), axis=1))
            if bad.any():
                i = int(np.nonzero(bad)[0][0])
                gi = int(g[i])
                w = self.g_shape[gi][W - int(self.g_ndim[gi]):]
                raise LayoutError(
                    f"shape mismatch for tensor {self.names[gi]!r}: destination ranks {_ranks_text(ranks)} "
                    f"say {tuple(int(x) for x in dgs[i][W - int(dnd[i]):])}, the sources hold "
                    f"{tuple(int(x) for x in w)}")
            tr = np.zeros(len(g), np.int64)
            diff = np.nonzero(ns & (ddt != self.g_dtype[g]))[0]
            if len(diff):
                pairs = np.unique(np.stack([self.g_dtype[g[diff]], ddt[diff]], axis=1), axis=0)
                for sdt, dd in pairs:
                    m = diff[(self.g_dtype[g[diff]] == sdt) & (ddt[diff] == dd)]
                    tr[m] = self._transform_for(int(sdt), int(dd), self.names[int(g[m[0]])], ranks)
            nsi = np.nonzero(ns)[0]
            gn = g[nsi]
            clash = dst_set[gn] & ((self.g_dst_dtype[gn] != ddt[nsi]) | (self.g_transform[gn] != tr[nsi]))
            if clash.any():
                i = int(nsi[np.nonzero(clash)[0][0]])
                gi = int(g[i])
                raise LayoutError(f"destinations disagree on the dtype of tensor {self.names[gi]!r} "
                                  f"(destination ranks {_ranks_text(ranks)} want {DTYPES[int(ddt[i])]}, "
                                  f"others "
                                  f"{DTYPES[int(self.g_dst_dtype[gi])]})")
            dst_set[gn] = True
            self.g_dst_dtype[gn] = ddt[nsi]
            self.g_transform[gn] = tr[nsi]
            sc = np.nonzero(~ns)[0]
            if len(sc):
                gs = g[sc]
                bad = ((ddt[sc] != DTYPE_CODE["float32"]) | (dnd[sc] != self.g_ndim[gs])
                       | np.any((dgs[sc] != UNKNOWN) & (dgs[sc] != self.g_shape[gs]), axis=1))
                if bad.any():
                    i = int(sc[np.nonzero(bad)[0][0]])
                    gi = int(g[i])
                    raise LayoutError(
                        f"FP8 scales {self.names[gi]!r} on destination ranks {_ranks_text(ranks)} must be "
                        f"float32 of shape "
                        f"{tuple(int(x) for x in self.g_shape[gi][W - int(self.g_ndim[gi]):])}")
        for gsc, w in scale_of.items():
            if self.g_transform[w] != T_FP8:
                raise LayoutError(f"destinations need {self.names[gsc]!r}, the FP8 block scales of "
                                  f"{self.names[w]!r}, but no destination holds that tensor in FP8")
        scaled = set(scale_of.values())
        for w in np.nonzero(self.g_transform == T_FP8)[0].tolist():
            if self.g_ndim[w] < 2:
                raise LayoutError(f"tensor {self.names[w]!r} has {int(self.g_ndim[w])} dimension(s): FP8 "
                                  f"block quantization needs at least 2 (destinations want it in "
                                  f"{DTYPES[int(self.g_dst_dtype[w])]})")
            if w not in scaled:
                raise LayoutError(f"destinations hold tensor {self.names[w]!r} in "
                                  f"{DTYPES[int(self.g_dst_dtype[w])]} but none holds its block scales "
                                  f"{self.names[w] + SCALE_SUFFIX!r} (float32): FP8 values mean nothing "
                                  f"without them")

    def _transform_for(self, src_dt: int, dst_dt: int, name: str, ranks: np.ndarray) -> int:
        if src_dt == dst_dt:
            return T_NONE
        s, d = DTYPES[src_dt], DTYPES[dst_dt]
        floats = ("float", "bfloat")
        if is_float8(d) and self.fp8_block is not None and s.startswith(floats) and not is_float8(s):
            return T_FP8
        if self.allow_cast and s.startswith(floats) and d.startswith(floats) and not is_float8(d):
            return T_CAST
        raise LayoutError(f"dtype mismatch for tensor {name!r}: destination ranks {_ranks_text(ranks)} hold "
                          f"{d}, the sources {s} (pass allow_cast=True for float casts, fp8_block for FP8)")

    def _raise_src_mismatch(self, g: int, c1: int, c0: int, what: str) -> None:
        r1 = self.src_ranks_of[c1]
        r0 = self.src_ranks_of[c0] if c0 >= 0 else []
        raise LayoutError(f"sources disagree on the {what} of tensor {self.names[g]!r}: source ranks "
                          f"{_ranks_text(r0)} vs {_ranks_text(r1)}")

    # ----------------------------------------------------------------------------------------------
    def _rows(self) -> None:
        """Concatenate the rows of every class into global tables (global tensor ids, padded width)."""
        W = self.W

        def cat(classes: list[Layout], tmaps: list[np.ndarray]) -> dict[str, np.ndarray]:
            parts: dict[str, list[np.ndarray]] = defaultdict(list)
            key_base = 0
            for c, lay in enumerate(classes):
                n = len(lay)
                parts["tensor"].append(tmaps[c][lay.tensor])
                parts["lo"].append(_pad(lay.offsets, W, 0))
                parts["shape"].append(_pad(lay.shape, W, 1))
                parts["strides"].append(_pad(lay.strides, W, 0))
                parts["boff"].append(lay.byte_offset)
                parts["class"].append(np.full(n, c, np.int32))
                parts["lrow"].append(np.arange(n, dtype=np.int64))
                parts["key"].append(lay.key.astype(np.int64) + key_base)
                key_base += len(lay.keys)
            if not classes:
                return {k: np.zeros((0, W) if k in ("lo", "shape", "strides") else 0, np.int64)
                        for k in ("tensor", "lo", "shape", "strides", "boff", "class", "lrow", "key")}
            return {k: np.concatenate(v) for k, v in parts.items()}

        self.S = cat(self.src_classes, self.src_tmap)
        self.D = cat(self.dst_classes, self.dst_tmap)
        # global key table: class-local key ids are offset per class; map them to strings once
        self.keys: list[str] = []
        kidx: dict[str, int] = {}
        for side in (self.src_classes, self.dst_classes):
            ids = []
            for lay in side:
                ids.extend(kidx.setdefault(k, len(kidx)) for k in lay.keys)
            if side is self.src_classes:
                self.src_key_map = np.array(ids, np.int64)
            else:
                self.dst_key_map = np.array(ids, np.int64)
        self.keys = list(kidx)


    # ----------------------------------------------------------------------------------------------
    def _geometry(self, sel: np.ndarray) -> tuple[dict[str, np.ndarray], np.ndarray]:
        """Byte blocks of the pieces ``sel`` (indices into the piece arrays): merge trailing dimensions
        contiguous on both sides into a run, the next dimension(s) into rows with a pitch, and
        enumerate what is left as separate blocks. Returns the block columns (blocks of one piece
        consecutive) and the number of blocks per piece."""
        P, S, D, W = self.P, self.S, self.D, self.W
        n = len(sel)
        tensor = P["tensor"][sel]
        tr = self.g_transform[tensor]
        sr, dr = P["srow"][sel], P["drow"][sel]
        shape = P["shape"][sel]
        lo = P["lo"][sel]
        ss, ds = S["strides"][sr].copy(), D["strides"][dr]
        is_scale = tr == T_SCALE
        is_fp8 = tr == T_FP8
        s_es = _ITEMSIZE[self.g_dtype[tensor]]
        d_es = D["esize"][dr]
        # element offsets of the piece's first element
        s_el = np.sum((lo - S["lo"][sr]) * ss, axis=1)
        d_el = np.sum((lo - D["lo"][dr]) * ds, axis=1)
        # FP8 values and scales are read from what the sender produces: its owned tile box quantized
        # into a dense row-major buffer (values) and the dense grid of that box's tile scales, both in
        # destination bytes. See Plan.boxes.
        q = np.nonzero(is_fp8 | is_scale)[0]
        if len(q):
            olo, osh = self._own_box(sr[q], is_scale[q])
            dense = np.ones((len(q), W), np.int64)
            for d in range(W - 2, -1, -1):
                dense[:, d] = dense[:, d + 1] * osh[:, d + 1]
            ss[q] = dense
            s_el[q] = np.sum((lo[q] - olo) * dense, axis=1)
            s_es = s_es.copy()
            s_es[q] = d_es[q]
        run = np.ones(n, np.int64)
        active = np.ones(n, bool)
        phase = np.zeros(n, np.int8)  # 0 run, 1 rows, 2 outer
        rows = np.ones(n, np.int64)
        sp = np.zeros(n, np.int64)
        dp = np.zeros(n, np.int64)
        outer = np.zeros((n, W), bool)
        for d in range(W - 1, -1, -1):
            sd_, dd_, sh = ss[:, d], ds[:, d], shape[:, d]
            trivial = sh == 1
            in_run = (phase == 0) & (trivial | ((sd_ == run) & (dd_ == run)))
            run = np.where(in_run, run * sh, run)
            start_rows = (phase == 0) & ~in_run
            sp = np.where(start_rows, sd_, sp)
            dp = np.where(start_rows, dd_, dp)
            rows = np.where(start_rows, sh, rows)
            merge_rows = (phase == 1) & (trivial | ((sd_ == sp * rows) & (dd_ == dp * rows)))
            rows = np.where(merge_rows, rows * sh, rows)
            to_outer = ((phase == 1) & ~merge_rows) | (phase == 2)
            outer[:, d] = to_outer & ~trivial
            phase = np.where(start_rows, 1, np.where(to_outer, 2, phase)).astype(np.int8)
        del active
        # per piece first; expand into several blocks only where outer dimensions remain
        boxed = is_fp8 | is_scale
        src_key = np.where(boxed, self.box_of_row[sr], self.src_key_map[S["key"][sr]])
        dst_key = self.dst_key_map[D["key"][dr]]
        src_off = np.where(boxed, 0, S["boff"][sr]) + s_el * s_es
        dst_off = D["boff"][dr] + d_el * d_es
        single = rows == 1
        src_pitch = np.where(single, run, sp) * s_es
        dst_pitch = np.where(single, run, dp) * d_es
        row_bytes = run * d_es
        nblk = np.prod(np.where(outer, shape, 1), axis=1)
        if (nblk > 1).any():
            k = np.repeat(np.arange(n), nblk)
            rem = np.arange(len(k)) - np.repeat(np.cumsum(nblk) - nblk, nblk)
            s_add = np.zeros(len(k), np.int64)
            d_add = np.zeros(len(k), np.int64)
            for d in range(W - 1, -1, -1):
                radix = np.where(outer[k, d], shape[k, d], 1)
                i_d = rem % radix
                rem //= radix
                s_add += i_d * ss[k, d]
                d_add += i_d * ds[k, d]
            src_off = src_off[k] + s_add * s_es[k]
            dst_off = dst_off[k] + d_add * d_es[k]
            src_key, dst_key, src_pitch, dst_pitch = src_key[k], dst_key[k], src_pitch[k], dst_pitch[k]
            row_bytes, rows, single, tr, tensor = row_bytes[k], rows[k], single[k], tr[k], tensor[k]
        geo = {"src_key": src_key, "dst_key": dst_key, "tensor": tensor, "transform": tr,
               "pack": (~single).astype(np.uint8), "src_offset": src_off, "dst_offset": dst_off, "rows": rows,
               "row_bytes": row_bytes, "src_pitch": src_pitch, "dst_pitch": dst_pitch}
        return geo, nblk

    def _blocks(self) -> np.ndarray:
        """Pieces to 2-D byte blocks (see :meth:`_geometry`). The replicas of a destination class need
        the same blocks from the same holder rows, so the geometry is computed once per class-level
        piece and holder row and then handed to every (source, destination) pair that uses it."""
        P = self.P
        base = P["base"]
        n = len(base)
        nbase = int(base.max()) + 1 if n else 0
        first = np.searchsorted(base, np.arange(nbase))
        srow0 = P["srow"][first]
        odd = np.nonzero(P["srow"] != srow0[base])[0]  # replicas served by another class's layout
        g_of_op = base.copy()
        g_of_op[odd] = nbase + np.arange(len(odd))
        geo, nblk = self._geometry(np.concatenate([first, odd]))
        if (nblk > 1).any():
            gstart = np.cumsum(nblk) - nblk
            cnt = nblk[g_of_op]
            k = np.repeat(np.arange(n), cnt)
            bidx = gstart[g_of_op][k] + (np.arange(len(k)) - np.repeat(np.cumsum(cnt) - cnt, cnt))
        else:
            k = None
            bidx = g_of_op
        ops = np.empty(len(bidx), OP_DTYPE)
        ops["src_rank"] = P["src"] if k is None else P["src"][k]
        ops["dst_rank"] = P["dst"] if k is None else P["dst"][k]
        ops["round"] = 0
        for name in ("src_key", "dst_key", "tensor", "transform", "pack", "src_offset", "dst_offset", "rows",
                     "row_bytes", "src_pitch", "dst_pitch"):
            ops[name] = geo[name][bidx]
        self.stats["blocks"] = len(ops)
        return ops
