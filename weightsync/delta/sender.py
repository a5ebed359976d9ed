"""Delta pushes: per planned write, only the elements that differ bitwise from the version the destination
holds cross the wire, encoded; the destination scatters them into place.

Who decides what
----------------
* A destination that can take deltas registers a *delta inbox* (``Destination(..., delta_bytes=N)``): a
  host array of header slots (per part one per source rank, :data:`HEADER_RECORD`, :func:`header_slot`)
  and a payload area of ``N``
  bytes on its device, split evenly between the group's sources. It publishes both descriptors under the
  pseudo-key :data:`DELTA_KEY` when it joins. Its grant says which version it can take a delta on (the
  ``held`` field of the grant): inplace, the live version unless an abandoned version left bytes in it;
  staged, the newest complete version if the shadow it grants holds it too (after every version the
  other shadow is brought up to it: same entries, off the sources' critical path), else -1.
* A push goes in :data:`SPANS` early *parts* and a final one. The local tensors are cut, in order, into
  SPANS runs of about equal bytes; a part holds the direct writes that read its tensors. Every source
  writes each inbox destination, per version and early part, that part's payload (its entries and
  encoded changes) and then its header, each with an immediate of the part's own
  (:func:`weightsync.wire.delta_part_imm`): the destination waits for the part's header from every
  source, then for the payload immediates they announce, then reads the entries and scatters the sparse
  ones, while the sources compare and send the next part. Last comes the final part (the staged writes
  and the tail; its header's immediate :func:`weightsync.wire.delta_header_imm`), held back like a
  push's tail until the source has checked its tensors: it announces the data immediates of every write
  sent as planned and of its own payload. The header may land before its payload (nothing orders two
  writes on the wire), so a payload is read only once its immediates are in. Only after the final part
  does the destination flip the version and ack. An inbox destination always lands this way (dense
  versions too, their parts holding entries only), so there is no mixed counting.
* A source created with ``delta=True`` keeps a copy of what it last pushed (its *reference*, one flat
  tensor per part and word size, a *space*, holding its local tensors' words end to end, on their device,
  ``PushStats.delta_ref_bytes``) and the version it holds. Its push compares every local tensor with the
  reference once (integer views: bitwise, so NaN, -0.0 and denormals count as what they are), and for
  each destination that granted a ``held`` equal to the reference's version sends, per planned direct
  write, only the changed elements, in the smallest of two encodings (:func:`choose`), or the write
  itself where that is smaller (the break-even). Every other destination (new, replaced, failed, behind,
  after a re-plan: the reference's version is reset then) gets the dense push, header included.
* A relay chain (the sources write its head, which forwards each chunk as it lands) takes a delta as one:
  every member holds one layout, so one entry table and payload, encoded once, serve all of them; each
  member with an inbox gets them straight from every source, while the writes they say go as planned
  travel as relay chunks through the chain, which the member counts (the header announces the payload's
  immediates only). The chain gets a delta only if every member has an inbox and granted the reference's
  version; otherwise the version is dense for the whole chain.

Entries and streams
-------------------
Each part's payload for one destination starts with one :data:`ENTRY_DTYPE` row per planned write of
this source in that part (key index in the destination's sorted keys, encoding, word size, destination
offset, rows, bytes per row, destination pitch, changed count, and for a sparse one its base in its
stream), a table of :data:`STREAM_DTYPE` rows (one per word size), then the streams; the parts lie one
after the other in this source's share of the payload area, which has room for every part's tables
(they are reserved when a push starts; the streams take what is left, in part order). A write is sparse
(:data:`ENC_STREAM`) when its changes alone would encode smaller than the write; all sparse writes of one
word size in a part are laid end to end (direct writes in the order of their words in the source's
reference; in the final part the staged ones) and their changed words encoded as one stream. Dense
entries carry no data: their bytes landed where the plan put them (a staged destination copies them into
its other shadow). A stream of
``n`` words of which ``k`` changed, ``w`` bytes a word, is encoded as the smaller of:

* :data:`ENC_IDX16`: per 65536-word block an int32 count, then each changed word's index within its
  block as 16 bits, then the ``k`` values: ``4 ceil(n / 65536) + 2k + wk`` bytes;
* :data:`ENC_BITMAP`: one bit per word (bit ``i % 8`` of byte ``i // 8``), then the values:
  ``ceil(n / 8) + wk`` bytes (smaller from about 6% changed on);
An entry is :data:`ENC_EMPTY` when nothing in it changed, :data:`ENC_DENSE` when it went as planned.

How it runs
-----------
Everything here is torch ops on the tensors' own device (CPU or GPU), a few large ones per push rather
than some per tensor or per write, and few host synchronizations (on a GPU each ``nonzero``, ``.cpu()``
or plain host-to-device copy waits for the device; small tables go up pinned and non-blocking). The
sender, per space (word size and part): per :data:`COMPARE_SLICE` words a change mask (one compare per
tensor in it) and one ``nonzero`` over it (the changed words' positions in the reference, sorted, into
one buffer); one ``searchsorted`` of every tensor's and every compared direct write's bounds, and one
copy of those counts to the host for the part's spaces at once; one gather of the new values per tensor.
Which writes go sparse is then decided on the host from the counts. A destination's stream is its writes'
changed words, which for direct writes adjacent in the reference are one slice of those positions plus a
constant: per such run of writes one copy of the values and the index section written from that slice and
constant (idx16: the positions' low 16 bits plus the constant's, one strided int16 add, and the block
counts by ``searchsorted`` of the blocks' ends less the constant; a bitmap: the positions shifted into a
scratch of :data:`SCRATCH` words, bits ``index_add_``-ed into int32 words from it). After the writes the
reference takes the changed values with one indexed copy per space. The receiver decodes each stream once
(``repeat_interleave`` of the block bases, the low bits copied in) and scatters each run of entries of
one key and one placement with one indexed copy.

On CUDA (unless ``WEIGHTSYNC_DELTA_KERNELS=0``) the sender's compare is device kernels instead: the
changed words' positions and values found reading each tensor and the reference once. First choice, CUDA
C++ compiled at run time with NVRTC (:mod:`weightsync.delta.cuda`: each tile's changes collected
where an atomic counter puts them; one host synchronization per space). Every part's collect is
launched at the push's start; once the announces are out, the search of each one's bounds (how many
changes lie before each) is queued too, on a stream of their own that waits for it on the device
(:meth:`DeltaSender.search_ahead`), so the host only waits for each part's answers and launches nothing
between the last compare and the last part's decisions. The changes are never put in order on that path:
the encode (either encoding's index: an ENC_BITMAP's bits or-ed in, one atomic per 32-bit word a warp's
changes fall in) and the reference's update read them where the collect left them (``ws_order`` runs only
for what wants them in order: strided writes, a collect past its room). The reference is
``finish``'s to update, while the destinations apply theirs. Where NVRTC cannot be had, or with
``WEIGHTSYNC_DELTA_KERNELS=triton``, two Triton kernels per slice
(:mod:`weightsync.delta.triton_kernels`: one host synchronization per slice, a slot scratch of 256 MiB a
slice at most), which update the reference in the same pass (``finish`` has nothing left to copy for
those spaces: a push that fails leaves the reference's version at -1, and the next push copies the
tensors whole into it). Their scratch (``DeltaSender.scratch_bytes``) comes from torch's caching
allocator and is reported as ``PushStats.delta_scratch_bytes``, beside the reference's
``delta_ref_bytes``. The receiver scatters an ENC_IDX16 stream's contiguous runs with one kernel per
stream, without decoding (:func:`weightsync.delta.triton_kernels.scatter_idx16`: CUDA C++, else Triton),
and with the CUDA C++ kernels an ENC_BITMAP stream's straight from its bits (a count per 65536-word block,
their prefix, one scatter: :func:`weightsync.delta.triton_kernels.scatter_bitmap`), each change checked
against its write; a stream whose bits do not match its entries fails the apply (:class:`DeltaReceiver`).

On CPU (unless ``WEIGHTSYNC_DELTA_KERNELS=0``) the same two steps are C++ (:mod:`weightsync.runtime.
delta_host`, cpp/delta/): the compare in one pass on up to 16 of the process's cores, the reference
updated in it, the sender's bitmap bits, and the receiver's scatter of an ENC_IDX16 stream's contiguous
runs (of an ENC_BITMAP stream's too, its bits read into 16-bit indices first).

Host synchronizations of a delta push on a GPU: the sender's ``nonzero`` (or the kernels' count) per
:data:`COMPARE_SLICE` words of each space, per part one copy of the counts, two more when direct writes
read strided source rows, and one wait before the engine reads each destination's part payload; one after
the reference's update; per staged chunk one ``nonzero`` and one copy of counts per inbox destination.
The receiver's, per part: one copy of the headers' entries, one wait after the scatters (and, where the
CUDA kernels scattered, a read of their refusal flags), and, for a bitmap stream the torch ops decode
(without the CUDA kernels, or a strided write's), one ``nonzero`` per :data:`BITMAP_SLICE` words.
"""

from __future__ import annotations

import os
import struct
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from weightsync.errors import TransportError, WeightSyncError
from weightsync.runtime.trace import mark
from weightsync.wire import DELTA_PARTS_MAX, delta_header_imm, delta_part_imm

DELTA_KEY = "\x00weightsync.delta"  # the descriptor entry of a destination's delta inbox
ENC_DENSE, ENC_EMPTY, ENC_IDX16, ENC_BITMAP, ENC_STREAM = 0, 1, 2, 3, 4
ENCODINGS = {ENC_DENSE: "dense", ENC_EMPTY: "empty", ENC_IDX16: "idx16", ENC_BITMAP: "bitmap",
             ENC_STREAM: "stream"}
WORDS = (1, 2, 4, 8)
BLOCK = 1 << 16  # words per ENC_IDX16 block (indices inside it fit 16 bits)
BITMAP_SLICE = 1 << 28  # words a bitmap is read in at a time (a multiple of 64: whole bytes)
# Words compared per nonzero: the change mask (one byte per word) is this big at most, and each slice
# costs one host synchronization.
COMPARE_SLICE = 1 << 29
SCRATCH = 1 << 25  # stream positions put in a bitmap at a time (int64: 256 MiB at most)
ALIGN = 16  # every section of a payload starts at a multiple of this (word views need it)
MAX_HEADERS = 1024  # header slots of an inbox per part: source ranks (weightsync.wire.MAX_SLOTS)
# A push's early parts: the local tensors in order, cut into this many runs (span_of). Each part's direct
# writes are compared, decided, encoded and sent (entries, payload and header of their own), and a
# destination scatters a part as soon as it has landed. On a GPU every part's compare is launched at the
# push's start (back to back on a stream of lower priority, DeltaSender.prefetch) while the host decides
# and encodes one part after another, so the compare overlaps the encode, transfer and apply of the parts
# before; what follows the last part's compare is the one stretch nothing overlaps. The final part (the
# header of old) carries the staged writes and the tail and completes the version. At most 7
# (weightsync.wire.delta_part_imm). On 2 x H100 (Llama-3-8B, 1.8% changed, docs/BENCHMARKS.md) 4 parts
# took 18.9 ms, 2 parts 21.8 and 6 parts (the last one half as large) 20.2.
SPANS = 4
assert SPANS <= DELTA_PARTS_MAX
# The parts' relative sizes (span_of): the last one half as large as the others, so that less follows
# its compare (its copy, and the destination's scatter, which queues behind the part before's). That
# paid only once each part's host work had shrunk to about a third of its compare's time (before, the
# host still worked on the part before when the last compare ended, and 30/30/28/12% of the bytes were
# no faster than equal parts): on 2 x H100 18.00 ms against 18.49 for equal parts, and 19.10 for five
# parts of 2, 2, 2, 2 and 1 shares, in one call (docs/BENCHMARKS.md).
SPAN_SHARES = (2, 2, 2, 1)
assert len(SPAN_SHARES) == SPANS
# The fewest bytes worth a part of their own. A part costs its own waits (headers, payload immediates, a
# host synchronization on each side) whatever its size, while what it overlaps grows with its bytes: a
# source with less than SPANS times this fills fewer parts, and the others go empty (their headers
# only). The RL loop example's 0.6 MB model on the CPU VM: push median 48.6 ms in one part against 57.3
# in four (docs/BENCHMARKS.md).
MIN_SPAN_BYTES = 1 << 28


def span_of(nbytes: np.ndarray, parts: int = SPANS, min_bytes: int | None = None,
            shares: Sequence[int] | None = None) -> np.ndarray:
    """Each tensor's part (``nbytes``: the tensors' bytes, in order): runs in order whose bytes are about
    in proportion to ``shares`` (None: :data:`SPAN_SHARES`), as many as ``parts`` but none under
    ``min_bytes`` (None: :data:`MIN_SPAN_BYTES`) where that can be (the rest empty, and the parts used
    equal); a tensor goes with the part its first byte falls in (so one larger than a part has one to
    itself, and the part after it may be empty)."""
    nbytes = np.asarray(nbytes, np.int64)
    total = int(nbytes.sum())
    least = MIN_SPAN_BYTES if min_bytes is None else min_bytes
    used = max(1, min(parts, total // max(least, 1)))
    want = list(SPAN_SHARES if shares is None else shares)
    w = np.asarray(want if len(want) == used else [1] * used, np.int64)
    # part p starts at the first byte at or past its share of the total
    starts = -(-np.cumsum(w)[:-1] * total // int(w.sum()))
    before = np.cumsum(nbytes) - nbytes
    return np.searchsorted(starts, before, side="right").astype(np.int64)


HEADER_RECORD = np.dtype([("epoch", "<i8"), ("version", "<i8"), ("imms", "<i8"), ("offset", "<i8"),
                          ("nbytes", "<i8"), ("entries", "<i8"), ("changed", "<i8"), ("room", "<i8")])
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


def first_room(hint: int, total: int) -> int:
    """Changes a compare of ``total`` words makes room for before it knows how many there are: ``hint``
    (the last push's count and a margin), or with none (the first compare) 1/64 of the words (RL steps
    change 1-5% of BF16 values); at least 1024, at most every word."""
    return min(max(hint or total // 64, 1024), max(total, 1))


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


def _to_device(a: np.ndarray, device: Any) -> Any:
    """A small host table as a tensor on ``device`` without waiting for the device: a GPU copy from
    pageable memory synchronizes the stream, one from pinned memory with ``non_blocking`` does not (torch's
    host allocator keeps the pinned block until the copy is done)."""
    import torch

    t = torch.from_numpy(np.array(a))  # its own copy: the caller may change ``a``
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t


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


def _choose_many(n: np.ndarray, k: np.ndarray, w: int) -> np.ndarray:
    """:func:`choose` of many writes at once, as ENC_EMPTY, ENC_DENSE or ENC_STREAM (sparse)."""
    n, k = n.astype(np.int64), k.astype(np.int64)

    def up(x: np.ndarray) -> np.ndarray:
        return -(-x // ALIGN) * ALIGN

    sparse = np.minimum(up(4 * -(-n // BLOCK)) + up(2 * k), up(-(-n // 8))) + w * k
    return np.where(k == 0, ENC_EMPTY, np.where(sparse >= n * w, ENC_DENSE, ENC_STREAM)).astype(np.int32)


def _values_at(enc: int, n: int, k: int) -> int:
    """Where the values start in an encoding of ``k`` changed words out of ``n``."""
    if enc == ENC_IDX16:
        return _align(4 * -(-n // BLOCK)) + _align(2 * k)
    if enc == ENC_BITMAP:
        return _align(-(-n // 8))
    raise WeightSyncError(f"internal: no sparse encoding {enc}")


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

    def add(self, positions: Any, shift: int, span: tuple[int, int] | None = None) -> None:
        """The next positions: ``positions + shift`` (int32 or int64), all in the stream's words
        ``span[0]:span[1]`` where given (only those blocks' counts are looked up)."""
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
            b0, b1 = (span[0] // BLOCK, (span[1] - 1) // BLOCK + 1) if span is not None else (0, self.nb)
            ends = self.ends[b0:b1] - shift
            if positions.dtype != torch.int64:  # positions of int32 are in [0, 2**31 - 1)
                ends = ends.clamp_(0, (1 << 31) - 1).to(positions.dtype)
            self.below[b0:b1] += torch.searchsorted(positions, ends)
            if b1 < self.nb:
                self.below[b1:] += m
            self.done += m
            return
        if self.host:  # CPU: C++ sets the bits (index_add_ of each bit took 0.2 s for 15M positions)
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
        parts = []
        # Bounded temporaries (one byte per word of a slice); each nonzero is one host synchronization.
        for lo in range(0, nbytes, BITMAP_SLICE // 8):
            bits = (buf[lo:min(lo + BITMAP_SLICE // 8, nbytes)].unsqueeze(1) >> shifts) & 1
            parts.append(torch.nonzero(bits.reshape(-1)).reshape(-1) + 8 * lo)
        local = parts[0] if len(parts) == 1 else torch.cat(parts)
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


def _kernels_wanted(device: Any) -> bool:
    """Whether the sender compares with device kernels (on CUDA: the CUDA C++ or the Triton ones, unless
    ``WEIGHTSYNC_DELTA_KERNELS=0``; :mod:`weightsync.delta.triton_kernels`); triton is not imported for a
    CPU sender unless the tests force the kernels under Triton's interpreter."""
    flag = os.environ.get("WEIGHTSYNC_DELTA_KERNELS", "")
    if flag == "0":
        return False
    if device.type != "cuda":
        from weightsync.delta import host as delta_host

        if delta_host.wanted(device):  # CPU: the C++ host kernels
            return True
        if flag != "1":
            return False
    from weightsync.delta import triton_kernels as delta_kernels

    return delta_kernels.enabled(device)


# -- the source's side -----------------------------------------------------------------------------------
_DIRECT_DTYPE = np.dtype([("round", "<i8"), ("pos", "<i8"), ("key", "<i4"), ("dkey", "<i4"), ("word", "<i8"),
                          ("src_off", "<i8"), ("dst_off", "<i8"), ("rows", "<i8"), ("row_bytes", "<i8"),
                          ("src_pitch", "<i8"), ("dst_pitch", "<i8"), ("imms", "<i8")])
# A compared direct write where its words lie in its word size's reference: its row in ``_Inbox.direct``,
# its first word and the words from it to its last one (``span``; strided rows: the rows between count),
# its own words ``n``, and for strided source rows their words and pitch in words.
_FLAT_DTYPE = np.dtype([("row", "<i8"), ("start", "<i8"), ("span", "<i8"), ("n", "<i8"),
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
    part: int = 0  # the push part its keys are sent in
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
    part: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))  # per direct write: its part
    round_len: dict[int, int] = field(default_factory=dict)  # round index -> writes in it
    capacity: int = 0  # entries at most of the final part (staged, tail)
    tables: int = 0  # bytes of every part's entry and stream tables (reserved at the push's start)
    relay: bool = False  # a relay chain member: the writes sent as planned reach it through the chain,
    # counted there, so its header announces the payload's immediates only
    send: Any = None  # the payload as sent (entries, then data), on this source's device
    region: Any = None


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
    """One early part of a push to one destination as decided: the entries of its direct writes, per
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
    """What one push sends one inbox destination: its early parts (:class:`_Span`, decided one by one)
    and the final part (staged writes and the tail), and once final the header figures."""

    rank: int
    delta: bool
    dense_bytes: int  # bytes a dense push sends it
    parts: list[_Span] = field(default_factory=list)
    at: int = 0  # where the next part's payload starts in the send buffer
    room: int = 0  # bytes left for streams (every part's tables are reserved)
    payload_bytes: int = 0  # bytes of every part's payload, the final one's included
    imms: int = 0  # data immediates of the final header (writes as planned, the final payload)
    entries: int = 0
    wire_bytes: int = 0  # bytes this source sends it this version (payloads, dense writes)
    changed: int = 0  # changed words in the writes compared
    words: int = 0  # words in the writes compared
    # writes sent as planned though their changes would have gone smaller, for want of room in this
    # source's share of the inbox: their bytes, and what their streams would have taken
    overflow_bytes: int = 0
    overflow_stream_bytes: int = 0
    # the final part being built: entry rows of the staged writes (blocks), the sparse ones, per word size
    # the words and changed words of its stream so far; the immediates and bytes of every write as planned
    rows: list[np.ndarray] = field(default_factory=list)
    pieces: list[_Piece] = field(default_factory=list)
    streams: dict[int, list[int]] = field(default_factory=dict)  # word size -> [words, changed words]
    planned_imms: int = 0
    planned_bytes: int = 0
    final_at: int = 0
    final_bytes: int = 0
    final: bool = False  # the final payload is encoded (finalize)


def header_slot(rank: int, part: int | None = None) -> int:
    """Where the header of source or destination ``rank`` lies in a header array: the final part's
    first, then each early part's, MAX_HEADERS slots each."""
    return (0 if part is None else 1 + part) * MAX_HEADERS + rank


def split_payload(total: int, sources: int) -> int:
    """Bytes of each source's share of a payload area of ``total`` bytes (ALIGN multiples)."""
    return total // max(sources, 1) // ALIGN * ALIGN


def _streams_bytes(totals: Mapping[int, Sequence[int]]) -> int:
    """Bytes of the streams of ``totals`` (word size -> words, changed words)."""
    return sum(_align(stream_size(n, k, w)[1]) for w, (n, k) in totals.items())


class DeltaSender:
    """A source's delta state: the reference (what it last pushed: per word size for the local tensors,
    which direct writes read, per staging chunk for packed, cast and FP8 writes), its version, and per
    plan epoch the inboxes of its destinations with their writes."""

    def __init__(self, engine: Any, locals_: Mapping[str, Any], device: Any, rank: int,
                 enabled: bool) -> None:
        self.engine = engine
        self.locals = locals_
        self.device = device
        self.rank = rank
        self.enabled = enabled
        self.chunk_refs: dict[int, Any] = {}  # staging chunk -> its bytes as last pushed
        self.chunk_words = np.zeros(0, np.int64)
        self.ref_version = -1  # the version the reference holds (-1: none usable)
        self.inboxes: dict[int, _Inbox] = {}
        self.lead: int | None = None  # in a relay chain: the member whose inbox holds the push's work
        self._alias: dict[int, int] = {}  # a relay chain's head -> its lead (the staged writes name the head)
        # header outbox: per part (the final one first) a slot per destination rank
        self.headers = np.zeros(MAX_HEADERS * (1 + SPANS), HEADER_RECORD)
        self.header_region = engine.register(self.headers, name=f"source {rank} delta headers")
        self.words = {k: self._key_word(t) for k, t in locals_.items()}
        self._key_index = {k: i for i, k in enumerate(locals_)}
        # Parts: the local tensors in order, cut into SPANS runs (span_of).
        nbytes = np.array([int(t.nbytes) if isinstance(t, np.ndarray) else
                           int(t.numel()) * int(t.element_size()) for t in locals_.values()], np.int64)
        self._key_span = span_of(nbytes)
        # The reference's layout: per part and word size a space, its keys end to end (in the order of the
        # local tensors).
        self._spaces: dict[int, _Space] = {}
        self._start = np.full(len(locals_), -1, np.int64)  # key index -> its first word in its space
        self._space_of = np.full(len(locals_), -1, np.int64)  # key index -> its space
        for part in range(SPANS):
            for w in WORDS:
                keys = [k for k in locals_
                        if self.words[k] == w and self._key_span[self._key_index[k]] == part]
                if not keys:
                    continue
                sizes = np.array([int(locals_[k].numel()) for k in keys], np.int64)
                starts = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
                s = len(self._spaces)
                self._spaces[s] = _Space(w, keys, starts, part)
                for k, a in zip(keys, starts[:-1].tolist(), strict=True):
                    self._start[self._key_index[k]] = a
                    self._space_of[self._key_index[k]] = s
        self._views = {k: words(locals_[k], sp.word) for sp in self._spaces.values() for k in sp.keys}
        self._referenced = False  # whether the reference holds a push's values (from the first push on)
        self._compared: set[int] = set()  # the parts this push compared with it
        self._launched: set[int] = set()  # the parts whose compare this push launched (CUDA kernels)
        self._compare_stream: Any = None  # the CUDA stream the launched compares run on
        self._order_stream: Any = None  # the CUDA stream their searches run on (search_ahead)
        self._hits: dict[int, dict[int, np.ndarray]] = {}  # this push: rank -> space -> _HIT_DTYPE rows
        self._chunk_changed: dict[int, tuple[Any, Any] | None] = {}  # chunk -> (changed word indices,
        # values), None: not compared
        self._works: dict[int, DeltaWork] = {}
        self.base = -1  # this push's reference version
        self.encode_seconds = 0.0
        # The compare as Triton kernels on a GPU (weightsync.delta.triton_kernels), else torch ops; may be
        # switched between pushes (benchmarks compare the two).
        self.use_kernels = bool(enabled and _kernels_wanted(device))
        # this push's encode by phase (seconds): compare (with the gathers, and the reference update where
        # the kernels ran), begin (host decisions), staged, finalize (streams and index sections), finish
        # (the reference update of the torch path)
        self.phases: dict[str, float] = {}
        self._side: Any = None  # the CUDA stream of the reference's update (finish), made at first use
        self._ref_ready: Any = None  # its event: recorded by finish, waited for by settle

    def _spent(self, phase: str, t0: float) -> None:
        """The time since ``t0`` to the push's encode and to ``phase``."""
        dt = time.perf_counter() - t0
        self.encode_seconds += dt
        self.phases[phase] = self.phases.get(phase, 0.0) + dt

    @staticmethod
    def _key_word(t: Any) -> int:
        if not hasattr(t, "element_size"):
            return 0  # numpy: compared never (sent dense)
        es = int(t.element_size())
        return es if es in (1, 2, 4, 8) else 0

    @property
    def ref_bytes(self) -> int:
        keys = sum(int(sp.ref.numel()) * sp.word for sp in self._spaces.values() if sp.ref is not None)
        return keys + sum(int(r.numel()) for r in self.chunk_refs.values())

    def close_regions(self) -> None:
        for region in {id(ib.region): ib.region for ib in self.inboxes.values() if ib.region is not None
                       }.values():  # a relay chain's inboxes share one
            self.engine.deregister(region)
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
        for sp in self._spaces.values():
            sp.query = None  # the writes' bounds change with the plan
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
        # In a relay chain the sources write only its head; every member with an inbox gets the same
        # entries and payload (one layout, and for a delta one version), straight from this source, into
        # its own inbox, and the writes sent as planned through the chain. The first such member (the
        # lead) holds the push's work, the others share it and its send buffer.
        chain = list(part.relay)
        self.lead = None
        self._alias = {}
        members = [r for r in (chain or dests) if DELTA_KEY in dests[r].target.descriptors]
        if chain and members:
            self.lead = members[0]
            self._alias = {chain[0]: self.lead}
            shared = min(split_payload(struct.unpack("<q", dests[r].target.descriptors[DELTA_KEY][2])[0],
                                       sources) for r in members)
        w = part.writes
        staged = w[(w["staged"] == 1) & (w["kind"] == K_DATA)]
        lead_keys: list[str] | None = None
        for rank in members:
            d = dests[rank]
            into = chain[0] if chain else rank  # the destination this source's writes name
            entry = d.target.descriptors[DELTA_KEY]
            size = struct.unpack("<q", entry[2])[0]
            share = shared if chain else split_payload(size, sources)
            dkeys = sorted(k for k in d.target.descriptors if k != DELTA_KEY)
            if chain and lead_keys is not None and dkeys != lead_keys:
                raise WeightSyncError(f"source {self.rank}: relay chain members {self.lead} and {rank} hold "
                                      "different keys; their delta entries could not be shared")
            lead_keys = lead_keys or dkeys
            kidx = {k: i for i, k in enumerate(dkeys)}
            ib = _Inbox(rank, entry[0], entry[1], self.rank * split_payload(size, sources), share, kidx,
                        dpos_keys[into], relay=bool(chain))
            if chain and rank != self.lead:
                lead = self.inboxes[self.lead]
                ib.fixed, ib.fixed_imms, ib.direct, ib.capacity = lead.fixed, lead.fixed_imms, lead.direct, \
                    lead.capacity
                ib.part, ib.round_len, ib.tables = lead.part, lead.round_len, lead.tables
                ib.send, ib.region = lead.send, lead.region  # the lead's work: nothing compared for this one
                self.inboxes[rank] = ib
                continue
            t = tails.get(into)
            if t is not None:  # the tail: posted as planned, from the snapshot
                rows = t.rows or 1
                ib.fixed = np.zeros(1, ENTRY_DTYPE)
                ib.fixed[0] = (kidx[ib.dkeys[t.dst_index]], ENC_DENSE, 1, t.dst_off, rows, t.nbytes,
                               t.dst_pitch if rows > 1 else t.nbytes, 0, 0)
                ib.fixed_imms = self.engine.imm_count(t.nbytes, True, rows)
            rows_: list[tuple] = []
            for ri, r in enumerate(rounds):
                if r.rank != into:
                    continue
                nrows, spitch, dpitch = r.geometry
                ib.round_len[ri] = len(r.nbytes)
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
                    rows_.append((ri, i, self._key_index[key], dkey, word, so, do, nr, rb, sp, dp,
                                  self.engine.imm_count(rb, True, nr)))
            ib.direct = np.array(rows_, _DIRECT_DTYPE) if rows_ else np.zeros(0, _DIRECT_DTYPE)
            ib.flat = self._flat(ib.direct)
            ib.part = self._key_span[ib.direct["key"]]
            slot = dests[into].target.slot
            ib.capacity = int((staged["dst_rank"] == slot).sum()) + len(ib.fixed)
            # the entry and stream tables: every early part's, then the final one's
            need = ib.tables = sum(data_at(int((ib.part == p).sum())) for p in range(SPANS)) + \
                data_at(ib.capacity)
            if need > share:
                raise WeightSyncError(
                    f"source {self.rank}: destination {rank}'s delta inbox gives each of {sources} sources "
                    f"{share} bytes, less than the {need} bytes of this source's entries alone (raise the "
                    "destination's delta_bytes)")
            ib.send = torch.zeros(share, dtype=torch.uint8, device=self.device)
            ib.region = self.engine.register(ib.send, name=f"source {self.rank} delta payload to {rank}")
            self.inboxes[rank] = ib

    def _flat(self, d: np.ndarray) -> dict[int, np.ndarray]:
        """Per space, the compared direct writes of ``d`` where they lie in its reference, by start."""
        out: dict[int, np.ndarray] = {}
        space = np.where(d["word"] > 0, self._space_of[d["key"]], -1)
        for s, sp in self._spaces.items():
            w = sp.word
            rows = np.flatnonzero(space == s)
            if not len(rows):
                continue
            e = d[rows]
            f = np.zeros(len(rows), _FLAT_DTYPE)
            f["row"] = rows
            f["start"] = self._start[e["key"]] + e["src_off"] // w
            f["strided"] = (e["rows"] > 1) & (e["src_pitch"] != e["row_bytes"])
            f["span"] = np.where(f["strided"], (e["rows"] - 1) * e["src_pitch"] + e["row_bytes"],
                                 e["rows"] * e["row_bytes"]) // w
            f["n"] = e["rows"] * e["row_bytes"] // w
            f["row_words"] = e["row_bytes"] // w
            f["pitch_words"] = e["src_pitch"] // w
            out[s] = f[np.argsort(f["start"], kind="stable")]
        return out

    # -- one push ----------------------------------------------------------------------------------
    def start(self) -> None:
        """At the push's start: takes the first reference, or starts comparing the tensors with it. Where
        the CUDA kernels run, every part's compare is only launched (back to back on a stream of their
        own, :meth:`prefetch`) and the host goes on: the device compares without a gap while the host
        decides, encodes and posts each part in turn (their scratch is alive at once). Elsewhere nothing
        is compared yet: :meth:`overlap_grants` compares the first part once the announces are out (the
        others as their part is decided, :meth:`decide`)."""
        import torch

        t0 = time.perf_counter()
        self._chunk_changed, self._works, self._hits = {}, {}, {}
        self._compared, self._launched = set(), set()
        for sp in self._spaces.values():  # a compare launched by a push that did not get to it
            if getattr(sp.compactor, "pending", None) is not None:
                sp.compactor.pending = None
        self.settle()
        self.base = self.ref_version
        self.ref_version = -1  # until this push has succeeded (its values replace the reference's)
        self.encode_seconds = 0.0
        self.phases = {}
        if not self.enabled:
            return
        if not self._referenced:
            for sp in self._spaces.values():
                sp.ref = torch.empty(int(sp.starts[-1]), dtype=word_dtype(sp.word), device=self.device)
            self._referenced = True
            self.base = -1
        if self.base < 0:  # the reference is not of a version anyone holds: it becomes this push's values
            for sp in self._spaces.values():
                for key, a, b in zip(sp.keys, sp.starts[:-1].tolist(), sp.starts[1:].tolist(), strict=True):
                    sp.ref[a:b].copy_(self._views[key])
            self._spent("compare", t0)
        else:
            for part in range(SPANS):
                self.prefetch(part)

    def prefetch(self, part: int) -> bool:
        """Launches the CUDA compare of ``part``'s spaces on the compare stream and returns without
        waiting for the device, so that the GPU compares one part while the host decides, encodes and
        posts the one before (:meth:`compare` finishes it). The stream waits for everything queued on
        the current one first (the caller's updates of the tensors; the reference's update,
        :meth:`settle`). False where nothing was launched (no CUDA kernels here, or already)."""
        import torch

        if not self.enabled or self.base < 0 or part >= SPANS or part in self._compared or \
                part in self._launched or not self.use_kernels or self.device.type != "cuda":
            return False
        t0 = time.perf_counter()
        if self._compare_stream is None:
            # the lowest priority: the push's own kernels (on its stream) go first
            self._compare_stream = torch.cuda.Stream(self.device, priority=0)
        self._compare_stream.wait_stream(torch.cuda.current_stream(self.device))
        launched = False
        for sp in self._spaces.values():
            if sp.part == part:
                launched |= self._compactor(sp).launch([self._views[k] for k in sp.keys], sp.ref, sp.hint,
                                                       self._compare_stream)
        if launched:
            self._launched.add(part)
        self._spent("compare", t0)
        return launched

    def overlap_grants(self) -> None:
        """What the push does while its grants travel, once the announces are out: on a GPU, queues the
        launched compares' searches (:meth:`search_ahead`); where nothing was launched (CPU tensors, the
        torch path), compares the first part, which the first grant's decisions need (on CPU that
        compare is most of the push: the grants' round trip now overlaps it instead of following it)."""
        if self._launched:
            self.search_ahead()
        else:
            self.compare(0)

    def search_ahead(self) -> None:
        """After :meth:`start` launched the compares: queues the searches of each one's space's query
        (where each key's and each inbox write's changes start) on a stream of their own, each waiting for
        its compare on the device, so that :meth:`compare` waits for the device once per part and launches
        nothing. Apart from start: these launches cost host time that the compares do not wait for (the
        announces go first)."""
        import torch

        if not self._launched:
            return
        t0 = time.perf_counter()
        if self._order_stream is None:
            # above the compares (priority 0): a part's searches run as soon as its compare is done
            self._order_stream = torch.cuda.Stream(self.device, priority=-1)
        for s, sp in self._spaces.items():
            if sp.part in self._launched and sp.compactor is not None:
                sp.compactor.search_ahead(self._query_on_device(s, sp), self._order_stream)
        self._spent("compare", t0)

    def settle(self) -> None:
        """Makes the device's current stream wait for the last push's reference update (:meth:`finish`)
        before anything reads or writes the reference."""
        if self._ref_ready is not None:
            import torch

            torch.cuda.current_stream(self.device).wait_event(self._ref_ready)
            self._ref_ready = None

    def compare_all(self) -> None:
        """Every part compared (the reference must take all of this push's changes, whether or not a
        destination asked for them): before the push checks that its tensors did not change."""
        for part in range(SPANS):
            self.compare(part)

    def compare(self, part: int) -> None:
        """The spaces of ``part`` compared with their reference (once a push): the changed positions (one
        nonzero per slice of COMPARE_SLICE words, or the kernels), then where each key's and each inbox
        write's changes start among them (one searchsorted per space, one copy to the host for all), the
        new values (one gather per key) and the strided writes' own changes."""
        import torch

        if not self.enabled or self.base < 0 or part in self._compared:
            return
        t0 = time.perf_counter()
        spaces = {s: sp for s, sp in self._spaces.items() if sp.part == part}
        cuts: list[Any] = []  # per space its searches' answers: on the host (search_ahead), or a tensor
        for s, sp in spaces.items():
            sp.idx = sp.vals = sp.tiles = None
            sp.ref_done = False
            found = self._changed_words_kernels(sp) if self.use_kernels else None
            if isinstance(found, tuple):
                sp.idx, sp.vals = found
            elif found is not None:
                sp.tiles = found
            else:
                sp.idx = self._changed_words(sp)
            query = self._query_on_device(s, sp)
            ahead = getattr(sp.compactor, "cuts", None) if found is not None else None
            cuts.append(ahead if ahead is not None else torch.searchsorted(sp.idx, query))
        mark("source %d: part %d changes ordered", self.rank, part)
        on_device = [c for c in cuts if not isinstance(c, np.ndarray)]
        if on_device:  # one copy to the host for every space's
            read = iter(np.split(torch.cat(on_device).cpu().numpy(),
                                 np.cumsum([int(c.numel()) for c in on_device])[:-1]))
            cuts = [c if isinstance(c, np.ndarray) else next(read) for c in cuts]
        host = np.concatenate(cuts) if cuts else np.zeros(0, np.int64)
        mark("source %d: part %d cuts read", self.rank, part)
        at = 0
        for s, sp in spaces.items():
            w = sp.word
            q = host[at:at + int(sp.query.numel())]
            at += int(sp.query.numel())
            nk = len(sp.keys)
            sp.cut = q[:nk + 1]
            if sp.vals is None and sp.tiles is None:  # the torch path: the new values, one gather per key
                sp.vals = torch.empty(int(sp.cut[-1]), dtype=word_dtype(w), device=self.device)
                for j, key in enumerate(sp.keys):
                    c0, c1, a = int(sp.cut[j]), int(sp.cut[j + 1]), int(sp.starts[j])
                    if c0 < c1:
                        torch.index_select(self._views[key], 0, sp.idx[c0:c1] - a if a else sp.idx[c0:c1],
                                           out=sp.vals[c0:c1])
            pos = nk + 1
            strided: list[tuple[int, np.ndarray]] = []
            for rank, ib in self.inboxes.items():
                f = ib.flat.get(s)
                if f is None:
                    continue
                b = q[pos:pos + 2 * len(f)]
                pos += 2 * len(f)
                hits = np.zeros(len(f), _HIT_DTYPE)
                hits["lo"], hits["hi"] = b[0::2], b[1::2]
                hits["k"] = hits["hi"] - hits["lo"]
                self._hits.setdefault(rank, {})[s] = hits
                if f["strided"].any():
                    strided.append((rank, np.flatnonzero(f["strided"])))
            self._select_strided(s, sp, strided)
        self._compared.add(part)
        self._spent("compare", t0)

    def _changed_words_kernels(self, sp: _Space) -> tuple[Any, Any] | Any | None:
        """:meth:`_changed_words` and the values' gathers as kernels: on a GPU those of
        :mod:`weightsync.delta.triton_kernels` (CUDA C++ or Triton), on CPU the C++ compare of
        :mod:`weightsync.delta.host`, its buffers kept in the space from push to push. Whether
        they also put the new values into the reference goes to ``sp.ref_done``. The changes as the CUDA
        collect left them (a TileChanges, for ``sp.tiles``) where its searches were queued ahead. None
        where they cannot compare this space (the torch ops do)."""
        found = self._compactor(sp).compare([self._views[k] for k in sp.keys], sp.ref, sp.hint)
        if found is not None:
            k = int(found[0].numel()) if isinstance(found, tuple) else found.count
            sp.hint = k + k // 8
            sp.ref_done = sp.compactor.ref_updated
        return found

    def _compactor(self, sp: _Space) -> Any:
        """The space's compare kernels: the C++ ones on CPU (:mod:`weightsync.delta.host`), else
        :class:`weightsync.delta.triton_kernels.Compactor` (CUDA C++ or Triton)."""
        from weightsync.delta import host as delta_host
        from weightsync.delta.triton_kernels import Compactor

        if delta_host.wanted(self.device):
            if not isinstance(sp.compactor, delta_host.SpaceCompare):
                sp.compactor = delta_host.SpaceCompare()
        elif sp.compactor is None:
            sp.compactor = Compactor(sp.word, sp.starts, self.device)
        return sp.compactor

    @property
    def scratch_bytes(self) -> int:
        """The kernels' scratch of the last push, every space's (slots and counts, from torch's caching
        allocator on the device; not in ``ref_bytes``): a push launches every part's compare at its start,
        so all of it is alive at once."""
        return sum(sp.compactor.scratch_bytes for sp in self._spaces.values() if sp.compactor is not None)

    def _changed_words(self, sp: _Space) -> Any:
        """The sorted positions (int64) of the words of ``sp`` that differ from its reference."""
        import torch

        total = int(sp.starts[-1])
        size = max(min(COMPARE_SLICE, total), 1)
        mask = torch.empty(size, dtype=torch.bool, device=self.device)
        if total <= size:  # one slice: its positions as they come
            for key, a, b in zip(sp.keys, sp.starts[:-1].tolist(), sp.starts[1:].tolist(), strict=True):
                if a < b:
                    torch.ne(self._views[key], sp.ref[a:b], out=mask[a:b])
            return torch.nonzero(mask[:total]).reshape(-1)  # a host synchronization (its size)
        # The positions go into one buffer as each slice's are found (a concatenation at the end would
        # hold them twice), sized by the last push's count and grown by the density seen so far.
        out = torch.empty(min(max(sp.hint, 1024), total), dtype=torch.int64, device=self.device)
        k = 0
        for lo in range(0, total, size):
            hi = min(lo + size, total)
            first = int(np.searchsorted(sp.starts, lo, side="right")) - 1
            last = int(np.searchsorted(sp.starts, hi, side="left"))
            for j in range(first, last):
                a, b = max(int(sp.starts[j]), lo), min(int(sp.starts[j + 1]), hi)
                if a < b:
                    s = int(sp.starts[j])
                    torch.ne(self._views[sp.keys[j]][a - s:b - s], sp.ref[a:b], out=mask[a - lo:b - lo])
            nz = torch.nonzero(mask[:hi - lo]).reshape(-1)  # a host synchronization (its size)
            m = int(nz.numel())
            if k + m > out.numel():
                grown = torch.empty(min(total, (k + m) * total // hi + 1024), dtype=torch.int64,
                                    device=self.device)
                grown[:k].copy_(out[:k])
                out = grown
            torch.add(nz, lo, out=out[k:k + m])
            k += m
        sp.hint = k + k // 8
        return out[:k]

    def _query(self, space: int, sp: _Space) -> np.ndarray:
        """The positions whose place among the changed ones a push looks up: the keys' starts and the
        total, then per inbox (in order) each compared direct write's first word and the word after its
        last."""
        parts = [sp.starts]
        for ib in self.inboxes.values():
            f = ib.flat.get(space)
            if f is not None:
                parts.append(np.stack([f["start"], f["start"] + f["span"]], 1).reshape(-1))
        return np.concatenate(parts).astype(np.int64)

    def _query_on_device(self, space: int, sp: _Space) -> Any:
        """:meth:`_query` on the device, made once per plan (``load`` forgets it)."""
        if sp.query is None:
            sp.query = _to_device(self._query(space, sp), self.device)
        return sp.query

    def _select_strided(self, s: int, sp: _Space, strided: list[tuple[int, np.ndarray]]) -> None:
        """The changes of the strided direct writes (source rows with words between them that are not
        theirs) among the changed words in their span, as indices into their own words, for all inboxes
        at once: two host synchronizations when any such write has changes in its span."""
        import torch

        sp.strided_local = sp.strided_vals = None
        if not strided:
            return
        sp.ordered()
        tables = []
        for rank, rows in strided:
            f, h = self.inboxes[rank].flat[s][rows], self._hits[rank][s][rows]
            tables.append(np.stack([h["lo"], h["hi"] - h["lo"], f["start"], f["row_words"],
                                    f["pitch_words"]]))
        t = np.concatenate(tables, 1)
        spans = t[1]
        total = int(spans.sum())
        seg = np.concatenate([[0], np.cumsum(spans)]).astype(np.int64)
        if total:
            dev = _to_device(np.concatenate([t[0] - seg[:-1], t[2], t[3], t[4], spans]).reshape(5, -1),
                             self.device)
            n = t.shape[1]
            jid = torch.repeat_interleave(torch.arange(n, device=self.device), dev[4], output_size=total)
            g = torch.arange(total, device=self.device) + dev[0][jid]  # positions in sp.idx
            sub = sp.idx[g] - dev[1][jid]  # words from the write's first
            m, pitch = dev[2][jid], dev[3][jid]
            r = torch.div(sub, pitch, rounding_mode="floor")
            c = sub - r * pitch
            sel = torch.nonzero(c < m).reshape(-1)  # a host synchronization
            first = torch.searchsorted(sel, _to_device(seg, self.device)).cpu().numpy()  # and another
            sp.strided_local = (r * m + c)[sel]
            sp.strided_vals = sp.vals[g[sel]]
        else:
            first = np.zeros(len(seg), np.int64)
        i = 0
        for rank, rows in strided:
            h = self._hits[rank][s]
            h["at"][rows] = first[i:i + len(rows)]
            h["k"][rows] = first[i + 1:i + len(rows) + 1] - first[i:i + len(rows)]
            i += len(rows)

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
        self._spent("chunk", t0)

    def begin(self, rank: int, base: int, dense_bytes: int) -> DeltaWork:
        """The work of a push to inbox destination ``rank``, which can take a delta on version ``base``
        (-1: none): a delta if the reference holds that version. Its parts are decided one by one
        (:meth:`decide`), the staged writes follow (:meth:`staged`), the final payload is encoded at
        :meth:`finalize`. No device work."""
        ib = self.inboxes[rank]
        delta = self.enabled and base >= 0 and base == self.base
        work = DeltaWork(rank, delta, dense_bytes)
        work.room = ib.share - ib.tables
        self._works[rank] = work
        return work

    def decide(self, rank: int, part: int) -> dict[int, np.ndarray] | None:
        """Part ``part`` of the push to ``rank`` (compared first if it was not): which of its direct writes
        go sparse (their changes smaller than the write, and within the room left in this source's share
        of the inbox) and which as planned. Returns the latter, round index -> mask over the round's
        writes ({}: none; None: every write of every round, a dense push's first part). Once a push."""
        work = self._works[rank]
        if len(work.parts) > part:
            return work.parts[part].keep
        assert len(work.parts) == part, "parts are decided in order"
        if work.delta:
            self.compare(part)
        t0 = time.perf_counter()
        ib = self.inboxes[rank]
        sel = np.flatnonzero(ib.part == part)  # its direct writes (rows of ib.direct)
        d = ib.direct[sel]
        enc = np.full(len(sel), ENC_DENSE, np.int32)
        counts = np.zeros(len(sel), np.int64)
        mine = {s: f for s, f in ib.flat.items() if self._spaces[s].part == part}
        at = {s: np.searchsorted(sel, f["row"]) for s, f in mine.items()}  # their rows in the part's entries
        direct: dict[int, tuple[np.ndarray, np.ndarray, np.ndarray]] = {}
        changed = 0
        if work.delta:
            hits = self._hits.get(rank, {})
            for s, f in mine.items():
                k = hits[s]["k"]
                enc[at[s]] = _choose_many(f["n"], k, self._spaces[s].word)
                counts[at[s]] = k
                changed += int(k.sum())
                work.words += int(f["n"].sum())
            self._fit(work, mine, at, enc)
            for s, f in mine.items():
                sparse = enc[at[s]] == ENC_STREAM
                direct[s] = (f[sparse], hits[s][sparse], at[s][sparse])
        work.changed += changed
        rows = np.zeros(len(d), ENTRY_DTYPE)
        rows["key"] = d["dkey"]
        rows["enc"] = enc
        rows["word"] = np.maximum(d["word"], 1)
        rows["dst_off"] = d["dst_off"]
        rows["rows"] = d["rows"]
        rows["row_bytes"] = d["row_bytes"]
        rows["pitch"] = d["dst_pitch"]
        rows["count"] = np.where(enc == ENC_DENSE, 0, counts)
        dense = enc == ENC_DENSE
        work.planned_imms += int(d["imms"][dense].sum())
        work.planned_bytes += int((d["rows"] * d["row_bytes"])[dense].sum())
        keep: dict[int, np.ndarray] | None
        if not work.delta:  # every write as planned, all posted with the first part
            keep = None if part == 0 else {}
        else:
            keep = {}
            for ri in np.unique(d["round"][dense]).tolist():
                m = dense & (d["round"] == ri)
                mask = np.zeros(ib.round_len[int(ri)], bool)
                mask[d["pos"][m]] = True
                keep[int(ri)] = mask
        work.parts.append(_Span(rows, direct, keep, changed))
        mark("source %d: part %d entries chosen", self.rank, part)
        self._spent("begin", t0)
        return keep

    def _fit(self, work: DeltaWork, mine: Mapping[int, np.ndarray], at: Mapping[int, np.ndarray],
             enc: np.ndarray) -> None:
        """The streams of a part's sparse direct writes (``enc``; ``mine`` per space, ``at`` their rows in
        ``enc``), within the room left in this source's share of the inbox: where all of them do not fit,
        writes go as planned instead from the first that does not. Takes their room."""
        hits = self._hits.get(work.rank, {})

        def totals_of(pick: Mapping[int, np.ndarray]) -> dict[int, list[int]]:
            out: dict[int, list[int]] = {}
            for s, m in pick.items():
                if m.any():
                    t = out.setdefault(self._spaces[s].word, [0, 0])
                    t[0] += int(mine[s]["n"][m].sum())
                    t[1] += int(hits[s]["k"][m].sum())
            return out

        sparse = {s: enc[at[s]] == ENC_STREAM for s in mine}
        size = _streams_bytes(totals_of(sparse))
        if size > work.room:
            kept: dict[int, np.ndarray] = {s: np.zeros(len(m), bool) for s, m in sparse.items()}
            size = 0
            for s, m in sparse.items():
                w = self._spaces[s].word
                for i in np.flatnonzero(m).tolist():
                    kept[s][i] = True
                    trial = _streams_bytes(totals_of(kept))
                    if trial <= work.room:
                        size = trial
                    else:
                        kept[s][i] = False
                        enc[at[s][i]] = ENC_DENSE
                        n, k = int(mine[s]["n"][i]), int(hits[s]["k"][i])
                        work.overflow_bytes += n * w
                        work.overflow_stream_bytes += stream_size(n, k, w)[1]
        work.room -= size

    def _take(self, work: DeltaWork, piece: _Piece) -> int:
        """Whether a staged write's changes travel in its word size's stream of the final part
        (ENC_STREAM; ENC_EMPTY: none changed) or the write goes as planned (ENC_DENSE: its changes would
        not be smaller, or the streams would no longer fit the room left in this source's share)."""
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
        if _streams_bytes(totals) > work.room:
            work.overflow_bytes += n * w
            work.overflow_stream_bytes += stream_size(n, k, w)[1]
            return ENC_DENSE
        work.streams = totals
        work.pieces.append(piece)
        return ENC_STREAM

    def staged(self, rank: int, c: int, src_off: np.ndarray, di: np.ndarray, dst_off: np.ndarray,
               nbytes: np.ndarray) -> np.ndarray | None:
        """Staged chunk ``c``'s writes into inbox destination ``rank`` (1-D, at ``src_off`` in the chunk):
        records their entries, encodes the changed words of those it sends as a delta, and returns which
        go as planned (None: ``rank`` has no inbox)."""
        rank = self._alias.get(rank, rank)
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
            bounds = _to_device(np.stack([so // cw, (so + nb) // cw], 1).reshape(-1).astype(
                np.int32 if idx.dtype == torch.int32 else np.int64), self.device)
            cut = torch.searchsorted(idx, bounds).tolist()  # one host synchronization per chunk
            for i in np.flatnonzero(ok).tolist():
                lo, hi = cut[2 * i], cut[2 * i + 1]
                piece = _Piece(len(work.rows), i, cw, int(keys[i]), idx[lo:hi], vals[lo:hi],
                               -(int(so[i]) // cw), hi - lo, int(nb[i]) // cw)
                enc[i], counts[i], word[i] = self._take(work, piece), hi - lo, cw
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
        self._spent("staged", t0)
        return keep

    def encode_span(self, rank: int, part: int) -> _Span:
        """Early part ``part`` of the push to ``rank`` (decided) encoded into the send buffer after the
        parts before it; once a push (a relay chain's members share it)."""
        import torch

        work = self._works[rank]
        pt = work.parts[part]
        if pt.at >= 0:
            return pt
        t0 = time.perf_counter()
        ib = self.inboxes[rank]
        direct = {self._spaces[s].word: (s, f, h, rows) for s, (f, h, rows) in pt.direct.items() if len(f)}
        pt.at = work.at
        pt.nbytes, _ = self._encode(ib, pt.at, len(pt.rows), [pt.rows], direct, [], np.zeros(0, ENTRY_DTYPE))
        pt.imms = self.engine.imm_count(pt.nbytes) if pt.nbytes else 0
        work.at += _align(pt.nbytes)
        work.payload_bytes += pt.nbytes
        if self.device.type == "cuda" and pt.nbytes:
            mark("source %d: part %d encode queued", self.rank, part)
            torch.cuda.current_stream(self.device).synchronize()  # the engine reads the send buffer
        self._spent("finalize", t0)
        return pt

    def finalize(self, rank: int) -> DeltaWork:
        """The final part of ``rank``'s push (every early part is decided and encoded by now): the staged
        writes' streams, the entries (the tail's last) and the stream table, after the early parts;
        returns the work with its final figures."""
        import torch

        work = self._works[rank]
        if work.final:
            return work  # a relay chain member: the lead's payload, encoded once
        for part in range(SPANS):  # parts no destination asked for (a push that posted none)
            self.decide(rank, part)
            self.encode_span(rank, part)
        t0 = time.perf_counter()
        ib = self.inboxes[rank]
        work.final_at = work.at
        work.final_bytes, n = self._encode(ib, work.final_at, ib.capacity, work.rows, {}, work.pieces,
                                           ib.fixed)
        work.entries = n
        work.payload_bytes += work.final_bytes
        work.imms = (self.engine.imm_count(work.final_bytes) if work.final_bytes else 0) + \
            (0 if ib.relay else work.planned_imms + ib.fixed_imms)
        tail = int(ib.fixed["rows"] @ ib.fixed["row_bytes"])
        work.wire_bytes = work.payload_bytes + work.planned_bytes + tail
        work.final = True
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()  # the engine reads the send buffer
        self._spent("finalize", t0)
        return work

    def _encode(self, ib: _Inbox, at0: int, cap: int, blocks: list[np.ndarray],
                direct: Mapping[int, tuple[int, np.ndarray, np.ndarray, np.ndarray]], pieces: list[_Piece],
                tail: np.ndarray) -> tuple[int, int]:
        """One part's payload written at byte ``at0`` of the send buffer, with room for ``cap`` entries:
        per word size its stream (the sparse direct writes of ``direct``: space, _FLAT_DTYPE and _HIT_DTYPE
        rows by start, their entries' rows in ``blocks[0]``; then the sparse staged ``pieces``), the
        stream table and the entries (``blocks`` then ``tail``). Returns (bytes, entries); (0, 0) for a
        part without entries (nothing is written or sent)."""
        entries = np.concatenate([*blocks, tail]) if blocks or len(tail) else np.zeros(0, ENTRY_DTYPE)
        if len(entries) > cap:
            raise WeightSyncError(f"internal: {len(entries)} delta entries for destination {ib.rank}, room "
                                  f"for {cap}")
        if not len(entries):
            return 0, 0
        streams = np.zeros(len(WORDS), STREAM_DTYPE)
        streams["word"] = WORDS
        at = data_at(cap)  # from the part's start
        for j, w in enumerate(WORDS):
            s, f, h, pos = direct.get(w, (-1, np.zeros(0, _FLAT_DTYPE), np.zeros(0, _HIT_DTYPE),
                                          np.zeros(0, np.int64)))
            mine = [p for p in pieces if p.word == w]
            if not len(f) and not mine:
                continue
            ns = np.concatenate([f["n"], np.array([p.n for p in mine], np.int64)])
            ks = np.concatenate([h["k"], np.array([p.k for p in mine], np.int64)])
            bases = np.cumsum(ns) - ns
            n, k = int(ns.sum()), int(ks.sum())
            entries["data"][pos] = bases[:len(f)]
            for p, b in zip(mine, bases[len(f):].tolist(), strict=True):
                entries["data"][sum(len(x) for x in blocks[:p.block]) + p.row] = b
            enc, size = stream_size(n, k, w)
            out = ib.send[at0 + at:at0 + at + size]
            o = _values_at(enc, n, k)
            values = out[o:o + w * k].view(word_dtype(w))
            index = _IndexWriter(out, enc, n, k, self.device)  # the changed words' positions in the stream
            o = 0
            if len(f):
                o = self._direct_changes(self._spaces[s], f, h, bases[:len(f)], index, values)
                mark("encode: word %d direct changes queued", w)
            for p, b in zip(mine, bases[len(f):].tolist(), strict=True):
                index.add(p.idx, p.shift + b, (b, b + p.n))
                values[o:o + p.k].copy_(p.vals)
                o += p.k
            index.close()
            mark("encode: word %d index closed", w)
            streams[j] = (w, enc, n, k, at, (0, 0, 0))
            at += _align(size)
        # the entries and the stream table (the room between them unused) in one copy
        head = np.zeros(data_at(cap), np.uint8)
        head[:entries.nbytes] = entries.view(np.uint8)
        head[streams_at(cap):] = streams.view(np.uint8)
        ib.send[at0:at0 + len(head)].copy_(_to_device(head, self.device))
        mark("encode: %d entries copied", len(entries))
        return at, len(entries)

    @staticmethod
    def _direct_changes(sp: _Space, f: np.ndarray, h: np.ndarray, bases: np.ndarray, index: _IndexWriter,
                        values: Any) -> int:
        """The sparse direct writes' changes (``f``, ``h``: by start) first in the stream: their positions
        (the write's base plus the word's index in it) to ``index``, their values at the head of
        ``values``. Writes that follow each other in the reference form one run whose positions are one
        slice of the reference's changed positions plus a constant: one add and one copy per run, or on
        CUDA one kernel for all runs (:meth:`weightsync.delta.cuda.TileChanges.encode` from the
        collect's scratch, else :func:`weightsync.delta.cuda.encode_runs`; the per-run ops cost
        about 0.1 ms of host time each, on the push's critical path). The runs are found by numpy
        ops over all writes: a loop over them cost about 5 us a write, on the last part's path. Returns
        how many."""
        bitmap = index.enc == ENC_BITMAP
        # the CUDA kernels write either encoding's index (ENC_BITMAP on CPU: C++ through index.add)
        tiles = sp.tiles if not index.host else None
        if tiles is None:
            sp.ordered()
        mod = None
        if tiles is not None or (not index.host and sp.idx is not None and sp.idx.is_cuda and
                                 str(sp.idx.dtype) == "torch.int64"):
            from weightsync.delta import cuda as delta_cuda

            mod = delta_cuda.module(sp.ref.device)
        # Groups in stream order: a strided write alone, or writes that follow each other in the reference
        # (one slice of its changed positions); each group's changes, and where they start among the part's.
        m = len(f)
        strided = f["strided"]
        brk = np.ones(m, bool)
        brk[1:] = strided[1:] | strided[:-1] | (f["start"][1:] != f["start"][:-1] + f["n"][:-1])
        first = np.flatnonzero(brk)
        last = np.append(first[1:], m) - 1
        alone = strided[first]
        count = np.where(alone, h["k"][first], h["hi"][last] - h["lo"][first])
        at = np.cumsum(count) - count
        shift = bases[first] - f["start"][first]

        def encode(runs: np.ndarray, groups: np.ndarray) -> None:
            """Rows (first change, shift, first entry, count) of ``groups`` by one kernel: from the collect's
            scratch where the changes were left there (the tiles that hold the groups' words), else from
            the changes in order."""
            from weightsync.delta import cuda as delta_cuda

            # ENC_BITMAP: bits or-ed into its section, nothing counted
            target, counts = (index.bits, None) if bitmap else (index.low, index.kernel_counts())
            if tiles is not None:
                span = tiles.tile_range(int(f["start"][first[groups]].min()),
                                        int((f["start"][last[groups]] + f["span"][last[groups]]).max()))
                tiles.encode(runs, span, target, values, counts, bitmap)
            else:
                delta_cuda.encode_runs(mod, sp.idx, sp.vals, runs, target, values, counts, bitmap)

        if mod is not None and not alone.any():  # every group's index and values by one kernel
            done = index.reserve(int(count.sum()))
            go = np.flatnonzero(count > 0)
            if len(go):
                encode(np.stack([h["lo"][first], shift, at + done, count], 1)[go], go)
            return int(count.sum())
        kernel_runs: list[tuple[int, int, int, int]] = []  # lo, shift, first entry, count
        kernel_groups: list[int] = []
        for g, (i, j) in enumerate(zip(first.tolist(), last.tolist(), strict=True)):
            o, k = int(at[g]), int(count[g])
            if alone[g]:
                a = int(h["at"][i])
                b = int(bases[i])
                index.add(sp.strided_local[a:a + k], b, (b, b + int(f["n"][i])))
                values[o:o + k].copy_(sp.strided_vals[a:a + k])
            elif mod is not None:
                if k:
                    kernel_runs.append((int(h["lo"][i]), int(shift[g]), index.reserve(k), k))
                    kernel_groups.append(g)
            else:
                lo = int(h["lo"][i])
                index.add(sp.idx[lo:lo + k], int(shift[g]), (int(bases[i]), int(bases[j] + f["n"][j])))
                values[o:o + k].copy_(sp.vals[lo:lo + k])
        if kernel_runs:
            encode(np.array(kernel_runs, np.int64), np.array(kernel_groups, np.int64))
        return int(count.sum())

    def overflow_note(self, rank: int) -> str | None:
        """What to tell the user where this push's writes to ``rank`` went as planned for want of room in
        this source's share of its inbox (None where none did)."""
        work = self._works.get(rank)
        if work is None or not work.overflow_bytes:
            return None
        return (f"destination {rank}'s delta inbox had no room left for the changes of {work.overflow_bytes} "
                f"bytes of writes, which went as planned; as streams they would have taken about "
                f"{work.overflow_stream_bytes} bytes more of this source's {self.inboxes[rank].share}-byte "
                "share (a larger Destination(delta_bytes=...) sends fewer bytes)")

    def share(self, work: DeltaWork, ranks: Sequence[int]) -> None:
        """A relay chain: the lead's work (:meth:`begin`) is also that of members ``ranks``."""
        for r in ranks:
            self._works[r] = work

    def header(self, rank: int, epoch: int, version: int, work: DeltaWork, part: int | None = None) -> int:
        """Fills the header record of ``rank``'s final part (``part`` None) or of early part ``part`` in
        the outbox; returns its slot (the same slot of the destination's header array, less this
        source's rank plus ``rank``: :func:`header_slot`)."""
        ib = self.inboxes[rank]
        slot = header_slot(rank, part)
        if part is None:
            self.headers[slot] = (epoch, version, work.imms, ib.offset + work.final_at, work.final_bytes,
                                  work.entries, work.changed, ib.capacity)
        else:
            pt = work.parts[part]
            self.headers[slot] = (epoch, version, pt.imms, ib.offset + pt.at, pt.nbytes, len(pt.rows),
                                  pt.changed, len(pt.rows))
        return slot

    # -- the push's face (weightsync.runtime.source), in the protocol's order: load (a plan epoch), start
    # and overlap_grants (announce), has_inbox, lead, begin, share (grants), decide (rounds), chunk and
    # staged (staging), post_span (parts), post_finals and compare_all (tails), finish (acks), stats and
    # overflow_note (stats). The other members serve these and the tests.
    def has_inbox(self, rank: int) -> bool:
        """Whether destination ``rank`` takes deltas (has an inbox in this plan epoch)."""
        return rank in self.inboxes

    def post_span(self, rank: int, epoch: int, version: int, part: int, peer: Any,
                  failed: dict[int, str]) -> list[tuple[int, Any]]:
        """Early part ``part`` of ``rank``'s delta: its payload (entries and encoded changes; none for a
        part without writes), then its header, each with the part's own immediate. Nothing orders the
        two on the wire: the destination reads the payload only once the immediates the header
        announces are in. A failed post is recorded in ``failed``."""
        pt = self.encode_span(rank, part)
        self.header(rank, epoch, version, self._works[rank], part)
        ib = self.inboxes[rank]
        out: list[tuple[int, Any]] = []
        try:
            if pt.nbytes:
                imm = delta_part_imm(epoch, version, part, header=False)
                out.append((rank, self.engine.write(ib.region, pt.at, peer, ib.payload, ib.offset + pt.at,
                                                    pt.nbytes, imm=imm)))
            out.append((rank, self._post_header(rank, epoch, version, peer, part)))
        except TransportError as exc:
            failed[rank] = str(exc)
        return out

    def post_finals(self, ranks: Sequence[int], epoch: int, version: int, imm: int, peers: Mapping[int, Any],
                    failed: dict[int, str]) -> list[tuple[int, Any]]:
        """Writes each inbox destination of ``ranks`` its final payload (entries, encoded changes) into
        its share, then its header: the data immediates of this version from this source and where its
        entries are. Posted with the tails, once the tensors are checked. Nothing orders the two on the
        wire: the destination reads the payload only once the immediates the header announces are in."""
        out: list[tuple[int, Any]] = []
        for rank in sorted(ranks):
            if rank in failed:
                continue
            work = self.finalize(rank)
            self.header(rank, epoch, version, work)
            try:
                if work.final_bytes:
                    ib = self.inboxes[rank]
                    out.append((rank, self.engine.write(ib.region, work.final_at, peers[rank], ib.payload,
                                                        ib.offset + work.final_at, work.final_bytes,
                                                        imm=imm)))
                out.append((rank, self._post_header(rank, epoch, version, peers[rank])))
            except TransportError as exc:
                failed[rank] = str(exc)
        return out

    def _post_header(self, rank: int, epoch: int, version: int, peer: Any, part: int | None = None) -> Any:
        """Posts the header record of ``rank``'s final part (``part`` None) or early part ``part``."""
        hdr = self.headers.itemsize
        imm = delta_header_imm(epoch, version) if part is None else \
            delta_part_imm(epoch, version, part, header=True)
        return self.engine.write(self.header_region, header_slot(rank, part) * hdr, peer,
                                 self.inboxes[rank].header, header_slot(self.rank, part) * hdr, hdr, imm=imm)

    def stats(self, works: Mapping[int, DeltaWork], sent: Sequence[int]) -> dict[str, Any]:
        """This push's delta figures for PushStats: ``works`` per inbox destination, ``sent`` the
        destinations written a delta."""
        compared = sum(works[r].words for r in sent)
        return {"changed_fraction": sum(works[r].changed for r in sent) / compared if compared else -1.0,
                "encode_seconds": self.encode_seconds, "delta_ref_bytes": self.ref_bytes,
                "delta_scratch_bytes": self.scratch_bytes,
                "delta_overflow_bytes": sum(works[r].overflow_bytes for r in sent)}

    def finish(self, version: int, ok: bool) -> None:
        """After the push: the changed values become the reference (one indexed copy per space); usable
        from the next push on if this one succeeded. On a GPU the copies run on a side stream and the
        push does not wait for them (about 6 ms for Llama-3-8B at 2% changed, after the destinations
        have applied their last part): the next compare, or anything else that touches the reference
        through this class, waits for them first (:meth:`settle`)."""
        import torch

        t0 = time.perf_counter()
        # the changes as the collect left them (one kernel each), else in order (an indexed copy)
        tiled = [sp.tiles for sp in self._spaces.values() if sp.tiles is not None and not sp.ref_done]
        todo = [(sp.ref, sp.idx, sp.vals) for sp in self._spaces.values()
                if sp.tiles is None and sp.idx is not None and not sp.ref_done]
        if (todo or tiled) and self.device.type == "cuda":
            if self._side is None:
                self._side = torch.cuda.Stream(self.device)
            self._side.wait_stream(torch.cuda.current_stream(self.device))  # the values are gathered
            with torch.cuda.stream(self._side):
                for tiles in tiled:
                    tiles.update_ref()
                for ref, idx, vals in todo:
                    ref[idx] = vals
            for tiles in tiled:  # their memory is not reused before the side stream is done with it
                tiles.record_stream(self._side)
            for _, idx, vals in todo:
                idx.record_stream(self._side)
                vals.record_stream(self._side)
            self._ref_ready = torch.cuda.Event()
            self._ref_ready.record(self._side)
        else:
            for ref, idx, vals in todo:
                ref[idx] = vals
        for sp in self._spaces.values():
            sp.idx = sp.vals = sp.tiles = sp.strided_local = sp.strided_vals = None
            sp.ref_done = False
        for c, changed in self._chunk_changed.items():
            if changed is not None:
                words(self.chunk_refs[c], int(self.chunk_words[c]))[changed[0]] = changed[1]
        # A part left uncompared would leave its spaces' reference behind: the next push is then dense.
        whole = self.base < 0 or len(self._compared) == SPANS
        self._chunk_changed, self._hits, self._compared = {}, {}, set()
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()  # not the side stream
        self.ref_version = version if ok and whole and self.enabled and self._referenced else -1
        self.phases["finish"] = time.perf_counter() - t0
        self.encode_seconds += self.phases["finish"]


# -- the destination's side ------------------------------------------------------------------------------
class DeltaReceiver:
    """A destination's delta inbox and what its shadows hold."""

    def __init__(self, engine: Any, buffers: Mapping[str, list[Any]], mode: str, device: Any, nbytes: int,
                 rank: int) -> None:
        import torch

        self.engine = engine
        self.buffers = buffers
        self.mode = mode
        self.device = device
        self.rank = rank
        self.keys = sorted(buffers)
        self.headers = np.full(MAX_HEADERS * (1 + SPANS), -1, HEADER_RECORD)  # header_slot(source, part)
        self.header_region = engine.register(self.headers, name=f"destination {rank} delta headers")
        self.payload = torch.zeros(max(int(nbytes), ALIGN), dtype=torch.uint8, device=device)
        self.payload_region = engine.register(self.payload, name=f"destination {rank} delta payload")
        self.holds = [-1, -1] if mode == "staged" else [-1]  # the version each buffer holds exactly
        self.apply_seconds = 0.0
        # ENC_IDX16 streams' contiguous runs scattered by a device kernel (CUDA C++ or Triton)
        self.use_kernels = _kernels_wanted(device)
        self.scatter_backend = ""  # the kernels of the last scatter by kernel
        # CUDA: the entries are read on a stream of their own, so that reading a part's does not wait
        # for the scatter of the part before it (queued on the current stream)
        self._read_stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._pinned: Any = None  # CUDA: the host memory the entries are read into
        # this version's entries, streams and payload offset, per part read and source; those not yet
        # scattered
        self._entries: list[tuple[np.ndarray, np.ndarray, int]] = []
        self._pending: list[tuple[np.ndarray, np.ndarray, int]] = []
        # this version's headers as read (payload offset, entries, room, head bytes), per source, until the
        # payload has landed and read_entries takes the entries from it; the sources' ranks, in that order
        self._heads: list[tuple[int, int, int, int]] = []
        self._sources: list[int] = []
        self._keys_at: dict[int, tuple[np.ndarray, np.ndarray]] = {}  # _key_table, per shadow
        # CUDA: a flag per stream scattered by the CUDA kernels since the last check, set by the kernel
        # where the stream does not match its entries (it then stores none, or none outside its writes),
        # and what each names; read once the device is synchronized (:meth:`_check_refused`)
        self._refused: Any = None
        self._refused_what: list[str] = []

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
        # An early part's scatter of a version given up on may still run: it ends before a byte of the
        # new version can land (in the shadow or the payload it reads).
        self._sync_device()
        self.holds[shadow] = -1  # bytes of the new version may land in it from now on
        self._entries = []
        self._pending = []
        self._heads = []
        self._sources = []
        self._refused_what = []
        self.apply_seconds = 0.0

    def read_headers(self, sources: Sequence[int], epoch: int, version: int, part: int | None = None) -> int:
        """The immediates the headers of the version's final part (``part`` None: its data immediates) or
        of early part ``part`` (its payload's) announce (every one of those headers has arrived). Only
        the header records are read: the entries and streams lie in the payload, which may land after
        its header (nothing orders two writes on the wire); :meth:`read_entries` takes them once the
        announced immediates, the payload's among them, have all arrived."""
        total = 0
        self._heads = []
        what = "final part" if part is None else f"part {part}"
        for r in sources:
            h = self.headers[header_slot(r, part)]
            if int(h["version"]) != version or int(h["epoch"]) != epoch:
                raise WeightSyncError(f"delta header ({what}) of source {r} names version "
                                      f"{int(h['version'])} of plan epoch {int(h['epoch'])}, not {version} "
                                      f"of {epoch}")
            total += int(h["imms"])
            # entries, then (past the room for all of them) the streams; a part without entries has no
            # payload
            if int(h["entries"]) > 0:
                self._heads.append((r, int(h["offset"]), int(h["entries"]), int(h["room"]),
                                    data_at(int(h["room"]))))
        return total

    def read_entries(self) -> None:
        """The entries and streams of the part whose headers :meth:`read_headers` read, in one copy to
        the host: call it once every immediate the headers announce has arrived (the payloads are in
        place). They are scattered by the next :meth:`apply`."""
        import torch

        heads, self._heads = self._heads, []
        if not heads:
            return
        # The payload was written by the sources (or copied in by this engine's landing copies, done
        # before their immediates count): nothing queued on this device precedes the read. On CUDA it is
        # copied by the copy engines, on a stream of its own: a kernel (a concatenation) would wait for
        # the SMs that the last part's scatter fills.
        total = sum(size for *_, size in heads)
        if self._read_stream is None:
            host = torch.cat([self.payload[off:off + size] for _, off, _, _, size in heads]).numpy()
        else:
            # kept from part to part (the entries and streams are copied out of it before the next read)
            if self._pinned is None or int(self._pinned.numel()) < total:
                self._pinned = torch.empty(max(total, 1 << 16), dtype=torch.uint8, pin_memory=True)
            pinned = self._pinned
            with torch.cuda.stream(self._read_stream):
                at = 0
                for _, off, _, _, size in heads:
                    pinned[at:at + size].copy_(self.payload[off:off + size], non_blocking=True)
                    at += size
            mark("destination: entries' copies queued")
            self._read_stream.synchronize()
            mark("destination: entries copied")
            host = pinned.numpy()
        at = 0
        for r, off, n, room, size in heads:
            head = host[at:at + size]
            at += size
            entries = head[:n * ENTRY_DTYPE.itemsize].view(ENTRY_DTYPE).copy()
            streams = head[streams_at(room):data_at(room)].view(STREAM_DTYPE).copy()
            self._entries.append((entries, streams, off))
            self._pending.append((entries, streams, off))
            self._sources.append(r)

    def planned_chunks(self, at: Mapping[tuple[str, int], int], total: int) -> list[int]:
        """A relay chain member: the relay chunks this version's entries say were sent as planned (they
        come through the chain, counted there), in chunk order. ``at``: each of the ``total`` chunks by
        where it lands. Every chunk must be named by exactly one entry (a chunk named by none would be
        neither counted nor applied)."""
        seen = np.zeros(total, bool)
        planned: list[int] = []
        for (entries, _, _), src in zip(self._entries, self._sources, strict=True):
            for key, off, enc in zip(entries["key"].tolist(), entries["dst_off"].tolist(),
                                     entries["enc"].tolist(), strict=True):
                c = at.get((self.keys[key] if 0 <= key < len(self.keys) else "", off))
                if c is None or seen[c]:
                    raise WeightSyncError(
                        f"delta entries of source {src} name a write at byte {off} of key index {key} that "
                        f"{'is no relay chunk' if c is None else 'another entry names too'}")
                seen[c] = True
                if enc == ENC_DENSE:
                    planned.append(c)
        if not seen.all():
            missing = np.flatnonzero(~seen)[:5].tolist()
            raise WeightSyncError(f"relay chunks {missing} are named by no source's delta entries")
        return sorted(planned)

    def apply(self, shadow: int, wait: bool = True) -> None:
        """Scatters the sparse entries read since the last apply into buffer ``shadow``; ``wait``: until
        the device has (an early part's need not: the next part's entries are read meanwhile, and the
        version's last apply waits for every scatter queued before it)."""
        t0 = time.perf_counter()
        pending, self._pending = self._pending, []
        self._scatter_all(shadow, pending)
        if wait:
            self._sync_device()
            self._check_refused()
        self.apply_seconds += time.perf_counter() - t0

    def _stream_name(self, off: int, word: int, enc: int) -> str:
        """The ``word``-byte stream (encoding ``enc``) of the part at payload byte ``off``, by its source."""
        what = f"{word}-byte ENC_{ENCODINGS[enc].upper()} stream"
        heads = [o for _, _, o in self._entries]
        if off in heads and len(self._sources) == len(heads):
            return f"source {self._sources[heads.index(off)]}'s {what}"
        return f"the {what} of the part at payload byte {off}"

    def _refusal_flag(self, off: int, word: int, enc: int) -> Any:
        """A zeroed device flag (int32) for the kernel that scatters the ``word``-byte stream (encoding
        ``enc``) of the part at payload byte ``off`` to set where the stream does not match its entries.
        Zeroed here, on the stream the kernel runs on: a version given up on may have left its flags set,
        unread."""
        import torch

        i = len(self._refused_what)
        if self._refused is None or int(self._refused.numel()) <= i:
            grown = torch.zeros(max(64, 2 * (i + 1)), dtype=torch.int32, device=self.device)
            if self._refused is not None:
                grown[:i].copy_(self._refused[:i])
            self._refused = grown
        self._refused_what.append(self._stream_name(off, word, enc))
        flag = self._refused[i:i + 1]
        flag.zero_()
        return flag

    def _check_refused(self) -> None:
        """After the device is synchronized: raises WeightSyncError, naming the sources, where a CUDA
        scatter refused its stream (its block counts or bits do not number its changed words, or put one
        outside the write its entry names): the version is then not complete here."""
        n = len(self._refused_what)
        if not n:
            return
        flags = self._refused[:n].cpu().numpy()
        what, self._refused_what = self._refused_what, []
        bad = [what[i] for i in np.flatnonzero(flags)]
        if bad:
            raise WeightSyncError(f"destination {self.rank}: {', '.join(bad)} does not match its entries "
                                  "(its changed words are not as many as it says, or fall outside their "
                                  "writes)")

    def _scatter_all(self, shadow: int, parts: Sequence[tuple[np.ndarray, np.ndarray, int]]) -> None:
        """Per source and word size: decodes its stream once, then scatters each run of its entries that
        go into one key with one placement (contiguous ones whose stream and destination offsets differ
        by the same amount, or strided ones) with one indexed copy. With the kernels, an ENC_IDX16
        stream's contiguous runs go by one kernel launch instead, and only its strided runs are decoded; an
        ENC_BITMAP stream's too (on CPU its bits read into 16-bit indices first, on CUDA scattered straight
        from them)."""
        import torch

        from weightsync.delta import host as delta_host

        host = delta_host.wanted(self.device)

        for entries, streams, off in parts:
            for st in streams:
                k, w = int(st["k"]), int(st["word"])
                if k == 0:
                    continue
                mark("destination: stream of word %d", w)
                ents = entries[(entries["enc"] == ENC_STREAM) & (entries["word"] == w)
                               & (entries["count"] > 0)]
                ents = ents[np.argsort(ents["data"], kind="stable")]
                ends = np.cumsum(ents["count"])
                starts = ends - ents["count"]
                strided = (ents["rows"] > 1) & (ents["pitch"] != ents["row_bytes"])
                # a contiguous entry's word at stream position p goes to word p + shift of its key
                shift = ents["dst_off"] // w - ents["data"]
                key = ents["key"]
                brk = np.ones(len(ents), bool)
                brk[1:] = (key[1:] != key[:-1]) | (strided[1:] != strided[:-1]) | \
                    (~strided[1:] & (shift[1:] != shift[:-1]))
                first = np.flatnonzero(brk).tolist()
                runs = list(zip(first, [*first[1:], len(ents)], strict=True))
                enc, n = int(st["enc"]), int(st["n"])
                stream = self.payload[off + int(st["data"]):]
                # the contiguous runs by one kernel, of either sparse encoding
                if self.use_kernels:
                    from weightsync.delta.triton_kernels import scatter_bitmap, scatter_idx16

                    nwords = ents["rows"] * ents["row_bytes"] // w
                    # the kernel needs each key's address only (a word view per run costs tens of us of
                    # host time, on the apply's critical path), the table made by numpy ops (a loop over
                    # the runs cost as much)
                    fi = np.asarray(first, np.int64)
                    la = np.append(fi[1:], len(ents)) - 1
                    cont = ~strided[fi]
                    fi, la = fi[cont], la[cont]
                    addresses, sizes = self._key_table(shadow)
                    todo = np.stack([addresses[key[fi]], shift[fi], starts[fi], ends[la], ents["data"][fi],
                                     ents["data"][la] + nwords[la]], 1)
                    mark("destination: %d runs of word %d found", len(todo), w)
                    if not len(todo):
                        done = ""
                    elif host:  # CPU: C++, each store checked (a bitmap's bits read into 16-bit indices)
                        by_host = delta_host.scatter_bitmap if enc == ENC_BITMAP else delta_host.scatter_idx16
                        try:
                            done = by_host(stream, n, k, w, _values_at(enc, n, k), todo, sizes[key[fi]])
                        except ValueError as exc:  # it came over the wire: refused, as on CUDA
                            name = self._stream_name(off, w, enc)
                            raise WeightSyncError(f"destination {self.rank}: {name} does not match its "
                                                  f"entries: {exc}") from exc
                    else:  # CUDA: ENC_BITMAP straight from its bits ("" elsewhere: torch ops)
                        scatter = scatter_bitmap if enc == ENC_BITMAP else scatter_idx16
                        done = scatter(stream, n, k, w, _values_at(enc, n, k), todo, self.device,
                                       lambda off=off, w=w, enc=enc: self._refusal_flag(off, w, enc))
                    mark("destination: scatter of word %d launched", w)
                    if done:
                        self.scatter_backend = done
                        runs = [(i, j) for i, j in runs if strided[i]]
                if not runs:
                    continue
                virt, vals = decode(stream, enc, n, k, w)
                for i, j in runs:
                    target = words(self.buffers[self.keys[int(key[i])]][shadow], w)
                    a, b = int(starts[i]), int(ends[j - 1])
                    seg = virt[a:b]  # decode's own tensor: made the target's word indices in place
                    if not strided[i]:
                        seg += int(shift[i])
                    else:
                        e = ents[i:j]
                        t = _to_device(np.stack([e["count"], e["data"], e["row_bytes"] // w, e["pitch"] // w,
                                                 e["dst_off"] // w]), self.device)
                        jid = torch.repeat_interleave(torch.arange(j - i, device=self.device), t[0],
                                                      output_size=b - a)
                        seg -= t[1][jid]  # index into the entry's own words
                        m = t[2][jid]
                        r = torch.div(seg, m, rounding_mode="floor")
                        seg -= r * m
                        seg += t[4][jid] + r * t[3][jid]
                    target[seg] = vals[a:b]

    def _key_table(self, shadow: int) -> tuple[np.ndarray, np.ndarray]:
        """Every key's buffer ``shadow`` as (address, bytes), by key index: the buffers were registered
        (contiguous, and kept for the receiver's life), so they are read once."""
        table = self._keys_at.get(shadow)
        if table is None:
            ts = [self.buffers[key][shadow] for key in self.keys]
            table = (np.array([int(t.data_ptr()) for t in ts], np.int64),
                     np.array([int(t.numel()) * int(t.element_size()) for t in ts], np.int64))
            self._keys_at[shadow] = table
        return table

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
        self._scatter_all(other, self._entries)
        self._sync_device()
        self._check_refused()
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
