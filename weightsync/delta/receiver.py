"""The destination's side of a delta push: its inbox, the sources' headers and entries, and the
scatter of their changes into a shadow."""

from __future__ import annotations

import struct
import time
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from weightsync.delta.backend import kernels_wanted
from weightsync.delta.codec import (
    ALL_PLANNED,
    ENC_BITMAP,
    ENC_DENSE,
    ENC_STREAM,
    ENCODINGS,
    ENTRY_DTYPE,
    HEADER_RECORD,
    MAX_HEADERS,
    SPANS,
    STREAM_DTYPE,
    _values_at,
    data_at,
    decode,
    header_slot,
    streams_at,
)
from weightsync.delta.units import ALIGN, _to_device, words
from weightsync.errors import WeightSyncError
from weightsync.runtime.trace import mark


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
        self.headers = np.full(MAX_HEADERS * (1 + SPANS), -1, HEADER_RECORD)  # header_slot(source, span)
        self.header_region = engine.register(self.headers, name=f"destination {rank} delta headers")
        self.payload = torch.zeros(max(int(nbytes), ALIGN), dtype=torch.uint8, device=device)
        self.payload_region = engine.register(self.payload, name=f"destination {rank} delta payload")
        self.holds = [-1, -1] if mode == "staged" else [-1]  # the version each buffer holds exactly
        self.apply_seconds = 0.0
        # ENC_IDX16 streams' contiguous runs scattered by a device kernel (CUDA C++ or Triton)
        self.use_kernels = kernels_wanted(device)
        self.scatter_backend = ""  # the kernels of the last scatter by kernel
        # CUDA: the entries are read on a stream of their own, so that reading a span's does not wait
        # for the scatter of the span before it (queued on the current stream)
        self._read_stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._pinned: Any = None  # CUDA: the host memory the entries are read into
        # this version's entries, streams and payload offset, per span read and source; those not yet
        # scattered
        self._entries: list[tuple[np.ndarray, np.ndarray, int]] = []
        self._pending: list[tuple[np.ndarray, np.ndarray, int]] = []
        # this version's headers as read (payload offset, entries, room, head bytes), per source, until the
        # payload has landed and read_entries takes the entries from it; the sources' ranks, in that order
        self._heads: list[tuple[int, int, int, int]] = []
        self._sources: list[int] = []
        # this version's sources whose every write went as planned (their inbox share holds no entries):
        # (source, first relay chunk of its writes, how many)
        self._all_planned: list[tuple[int, int, int]] = []
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
        # An early span's scatter of a version given up on may still run: it ends before a byte of the
        # new version can land (in the shadow or the payload it reads).
        self._sync_device()
        self.holds[shadow] = -1  # bytes of the new version may land in it from now on
        self._entries = []
        self._pending = []
        self._heads = []
        self._sources = []
        self._all_planned = []
        self._refused_what = []
        self.apply_seconds = 0.0

    def read_headers(self, sources: Sequence[int], epoch: int, version: int, span: int | None = None) -> int:
        """The immediates the headers of the version's final span (``span`` None: its data immediates) or
        of early span ``span`` (its payload's) announce (every one of those headers has arrived). Only
        the header records are read: the entries and streams lie in the payload, which may land after
        its header (nothing orders two writes on the wire); :meth:`read_entries` takes them once the
        announced immediates, the payload's among them, have all arrived."""
        total = 0
        self._heads = []
        what = "final span" if span is None else f"span {span}"
        for r in sources:
            h = self.headers[header_slot(r, span)]
            if int(h["version"]) != version or int(h["epoch"]) != epoch:
                raise WeightSyncError(f"delta header ({what}) of source {r} names version "
                                      f"{int(h['version'])} of plan epoch {int(h['epoch'])}, not {version} "
                                      f"of {epoch}")
            total += int(h["imms"])
            if span is None and int(h["entries"]) == ALL_PLANNED:
                self._all_planned.append((r, int(h["offset"]), int(h["room"])))
                continue
            # entries, then (past the room for all of them) the streams; a span without entries has no
            # payload
            if int(h["entries"]) > 0:
                self._heads.append((r, int(h["offset"]), int(h["entries"]), int(h["room"]),
                                    data_at(int(h["room"]))))
        return total

    def read_entries(self) -> None:
        """The entries and streams of the span whose headers :meth:`read_headers` read, in one copy to
        the host: call it once every immediate the headers announce has arrived (the payloads are in
        place). They are scattered by the next :meth:`apply`."""
        import torch

        heads, self._heads = self._heads, []
        if not heads:
            return
        # The payload was written by the sources (or copied in by this engine's landing copies, done
        # before their immediates count): nothing queued on this device precedes the read. On CUDA it is
        # copied by the copy engines, on a stream of its own: a kernel (a concatenation) would wait for
        # the SMs that the last span's scatter fills.
        total = sum(size for *_, size in heads)
        if self._read_stream is None:
            host = torch.cat([self.payload[off:off + size] for _, off, _, _, size in heads]).numpy()
        else:
            # kept from span to span (the entries and streams are copied out of it before the next read)
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
        where it lands. Every chunk must be named by exactly one entry, or lie in the chunks of a source
        whose header says every write of it went as planned (a chunk named by none would be neither
        counted nor applied)."""
        seen = np.zeros(total, bool)
        planned: list[int] = []
        for src, first, count in self._all_planned:  # named by their header, not by entries
            if first < 0 or count < 0 or first + count > total or seen[first:first + count].any():
                raise WeightSyncError(f"delta header of source {src} says relay chunks {first} to "
                                      f"{first + count - 1} were sent as planned: of {total} chunks, they "
                                      "lie outside them or another source's header names them too")
            seen[first:first + count] = True
            planned.extend(range(first, first + count))
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
        the device has (an early span's need not: the next span's entries are read meanwhile, and the
        version's last apply waits for every scatter queued before it)."""
        t0 = time.perf_counter()
        pending, self._pending = self._pending, []
        self._scatter_all(shadow, pending)
        if wait:
            self._sync_device()
            self._check_refused()
        self.apply_seconds += time.perf_counter() - t0

    def _stream_name(self, off: int, word: int, enc: int) -> str:
        """The ``word``-byte stream (encoding ``enc``) of the span at payload byte ``off``, by its source."""
        what = f"{word}-byte ENC_{ENCODINGS[enc].upper()} stream"
        heads = [o for _, _, o in self._entries]
        if off in heads and len(self._sources) == len(heads):
            return f"source {self._sources[heads.index(off)]}'s {what}"
        return f"the {what} of the span at payload byte {off}"

    def _refusal_flag(self, off: int, word: int, enc: int) -> Any:
        """A zeroed device flag (int32) for the kernel that scatters the ``word``-byte stream (encoding
        ``enc``) of the span at payload byte ``off`` to set where the stream does not match its entries.
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

    def _scatter_all(self, shadow: int, spans: Sequence[tuple[np.ndarray, np.ndarray, int]]) -> None:
        """Per source and word size: decodes its stream once, then scatters each run of its entries that
        go into one key with one placement (contiguous ones whose stream and destination offsets differ
        by the same amount, or strided ones) with one indexed copy. With the kernels, an ENC_IDX16
        stream's contiguous runs go by one kernel launch instead, and only its strided runs are decoded; an
        ENC_BITMAP stream's too (on CPU its bits read into 16-bit indices first, on CUDA scattered straight
        from them)."""
        import torch

        from weightsync.delta import host as delta_host

        host = delta_host.wanted(self.device)

        for entries, streams, off in spans:
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
                    # the kernel needs each key's address only (a word view per run costs host time, on
                    # the apply's critical path), the table made by numpy ops (a loop over
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
