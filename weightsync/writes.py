"""Plan ops to engine writes: the one place that decides how a 2-D block crosses the wire.

A plan op is a block of ``rows`` rows of ``row_bytes`` bytes. On the wire it becomes

* one write when it is contiguous on both sides;
* one write from a staging buffer when only the source side is strided: the sender packs the rows
  first (one local copy is far cheaper than ``rows`` network messages);
* one write per row when the destination side is strided (a one-sided write cannot scatter).

Sources use this to execute their ops and the coordinator uses it to tell each destination how many
immediates to expect, so both sides count the same writes by construction.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from weightsync.errors import PlanError

WRITE_DTYPE = np.dtype([
    ("dst_rank", "<i4"), ("src_key", "<i4"), ("dst_key", "<i4"), ("staged", "u1"),
    ("src_offset", "<i8"), ("dst_offset", "<i8"), ("nbytes", "<i8"),
])
PACK_DTYPE = np.dtype([
    ("src_key", "<i4"), ("src_offset", "<i8"), ("rows", "<i8"), ("row_bytes", "<i8"), ("src_pitch", "<i8"),
    ("staging_offset", "<i8"),
])


@dataclass
class Writes:
    """A source's writes in execution order, and the packing it does before them.

    ``writes["staged"] == 1`` reads from the staging buffer at ``src_offset`` instead of local tensor
    ``src_key``; ``packs`` fill that buffer (``staging_bytes`` long) from strided source blocks.
    """

    writes: np.ndarray
    packs: np.ndarray
    staging_bytes: int


def lower(ops: np.ndarray) -> Writes:
    """Turns plan ops (``weightsync.plan.OP_DTYPE`` rows of one source) into writes and packs."""
    if len(ops) and (ops["transform"] != 0).any():
        bad = int(np.flatnonzero(ops["transform"] != 0)[0])
        raise PlanError(
            f"op {bad} of source rank {int(ops['src_rank'][bad])} needs a transform (dtype cast or FP8), "
            "which the sender cannot run yet: give destinations the sources' dtype"
        )
    rows = ops["rows"].astype(np.int64)
    row_bytes = ops["row_bytes"].astype(np.int64)
    dst_contig = (rows == 1) | (ops["dst_pitch"] == row_bytes)
    src_contig = (rows == 1) | (ops["src_pitch"] == row_bytes)

    # Writes per op: 1, except `rows` for destination-strided blocks.
    per_op = np.where(dst_contig, 1, rows)
    total = int(per_op.sum())
    out = np.zeros(total, dtype=WRITE_DTYPE)
    first = np.concatenate([[0], np.cumsum(per_op)[:-1]]).astype(np.int64)

    # Contiguous on the destination: a single write, from staging when the source is strided.
    single = np.flatnonzero(dst_contig)
    packed = single[~src_contig[single]]
    staging_sizes = rows[packed] * row_bytes[packed]
    staging_off = np.concatenate([[0], np.cumsum(staging_sizes)[:-1]]).astype(np.int64)
    w = first[single]
    out["dst_rank"][w] = ops["dst_rank"][single]
    out["src_key"][w] = ops["src_key"][single]
    out["dst_key"][w] = ops["dst_key"][single]
    out["src_offset"][w] = ops["src_offset"][single]
    out["dst_offset"][w] = ops["dst_offset"][single]
    out["nbytes"][w] = rows[single] * row_bytes[single]
    wp = first[packed]
    out["staged"][wp] = 1
    out["src_offset"][wp] = staging_off

    packs = np.zeros(len(packed), dtype=PACK_DTYPE)
    packs["src_key"] = ops["src_key"][packed]
    packs["src_offset"] = ops["src_offset"][packed]
    packs["rows"] = rows[packed]
    packs["row_bytes"] = row_bytes[packed]
    packs["src_pitch"] = ops["src_pitch"][packed]
    packs["staging_offset"] = staging_off

    # Strided on the destination: one write per row.
    for i in np.flatnonzero(~dst_contig):
        r = np.arange(rows[i], dtype=np.int64)
        sl = slice(first[i], first[i] + rows[i])
        out["dst_rank"][sl] = ops["dst_rank"][i]
        out["src_key"][sl] = ops["src_key"][i]
        out["dst_key"][sl] = ops["dst_key"][i]
        out["src_offset"][sl] = ops["src_offset"][i] + r * ops["src_pitch"][i]
        out["dst_offset"][sl] = ops["dst_offset"][i] + r * ops["dst_pitch"][i]
        out["nbytes"][sl] = row_bytes[i]
    return Writes(out, packs, int(staging_sizes.sum()))


def imm_count_for(nbytes: np.ndarray, nics: int, stripe_threshold: int, max_piece: int) -> np.ndarray:
    """Immediates each write delivers from an engine with this configuration.

    Mirrors the engine's rule (cpp/src/engine.cpp, ``Engine::piece_size``; documented in
    weightsync/engine.py); tests check the two agree. Every write here carries an immediate.
    """
    n = np.asarray(nbytes, dtype=np.int64)
    stripe_threshold = min(stripe_threshold, max_piece)
    nics = max(int(nics), 1)
    count = nics * _ceil_div(n, nics * max_piece)
    piece = np.minimum(_ceil_div(_ceil_div(n, np.maximum(count, 1)), 4096) * 4096, max_piece)
    striped = _ceil_div(n, np.maximum(piece, 1))
    return np.where(n == 0, 1, np.where(n <= stripe_threshold, 1, striped)).astype(np.int64)


def _ceil_div(a: np.ndarray, b: np.ndarray | int) -> np.ndarray:
    return (a + b - 1) // b
