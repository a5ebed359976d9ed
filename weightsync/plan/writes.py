"""Plan ops to engine writes: the one place that decides how a block crosses the wire.

A plan op is a block of ``rows`` rows of ``row_bytes`` bytes. On the wire it becomes

* one write when it is contiguous on both sides and needs no transform;
* one 2-D write (``rows`` rows, a pitch on each side) when the destination side is strided and the
  source is not transformed: the engine moves it as one ``cuMemcpy2DAsync`` on the cuda lane or as
  separate RMA writes over the fabric, and it delivers exactly one immediate either way;
* otherwise writes from *staging*: the sender prepares the bytes (packs strided rows, casts, quantizes
  FP8 tiles) into a staging chunk, laid out in the order the destination wants them, and writes from
  there (one write per destination-contiguous run).

Staging comes in *chunks* of at most ``chunk_bytes``. How ops are cut into chunks depends only on the
plan and ``chunk_bytes`` (which the source declares when it joins), never on what the sender has free
at run time: sources use this module to execute their ops and the coordinator uses it to tell each
destination how many immediates to expect, so both sides count the same writes by construction. The
sender's staging watermark bounds only how many chunks are in flight at once.

FP8: an op's bytes come from the sender's *box* (``Plan.boxes``: the whole tiles it owns). A box is
cut into *units* (bands of 128-row tiles across all columns, or, for very wide tensors, 128-row bands
of some tile columns) of at most ``chunk_bytes`` FP8 bytes; the sender quantizes a unit at a time and
copies the bytes each write needs (values and scales) into chunks, which run across units so that
small tensors share one. Gathers (rows of owned
tiles held by another source) are written by their provider from staging into the gatherer's receive
buffer, like data writes (``kind == K_GATHER``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from weightsync.errors import PlanError
from weightsync.plan.layout import DTYPE_SIZES
from weightsync.plan.ops import T_CAST, T_FP8, T_NONE, T_SCALE

if TYPE_CHECKING:
    from weightsync.plan.ops import Plan

DEFAULT_CHUNK_BYTES = 8 << 20
MIN_CHUNK_BYTES = 64 << 10  # one 128x128 FP8 tile row band of a narrow tensor, with room to spare

K_DATA, K_GATHER = 0, 1  # write kinds: into a destination, or into another source's receive buffer
# copy kinds: what a copy into a staging chunk reads
C_RAW, C_CAST, C_FP8, C_SCALE, C_GATHER = 0, 1, 2, 3, 4

WRITE_DTYPE = np.dtype([
    ("dst_rank", "<i4"), ("src_key", "<i4"), ("dst_key", "<i4"), ("staged", "u1"), ("kind", "u1"),
    ("chunk", "<i4"), ("round", "<i4"), ("src_offset", "<i8"), ("dst_offset", "<i8"), ("nbytes", "<i8"),
    ("rows", "<i8"), ("src_pitch", "<i8"), ("dst_pitch", "<i8"),
])
# ``nbytes`` counts all bytes of a write; a 2-D write (``rows > 1``) is ``rows`` rows of ``nbytes // rows``
# bytes, ``src_pitch``/``dst_pitch`` apart. ``round`` is the plan round of a direct write (sources post
# rounds in order, so that each destination has as few writers at a time as the plan scheduled).
# A copy into chunk ``chunk`` at ``staging_offset``: ``rows`` rows of ``row_bytes`` bytes read at
# ``src_offset`` with ``src_pitch`` from local tensor ``key`` (C_RAW, C_CAST: source bytes, cast into
# ``tensor``'s destination dtype), from FP8 unit ``unit``'s output (C_FP8 values, C_SCALE scale bytes), or
# rows ``src_offset..`` and element columns ``col..`` of provider gather ``key`` (C_GATHER).
COPY_DTYPE = np.dtype([
    ("chunk", "<i4"), ("kind", "u1"), ("key", "<i4"), ("tensor", "<i4"), ("unit", "<i4"),
    ("src_offset", "<i8"), ("rows", "<i8"), ("row_bytes", "<i8"), ("src_pitch", "<i8"), ("col", "<i8"),
    ("staging_offset", "<i8"), ("nbytes", "<i8"),
])
CHUNK_DTYPE = np.dtype([("unit", "<i4"), ("nbytes", "<i8")])  # unit: the first FP8 unit it copies from, or -1
# A unit: rows r0..r1 and columns c0..c1 of 2-D slice ``lead`` of box ``box``, quantized at once.
UNIT_DTYPE = np.dtype([("box", "<i8"), ("lead", "<i8"), ("r0", "<i8"), ("r1", "<i8"), ("c0", "<i8"),
                       ("c1", "<i8")])


@dataclass
class Writes:
    """A source's writes and the staging they need.

    ``writes["staged"] == 0`` reads local tensor ``src_key`` at ``src_offset``; staged writes read chunk
    ``chunk`` at ``src_offset``. Direct writes come first; staged writes are ordered by chunk, and chunks
    in execution order (gathers first, then packs and casts, then FP8 units). ``copies`` fill the chunks,
    ``units`` are the FP8 quantizations; C_GATHER copies name rows of the ``gathers`` given to ``lower``.
    """

    writes: np.ndarray
    copies: np.ndarray
    chunks: np.ndarray
    units: np.ndarray
    chunk_bytes: int

    @property
    def staging_bytes(self) -> int:
        """All staged bytes of one push (what an unbounded staging buffer would need)."""
        return int(self.chunks["nbytes"].sum())

    def data(self) -> np.ndarray:
        """The writes into destinations (what their counters see)."""
        return self.writes[self.writes["kind"] == K_DATA]


def lower(ops: np.ndarray, chunk_bytes: int = DEFAULT_CHUNK_BYTES, plan: Plan | None = None,
          gathers: np.ndarray | None = None, pack_strided: bool = True) -> Writes:
    """Turns plan ops (``weightsync.plan.OP_DTYPE`` rows of one source) into writes, staging copies and
    FP8 units. ``plan`` (or a part of it holding these ops) gives dtypes, boxes and the FP8 block for
    transformed ops; ``gathers`` are the ``Plan.gathers`` rows this source provides.

    ``pack_strided=False`` writes source-strided blocks as 2-D writes straight from the tensor instead of
    packing them into staging first: right for sources whose writes go over the cuda lane, where one
    ``cuMemcpy2DAsync`` reads the strided rows at copy-engine speed (packing costs a kernel, staging
    and a wait); over a NIC every row would be a message of its own, so NIC sources pack."""

    chunk_bytes = int(chunk_bytes)
    if chunk_bytes < MIN_CHUNK_BYTES:
        raise PlanError(f"staging chunks of {chunk_bytes} bytes are too small (at least {MIN_CHUNK_BYTES})")
    tr = ops["transform"]
    if (tr != T_NONE).any() and plan is None:
        bad = int(np.flatnonzero(tr != T_NONE)[0])
        raise PlanError(f"op {bad} of source rank {int(ops['src_rank'][bad])} needs a transform; lowering it "
                        "needs the plan (dtypes, FP8 boxes)")
    rows = ops["rows"].astype(np.int64)
    row_bytes = ops["row_bytes"].astype(np.int64)
    dst_contig = (rows == 1) | (ops["dst_pitch"] == row_bytes)
    src_contig = (rows == 1) | (ops["src_pitch"] == row_bytes)
    plain = tr == T_NONE
    direct = np.flatnonzero(plain & dst_contig & src_contig)
    strided = np.flatnonzero(plain & ~dst_contig)
    # strided source, contiguous destination: pack into staging, unless a row alone fills a chunk
    packed = np.flatnonzero(plain & dst_contig & ~src_contig)
    big_rows = packed[(row_bytes[packed] > chunk_bytes) | (not pack_strided)]
    packed = packed[(row_bytes[packed] <= chunk_bytes) & pack_strided]
    strided = np.sort(np.concatenate([strided, big_rows]))

    parts: list[np.ndarray] = [_direct(ops, direct), _two_d(ops, strided)]
    copies: list[np.ndarray] = []
    chunks: list[np.ndarray] = []
    units = np.zeros(0, UNIT_DTYPE)
    n_chunks = 0

    g_writes, g_copies, g_chunks = _gather_writes(gathers, plan, chunk_bytes)
    parts.append(g_writes)
    copies.append(g_copies)
    chunks.append(g_chunks)
    n_chunks += len(g_chunks)

    cast = np.flatnonzero(tr == T_CAST)
    staged = np.sort(np.concatenate([packed, cast]))
    if len(staged):
        if plan is not None:
            s_es = np.array([DTYPE_SIZES[d] for d in plan.src_dtype], np.int64)[ops["tensor"][staged]]
            d_es = np.array([DTYPE_SIZES[d] for d in plan.dst_dtype], np.int64)[ops["tensor"][staged]]
        else:
            s_es = d_es = np.ones(len(staged), np.int64)
        is_cast = tr[staged] == T_CAST
        s_es = np.where(is_cast, s_es, 1)
        d_es = np.where(is_cast, d_es, 1)
        w, c, ch = _staged_ops(ops, staged, s_es, d_es, is_cast, chunk_bytes, n_chunks)
        parts.append(w)
        copies.append(c)
        chunks.append(ch)
        n_chunks += len(ch)

    fp8 = np.flatnonzero((tr == T_FP8) | (tr == T_SCALE))
    if len(fp8):
        w, c, ch, units = _fp8_ops(ops, fp8, plan, chunk_bytes, n_chunks)  # type: ignore[arg-type]
        parts.append(w)
        copies.append(c)
        chunks.append(ch)
    writes = np.concatenate(parts) if parts else _new_writes(0)
    allc = np.concatenate(copies) if copies else np.zeros(0, COPY_DTYPE)
    allch = np.concatenate(chunks) if chunks else np.zeros(0, CHUNK_DTYPE)
    if len(allch) and int(allch["nbytes"].max()) > chunk_bytes:
        raise PlanError("internal: a staging chunk exceeds chunk_bytes")  # construction prevents it
    return Writes(writes, allc, allch, units, chunk_bytes)


# ------------------------------------------------------------------------------------------------


def _direct(ops: np.ndarray, idx: np.ndarray) -> np.ndarray:
    out = _new_writes(len(idx))
    out["dst_rank"] = ops["dst_rank"][idx]
    out["src_key"] = ops["src_key"][idx]
    out["dst_key"] = ops["dst_key"][idx]
    out["chunk"] = -1
    out["src_offset"] = ops["src_offset"][idx]
    out["dst_offset"] = ops["dst_offset"][idx]
    out["nbytes"] = ops["rows"][idx] * ops["row_bytes"][idx]
    out["round"] = ops["round"][idx]
    return out


def _two_d(ops: np.ndarray, idx: np.ndarray) -> np.ndarray:
    """Destination-strided blocks: one 2-D write each, read straight from the source tensor."""
    out = _direct(ops, idx)
    out["rows"] = ops["rows"][idx]
    out["src_pitch"] = ops["src_pitch"][idx]
    out["dst_pitch"] = ops["dst_pitch"][idx]
    return out


def _new_writes(n: int) -> np.ndarray:
    out = np.zeros(n, WRITE_DTYPE)
    out["rows"] = 1
    return out


def _greedy_chunks(sizes: np.ndarray, cap: int) -> tuple[np.ndarray, np.ndarray]:
    """Consecutive items into chunks of at most ``cap`` bytes: chunk of each item, offset inside it."""
    chunk = np.zeros(len(sizes), np.int64)
    off = np.zeros(len(sizes), np.int64)
    c, used = 0, 0
    for i, s in enumerate(sizes.tolist()):
        if used and used + s > cap:
            c += 1
            used = 0
        chunk[i] = c
        off[i] = used
        used += s
    return chunk, off


def _cut_rows(rows: np.ndarray, nel: np.ndarray, es: np.ndarray, chunk_bytes: int
              ) -> tuple[np.ndarray, ...]:
    """Blocks of ``rows`` rows of ``nel`` elements of ``es`` bytes, cut into pieces that fit a chunk:
    whole rows where a row fits (as many as fit), else parts of one row. Returns per piece: its block
    ``k``, whether it holds whole rows, first row, rows, first element and elements per row."""
    rb = nel * es
    whole = rb <= chunk_bytes
    per = np.where(whole, np.maximum(chunk_bytes // np.maximum(rb, 1), 1), 1)  # rows per piece
    el_per = np.where(whole, nel, chunk_bytes // es)  # elements per piece row
    splits = np.where(whole, 1, -(-nel // np.maximum(el_per, 1)))
    npieces = np.where(whole, -(-rows // per), rows * splits)
    k = np.repeat(np.arange(len(rows)), npieces)
    j = np.arange(len(k)) - np.repeat(np.cumsum(npieces) - npieces, npieces)
    w_ = whole[k]
    row0 = np.where(w_, j * per[k], j // splits[k])
    nrow = np.where(w_, np.minimum(per[k], rows[k] - row0), 1)
    el0 = np.where(w_, 0, (j % splits[k]) * el_per[k])
    nel_p = np.where(w_, nel[k], np.minimum(el_per[k], nel[k] - el0))
    return k, w_, row0, nrow, el0, nel_p


def _staged_ops(ops: np.ndarray, idx: np.ndarray, s_es: np.ndarray, d_es: np.ndarray, is_cast: np.ndarray,
                chunk_bytes: int, chunk_base: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Packs and casts: each op cut into pieces of whole rows (or, where one row is larger than a
    chunk, of part of a row) that fit a chunk; pieces packed into chunks in op order."""
    rows = ops["rows"][idx].astype(np.int64)
    rb = ops["row_bytes"][idx].astype(np.int64)  # destination bytes
    k, w_, row0, nrow, el0, nel_p = _cut_rows(rows, rb // d_es, d_es, chunk_bytes)
    size = nrow * nel_p * d_es[k]
    ch, soff = _greedy_chunks(size, chunk_bytes)
    o = idx[k]
    copies = np.zeros(len(k), COPY_DTYPE)
    copies["chunk"] = ch + chunk_base
    copies["unit"] = -1
    copies["kind"] = np.where(is_cast[k], C_CAST, C_RAW)
    copies["key"] = ops["src_key"][o]
    copies["tensor"] = ops["tensor"][o]
    copies["src_offset"] = ops["src_offset"][o] + row0 * ops["src_pitch"][o] + el0 * s_es[k]
    copies["rows"] = nrow
    copies["row_bytes"] = nel_p * s_es[k]
    copies["src_pitch"] = ops["src_pitch"][o]
    copies["staging_offset"] = soff
    copies["nbytes"] = size
    # writes: one per piece where the destination is contiguous over it, else one per row
    dcont = ((rows[k] == 1) | (ops["dst_pitch"][o] == rb[k])) & w_ | ~w_
    nw = np.where(dcont, 1, nrow)
    kw = np.repeat(np.arange(len(k)), nw)
    r = np.arange(len(kw)) - np.repeat(np.cumsum(nw) - nw, nw)
    ow = o[kw]
    row_len = nel_p[kw] * d_es[k][kw]
    out = _new_writes(len(kw))
    out["dst_rank"] = ops["dst_rank"][ow]
    out["src_key"] = -1
    out["dst_key"] = ops["dst_key"][ow]
    out["staged"] = 1
    out["chunk"] = ch[kw] + chunk_base
    out["src_offset"] = soff[kw] + r * row_len
    out["dst_offset"] = (ops["dst_offset"][ow] + (row0[kw] + r) * ops["dst_pitch"][ow]
                         + el0[kw] * d_es[k][kw])
    out["nbytes"] = np.where(dcont[kw], size[kw], row_len)
    nch = int(ch.max()) + 1 if len(ch) else 0
    chunks = np.zeros(nch, CHUNK_DTYPE)
    chunks["unit"] = -1
    chunks["nbytes"] = np.bincount(ch, weights=size, minlength=nch).astype(np.int64)
    return out, copies, chunks


def _gather_writes(gathers: np.ndarray | None, plan: Plan | None, chunk_bytes: int
                   ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A provider's gathers: each box, flattened to (rows, last dim), in pieces of whole rows (or of
    part of a row) that fit a chunk, one chunk each (they are few and small)."""
    if gathers is None or len(gathers) == 0:
        return _new_writes(0), np.zeros(0, COPY_DTYPE), np.zeros(0, CHUNK_DTYPE)
    assert plan is not None
    es = np.array([DTYPE_SIZES[d] for d in plan.src_dtype], np.int64)[gathers["tensor"]]
    shape = gathers["shape"].astype(np.int64)
    cols = shape[:, -1]
    m = np.prod(shape[:, :-1], axis=1)
    k, _, row0, nrow, c0, ncol = _cut_rows(m, cols, es, chunk_bytes)
    size = nrow * ncol * es[k]
    copies = np.zeros(len(k), COPY_DTYPE)
    copies["chunk"] = np.arange(len(k))
    copies["unit"] = -1
    copies["kind"] = C_GATHER
    copies["key"] = k
    copies["tensor"] = gathers["tensor"][k]
    copies["src_offset"] = row0
    copies["rows"] = nrow
    copies["row_bytes"] = ncol * es[k]
    copies["col"] = c0
    copies["nbytes"] = size
    out = _new_writes(len(k))
    out["dst_rank"] = gathers["gatherer"][k]
    out["src_key"] = -1
    out["dst_key"] = -1
    out["staged"] = 1
    out["kind"] = K_GATHER
    out["chunk"] = np.arange(len(k))
    out["dst_offset"] = gathers["offset"][k] + (row0 * cols[k] + c0) * es[k]
    out["nbytes"] = size
    chunks = np.zeros(len(k), CHUNK_DTYPE)
    chunks["unit"] = -1
    chunks["nbytes"] = size
    return out, copies, chunks


def _fp8_ops(ops: np.ndarray, idx: np.ndarray, plan: Plan, chunk_bytes: int, chunk_base: int
             ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:

    if plan.fp8_block is None or not len(plan.boxes):
        raise PlanError("FP8 ops without the plan's FP8 block size and boxes")
    bm, bn = plan.fp8_block
    boxes = plan.boxes
    b_pos = {int(b): i for i, b in enumerate(boxes["id"].tolist())}
    box = ops["src_key"][idx].astype(np.int64)
    missing = [int(b) for b in np.unique(box) if int(b) not in b_pos]
    if missing:
        raise PlanError(f"FP8 ops name boxes {missing[:5]} the plan part does not carry")
    bi = np.array([b_pos[int(b)] for b in box.tolist()], np.int64)
    own = boxes["own_shape"].astype(np.int64)
    R_all, C_all = own[:, -2], own[:, -1]
    TR_all, TC_all = -(-R_all // bm), -(-C_all // bn)
    # unit grid per box: bands of `ub` tile rows across `cg` columns
    fits = bm * C_all <= chunk_bytes
    ub_all = np.where(fits, np.maximum(chunk_bytes // np.maximum(bm * C_all, 1), 1), 1)
    cg_all = np.where(fits, C_all, np.maximum(chunk_bytes // (bm * bn), 1) * bn)
    cgt_all = -(-cg_all // bn)
    ngb_all = -(-TR_all // ub_all)
    ncg_all = -(-C_all // cg_all)
    is_sc = ops["transform"][idx] == T_SCALE
    es = np.where(is_sc, 4, 1)
    # block rows of every op
    rows = ops["rows"][idx].astype(np.int64)
    k = np.repeat(np.arange(len(idx)), rows)
    i = np.arange(len(k)) - np.repeat(np.cumsum(rows) - rows, rows)
    o = idx[k]
    e_k = es[k]
    start = (ops["src_offset"][o] + i * ops["src_pitch"][o]) // e_k  # element in the dense buffer
    n = ops["row_bytes"][o] // e_k
    dst = ops["dst_offset"][o] + i * ops["dst_pitch"][o]
    # the dense buffer's row width: box columns (values) or tile columns (scales)
    width = np.where(is_sc[k], TC_all[bi[k]], C_all[bi[k]])
    f0 = start // width
    nseg = (start - f0 * width + n + width - 1) // width
    ks = np.repeat(np.arange(len(k)), nseg)
    j = np.arange(len(ks)) - np.repeat(np.cumsum(nseg) - nseg, nseg)
    f = f0[ks] + j
    s = np.maximum(start[ks], f * width[ks])
    e = np.minimum(start[ks] + n[ks], (f + 1) * width[ks])
    # split at column-group edges
    b_ = bi[k][ks]
    sc_ = is_sc[k][ks]
    grp = np.where(sc_, cgt_all[b_], cg_all[b_])
    c_lo = s - f * width[ks]
    c_hi = e - f * width[ks]
    g0 = c_lo // grp
    ng = (c_hi - 1) // grp - g0 + 1
    kk = np.repeat(np.arange(len(ks)), ng)
    gi = g0[kk] + (np.arange(len(kk)) - np.repeat(np.cumsum(ng) - ng, ng))
    cs = np.maximum(c_lo[kk], gi * grp[kk])
    ce = np.minimum(c_hi[kk], (gi + 1) * grp[kk])
    seg_k = ks[kk]  # block row of each segment
    seg_b = b_[kk]
    seg_sc = sc_[kk]
    seg_f = f[kk]
    seg_e = e_k[seg_k]
    # the segment's offset inside its block row: elements before it in the row
    seg_dst = dst[seg_k] + (seg_f * width[seg_k] + cs - start[seg_k]) * seg_e
    R, C, TR = R_all[seg_b], C_all[seg_b], TR_all[seg_b]
    rows_per_slice = np.where(seg_sc, TR, R)
    lead = seg_f // rows_per_slice
    r = seg_f % rows_per_slice
    band = np.where(seg_sc, r, r // bm)
    bg = band // ub_all[seg_b]
    unit_local = (lead * ngb_all[seg_b] + bg) * ncg_all[seg_b] + gi
    # unit geometry (elements): rows/cols of values, and of the scale grid
    ur0 = bg * ub_all[seg_b] * bm
    ur1 = np.minimum((bg + 1) * ub_all[seg_b] * bm, R)
    uc0 = gi * np.where(seg_sc, cgt_all[seg_b] * bn, cg_all[seg_b])
    uc1 = np.minimum(uc0 + cg_all[seg_b], C)
    u_cols = np.where(seg_sc, -(-uc1 // bn) - uc0 // bn, uc1 - uc0)
    row_in = np.where(seg_sc, band - bg * ub_all[seg_b], r - ur0)
    col_in = np.where(seg_sc, cs - uc0 // bn, cs - uc0)
    src_in = (row_in * u_cols + col_in) * seg_e
    nbytes = (ce - cs) * seg_e
    # units in order of first use (ops are in schedule order)
    ukey = seg_b * int((ngb_all * ncg_all * np.prod(own[:, :-2], axis=1)).max() + 1) + unit_local
    _, first_idx, inv = np.unique(ukey, return_index=True, return_inverse=True)
    by_use = np.argsort(first_idx, kind="stable")
    rank_of = np.empty(len(by_use), np.int64)
    rank_of[by_use] = np.arange(len(by_use))
    seg_u = rank_of[inv.reshape(-1)]
    fpos = first_idx[by_use]
    units = np.zeros(len(fpos), UNIT_DTYPE)
    units["box"] = boxes["id"][seg_b[fpos]]
    units["lead"] = lead[fpos]
    units["r0"] = ur0[fpos]
    units["r1"] = ur1[fpos]
    units["c0"] = uc0[fpos]
    units["c1"] = uc1[fpos]
    # segments in (unit, op, row) order; staging laid out in that order, cut into chunks
    order = np.lexsort((seg_f, seg_k, seg_u))
    seg_u, src_in, nbytes, seg_dst, seg_sc = seg_u[order], src_in[order], nbytes[order], seg_dst[order], \
        seg_sc[order]
    seg_k, u_cols, seg_e = seg_k[order], u_cols[order], seg_e[order]
    # Chunks run across units (small tensors share one): a chunk holds the segments starting inside
    # [k*cap, (k+1)*cap) of the running total, so at most cap + the largest segment = chunk_bytes.
    cum = np.cumsum(nbytes) - nbytes
    cap = chunk_bytes - int(nbytes.max())
    sub = cum // cap
    new_c = np.ones(len(sub), bool)
    new_c[1:] = sub[1:] != sub[:-1]
    chunk = np.cumsum(new_c) - 1
    chunk_start = np.maximum.accumulate(np.where(new_c, cum, 0))
    soff = cum - chunk_start
    nch = int(chunk[-1]) + 1
    chunks = np.zeros(nch, CHUNK_DTYPE)
    chunks["unit"] = seg_u[new_c]
    chunks["nbytes"] = np.bincount(chunk, weights=nbytes, minlength=nch).astype(np.int64)
    # copies: runs of segments of one block-op row after row (2-D copies out of the unit's output)
    op_of = k[seg_k]
    pitch = u_cols * seg_e
    cont = np.zeros(len(chunk), bool)
    cont[1:] = ((chunk[1:] == chunk[:-1]) & (seg_u[1:] == seg_u[:-1]) & (op_of[1:] == op_of[:-1])
                & (nbytes[1:] == nbytes[:-1])
                & (src_in[1:] == src_in[:-1] + pitch[:-1]) & (seg_sc[1:] == seg_sc[:-1]))
    cid = np.cumsum(~cont) - 1
    heads = np.flatnonzero(~cont)
    copies = np.zeros(len(heads), COPY_DTYPE)
    copies["chunk"] = chunk[heads] + chunk_base
    copies["kind"] = np.where(seg_sc[heads], C_SCALE, C_FP8)
    copies["key"] = -1
    copies["unit"] = seg_u[heads]
    copies["tensor"] = ops["tensor"][idx[op_of[heads]]]
    copies["src_offset"] = src_in[heads]
    copies["rows"] = np.bincount(cid, minlength=len(heads))
    copies["row_bytes"] = nbytes[heads]
    copies["src_pitch"] = pitch[heads]
    copies["staging_offset"] = soff[heads]
    copies["nbytes"] = copies["rows"] * copies["row_bytes"]
    # writes: runs contiguous in the destination (staging is contiguous in segment order)
    oi = idx[op_of]
    wcont = np.zeros(len(chunk), bool)
    wcont[1:] = ((chunk[1:] == chunk[:-1]) & (oi[1:] == oi[:-1])
                 & (seg_dst[1:] == seg_dst[:-1] + nbytes[:-1]))
    wid = np.cumsum(~wcont) - 1
    wh = np.flatnonzero(~wcont)
    out = _new_writes(len(wh))
    out["dst_rank"] = ops["dst_rank"][oi[wh]]
    out["src_key"] = -1
    out["dst_key"] = ops["dst_key"][oi[wh]]
    out["staged"] = 1
    out["chunk"] = chunk[wh] + chunk_base
    out["src_offset"] = soff[wh]
    out["dst_offset"] = seg_dst[wh]
    out["nbytes"] = np.bincount(wid, weights=nbytes, minlength=len(wh)).astype(np.int64)
    return out, copies, chunks, units
