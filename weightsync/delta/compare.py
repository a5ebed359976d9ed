"""The sender's compare: which words of its local tensors and staged chunks changed since the
reference (what it last pushed), and their new values.

Everything here is torch ops on the tensors' own device (CPU or GPU), a few large ones per push rather
than some per tensor or per write, and few host synchronizations (on a GPU each ``nonzero``, ``.cpu()``
or plain host-to-device copy waits for the device; small tables go up pinned and non-blocking). The
sender, per space (word size and span): per :data:`COMPARE_SLICE` words a change mask (one compare per
tensor in it) and one ``nonzero`` over it (the changed words' positions in the reference, sorted, into
one buffer); one ``searchsorted`` of every tensor's and every compared direct write's bounds, and one
copy of those counts to the host for the span's spaces at once; one gather of the new values per tensor.
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
where an atomic counter puts them; one host synchronization per space). Every span's collect is
launched at the push's start; once the announces are out, the search of each one's bounds (how many
changes lie before each) is queued too, on a stream of their own that waits for it on the device
(:meth:`DeltaSender.search_ahead`), so the host only waits for each span's answers and launches nothing
between the last compare and the last span's decisions. The changes are never put in order on that path:
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
:data:`COMPARE_SLICE` words of each space, per span one copy of the counts, two more when direct writes
read strided source rows, and one wait before the engine reads each destination's span payload; one after
the reference's update; per staged chunk one ``nonzero`` and one copy of counts per inbox destination.
The receiver's, per span: one copy of the headers' entries, one wait after the scatters (and, where the
CUDA kernels scattered, a read of their refusal flags), and, for a bitmap stream the torch ops decode
(without the CUDA kernels, or a strided write's), one ``nonzero`` per :data:`BITMAP_SLICE` words.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from weightsync.delta.codec import SPANS
from weightsync.delta.units import _narrow, _to_device, word_dtype, words
from weightsync.delta.work import (
    _HIT_DTYPE,
    _Space,
)
from weightsync.runtime.trace import mark

# Words compared per nonzero: the change mask (one byte per word) is this big at most, and each slice
# costs one host synchronization.
COMPARE_SLICE = 1 << 29


class Compare:
    """The compare half of :class:`weightsync.delta.sender.DeltaSender` (its state is the sender's): run
    at the push's start and per staged chunk, read by the sender's decisions and encode."""

    # -- one push ----------------------------------------------------------------------------------
    def start(self) -> None:
        """At the push's start: takes the first reference, or starts comparing the tensors with it. Where
        the CUDA kernels run, every span's compare is only launched (back to back on a stream of their
        own, :meth:`prefetch`) and the host goes on: the device compares without a gap while the host
        decides, encodes and posts each span in turn (their scratch is alive at once). Elsewhere nothing
        is compared yet: :meth:`overlap_grants` compares the first span once the announces are out (the
        others as their span is decided, :meth:`decide`)."""
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
            for span in range(SPANS):
                self.prefetch(span)

    def prefetch(self, span: int) -> bool:
        """Launches the CUDA compare of ``span``'s spaces on the compare stream and returns without
        waiting for the device, so that the GPU compares one span while the host decides, encodes and
        posts the one before (:meth:`compare` finishes it). The stream waits for everything queued on
        the current one first (the caller's updates of the tensors; the reference's update,
        :meth:`settle`). False where nothing was launched (no CUDA kernels here, or already)."""
        import torch

        if not self.enabled or self.base < 0 or span >= SPANS or span in self._compared or \
                span in self._launched or not self.use_kernels or self.device.type != "cuda":
            return False
        t0 = time.perf_counter()
        if self._compare_stream is None:
            # the lowest priority: the push's own kernels (on its stream) go first
            self._compare_stream = torch.cuda.Stream(self.device, priority=0)
        self._compare_stream.wait_stream(torch.cuda.current_stream(self.device))
        launched = False
        for sp in self._spaces.values():
            if sp.span == span:
                launched |= self._compactor(sp).launch([self._views[k] for k in sp.keys], sp.ref, sp.hint,
                                                       self._compare_stream)
        if launched:
            self._launched.add(span)
        self._spent("compare", t0)
        return launched

    def overlap_grants(self) -> None:
        """What the push does while its grants travel, once the announces are out: on a GPU, queues the
        launched compares' searches (:meth:`search_ahead`); where nothing was launched (CPU tensors, the
        torch path), compares the first span, which the first grant's decisions need (on CPU that
        compare is most of the push: the grants' round trip now overlaps it instead of following it)."""
        if self._launched:
            self.search_ahead()
        else:
            self.compare(0)

    def search_ahead(self) -> None:
        """After :meth:`start` launched the compares: queues the searches of each one's space's query
        (where each key's and each inbox write's changes start) on a stream of their own, each waiting for
        its compare on the device, so that :meth:`compare` waits for the device once per span and launches
        nothing. Apart from start: these launches cost host time that the compares do not wait for (the
        announces go first)."""
        import torch

        if not self._launched:
            return
        t0 = time.perf_counter()
        if self._order_stream is None:
            # above the compares (priority 0): a span's searches run as soon as its compare is done
            self._order_stream = torch.cuda.Stream(self.device, priority=-1)
        for s, sp in self._spaces.items():
            if sp.span in self._launched and sp.compactor is not None:
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
        """Every span compared (the reference must take all of this push's changes, whether or not a
        destination asked for them): before the push checks that its tensors did not change."""
        for span in range(SPANS):
            self.compare(span)

    def compare(self, span: int) -> None:
        """The spaces of ``span`` compared with their reference (once a push): the changed positions (one
        nonzero per slice of COMPARE_SLICE words, or the kernels), then where each key's and each inbox
        write's changes start among them (one searchsorted per space, one copy to the host for all), the
        new values (one gather per key) and the strided writes' own changes."""
        import torch

        if not self.enabled or self.base < 0 or span in self._compared:
            return
        t0 = time.perf_counter()
        spaces = {s: sp for s, sp in self._spaces.items() if sp.span == span}
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
        mark("source %d: span %d changes ordered", self.rank, span)
        on_device = [c for c in cuts if not isinstance(c, np.ndarray)]
        if on_device:  # one copy to the host for every space's
            read = iter(np.split(torch.cat(on_device).cpu().numpy(),
                                 np.cumsum([int(c.numel()) for c in on_device])[:-1]))
            cuts = [c if isinstance(c, np.ndarray) else next(read) for c in cuts]
        host = np.concatenate(cuts) if cuts else np.zeros(0, np.int64)
        mark("source %d: span %d cuts read", self.rank, span)
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
        self._compared.add(span)
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
        allocator on the device; not in ``ref_bytes``): a push launches every span's compare at its start,
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
        bounds = [sp.starts]
        for ib in self.inboxes.values():
            f = ib.flat.get(space)
            if f is not None:
                bounds.append(np.stack([f["start"], f["start"] + f["extent"]], 1).reshape(-1))
        return np.concatenate(bounds).astype(np.int64)

    def _query_on_device(self, space: int, sp: _Space) -> Any:
        """:meth:`_query` on the device, made once per plan (``load`` forgets it)."""
        if sp.query is None:
            sp.query = _to_device(self._query(space, sp), self.device)
        return sp.query

    def _select_strided(self, s: int, sp: _Space, strided: list[tuple[int, np.ndarray]]) -> None:
        """The changes of the strided direct writes (source rows with words between them that are not
        theirs) among the changed words in their extent, as indices into their own words, for all inboxes
        at once: two host synchronizations when any such write has changes in its extent."""
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
        lengths = t[1]
        total = int(lengths.sum())
        seg = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
        if total:
            dev = _to_device(np.concatenate([t[0] - seg[:-1], t[2], t[3], t[4], lengths]).reshape(5, -1),
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
