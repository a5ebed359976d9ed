"""The delta payload's codec: what a payload holds (its entries, stream table and encoded streams),
the encodings and their one size rule, and the spans a push is cut into.

this source in that span (key index in the destination's sorted keys, encoding, word size, destination
offset, rows, bytes per row, destination pitch, changed count, and for a sparse one its base in its
stream), a table of :data:`STREAM_DTYPE` rows (one per word size), then the streams; the spans lie one
after the other in this source's share of the payload area, which has room for every span's tables
(they are reserved when a push starts; the streams take what is left, in span order). A write is sparse
(:data:`ENC_STREAM`) when its changes alone would encode smaller than the write; all sparse writes of one
word size in a span are laid end to end (direct writes in the order of their words in the source's
reference; in the final span the staged ones) and their changed words encoded as one stream. Dense
entries carry no data: their bytes landed where the plan put them (a staged destination copies them into
its other shadow). A stream of
``n`` words of which ``k`` changed, ``w`` bytes a word, is encoded as the smaller of:

* :data:`ENC_IDX16`: per 65536-word block an int32 count, then each changed word's index within its
  block as 16 bits, then the ``k`` values: ``4 ceil(n / 65536) + 2k + wk`` bytes;
* :data:`ENC_BITMAP`: one bit per word (bit ``i % 8`` of byte ``i // 8``), then the values:
  ``ceil(n / 8) + wk`` bytes (smaller from about 6% changed on);
An entry is :data:`ENC_EMPTY` when nothing in it changed, :data:`ENC_DENSE` when it went as planned.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from weightsync.delta.units import ALIGN, BLOCK, _align, word_dtype
from weightsync.errors import WeightSyncError
from weightsync.wire import DELTA_PARTS_MAX

DELTA_KEY = "\x00weightsync.delta"  # the descriptor entry of a destination's delta inbox
ENC_DENSE, ENC_EMPTY, ENC_IDX16, ENC_BITMAP, ENC_STREAM = 0, 1, 2, 3, 4
ENCODINGS = {ENC_DENSE: "dense", ENC_EMPTY: "empty", ENC_IDX16: "idx16", ENC_BITMAP: "bitmap",
             ENC_STREAM: "stream"}
WORDS = (1, 2, 4, 8)
BITMAP_SLICE = 1 << 28  # words a bitmap is read in at a time (a multiple of 64: whole bytes)
SCRATCH = 1 << 25  # stream positions put in a bitmap at a time (int64: 256 MiB at most)
MAX_HEADERS = 1024  # header slots of an inbox per span: source ranks (weightsync.wire.MAX_SLOTS)
# A push's early spans: the local tensors in order, cut into this many runs (span_of). Each span's direct
# writes are compared, decided, encoded and sent (entries, payload and header of their own), and a
# destination scatters a span as soon as it has landed. On a GPU every span's compare is launched at the
# push's start (back to back on a stream of lower priority, DeltaSender.prefetch) while the host decides
# and encodes one span after another, so the compare overlaps the encode, transfer and apply of the spans
# before; what follows the last span's compare is the one stretch nothing overlaps. The final span
# carries the staged writes and the tail and completes the version. At most 7
# (weightsync.wire.delta_part_imm). Four was the fastest count measured (scripts/bench_delta.py): fewer
# overlap less, more pay their fixed waits more often.
SPANS = 4
assert SPANS <= DELTA_PARTS_MAX
# The spans' relative sizes (span_of): the last one half as large as the others, so that less follows
# its compare (its copy, and the destination's scatter, which queues behind the span before's). It pays
# while each span's host work is well under its compare's time, as it is today (scripts/bench_delta.py
# compares share choices).
SPAN_SHARES = (2, 2, 2, 1)
assert len(SPAN_SHARES) == SPANS
# The fewest bytes worth a span of their own. A span costs its own waits (headers, payload immediates, a
# host synchronization on each side) whatever its size, while what it overlaps grows with its bytes: a
# source with less than SPANS times this fills fewer spans, and the others go empty (their headers
# only). A small model (the RL loop example's) pushes faster in one span than in four.
MIN_SPAN_BYTES = 1 << 28


def span_of(nbytes: np.ndarray, spans: int = SPANS, min_bytes: int | None = None,
            shares: Sequence[int] | None = None) -> np.ndarray:
    """Each tensor's span (``nbytes``: the tensors' bytes, in order): runs in order whose bytes are about
    in proportion to ``shares`` (None: :data:`SPAN_SHARES`), as many as ``spans`` but none under
    ``min_bytes`` (None: :data:`MIN_SPAN_BYTES`) where that can be (the rest empty, and the spans used
    equal); a tensor goes with the span its first byte falls in (so one larger than a span has one to
    itself, and the span after it may be empty)."""
    nbytes = np.asarray(nbytes, np.int64)
    total = int(nbytes.sum())
    least = MIN_SPAN_BYTES if min_bytes is None else min_bytes
    used = max(1, min(spans, total // max(least, 1)))
    want = list(SPAN_SHARES if shares is None else shares)
    w = np.asarray(want if len(want) == used else [1] * used, np.int64)
    # span p starts at the first byte at or past its share of the total
    starts = -(-np.cumsum(w)[:-1] * total // int(w.sum()))
    before = np.cumsum(nbytes) - nbytes
    return np.searchsorted(starts, before, side="right").astype(np.int64)


HEADER_RECORD = np.dtype([("epoch", "<i8"), ("version", "<i8"), ("imms", "<i8"), ("offset", "<i8"),
                          ("nbytes", "<i8"), ("entries", "<i8"), ("changed", "<i8"), ("room", "<i8")])
# ``entries`` of a final-span header from a source whose share of the inbox cannot hold its entry tables:
# every write of that source went as planned and nothing lies in the payload; ``offset`` and ``room`` then
# give the first relay chunk of the source's writes and how many (0 and 0 outside a relay chain), which
# a chain member takes as sent as planned without an entry naming them.
ALL_PLANNED = -1
ENTRY_DTYPE = np.dtype([("key", "<i4"), ("enc", "<i4"), ("word", "<i8"), ("dst_off", "<i8"), ("rows", "<i8"),
                        ("row_bytes", "<i8"), ("pitch", "<i8"), ("count", "<i8"), ("data", "<i8")])
# One per word size, after the entries: the changed words of every sparse entry of that word size, as one
# encoded stream over their words laid end to end (``data``: where the encoding starts in the payload).
STREAM_DTYPE = np.dtype([("word", "<i8"), ("enc", "<i8"), ("n", "<i8"), ("k", "<i8"), ("data", "<i8"),
                         ("reserved", "<i8", (3,))])
assert HEADER_RECORD.itemsize == 64 and ENTRY_DTYPE.itemsize == 64 and STREAM_DTYPE.itemsize == 64
# The wire is little-endian, and so are the word views here: an int64's low 16 bits are its first int16,
# a bitmap's bit i is bit i % 32 of int32 word i // 32.
assert sys.byteorder == "little", "weightsync's delta codec needs a little-endian host"


def streams_at(capacity: int) -> int:
    """Where the stream table starts in a payload with room for ``capacity`` entries."""
    return _align(capacity * ENTRY_DTYPE.itemsize)


def data_at(capacity: int) -> int:
    """Where the encoded streams start."""
    return streams_at(capacity) + len(WORDS) * STREAM_DTYPE.itemsize














def write_word(w_max: int, *offsets: int) -> int:
    """The largest word size up to ``w_max`` (a power of two) dividing every offset, size and pitch of a
    write: its elements are compared and placed in words of that many bytes."""
    w = w_max
    while w > 1 and any(int(o) % w for o in offsets):
        w //= 2
    return w


# -- the codec -------------------------------------------------------------------------------------------
def index_bytes(enc: int, n: Any, k: Any) -> Any:
    """The size rule: bytes of the index section of sparse encoding ``enc`` of ``k`` changed words out of
    ``n`` (ints, or numpy arrays of many writes); its ``k`` values follow, ``w`` bytes each. ENC_IDX16:
    an int32 count per block, then a 16-bit index per change; ENC_BITMAP: a bit per word."""
    if enc == ENC_IDX16:
        return _up(4 * -(-n // BLOCK)) + _up(2 * k)
    if enc == ENC_BITMAP:
        return _up(-(-n // 8))
    raise WeightSyncError(f"internal: no sparse encoding {enc}")


def _up(x: Any) -> Any:
    """``x`` rounded up to a multiple of ALIGN (an int, or a numpy array of them)."""
    return -(-x // ALIGN) * ALIGN


def sparse_sizes(n: int, k: int, w: int) -> dict[int, int]:
    """Bytes of each sparse encoding of ``k`` changed words out of ``n`` words of ``w`` bytes."""
    return {enc: index_bytes(enc, n, k) + w * k for enc in (ENC_IDX16, ENC_BITMAP)}


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
    enc, size = stream_size(n, k, w)
    if size >= n * w:
        return ENC_DENSE, n * w
    return enc, size


def _choose_many(n: np.ndarray, k: np.ndarray, w: int) -> np.ndarray:
    """:func:`choose` of many writes at once, as ENC_EMPTY, ENC_DENSE or ENC_STREAM (sparse)."""
    n, k = n.astype(np.int64), k.astype(np.int64)
    sparse = np.minimum(index_bytes(ENC_IDX16, n, k), index_bytes(ENC_BITMAP, n, k)) + w * k
    return np.where(k == 0, ENC_EMPTY, np.where(sparse >= n * w, ENC_DENSE, ENC_STREAM)).astype(np.int32)


def _values_at(enc: int, n: int, k: int) -> int:
    """Where the values start in an encoding of ``k`` changed words out of ``n``."""
    return int(index_bytes(enc, n, k))


class _IndexWriter:
    """Writes the index section of encoding ``enc`` of ``k`` changed words out of ``n`` at the head of
    ``out`` (uint8) from their positions (sorted, unique), given in pieces in order (:meth:`add`), with no
    host synchronization. ENC_IDX16, two device ops per piece: the low 16 bits of each position plus the
    piece's shift, as the low 16 bits of the position (the first int16 of a little-endian integer) plus
    the shift's in int16 (sums wrap modulo 2**16 alike); the per-block counts from how many positions
    lie below each block's end less the shift (``searchsorted``). ENC_BITMAP on CPU, one C++ call per
    piece (:mod:`weightsync.delta.host`); on CUDA one kernel per piece
    (:func:`weightsync.delta.cuda.bitmap_set`); else (no NVRTC, or ``WEIGHTSYNC_DELTA_KERNELS``
    naming another path) a few device ops per :data:`SCRATCH` positions shifted into a scratch: bits added
    into int32 words (the bits of one word are distinct powers of two, so adding them is or-ing them; bit
    31 as the int32 -2**31, two's complement sums wrap alike). A kernel may also write the section
    (:meth:`reserve`, then ``low`` and :meth:`kernel_counts`, or ``bits``)."""

    def __init__(self, out: Any, enc: int, n: int, k: int, device: Any) -> None:
        import torch

        self.out, self.enc, self.n, self.k, self.device = out, enc, n, k, device
        self.done = 0  # positions written (or reserved: :meth:`reserve`)
        self.fill = 0  # positions in the scratch
        # ENC_IDX16: the section's block counts, where a kernel adds into them (:meth:`kernel_counts`);
        # per block end, how many positions :meth:`add` gave lie below it. Made when first wanted: each
        # is a device op or two of host time, on the push's path.
        self.counts: Any = None
        self.ends: Any = None
        self.below: Any = None
        self.host = False  # ENC_BITMAP on CPU: bits set by C++, no scratch
        self.mod: Any = None  # ENC_BITMAP on CUDA: the kernels that set bits (delta_cuda), where they load
        self.scratch: Any = None  # ENC_BITMAP by device ops: positions gathered for one index_add_
        if enc == ENC_IDX16:
            self.nb = -(-n // BLOCK)
            o = _align(4 * self.nb)
            self.low = out[o:o + 2 * k].view(torch.int16)
        elif enc == ENC_BITMAP:
            section = out[: _align(-(-n // 8))]
            section.zero_()
            from weightsync.delta import host as delta_host

            # on CPU the bits are set by C++ (delta_host), on CUDA by delta_cuda's kernels, else by device
            # ops through a scratch
            self.host = delta_host.wanted(device) and out.is_contiguous()
            if not self.host:
                self.bits = section.view(torch.int32)
                if device.type == "cuda":  # None where WEIGHTSYNC_DELTA_KERNELS chooses another path
                    from weightsync.delta import cuda as delta_cuda

                    self.mod = delta_cuda.module(device)
        else:
            raise WeightSyncError(f"internal: no sparse encoding {enc}")

    def add(self, positions: Any, shift: int, within: tuple[int, int] | None = None) -> None:
        """The next positions: ``positions + shift`` (int32 or int64), all in the stream's words
        ``within[0]:within[1]`` where given (only those blocks' counts are looked up)."""
        import torch

        if self.enc == ENC_IDX16:
            m = int(positions.numel())
            if not m:
                return
            positions = positions.contiguous()
            if self.below is None:
                self.ends = torch.arange(1, self.nb + 1, device=self.device, dtype=torch.int64) * BLOCK
                self.below = torch.zeros(self.nb, dtype=torch.int64, device=self.device)
            low = positions.view(torch.int16)[0::positions.element_size() // 2]
            torch.add(low, ((shift & 0xFFFF) ^ 0x8000) - 0x8000, out=self.low[self.done:self.done + m])
            # blocks b0:b1 may hold some of them; every one lies below the ends of the blocks after
            b0, b1 = ((within[0] // BLOCK, (within[1] - 1) // BLOCK + 1) if within is not None
                      else (0, self.nb))
            ends = self.ends[b0:b1] - shift
            if positions.dtype != torch.int64:  # positions of int32 are in [0, 2**31 - 1)
                ends = ends.clamp_(0, (1 << 31) - 1).to(positions.dtype)
            self.below[b0:b1] += torch.searchsorted(positions, ends)
            if b1 < self.nb:
                self.below[b1:] += m
            self.done += m
            return
        if self.host:  # CPU: C++ sets the bits (index_add_ of each bit is far slower on a CPU)
            from weightsync._ext import _core

            m = int(positions.numel())
            held = positions.contiguous().to(torch.int64)
            _core.delta_bitmap_set(int(self.out.data_ptr()), self.n, int(held.data_ptr()), m, shift)
            self.done += m
            return
        if self.mod is not None:  # CUDA: one kernel, no scratch
            from weightsync.delta import cuda as delta_cuda

            delta_cuda.bitmap_set(self.mod, positions, shift, self.bits)
            self.done += int(positions.numel())
            return
        if self.scratch is None:
            self.scratch = torch.empty(max(min(self.k, SCRATCH), 1), dtype=torch.int64, device=self.device)
            self.one = torch.ones((), dtype=torch.int32, device=self.device)
        a, m = 0, int(positions.numel())
        while a < m:
            c = min(m - a, int(self.scratch.numel()) - self.fill)
            dst = self.scratch[self.fill:self.fill + c]
            if positions.dtype == torch.int64:
                torch.add(positions[a:a + c], shift, out=dst)
            else:  # widened first: the sum may not fit the narrower type
                dst.copy_(positions[a:a + c])
                if shift:
                    dst += shift
            self.fill += c
            a += c
            if self.fill == self.scratch.numel():
                self._flush()

    def reserve(self, m: int) -> int:
        """ENC_IDX16: the next ``m`` entries are written by a kernel (which counts their blocks into
        :meth:`kernel_counts`); returns the first one's index."""
        at = self.done
        self.done += m
        return at

    def kernel_counts(self) -> Any:
        """ENC_IDX16: the section's block counts (int32), zeroed, for a kernel to add its entries' into."""
        import torch

        if self.counts is None:
            self.counts = self.out[: 4 * self.nb].view(torch.int32)
            self.counts.zero_()
        return self.counts

    def _flush(self) -> None:
        import torch

        if self.host or self.scratch is None or not self.fill:
            return
        pos = self.scratch[:self.fill]
        self.bits.index_add_(0, pos >> 5, torch.bitwise_left_shift(self.one, (pos & 31).to(torch.int32)))
        self.done += self.fill
        self.fill = 0

    def close(self) -> None:
        import torch

        self._flush()
        if self.enc == ENC_IDX16:
            counts = self.kernel_counts()  # a kernel's counts, or zeros
            if self.below is not None:  # and those of the positions given to add
                counts[:1] += self.below[:1].to(torch.int32)
                counts[1:] += (self.below[1:] - self.below[:-1]).to(torch.int32)


def encode_into(out: Any, enc: int, local: Any, values: Any, n: int) -> None:
    """Writes the ``enc`` encoding of changed words ``local`` (sorted indices into the write's ``n``
    words) with ``values`` (their new words) into ``out`` (uint8, exactly ``sparse_sizes(...)[enc]``
    bytes, starting at a multiple of 4 bytes)."""

    k, w = int(local.numel()), values.element_size()
    writer = _IndexWriter(out, enc, n, k, local.device)
    writer.add(local, 0)
    writer.close()
    o = _values_at(enc, n, k)
    out[o:o + w * k].view(values.dtype).copy_(values)


def decode(buf: Any, enc: int, n: int, k: int, w: int) -> tuple[Any, Any]:
    """The changed words' indices (int64, sorted) into the write's ``n`` words and their values (``w``-byte
    integers), from an encoding written by :func:`encode_into` (``buf``: uint8, starting at it)."""
    import torch

    if enc == ENC_IDX16:
        nb = -(-n // BLOCK)
        counts = buf[: 4 * nb].view(torch.int32)
        o = _align(4 * nb)
        # each block's base once per changed word in it (low 16 bits zero), then the low bits copied in
        bases = torch.arange(nb, device=buf.device, dtype=torch.int64) * BLOCK
        local = torch.repeat_interleave(bases, counts, output_size=k)
        local.view(torch.int16)[0::4].copy_(buf[o:o + 2 * k].view(torch.int16))
    elif enc == ENC_BITMAP:
        nbytes = -(-n // 8)
        shifts = torch.arange(8, dtype=torch.uint8, device=buf.device)
        spans = []
        # Bounded temporaries (one byte per word of a slice); each nonzero is one host synchronization.
        for lo in range(0, nbytes, BITMAP_SLICE // 8):
            bits = (buf[lo:min(lo + BITMAP_SLICE // 8, nbytes)].unsqueeze(1) >> shifts) & 1
            spans.append(torch.nonzero(bits.reshape(-1)).reshape(-1) + 8 * lo)
        local = spans[0] if len(spans) == 1 else torch.cat(spans)
    else:
        raise WeightSyncError(f"internal: no sparse encoding {enc}")
    o = _values_at(enc, n, k)
    return local, buf[o:o + w * k].view(word_dtype(w))


def placed(local: Any, base: int, row_words: int, pitch_words: int, rows: int) -> Any:
    """Word indices, in a tensor's flat word view, of a write's words ``local`` (indices into its
    ``rows`` rows of ``row_words`` words, ``pitch_words`` apart, the first at word ``base``)."""
    if rows <= 1 or pitch_words == row_words:
        return local + base
    r = local // row_words
    return base + r * pitch_words + (local - r * row_words)


def header_slot(rank: int, span: int | None = None) -> int:
    """Where the header of source or destination ``rank`` lies in a header array: the final span's
    first, then each early span's, MAX_HEADERS slots each."""
    return (0 if span is None else 1 + span) * MAX_HEADERS + rank


def split_payload(total: int, sources: int) -> int:
    """Bytes of each source's share of a payload area of ``total`` bytes (ALIGN multiples)."""
    return total // max(sources, 1) // ALIGN * ALIGN


def suggested_inbox(share: int, sources: int) -> int:
    """A ``delta_bytes`` whose split among ``sources`` gives each at least ``share`` bytes, an eighth more
    (the changes move from push to push), in whole KiB."""
    per_source = -(-(share + share // 8) // 1024) * 1024
    return max(sources, 1) * _align(per_source)


def _streams_bytes(totals: Mapping[int, Sequence[int]]) -> int:
    """Bytes of the streams of ``totals`` (word size -> words, changed words)."""
    return sum(_align(stream_size(n, k, w)[1]) for w, (n, k) in totals.items())
