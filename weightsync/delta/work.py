"""What a source keeps per plan epoch (per space of its reference, per inbox destination) and per push
(per destination: its spans and final span) for its delta pushes."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from weightsync.delta.codec import ENTRY_DTYPE

_DIRECT_DTYPE = np.dtype([("round", "<i8"), ("pos", "<i8"), ("key", "<i4"), ("dkey", "<i4"), ("word", "<i8"),
                          ("src_off", "<i8"), ("dst_off", "<i8"), ("rows", "<i8"), ("row_bytes", "<i8"),
                          ("src_pitch", "<i8"), ("dst_pitch", "<i8"), ("imms", "<i8")])
# A compared direct write where its words lie in its word size's reference: its row in ``_Inbox.direct``,
# its first word and the words from it to its last one (``extent``; strided rows: the rows between count),
# its own words ``n``, and for strided source rows their words and pitch in words.
_FLAT_DTYPE = np.dtype([("row", "<i8"), ("start", "<i8"), ("extent", "<i8"), ("n", "<i8"),
                        ("row_words", "<i8"), ("pitch_words", "<i8"), ("strided", "?")])
# What one push found in a compared direct write: its changed words are positions ``lo:hi`` of the
# reference's changed positions (contiguous writes) or ``at:at + k`` of the strided writes' selection.
_HIT_DTYPE = np.dtype([("lo", "<i8"), ("hi", "<i8"), ("k", "<i8"), ("at", "<i8")])


@dataclass
class _Space:
    """The local tensors of one word size laid end to end, in words: the reference holds them so, and a
    push compares them, finds and gathers their changes and updates the reference once per space."""

    word: int
    keys: list[str]
    starts: np.ndarray  # first word of each key, then the total
    span: int = 0  # the push span its keys are sent in
    ref: Any = None  # the reference: the keys' words as last pushed (one flat tensor)
    query: Any = None  # on the device: the keys' starts and every inbox's compared direct writes' bounds
    # this push: the changed words' positions (sorted int64) and new values, where each key's start in
    # them, and the strided direct writes' changed words (indices into each write's own words, values)
    idx: Any = None
    vals: Any = None
    cut: np.ndarray | None = None
    strided_local: Any = None
    strided_vals: Any = None
    hint: int = 0  # the last push's count of changed words (how much room the next one's start with)
    compactor: Any = None  # the GPU kernels' tile tables (weightsync.delta.triton_kernels), where they run
    ref_done: bool = False  # this push's compare already put the changed values into the reference
    # (the Triton and CPU kernels do; the CUDA compare leaves it to finish)
    # this push's changes as the CUDA collect left them (weightsync.delta.cuda.TileChanges), where
    # its searches were queued ahead: ``idx`` and ``vals`` stay None until something needs them in order
    tiles: Any = None

    def ordered(self) -> None:
        """``idx`` and ``vals`` made from ``tiles`` where they are not yet (the encode, of either encoding,
        and the reference's update read ``tiles``; the strided writes' selection wants the changes in
        order)."""
        if self.idx is None and self.tiles is not None:
            self.idx, self.vals = self.tiles.ordered()


@dataclass
class _Inbox:
    """A destination's delta inbox as a source sees it, and what this source writes into it."""

    rank: int
    header: bytes  # descriptor of its header slots
    payload: bytes  # descriptor of its payload area
    offset: int  # this source's share of the payload area
    share: int
    keys: dict[str, int]  # destination key -> index in its sorted keys
    dkeys: Sequence[str]  # the destination keys this source's writes index (its descriptor table)
    # Direct writes (of the program's rounds), one row each: round, position in it, source key, geometry
    direct: np.ndarray = field(default_factory=lambda: np.zeros(0, _DIRECT_DTYPE))
    flat: dict[int, np.ndarray] = field(default_factory=dict)  # word size -> its compared ones, by start
    fixed: np.ndarray = field(default_factory=lambda: np.zeros(0, ENTRY_DTYPE))  # the tail: as planned
    fixed_imms: int = 0
    span: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))  # per direct write: its span
    round_len: dict[int, int] = field(default_factory=dict)  # round index -> writes in it
    capacity: int = 0  # entries at most of the final span (staged, tail)
    tables: int = 0  # bytes of every span's entry and stream tables (reserved at the push's start)
    relay: bool = False  # a relay chain member: the writes sent as planned reach it through the chain,
    # counted there, so its header announces the payload's immediates only
    send: Any = None  # the payload as sent (entries, then data), on this source's device
    region: Any = None
    # The share cannot hold this source's entry tables (``tables`` > ``share``): every write goes as
    # planned, the headers announce no entries (codec.ALL_PLANNED) and nothing is compared for it.
    planned_only: bool = False
    bound_by: int = -1  # the destination whose inbox sets ``share`` (in a relay chain its smallest member)
    sources: int = 1  # the sources the inbox is split among
    chunks: tuple[int, int] = (0, 0)  # a relay chain: the first relay chunk of this source's writes, how many


@dataclass
class _Piece:
    """A staged write's changes: entry ``row`` of ``work.rows[block]``; its changed words are
    ``idx + shift`` (sorted, into the write's own ``n`` words of ``word`` bytes) with values ``vals``."""

    block: int
    row: int
    word: int
    key: int
    idx: Any
    vals: Any
    shift: int
    k: int
    n: int


@dataclass
class _Span:
    """One early span of a push to one destination as decided: the entries of its direct writes, per
    space its sparse ones (_FLAT_DTYPE and _HIT_DTYPE rows, by start, and their rows in ``rows``), which
    of its writes go as planned (round index -> mask over the round's writes; None: all of every round),
    and once encoded where its payload lies in the send buffer, its bytes and the immediates its write
    delivers."""

    rows: np.ndarray
    direct: dict[int, tuple[np.ndarray, np.ndarray, np.ndarray]]
    keep: dict[int, np.ndarray] | None
    changed: int = 0
    at: int = -1
    nbytes: int = 0
    imms: int = 0


@dataclass
class DeltaWork:
    """What one push sends one inbox destination: its early spans (:class:`_Span`, decided one by one)
    and the final span (staged writes and the tail), and once final the header figures."""

    rank: int
    delta: bool
    dense_bytes: int  # bytes a dense push sends it
    spans: list[_Span] = field(default_factory=list)
    at: int = 0  # where the next span's payload starts in the send buffer
    room: int = 0  # bytes left for streams (every span's tables are reserved)
    payload_bytes: int = 0  # bytes of every span's payload, the final one's included
    imms: int = 0  # data immediates of the final header (writes as planned, the final payload)
    entries: int = 0
    wire_bytes: int = 0  # bytes this source sends it this version (payloads, dense writes)
    changed: int = 0  # changed words in the writes compared
    words: int = 0  # words in the writes compared
    # writes sent as planned though their changes would have gone smaller, for want of room in this
    # source's share of the inbox: their bytes, and what their streams would have taken
    overflow_bytes: int = 0
    overflow_stream_bytes: int = 0
    # the final span being built: entry rows of the staged writes (blocks), the sparse ones, per word size
    # the words and changed words of its stream so far; the immediates and bytes of every write as planned
    rows: list[np.ndarray] = field(default_factory=list)
    pieces: list[_Piece] = field(default_factory=list)
    streams: dict[int, list[int]] = field(default_factory=dict)  # word size -> [words, changed words]
    planned_imms: int = 0
    planned_bytes: int = 0
    final_at: int = 0
    final_bytes: int = 0
    final: bool = False  # the final payload is encoded (finalize)
