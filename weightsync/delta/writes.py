"""A plan part's writes as the delta sender compares them: the word each staging chunk is compared in,
and each direct write to a destination with the word its changes are found in."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from weightsync.delta.codec import write_word
from weightsync.delta.work import _DIRECT_DTYPE


def chunk_words(plan_part: Any, words: Mapping[str, int]) -> np.ndarray:
    """Per staging chunk, the word it is compared in: its smallest element (FP8 values: bytes), from
    the copies that fill it (``words``: the source keys' element sizes)."""
    from weightsync.plan.layout import DTYPE_SIZES
    from weightsync.plan.writes import C_CAST, C_FP8, C_RAW, C_SCALE

    keys = plan_part.keys
    cw = np.full(len(plan_part.chunks), 8, np.int64)
    for c in plan_part.copies:
        kind = int(c["kind"])
        if kind == C_RAW:
            w = words.get(keys[int(c["key"])], 1) or 1
        elif kind == C_CAST:
            w = DTYPE_SIZES[plan_part.plan.dst_dtype[int(c["tensor"])]]
        elif kind == C_SCALE:
            w = 4
        elif kind == C_FP8:
            w = 1
        else:
            continue
        cw[int(c["chunk"])] = min(cw[int(c["chunk"])], w)
    return cw


def direct_writes(rounds: Sequence[Any], into: int, src_keys: Sequence[str], words: Mapping[str, int],
                  key_index: Mapping[str, int], kidx: Mapping[str, int], dkeys: Sequence[str], engine: Any
                  ) -> tuple[np.ndarray, dict[int, int]]:
    """The direct writes of ``rounds`` to destination ``into`` as :data:`_DIRECT_DTYPE` rows (round,
    index in it, source key, destination key, word, offsets, rows, bytes, pitches, immediates), and
    per round its length. A write not aligned to its key's elements gets word 0: always as planned."""
    rows: list[tuple] = []
    round_len: dict[int, int] = {}
    for ri, r in enumerate(rounds):
        if r.rank != into:
            continue
        nrows, spitch, dpitch = r.geometry
        round_len[ri] = len(r.nbytes)
        for i in range(len(r.nbytes)):
            key = src_keys[int(r.src_index[i])]
            nr = int(nrows[i]) if nrows is not None else 1
            rb, so, do = int(r.nbytes[i]), int(r.src_off[i]), int(r.dst_off[i])
            sp = int(spitch[i]) if nrows is not None and nr > 1 else rb
            dp = int(dpitch[i]) if nrows is not None and nr > 1 else rb
            kw = words[key]
            word = write_word(kw, so, do, rb, sp, dp) if kw else 0
            if word != kw:
                word = 0
            dkey = kidx[dkeys[int(r.dst_index[i])]]
            rows.append((ri, i, key_index[key], dkey, word, so, do, nr, rb, sp, dp,
                         engine.imm_count(rb, True, nr)))
    direct = np.array(rows, _DIRECT_DTYPE) if rows else np.zeros(0, _DIRECT_DTYPE)
    return direct, round_len
