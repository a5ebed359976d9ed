"""Delta pushes: per planned write, only the elements that differ bitwise from the version the destination
holds cross the wire, encoded; the destination scatters them into place.

Who decides what
----------------
* A destination that can take deltas registers a *delta inbox* (``Destination(..., delta_bytes=N)``): a
  host array of header slots (one per source rank, :data:`HEADER_RECORD`) and a payload area of ``N``
  bytes on its device, split evenly between the group's sources. It publishes both descriptors under the
  pseudo-key :data:`DELTA_KEY` when it joins. Its grant says which version it can take a delta on (the
  ``held`` field of the grant): inplace, the live version unless an abandoned version left bytes in it;
  staged, the newest complete version if the shadow it grants holds it too (after every version the
  other shadow is brought up to it: same entries, off the sources' critical path), else -1.
* Every source writes each inbox destination, per version, one *header* (its immediate
  :func:`weightsync.wire.delta_header_imm`) after all its other writes to it, held back like a push's
  tail until the source has checked its tensors: how many data immediates it delivers this version and
  where its *entries* lie in the payload area. The destination waits for one header per source, then
  for the sum of their data immediates, applies the sparse entries, flips the version and acks. An inbox
  destination always lands this way (dense versions too), so there is no mixed counting.
* A source created with ``delta=True`` keeps a copy of what it last pushed (its *reference*, one copy of
  its local tensors on their device, ``PushStats.delta_ref_bytes``) and the version it holds. Its push
  compares every local tensor with the reference once (integer views: bitwise, so NaN, -0.0 and
  denormals count as what they are), and for each destination that granted a ``held`` equal to the
  reference's version sends, per planned direct write, only the changed elements, in the smallest of
  two encodings (:func:`choose`), or the write itself where that is smaller (the break-even). Every other
  destination (new, replaced, failed, behind, after a re-plan: the reference's version is reset then)
  gets the dense push, header included.

Entries and streams
-------------------
A source's payload for one destination starts with one :data:`ENTRY_DTYPE` row per planned write of this
source into it (key index in the destination's sorted keys, encoding, word size, destination offset,
rows, bytes per row, destination pitch, changed count, and for a sparse one its base in its stream), a
table of :data:`STREAM_DTYPE` rows (one per word size), then the streams. A write is sparse
(:data:`ENC_STREAM`) when its changes alone would encode smaller than the write; all sparse writes of one
word size are laid end to end (by destination key: the destination scatters each key's changes with one
op) and their changed words encoded as one stream, which costs a handful of torch ops per destination
rather than per write. Dense entries carry no data: their bytes landed where the plan put them (a staged
destination copies them into its other shadow). A stream of ``n`` words of which ``k`` changed, ``w``
bytes a word, is encoded as the smaller of:

* :data:`ENC_IDX16`: per 65536-word block an int32 count, then each changed word's index within its
  block as 16 bits, then the ``k`` values: ``4 ceil(n / 65536) + 2k + wk`` bytes;
* :data:`ENC_BITMAP`: one bit per word, then the values: ``ceil(n / 8) + wk`` bytes (smaller from about
  6% changed on);
An entry is :data:`ENC_EMPTY` when nothing in it changed, :data:`ENC_DENSE` when it went as planned.

Everything here is torch ops on the tensors' own device (CPU or GPU).
"""

from __future__ import annotations

import struct
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from weightsync.errors import WeightSyncError

DELTA_KEY = "\x00weightsync.delta"  # the descriptor entry of a destination's delta inbox
ENC_DENSE, ENC_EMPTY, ENC_IDX16, ENC_BITMAP, ENC_STREAM = 0, 1, 2, 3, 4
ENCODINGS = {ENC_DENSE: "dense", ENC_EMPTY: "empty", ENC_IDX16: "idx16", ENC_BITMAP: "bitmap",
             ENC_STREAM: "stream"}
WORDS = (1, 2, 4, 8)
BLOCK = 1 << 16  # words per ENC_IDX16 block (indices inside it fit 16 bits)
BITMAP_SLICE = 1 << 26  # words a bitmap is built or read in at a time (a multiple of 64: whole bytes)
_PACK = 0x0102040810204080  # times 8 little-endian 0/1 bytes: their bits in the top byte, first lowest
ALIGN = 16  # every section of a payload starts at a multiple of this (word views need it)
MAX_HEADERS = 1024  # header slots of an inbox: source ranks (weightsync.wire.MAX_SLOTS)
HEADER_RECORD = np.dtype([("epoch", "<i8"), ("version", "<i8"), ("imms", "<i8"), ("offset", "<i8"),
                          ("nbytes", "<i8"), ("entries", "<i8"), ("changed", "<i8"), ("room", "<i8")])
ENTRY_DTYPE = np.dtype([("key", "<i4"), ("enc", "<i4"), ("word", "<i8"), ("dst_off", "<i8"), ("rows", "<i8"),
                        ("row_bytes", "<i8"), ("pitch", "<i8"), ("count", "<i8"), ("data", "<i8")])
# One per word size, after the entries: the changed words of every sparse entry of that word size, as one
# encoded stream over their words laid end to end (``data``: where the encoding starts in the payload).
STREAM_DTYPE = np.dtype([("word", "<i8"), ("enc", "<i8"), ("n", "<i8"), ("k", "<i8"), ("data", "<i8"),
                         ("reserved", "<i8", (3,))])
assert HEADER_RECORD.itemsize == 64 and ENTRY_DTYPE.itemsize == 64 and STREAM_DTYPE.itemsize == 64


def streams_at(capacity: int) -> int:
    """Where the stream table starts in a payload with room for ``capacity`` entries."""
    return _align(capacity * ENTRY_DTYPE.itemsize)


def data_at(capacity: int) -> int:
    """Where the encoded streams start."""
    return streams_at(capacity) + len(WORDS) * STREAM_DTYPE.itemsize


def _align(n: int) -> int:
    return -(-int(n) // ALIGN) * ALIGN


def word_dtype(w: int) -> Any:
    """The integer torch dtype of ``w`` bytes: compares and copies of it are bitwise."""
    import torch

    return {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[w]


def words(t: Any, w: int) -> Any:
    """A contiguous tensor's bytes as a flat tensor of ``w``-byte integers (trailing bytes left out)."""
    import torch

    b = t.detach().reshape(-1).view(torch.uint8)
    return b[: b.numel() // w * w].view(word_dtype(w))


def _narrow(idx: Any, n: int) -> Any:
    """Changed-word indices as int32 where they fit (they are kept through a push: half the memory)."""
    import torch

    return idx.to(torch.int32) if n < 1 << 31 else idx


def write_word(w_max: int, *offsets: int) -> int:
    """The largest word size up to ``w_max`` (a power of two) dividing every offset, size and pitch of a
    write: its elements are compared and placed in words of that many bytes."""
    w = w_max
    while w > 1 and any(int(o) % w for o in offsets):
        w //= 2
    return w


# -- the codec -------------------------------------------------------------------------------------------
def sparse_sizes(n: int, k: int, w: int) -> dict[int, int]:
    """Bytes of each sparse encoding of ``k`` changed words out of ``n`` words of ``w`` bytes."""
    return {ENC_IDX16: _align(4 * -(-n // BLOCK)) + _align(2 * k) + w * k,
            ENC_BITMAP: _align(-(-n // 8)) + w * k}


def stream_size(n: int, k: int, w: int) -> tuple[int, int]:
    """(encoding, bytes) of the smaller sparse encoding of ``k`` changed words out of ``n``."""
    enc, size = min(sparse_sizes(n, k, w).items(), key=lambda kv: (kv[1], kv[0]))
    return enc, size


def choose(n: int, k: int, w: int) -> tuple[int, int]:
    """(encoding, data bytes) of a write of ``n`` words of which ``k`` changed: nothing when none did, the
    smaller sparse encoding when it is smaller than the write itself, else ENC_DENSE (the write goes as
    planned, ``n * w`` bytes)."""
    if k == 0:
        return ENC_EMPTY, 0
    enc, size = min(sparse_sizes(n, k, w).items(), key=lambda kv: (kv[1], kv[0]))
    if size >= n * w:
        return ENC_DENSE, n * w
    return enc, size


def encode_into(out: Any, enc: int, local: Any, values: Any, n: int) -> None:
    """Writes the ``enc`` encoding of changed words ``local`` (sorted int64 indices into the write's ``n``
    words) with ``values`` (their new words) into ``out`` (uint8, exactly ``sparse_sizes(...)[enc]``
    bytes)."""
    import torch

    k, w = int(local.numel()), values.element_size()
    if enc == ENC_IDX16:
        nb = -(-n // BLOCK)
        counts = torch.zeros(nb, dtype=torch.int64, device=local.device)  # (bincount would sync on a GPU)
        counts.scatter_add_(0, local >> 16, torch.ones_like(local))
        out[: 4 * nb].view(torch.int32).copy_(counts)
        low = local & 0xFFFF
        o = _align(4 * nb)
        out[o:o + 2 * k].view(torch.int16).copy_(low - ((low >> 15) << 16))  # as signed 16 bits
        o += _align(2 * k)
    elif enc == ENC_BITMAP:
        nbytes = -(-n // 8)
        # Slice by slice of BITMAP_SLICE words: one flag byte per word and its int64 products for the whole
        # stream would be about 3 n bytes of temporaries (gigabytes for a model's stream on a GPU).
        starts = torch.arange(0, n, BITMAP_SLICE, device=local.device, dtype=local.dtype)
        cut = [*torch.searchsorted(local, starts).tolist(), k]
        for i, lo in enumerate(range(0, n, BITMAP_SLICE)):
            m = min(BITMAP_SLICE, n - lo)
            bits = torch.zeros(-(-m // 64) * 64, dtype=torch.uint8, device=local.device)
            bits[local[cut[i]:cut[i + 1]] - lo] = 1
            # 8 flags (one byte each) to one byte: byte i of the product's top byte is flag i (no carries)
            packed = ((bits.view(torch.int64) * _PACK) >> 56) & 0xFF
            mb = -(-m // 8)
            out[lo // 8:lo // 8 + mb].copy_(packed.to(torch.uint8)[:mb])
        o = _align(nbytes)
    else:
        raise WeightSyncError(f"internal: no sparse encoding {enc}")
    out[o:o + w * k].view(values.dtype).copy_(values)


def decode(buf: Any, enc: int, n: int, k: int, w: int) -> tuple[Any, Any]:
    """The changed words' indices (int64, sorted) into the write's ``n`` words and their values (``w``-byte
    integers), from an encoding written by :func:`encode_into` (``buf``: uint8, starting at it)."""
    import torch

    if enc == ENC_IDX16:
        nb = -(-n // BLOCK)
        counts = buf[: 4 * nb].view(torch.int32).to(torch.int64)
        o = _align(4 * nb)
        low = buf[o:o + 2 * k].view(torch.int16).to(torch.int64) & 0xFFFF
        blocks = torch.repeat_interleave(torch.arange(nb, device=buf.device), counts, output_size=k)
        local = (blocks << 16) | low
        o += _align(2 * k)
    elif enc == ENC_BITMAP:
        nbytes = -(-n // 8)
        shifts = torch.arange(8, dtype=torch.uint8, device=buf.device)
        parts = []
        for lo in range(0, nbytes, BITMAP_SLICE // 8):  # bounded temporaries, as in encode_into
            bits = (buf[lo:min(lo + BITMAP_SLICE // 8, nbytes)].unsqueeze(1) >> shifts) & 1
            parts.append(torch.nonzero(bits.reshape(-1)).reshape(-1) + 8 * lo)
        local = parts[0] if len(parts) == 1 else torch.cat(parts)
        o = _align(nbytes)
    else:
        raise WeightSyncError(f"internal: no sparse encoding {enc}")
    return local, buf[o:o + w * k].view(word_dtype(w))


def placed(local: Any, base: int, row_words: int, pitch_words: int, rows: int) -> Any:
    """Word indices, in a tensor's flat word view, of a write's words ``local`` (indices into its
    ``rows`` rows of ``row_words`` words, ``pitch_words`` apart, the first at word ``base``)."""
    if rows <= 1 or pitch_words == row_words:
        return local + base
    r = local // row_words
    return base + r * pitch_words + (local - r * row_words)


# -- the source's side -----------------------------------------------------------------------------------
_DIRECT_DTYPE = np.dtype([("round", "<i8"), ("pos", "<i8"), ("key", "<i4"), ("dkey", "<i4"), ("word", "<i8"),
                          ("src_off", "<i8"), ("dst_off", "<i8"), ("rows", "<i8"), ("row_bytes", "<i8"),
                          ("src_pitch", "<i8"), ("dst_pitch", "<i8"), ("imms", "<i8")])


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
    fixed: np.ndarray = field(default_factory=lambda: np.zeros(0, ENTRY_DTYPE))  # the tail: as planned
    fixed_imms: int = 0
    capacity: int = 0  # entries at most per push (direct, staged, tail)
    send: Any = None  # the payload as sent (entries, then data), on this source's device
    region: Any = None


@dataclass
class _Piece:
    """A sparse write's changes: entry ``row`` of ``work.rows[block]``; its changed words are
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
class DeltaWork:
    """What one push sends one inbox destination: per round index, which of its direct writes go as
    planned (None: every write, a dense push), and, once final, the payload (entries and sparse data) and
    header figures."""

    rank: int
    delta: bool
    keep: dict[int, np.ndarray] | None
    dense_bytes: int  # bytes a dense push sends it
    payload_bytes: int = 0
    imms: int = 0  # data immediates this source delivers this version (writes as planned, payload)
    entries: int = 0
    wire_bytes: int = 0  # bytes this source sends it this version (sparse data, entries, dense writes)
    changed: int = 0  # changed words in the writes compared
    words: int = 0  # words in the writes compared
    # being built: entry rows so far, the sparse pieces (per word size: words and changes so far), the
    # immediates and bytes of the writes sent as planned
    rows: list[np.ndarray] = field(default_factory=list)
    pieces: list[_Piece] = field(default_factory=list)
    streams: dict[int, list[int]] = field(default_factory=dict)  # word size -> [words, changed words]
    planned_imms: int = 0
    planned_bytes: int = 0


def split_payload(total: int, sources: int) -> int:
    """Bytes of each source's share of a payload area of ``total`` bytes (ALIGN multiples)."""
    return total // max(sources, 1) // ALIGN * ALIGN


class DeltaSender:
    """A source's delta state: the reference (what it last pushed: per local key for direct writes, per
    staging chunk for packed, cast and FP8 writes), its version, and per plan epoch the inboxes of its
    destinations with their writes."""

    def __init__(self, engine: Any, locals_: Mapping[str, Any], device: Any, rank: int,
                 enabled: bool) -> None:
        self.engine = engine
        self.locals = locals_
        self.device = device
        self.rank = rank
        self.enabled = enabled
        self.refs: dict[str, Any] | None = None
        self.chunk_refs: dict[int, Any] = {}  # staging chunk -> its bytes as last pushed
        self.chunk_words = np.zeros(0, np.int64)
        self.ref_version = -1  # the version the reference holds (-1: none usable)
        self.inboxes: dict[int, _Inbox] = {}
        self.headers = np.zeros(MAX_HEADERS, HEADER_RECORD)  # header outbox, by destination rank
        self.header_region = engine.register(self.headers, name=f"source {rank} delta headers")
        self.words = {k: self._key_word(t) for k, t in locals_.items()}
        self._changed: dict[str, tuple[Any, Any]] = {}  # this push: key -> (changed word indices, values)
        self._chunk_changed: dict[int, tuple[Any, Any] | None] = {}  # chunk -> same (None: not compared)
        self._works: dict[int, DeltaWork] = {}
        self.base = -1  # this push's reference version
        self.encode_seconds = 0.0

    @staticmethod
    def _key_word(t: Any) -> int:
        if not hasattr(t, "element_size"):
            return 0  # numpy: compared never (sent dense)
        es = int(t.element_size())
        return es if es in (1, 2, 4, 8) else 0

    @property
    def ref_bytes(self) -> int:
        keys = 0 if self.refs is None else sum(int(r.numel()) * r.element_size() for r in self.refs.values())
        return keys + sum(int(r.numel()) for r in self.chunk_refs.values())

    def close_regions(self) -> None:
        for ib in self.inboxes.values():
            if ib.region is not None:
                self.engine.deregister(ib.region)
        self.inboxes = {}

    def load(self, part: Any, rounds: Sequence[Any], src_keys: Sequence[str], tails: Mapping[int, Any],
             dests: Mapping[int, Any], dpos_keys: Mapping[int, Sequence[str]], sources: int) -> None:
        """A new plan part: the inboxes of this source's destinations and its writes into each. The
        staging chunks' references go (the chunks are cut anew); the tensors' stay, and so does their
        version: a destination that still holds it gets a delta of the direct writes."""
        import torch

        from weightsync.plan.layout import DTYPE_SIZES
        from weightsync.plan.writes import C_CAST, C_FP8, C_RAW, C_SCALE, K_DATA

        self.close_regions()
        self.chunk_refs = {}
        keys = part.keys
        # A staging chunk is compared in words of its smallest element (FP8 values: bytes).
        cw = np.full(len(part.chunks), 8, np.int64)
        for c in part.copies:
            kind = int(c["kind"])
            if kind == C_RAW:
                w = self.words.get(keys[int(c["key"])], 1) or 1
            elif kind == C_CAST:
                w = DTYPE_SIZES[part.plan.dst_dtype[int(c["tensor"])]]
            elif kind == C_SCALE:
                w = 4
            elif kind == C_FP8:
                w = 1
            else:
                continue
            cw[int(c["chunk"])] = min(cw[int(c["chunk"])], w)
        self.chunk_words = cw
        if part.relay:
            return  # relay chains land by their own counts: no headers
        w = part.writes
        staged = w[(w["staged"] == 1) & (w["kind"] == K_DATA)]
        for rank, d in dests.items():
            entry = d.target.descriptors.get(DELTA_KEY)
            if not entry:
                continue
            size = struct.unpack("<q", entry[2])[0]
            share = split_payload(size, sources)
            dkeys = sorted(k for k in d.target.descriptors if k != DELTA_KEY)
            kidx = {k: i for i, k in enumerate(dkeys)}
            ib = _Inbox(rank, entry[0], entry[1], self.rank * share, share, kidx, dpos_keys[rank])
            t = tails.get(rank)
            if t is not None:  # the tail: posted as planned, from the snapshot
                rows = t.rows or 1
                ib.fixed = np.zeros(1, ENTRY_DTYPE)
                ib.fixed[0] = (kidx[ib.dkeys[t.dst_index]], ENC_DENSE, 1, t.dst_off, rows, t.nbytes,
                               t.dst_pitch if rows > 1 else t.nbytes, 0, 0)
                ib.fixed_imms = self.engine.imm_count(t.nbytes, True, rows)
            rows_: list[tuple] = []
            for ri, r in enumerate(rounds):
                if r.rank != rank:
                    continue
                nrows, spitch, dpitch = r.geometry
                for i in range(len(r.nbytes)):
                    key = src_keys[int(r.src_index[i])]
                    nr = int(nrows[i]) if nrows is not None else 1
                    rb, so, do = int(r.nbytes[i]), int(r.src_off[i]), int(r.dst_off[i])
                    sp = int(spitch[i]) if nrows is not None and nr > 1 else rb
                    dp = int(dpitch[i]) if nrows is not None and nr > 1 else rb
                    kw = self.words[key]
                    word = write_word(kw, so, do, rb, sp, dp) if kw else 0
                    if word != kw:
                        word = 0  # not aligned to the key's elements: always as planned
                    dkey = kidx[ib.dkeys[int(r.dst_index[i])]]
                    rows_.append((ri, i, list(self.locals).index(key), dkey, word, so, do, nr, rb, sp, dp,
                                  self.engine.imm_count(rb, True, nr)))
            ib.direct = np.array(rows_, _DIRECT_DTYPE) if rows_ else np.zeros(0, _DIRECT_DTYPE)
            ib.capacity = len(ib.direct) + int((staged["dst_rank"] == d.target.slot).sum()) + len(ib.fixed)
            need = data_at(ib.capacity)  # the entries and the stream table
            if need > share:
                raise WeightSyncError(
                    f"source {self.rank}: destination {rank}'s delta inbox gives each of {sources} sources "
                    f"{share} bytes, less than the {need} bytes of this source's entries alone (raise the "
                    "destination's delta_bytes)")
            ib.send = torch.zeros(share, dtype=torch.uint8, device=self.device)
            ib.region = self.engine.register(ib.send, name=f"source {self.rank} delta payload to {rank}")
            self.inboxes[rank] = ib

    # -- one push ----------------------------------------------------------------------------------
    def start(self) -> None:
        """At the push's start: compares every local tensor with the reference (changed word indices and
        their values are kept for this push), or takes the first reference."""
        import torch

        t0 = time.perf_counter()
        self._changed, self._chunk_changed, self._works = {}, {}, {}
        self.base = self.ref_version
        self.ref_version = -1  # until this push has succeeded (its values replace the reference's)
        self.encode_seconds = 0.0
        if not self.enabled:
            return
        if self.refs is None:
            self.refs = {k: t.detach().clone() for k, t in self.locals.items() if self.words[k]}
            self.base = -1
        elif self.base >= 0:
            for key, ref in self.refs.items():
                w = self.words[key]
                cur, old = words(self.locals[key], w), words(ref, w)
                idx = _narrow(torch.nonzero(cur != old).reshape(-1), cur.numel())
                self._changed[key] = (idx, cur[idx])
        else:  # the reference is not of a version anyone holds: it becomes this push's values
            for key, ref in self.refs.items():
                ref.copy_(self.locals[key].detach())
        self.encode_seconds = time.perf_counter() - t0

    def chunk(self, c: int, view: Any) -> None:
        """Staging chunk ``c`` is prepared in ``view`` (first time this push: compared with its reference,
        or its reference taken)."""
        import torch

        if not self.enabled or c in self._chunk_changed:
            return
        t0 = time.perf_counter()
        ref = self.chunk_refs.get(c)
        if ref is None or ref.numel() != view.numel():
            self.chunk_refs[c] = view.clone()
            self._chunk_changed[c] = None  # its writes as planned this push
        elif self.base < 0:
            ref.copy_(view)
            self._chunk_changed[c] = None
        else:
            w = int(self.chunk_words[c])
            cur = words(view, w)
            idx = _narrow(torch.nonzero(cur != words(ref, w)).reshape(-1), cur.numel())
            self._chunk_changed[c] = (idx, cur[idx])
        self.encode_seconds += time.perf_counter() - t0

    def begin(self, rank: int, base: int, dense_bytes: int) -> DeltaWork:
        """Encodes this push's direct writes for inbox destination ``rank``, which can take a delta on
        version ``base`` (-1: none), into its send buffer; staged writes follow (``staged``)."""
        t0 = time.perf_counter()
        ib = self.inboxes[rank]
        d = ib.direct
        delta = self.enabled and base >= 0 and base == self.base
        work = DeltaWork(rank, delta, None, dense_bytes)
        enc = np.full(len(d), ENC_DENSE, np.int32)
        counts = np.zeros(len(d), np.int64)
        if delta:
            for i, (idx, vals, shift, k) in self._select(d, list(self.locals)).items():
                n = int(d["rows"][i]) * int(d["row_bytes"][i]) // int(d["word"][i])
                w = int(d["word"][i])
                piece = _Piece(len(work.rows), i, w, int(d["dkey"][i]), idx, vals, shift, k, n)
                enc[i], counts[i] = self._take(ib, work, piece), k
        rows = np.zeros(len(d), ENTRY_DTYPE)
        rows["key"] = d["dkey"]
        rows["enc"] = enc
        rows["word"] = np.maximum(d["word"], 1)
        rows["dst_off"] = d["dst_off"]
        rows["rows"] = d["rows"]
        rows["row_bytes"] = d["row_bytes"]
        rows["pitch"] = d["dst_pitch"]
        rows["count"] = np.where(enc == ENC_DENSE, 0, counts)
        work.rows.append(rows)
        dense = enc == ENC_DENSE
        work.planned_imms += int(d["imms"][dense].sum())
        work.planned_bytes += int((d["rows"] * d["row_bytes"])[dense].sum())
        if delta:
            work.keep = {}
            for ri in np.unique(d["round"]).tolist():
                m = d["round"] == ri
                mask = np.zeros(int(d["pos"][m].max()) + 1, bool)
                mask[d["pos"][m]] = dense[m]
                work.keep[int(ri)] = mask
        self._works[rank] = work
        self.encode_seconds += time.perf_counter() - t0
        return work

    def _take(self, ib: _Inbox, work: DeltaWork, piece: _Piece) -> int:
        """Whether a write's changes travel in its word size's stream (ENC_STREAM; ENC_EMPTY: none
        changed) or the write goes as planned (ENC_DENSE: its changes would not be smaller, or the
        streams would no longer fit this source's share of the inbox)."""
        n, k, w = piece.n, piece.k, piece.word
        work.changed += k
        work.words += n
        e, _ = choose(n, k, w)
        if e == ENC_EMPTY or e == ENC_DENSE:
            return e
        totals = {x: list(v) for x, v in work.streams.items()}
        t = totals.setdefault(w, [0, 0])
        t[0] += n
        t[1] += k
        size = data_at(ib.capacity) + sum(_align(stream_size(nn, kk, x)[1]) for x, (nn, kk) in totals.items())
        if size > ib.share:
            return ENC_DENSE
        work.streams = totals
        work.pieces.append(piece)
        return ENC_STREAM

    def staged(self, rank: int, c: int, src_off: np.ndarray, di: np.ndarray, dst_off: np.ndarray,
               nbytes: np.ndarray) -> np.ndarray | None:
        """Staged chunk ``c``'s writes into inbox destination ``rank`` (1-D, at ``src_off`` in the chunk):
        records their entries, encodes the changed words of those it sends as a delta, and returns which
        go as planned (None: ``rank`` has no inbox)."""
        work = self._works.get(rank)
        if work is None:
            return None
        t0 = time.perf_counter()
        ib = self.inboxes[rank]
        n_w = len(nbytes)
        enc = np.full(n_w, ENC_DENSE, np.int32)
        counts = np.zeros(n_w, np.int64)
        word = np.ones(n_w, np.int64)
        keys = np.array([ib.keys[ib.dkeys[int(x)]] for x in di], np.int64)
        changed = self._chunk_changed.get(c)
        if work.delta and changed is not None:
            import torch

            idx, vals = changed
            cw = int(self.chunk_words[c])
            so, nb, do = src_off.astype(np.int64), nbytes.astype(np.int64), dst_off.astype(np.int64)
            ok = (so % cw == 0) & (nb % cw == 0) & (do % cw == 0)
            bounds = torch.tensor(np.stack([so // cw, (so + nb) // cw], 1).reshape(-1), device=idx.device,
                                  dtype=idx.dtype)
            cut = torch.searchsorted(idx, bounds).tolist()
            for i in np.flatnonzero(ok).tolist():
                lo, hi = cut[2 * i], cut[2 * i + 1]
                piece = _Piece(len(work.rows), i, cw, int(keys[i]), idx[lo:hi], vals[lo:hi],
                               -(int(so[i]) // cw), hi - lo, int(nb[i]) // cw)
                enc[i], counts[i], word[i] = self._take(ib, work, piece), hi - lo, cw
        rows = np.zeros(n_w, ENTRY_DTYPE)
        rows["key"] = keys
        rows["enc"] = enc
        rows["word"] = word
        rows["dst_off"] = dst_off
        rows["rows"] = 1
        rows["row_bytes"] = nbytes
        rows["pitch"] = nbytes
        rows["count"] = np.where(enc == ENC_DENSE, 0, counts)
        work.rows.append(rows)
        keep = enc == ENC_DENSE
        work.planned_imms += sum(self.engine.imm_count(int(n)) for n in nbytes[keep].tolist())
        work.planned_bytes += int(nbytes[keep].astype(np.int64).sum())
        self.encode_seconds += time.perf_counter() - t0
        return keep

    def finalize(self, rank: int) -> DeltaWork:
        """The payload of ``rank`` complete: its entries (the tail's last) written at the head of the
        send buffer; returns the work with its final figures."""
        import torch

        t0 = time.perf_counter()
        work = self._works[rank]
        ib = self.inboxes[rank]
        streams = np.zeros(len(WORDS), STREAM_DTYPE)
        streams["word"] = WORDS
        at = data_at(ib.capacity)
        # Per word size, the sparse writes' changes laid end to end, by destination key (the destination
        # then scatters each key's changes at once), each write at its base in the stream.
        for j, w in enumerate(WORDS):
            pieces = sorted((p for p in work.pieces if p.word == w), key=lambda p: (p.key, p.block, p.row))
            if not pieces:
                continue
            n, k = work.streams[w]
            base, shifts = 0, []
            for p in pieces:
                work.rows[p.block][p.row]["data"] = base
                shifts.append(p.shift + base)
                base += p.n
            dev = pieces[0].idx.device
            counts = torch.tensor([p.k for p in pieces], device=dev)
            local = torch.repeat_interleave(torch.tensor(shifts, device=dev), counts, output_size=k)
            local += torch.cat([p.idx for p in pieces])
            enc, size = stream_size(n, k, w)
            encode_into(ib.send[at:at + size], enc, local, torch.cat([p.vals for p in pieces]), n)
            streams[j] = (w, enc, n, k, at, (0, 0, 0))
            at += _align(size)
        s0 = streams_at(ib.capacity)
        ib.send[s0:s0 + streams.nbytes].copy_(torch.from_numpy(streams.view(np.uint8)))
        entries = np.concatenate([*work.rows, ib.fixed])
        if len(entries) > ib.capacity:
            raise WeightSyncError(f"internal: {len(entries)} delta entries for destination {rank}, room for "
                                  f"{ib.capacity}")
        ib.send[: len(entries) * ENTRY_DTYPE.itemsize].copy_(torch.from_numpy(entries.view(np.uint8)))
        work.entries = len(entries)
        work.payload_bytes = at
        work.imms = work.planned_imms + ib.fixed_imms + self.engine.imm_count(at)
        work.wire_bytes = at + work.planned_bytes + int(ib.fixed["rows"] @ ib.fixed["row_bytes"])
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()  # the engine reads the send buffer
        self.encode_seconds += time.perf_counter() - t0
        return work

    def _select(self, d: np.ndarray, keys: list[str]) -> dict[int, tuple[Any, Any, int, int]]:
        """Per direct write of ``d`` that is compared: its changed words out of its key's (``idx + shift``
        are their indices into its own words, in order), their values, and how many."""
        import torch

        out: dict[int, tuple[Any, Any, int, int]] = {}
        for ki in np.unique(d["key"]).tolist():
            key = keys[ki]
            if key not in self._changed:
                continue
            idx, vals = self._changed[key]
            rows = np.flatnonzero((d["key"] == ki) & (d["word"] > 0))
            if not len(rows):
                continue
            w = d["word"][rows]
            start = d["src_off"][rows] // w
            span = ((d["rows"][rows] - 1) * d["src_pitch"][rows] + d["row_bytes"][rows]) // w
            bounds = torch.tensor(np.stack([start, start + span], 1).reshape(-1), device=idx.device,
                                  dtype=idx.dtype)
            cut = torch.searchsorted(idx, bounds).tolist()
            for j, i in enumerate(rows.tolist()):
                lo, hi = cut[2 * j], cut[2 * j + 1]
                nr = int(d["rows"][i])
                m = int(d["row_bytes"][i]) // int(w[j])
                p = int(d["src_pitch"][i]) // int(w[j])
                if nr > 1 and p != m:  # strided rows: the words between them are not this write's
                    sub = idx[lo:hi] - int(start[j])
                    r = sub // p
                    c = sub - r * p
                    inside = c < m
                    sub, v = (r * m + c)[inside], vals[lo:hi][inside]
                    out[i] = (sub, v, 0, int(sub.numel()))
                else:
                    out[i] = (idx[lo:hi], vals[lo:hi], -int(start[j]), hi - lo)
        return out

    def header(self, rank: int, epoch: int, version: int, work: DeltaWork) -> None:
        ib = self.inboxes[rank]
        self.headers[rank] = (epoch, version, work.imms, ib.offset, work.payload_bytes, work.entries,
                              work.changed, ib.capacity)

    def finish(self, version: int, ok: bool) -> None:
        """After the push: the changed values become the reference; usable from the next push on if this
        one succeeded."""
        t0 = time.perf_counter()
        if self.refs is not None:
            for key, (idx, vals) in self._changed.items():
                words(self.refs[key], self.words[key])[idx] = vals
        for c, changed in self._chunk_changed.items():
            if changed is not None:
                words(self.chunk_refs[c], int(self.chunk_words[c]))[changed[0]] = changed[1]
        self._changed, self._chunk_changed = {}, {}
        if self.device.type == "cuda":
            import torch

            torch.cuda.current_stream(self.device).synchronize()
        self.ref_version = version if ok and self.enabled and self.refs is not None else -1
        self.encode_seconds += time.perf_counter() - t0


# -- the destination's side ------------------------------------------------------------------------------
def _per_word(col: np.ndarray, counts: Any, total: int) -> Any:
    """A per-entry column repeated for each of the entry's ``counts`` changed words (on their device)."""
    import torch

    return torch.repeat_interleave(torch.tensor(col, device=counts.device), counts, output_size=total)


class DeltaReceiver:
    """A destination's delta inbox and what its shadows hold."""

    def __init__(self, engine: Any, buffers: Mapping[str, list[Any]], mode: str, device: Any, nbytes: int,
                 rank: int) -> None:
        import torch

        self.engine = engine
        self.buffers = buffers
        self.mode = mode
        self.device = device
        self.keys = sorted(buffers)
        self.headers = np.full(MAX_HEADERS, -1, HEADER_RECORD)
        self.header_region = engine.register(self.headers, name=f"destination {rank} delta headers")
        self.payload = torch.zeros(max(int(nbytes), ALIGN), dtype=torch.uint8, device=device)
        self.payload_region = engine.register(self.payload, name=f"destination {rank} delta payload")
        self.holds = [-1, -1] if mode == "staged" else [-1]  # the version each buffer holds exactly
        self.apply_seconds = 0.0
        # this version's entries, streams and payload offset, per source
        self._entries: list[tuple[np.ndarray, np.ndarray, int]] = []

    def descriptor(self) -> list[bytes]:
        return [self.header_region.descriptor, self.payload_region.descriptor,
                struct.pack("<q", int(self.payload.numel()))]

    def base(self, version: int, dirty: bool, shadow: int) -> int:
        """The version a delta into ``shadow`` may be taken on: the one this destination holds, if the
        buffer written holds exactly it."""
        if dirty or version < 0 or self.holds[shadow] != version:
            return -1
        return version

    def granted(self, shadow: int) -> None:
        self.holds[shadow] = -1  # bytes of the new version may land in it from now on
        self._entries = []

    def read_headers(self, sources: Sequence[int], epoch: int, version: int) -> int:
        """The data immediates the version's headers announce (all of them arrived)."""
        total = 0
        self._entries = []
        for r in sources:
            h = self.headers[r]
            if int(h["version"]) != version or int(h["epoch"]) != epoch:
                raise WeightSyncError(f"delta header of source {r} names version {int(h['version'])} of plan "
                                      f"epoch {int(h['epoch'])}, not {version} of {epoch}")
            total += int(h["imms"])
            n = int(h["entries"])
            off = int(h["offset"])
            # entries, then (past the room for all of them) the streams: one copy of both
            room = int(h["room"])
            head = self.payload[off:off + data_at(room)].cpu().numpy()
            entries = head[:n * ENTRY_DTYPE.itemsize].view(ENTRY_DTYPE).copy()
            streams = head[streams_at(room):data_at(room)].view(STREAM_DTYPE).copy()
            self._entries.append((entries, streams, off))
        return total

    def apply(self, shadow: int) -> None:
        """Scatters this version's sparse entries into buffer ``shadow``."""
        t0 = time.perf_counter()
        self._scatter_all(shadow)
        self._sync_device()
        self.apply_seconds = time.perf_counter() - t0

    def _scatter_all(self, shadow: int) -> None:
        """Per source and word size: decodes its stream once, then scatters each key's changes at once
        (a strided write's alone)."""
        import torch

        for entries, streams, off in self._entries:
            for st in streams:
                k, w = int(st["k"]), int(st["word"])
                if k == 0:
                    continue
                virt, vals = decode(self.payload[off + int(st["data"]):], int(st["enc"]), int(st["n"]), k, w)
                ents = entries[(entries["enc"] == ENC_STREAM) & (entries["word"] == w)]
                ents = ents[np.argsort(ents["data"], kind="stable")]
                ends = np.cumsum(ents["count"])
                starts = ends - ents["count"]
                strided = (ents["rows"] > 1) & (ents["pitch"] != ents["row_bytes"])
                dev = virt.device
                # contiguous writes: the stream's index plus one shift per write gives the target's word
                counts = torch.tensor(ents["count"], device=dev)
                shift = _per_word(ents["dst_off"] // w - ents["data"], counts, k)
                for key in np.unique(ents["key"]).tolist():
                    target = words(self.buffers[self.keys[key]][shadow], w)
                    mine = np.flatnonzero(ents["key"] == key)  # one run of the stream: sorted by key
                    a, b = int(starts[mine[0]]), int(ends[mine[-1]])
                    if not strided[mine].any():
                        target[virt[a:b] + shift[a:b]] = vals[a:b]
                        continue
                    cnt = torch.tensor(ents["count"][mine], device=dev)
                    e = ents[mine]
                    row = np.where(strided[mine], e["row_bytes"] // w, e["rows"] * e["row_bytes"] // w)
                    local = virt[a:b] - _per_word(e["data"], cnt, b - a)
                    m = _per_word(row, cnt, b - a)
                    r = local // m
                    pitch = _per_word(e["pitch"] // w, cnt, b - a)
                    target[_per_word(e["dst_off"] // w, cnt, b - a) + r * pitch + (local - r * m)] = vals[a:b]

    def completed(self, version: int, shadow: int) -> None:
        self.holds[shadow] = version

    def sync_other(self, version: int, shadow: int) -> None:
        """Staged: brings the other shadow to ``version`` (complete in ``shadow``): the dense entries'
        regions copied, the sparse ones applied again. The next version is granted into it."""
        if self.mode != "staged":
            return
        other = 1 - shadow
        self.holds[other] = -1
        for entries, _, _ in self._entries:
            for e in entries[entries["enc"] == ENC_DENSE]:
                self._copy_region(e, shadow, other)
        self._scatter_all(other)
        self._sync_device()
        self.holds[other] = version

    def _copy_region(self, e: np.void, src: int, dst: int) -> None:
        import torch

        key = self.keys[int(e["key"])]
        a = self.buffers[key][src].detach().reshape(-1).view(torch.uint8)
        b = self.buffers[key][dst].detach().reshape(-1).view(torch.uint8)
        rows, rb, pitch, o = int(e["rows"]), int(e["row_bytes"]), int(e["pitch"]), int(e["dst_off"])
        if rows <= 1 or pitch == rb:
            b[o:o + rows * rb].copy_(a[o:o + rows * rb])
        else:
            b.as_strided((rows, rb), (pitch, 1), b.storage_offset() + o).copy_(
                a.as_strided((rows, rb), (pitch, 1), a.storage_offset() + o))

    def _sync_device(self) -> None:
        if self.device.type == "cuda":
            import torch

            torch.cuda.current_stream(self.device).synchronize()
