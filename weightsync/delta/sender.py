"""The source's side of a delta push: per inbox destination and span, which planned writes go as
planned and which as encoded changes, the payloads and headers posted, and the reference's update."""

from __future__ import annotations

import struct
import time
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from weightsync.delta.backend import kernels_wanted
from weightsync.delta.codec import (
    ALL_PLANNED,
    DELTA_KEY,
    ENC_BITMAP,
    ENC_DENSE,
    ENC_EMPTY,
    ENC_STREAM,
    ENTRY_DTYPE,
    HEADER_RECORD,
    MAX_HEADERS,
    SPANS,
    STREAM_DTYPE,
    WORDS,
    _choose_many,
    _IndexWriter,
    _streams_bytes,
    _values_at,
    choose,
    data_at,
    header_slot,
    span_of,
    split_payload,
    stream_size,
    streams_at,
    suggested_inbox,
)
from weightsync.delta.compare import Compare
from weightsync.delta.units import _align, _to_device, word_dtype, words
from weightsync.delta.work import (
    _FLAT_DTYPE,
    _HIT_DTYPE,
    DeltaWork,
    _Inbox,
    _Piece,
    _Space,
    _Span,
)
from weightsync.delta.writes import chunk_words, direct_writes
from weightsync.errors import TransportError, WeightSyncError
from weightsync.runtime.trace import mark
from weightsync.wire import delta_header_imm, delta_part_imm


class DeltaSender(Compare):
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
        # header outbox: per span (the final one first) a slot per destination rank
        self.headers = np.zeros(MAX_HEADERS * (1 + SPANS), HEADER_RECORD)
        self.header_region = engine.register(self.headers, name=f"source {rank} delta headers")
        self.words = {k: self._key_word(t) for k, t in locals_.items()}
        self._key_index = {k: i for i, k in enumerate(locals_)}
        # Spans: the local tensors in order, cut into SPANS runs (span_of).
        nbytes = np.array([int(t.nbytes) if isinstance(t, np.ndarray) else
                           int(t.numel()) * int(t.element_size()) for t in locals_.values()], np.int64)
        self._key_span = span_of(nbytes)
        # The reference's layout: per span and word size a space, its keys end to end (in the order of the
        # local tensors).
        self._spaces: dict[int, _Space] = {}
        self._start = np.full(len(locals_), -1, np.int64)  # key index -> its first word in its space
        self._space_of = np.full(len(locals_), -1, np.int64)  # key index -> its space
        for span in range(SPANS):
            for w in WORDS:
                keys = [k for k in locals_
                        if self.words[k] == w and self._key_span[self._key_index[k]] == span]
                if not keys:
                    continue
                sizes = np.array([int(locals_[k].numel()) for k in keys], np.int64)
                starts = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
                s = len(self._spaces)
                self._spaces[s] = _Space(w, keys, starts, span)
                for k, a in zip(keys, starts[:-1].tolist(), strict=True):
                    self._start[self._key_index[k]] = a
                    self._space_of[self._key_index[k]] = s
        self._views = {k: words(locals_[k], sp.word) for sp in self._spaces.values() for k in sp.keys}
        self._referenced = False  # whether the reference holds a push's values (from the first push on)
        self._compared: set[int] = set()  # the spans this push compared with it
        self._launched: set[int] = set()  # the spans whose compare this push launched (CUDA kernels)
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
        self.use_kernels = bool(enabled and kernels_wanted(device))
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

    def load(self, plan_part: Any, rounds: Sequence[Any], src_keys: Sequence[str], tails: Mapping[int, Any],
             dests: Mapping[int, Any], dpos_keys: Mapping[int, Sequence[str]], sources: int) -> None:
        """A new plan part: the inboxes of this source's destinations and its writes into each. The
        staging chunks' references go (the chunks are cut anew); the tensors' stay, and so does their
        version: a destination that still holds it gets a delta of the direct writes. All or nothing: a
        part refused leaves the previous one in place (its payload regions are deregistered only once
        the new part's are made)."""
        cw = chunk_words(plan_part, self.words)
        inboxes: dict[int, _Inbox] = {}
        try:
            lead = self._inboxes(plan_part, rounds, src_keys, tails, dests, dpos_keys, sources, inboxes)
        except BaseException:
            for region in {id(ib.region): ib.region for ib in inboxes.values() if ib.region is not None
                           }.values():
                self.engine.deregister(region)
            raise
        self.close_regions()
        self.chunk_refs = {}
        for sp in self._spaces.values():
            sp.query = None  # the writes' bounds change with the plan
        self.chunk_words = cw
        self.inboxes = inboxes
        chain = list(plan_part.relay)
        self.lead = lead
        self._alias = {chain[0]: lead} if chain and lead is not None else {}

    def _inboxes(self, plan_part: Any, rounds: Sequence[Any], src_keys: Sequence[str],
                 tails: Mapping[int, Any], dests: Mapping[int, Any], dpos_keys: Mapping[int, Sequence[str]],
                 sources: int, inboxes: dict[int, _Inbox]) -> int | None:
        """:meth:`load`'s inboxes, into ``inboxes`` (payload regions registered as they are made); returns
        a relay chain's lead (None: no chain, or no member with an inbox).

        An inbox whose share cannot hold this source's entry tables is ``planned_only``: this source
        sends it every write as planned, its headers saying so, rather than refusing the plan (the
        destination's inbox is its own choice; its neighbours' pushes must not fail for it)."""
        import torch

        from weightsync.plan.writes import K_DATA

        # In a relay chain the sources write only its head; every member with an inbox gets the same
        # entries and payload (one layout, and for a delta one version), straight from this source, into
        # its own inbox, and the writes sent as planned through the chain. The first such member (the
        # lead) holds the push's work, the others share it and its send buffer; the payload must fit
        # every member's share, so the smallest member's share is the chain's.
        chain = list(plan_part.relay)
        members = [r for r in (chain or dests) if DELTA_KEY in dests[r].target.descriptors]

        def share_of(r: int) -> int:
            return split_payload(struct.unpack("<q", dests[r].target.descriptors[DELTA_KEY][2])[0], sources)

        lead = members[0] if chain and members else None
        bound = min(members, key=share_of) if chain and members else -1
        # a relay chain: this source's writes into the head are relay chunks first..first + count - 1
        relay_chunks = (plan_part.imms[plan_part.imms != 0] & 0xFFFF).astype(np.int64) if chain else []
        chunks = (int(relay_chunks.min()), len(relay_chunks)) if len(relay_chunks) else (0, 0)
        w = plan_part.writes
        staged = w[(w["staged"] == 1) & (w["kind"] == K_DATA)]
        lead_keys: list[str] | None = None
        for rank in members:
            d = dests[rank]
            into = chain[0] if chain else rank  # the destination this source's writes name
            entry = d.target.descriptors[DELTA_KEY]
            size = struct.unpack("<q", entry[2])[0]
            share = share_of(bound) if chain else split_payload(size, sources)
            dkeys = sorted(k for k in d.target.descriptors if k != DELTA_KEY)
            if chain and lead_keys is not None and dkeys != lead_keys:
                raise WeightSyncError(f"source {self.rank}: relay chain members {lead} and {rank} hold "
                                      "different keys; their delta entries could not be shared")
            lead_keys = lead_keys or dkeys
            kidx = {k: i for i, k in enumerate(dkeys)}
            ib = _Inbox(rank, entry[0], entry[1], self.rank * split_payload(size, sources), share, kidx,
                        dpos_keys[into], relay=bool(chain), bound_by=bound if chain else rank,
                        sources=sources, chunks=chunks)
            if chain and rank != lead:
                first = inboxes[lead]  # the lead's work: nothing compared for this one
                ib.fixed, ib.fixed_imms, ib.direct, ib.capacity = first.fixed, first.fixed_imms, \
                    first.direct, first.capacity
                ib.span, ib.round_len, ib.tables = first.span, first.round_len, first.tables
                ib.planned_only, ib.send, ib.region = first.planned_only, first.send, first.region
                inboxes[rank] = ib
                continue
            t = tails.get(into)
            if t is not None:  # the tail: posted as planned, from the snapshot
                rows = t.rows or 1
                ib.fixed = np.zeros(1, ENTRY_DTYPE)
                ib.fixed[0] = (kidx[ib.dkeys[t.dst_index]], ENC_DENSE, 1, t.dst_off, rows, t.nbytes,
                               t.dst_pitch if rows > 1 else t.nbytes, 0, 0)
                ib.fixed_imms = self.engine.imm_count(t.nbytes, True, rows)
            ib.direct, ib.round_len = direct_writes(rounds, into, src_keys, self.words, self._key_index,
                                                    kidx, ib.dkeys, self.engine)
            ib.span = self._key_span[ib.direct["key"]]
            slot = dests[into].target.slot
            ib.capacity = int((staged["dst_rank"] == slot).sum()) + len(ib.fixed)
            # the entry and stream tables: every early span's, then the final one's
            ib.tables = sum(data_at(int((ib.span == p).sum())) for p in range(SPANS)) + data_at(ib.capacity)
            ib.planned_only = ib.tables > share
            if not ib.planned_only:
                ib.flat = self._flat(ib.direct)
                ib.send = torch.zeros(share, dtype=torch.uint8, device=self.device)
                ib.region = self.engine.register(ib.send, name=f"source {self.rank} delta payload to {rank}")
            inboxes[rank] = ib
        return lead

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
            f["extent"] = np.where(f["strided"], (e["rows"] - 1) * e["src_pitch"] + e["row_bytes"],
                                 e["rows"] * e["row_bytes"]) // w
            f["n"] = e["rows"] * e["row_bytes"] // w
            f["row_words"] = e["row_bytes"] // w
            f["pitch_words"] = e["src_pitch"] // w
            out[s] = f[np.argsort(f["start"], kind="stable")]
        return out

    def begin(self, rank: int, base: int, dense_bytes: int) -> DeltaWork:
        """The work of a push to inbox destination ``rank``, which can take a delta on version ``base``
        (-1: none): a delta if the reference holds that version. Its spans are decided one by one
        (:meth:`decide`), the staged writes follow (:meth:`staged`), the final payload is encoded at
        :meth:`finalize`. No device work."""
        ib = self.inboxes[rank]
        delta = self.enabled and base >= 0 and base == self.base and not ib.planned_only
        work = DeltaWork(rank, delta, dense_bytes)
        work.room = ib.share - ib.tables
        self._works[rank] = work
        return work

    def decide(self, rank: int, span: int) -> dict[int, np.ndarray] | None:
        """Span ``span`` of the push to ``rank`` (compared first if it was not): which of its direct writes
        go sparse (their changes smaller than the write, and within the room left in this source's share
        of the inbox) and which as planned. Returns the latter, round index -> mask over the round's
        writes ({}: none; None: every write of every round, a dense push's first span). Once a push."""
        work = self._works[rank]
        if len(work.spans) > span:
            return work.spans[span].keep
        assert len(work.spans) == span, "spans are decided in order"
        if work.delta:
            self.compare(span)
        t0 = time.perf_counter()
        ib = self.inboxes[rank]
        sel = np.flatnonzero(ib.span == span)  # its direct writes (rows of ib.direct)
        d = ib.direct[sel]
        enc = np.full(len(sel), ENC_DENSE, np.int32)
        counts = np.zeros(len(sel), np.int64)
        mine = {s: f for s, f in ib.flat.items() if self._spaces[s].span == span}
        at = {s: np.searchsorted(sel, f["row"]) for s, f in mine.items()}  # their rows in the span's entries
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
        if not work.delta:  # every write as planned, all posted with the first span
            keep = None if span == 0 else {}
        else:
            keep = {}
            for ri in np.unique(d["round"][dense]).tolist():
                m = dense & (d["round"] == ri)
                mask = np.zeros(ib.round_len[int(ri)], bool)
                mask[d["pos"][m]] = True
                keep[int(ri)] = mask
        # a planned_only inbox: no entries (its header says every write went as planned)
        work.spans.append(_Span(rows[:0] if ib.planned_only else rows, direct, keep, changed))
        mark("source %d: span %d entries chosen", self.rank, span)
        self._spent("begin", t0)
        return keep

    def _fit(self, work: DeltaWork, mine: Mapping[int, np.ndarray], at: Mapping[int, np.ndarray],
             enc: np.ndarray) -> None:
        """The streams of a span's sparse direct writes (``enc``; ``mine`` per space, ``at`` their rows in
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
        """Whether a staged write's changes travel in its word size's stream of the final span
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

    def encode_span(self, rank: int, span: int) -> _Span:
        """Early span ``span`` of the push to ``rank`` (decided) encoded into the send buffer after the
        spans before it; once a push (a relay chain's members share it)."""
        import torch

        work = self._works[rank]
        pt = work.spans[span]
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
            mark("source %d: span %d encode queued", self.rank, span)
            torch.cuda.current_stream(self.device).synchronize()  # the engine reads the send buffer
        self._spent("finalize", t0)
        return pt

    def finalize(self, rank: int) -> DeltaWork:
        """The final span of ``rank``'s push (every early span is decided and encoded by now): the staged
        writes' streams, the entries (the tail's last) and the stream table, after the early spans;
        returns the work with its final figures."""
        import torch

        work = self._works[rank]
        if work.final:
            return work  # a relay chain member: the lead's payload, encoded once
        for span in range(SPANS):  # spans no destination asked for (a push that posted none)
            self.decide(rank, span)
            self.encode_span(rank, span)
        t0 = time.perf_counter()
        ib = self.inboxes[rank]
        work.final_at = work.at
        if ib.planned_only:
            work.final_bytes, work.entries = 0, 0  # the header says ALL_PLANNED
        else:
            work.final_bytes, work.entries = self._encode(ib, work.final_at, ib.capacity, work.rows, {},
                                                          work.pieces, ib.fixed)
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
        """One span's payload written at byte ``at0`` of the send buffer, with room for ``cap`` entries:
        per word size its stream (the sparse direct writes of ``direct``: space, _FLAT_DTYPE and _HIT_DTYPE
        rows by start, their entries' rows in ``blocks[0]``; then the sparse staged ``pieces``), the
        stream table and the entries (``blocks`` then ``tail``). Returns (bytes, entries); (0, 0) for a
        span without entries (nothing is written or sent)."""
        entries = np.concatenate([*blocks, tail]) if blocks or len(tail) else np.zeros(0, ENTRY_DTYPE)
        if len(entries) > cap:
            raise WeightSyncError(f"internal: {len(entries)} delta entries for destination {ib.rank}, room "
                                  f"for {cap}")
        if not len(entries):
            return 0, 0
        streams = np.zeros(len(WORDS), STREAM_DTYPE)
        streams["word"] = WORDS
        at = data_at(cap)  # from the span's start
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
        collect's scratch, else :func:`weightsync.delta.cuda.encode_runs`; per-run ops would cost host
        time per run, on the push's critical path). The runs are found by numpy ops over all writes (a
        Python loop over them would cost host time per write, on the last span's path). Returns
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
        # (one slice of its changed positions); each group's changes, and where they start among the span's.
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
                tile_range = tiles.tile_range(int(f["start"][first[groups]].min()),
                                        int((f["start"][last[groups]] + f["extent"][last[groups]]).max()))
                tiles.encode(runs, tile_range, target, values, counts, bitmap)
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
        this source's share of its inbox (None where none did): some of them, or all of them where the
        share cannot hold even the entry tables (told of the destination whose inbox sets the share)."""
        work, ib = self._works.get(rank), self.inboxes.get(rank)
        if ib is not None and ib.planned_only and rank == ib.bound_by:
            chain = " (a relay chain's members take the same entries: the whole chain takes them so)" \
                if ib.relay else ""
            return (f"destination {rank}'s delta inbox gives each of {ib.sources} sources {ib.share} bytes, "
                    f"less than the {ib.tables} bytes of this source's entry tables: it takes every write "
                    f"of this source as planned{chain}; Destination(delta_bytes="
                    f"{suggested_inbox(ib.tables, ib.sources)}) would take deltas")
        if work is None or ib is None or not work.overflow_bytes:
            return None
        wanted = suggested_inbox(ib.share + work.overflow_stream_bytes, ib.sources)
        return (f"destination {rank}'s delta inbox had no room left for the changes of {work.overflow_bytes} "
                f"bytes of writes, which went as planned; as streams they would have taken about "
                f"{work.overflow_stream_bytes} bytes more of this source's {ib.share}-byte share: "
                f"Destination(delta_bytes={wanted}) "
                "would have held them (docs/DELTA.md, 'Sizing the inbox')")

    def share(self, work: DeltaWork, ranks: Sequence[int]) -> None:
        """A relay chain: the lead's work (:meth:`begin`) is also that of members ``ranks``."""
        for r in ranks:
            self._works[r] = work

    def header(self, rank: int, epoch: int, version: int, work: DeltaWork, span: int | None = None) -> int:
        """Fills the header record of ``rank``'s final span (``span`` None) or of early span ``span`` in
        the outbox; returns its slot (the same slot of the destination's header array, less this
        source's rank plus ``rank``: :func:`header_slot`)."""
        ib = self.inboxes[rank]
        slot = header_slot(rank, span)
        if span is None and ib.planned_only:
            self.headers[slot] = (epoch, version, work.imms, ib.chunks[0], 0, ALL_PLANNED, 0, ib.chunks[1])
        elif span is None:
            self.headers[slot] = (epoch, version, work.imms, ib.offset + work.final_at, work.final_bytes,
                                  work.entries, work.changed, ib.capacity)
        else:
            pt = work.spans[span]
            self.headers[slot] = (epoch, version, pt.imms, ib.offset + pt.at, pt.nbytes, len(pt.rows),
                                  pt.changed, len(pt.rows))
        return slot

    # -- the push's face (weightsync.runtime.push), in the protocol's order: load (a plan epoch), start
    # and overlap_grants (announce), has_inbox, lead, begin, share (grants), decide (rounds), chunk and
    # staged (staging), post_span (spans), post_finals and compare_all (tails), finish (acks), stats and
    # overflow_note (stats). The other members serve these and the tests.
    def has_inbox(self, rank: int) -> bool:
        """Whether destination ``rank`` takes deltas (has an inbox in this plan epoch)."""
        return rank in self.inboxes

    def post_span(self, rank: int, epoch: int, version: int, span: int, peer: Any,
                  failed: dict[int, str]) -> list[tuple[int, Any]]:
        """Early span ``span`` of ``rank``'s delta: its payload (entries and encoded changes; none for a
        span without writes), then its header, each with the span's own immediate. Nothing orders the
        two on the wire: the destination reads the payload only once the immediates the header
        announces are in. A failed post is recorded in ``failed``."""
        pt = self.encode_span(rank, span)
        self.header(rank, epoch, version, self._works[rank], span)
        ib = self.inboxes[rank]
        out: list[tuple[int, Any]] = []
        try:
            if pt.nbytes:
                imm = delta_part_imm(epoch, version, span, header=False)
                out.append((rank, self.engine.write(ib.region, pt.at, peer, ib.payload, ib.offset + pt.at,
                                                    pt.nbytes, imm=imm)))
            out.append((rank, self._post_header(rank, epoch, version, peer, span)))
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

    def _post_header(self, rank: int, epoch: int, version: int, peer: Any, span: int | None = None) -> Any:
        """Posts the header record of ``rank``'s final span (``span`` None) or early span ``span``."""
        hdr = self.headers.itemsize
        imm = delta_header_imm(epoch, version) if span is None else \
            delta_part_imm(epoch, version, span, header=True)
        return self.engine.write(self.header_region, header_slot(rank, span) * hdr, peer,
                                 self.inboxes[rank].header, header_slot(self.rank, span) * hdr, hdr, imm=imm)

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
        push does not wait for them (they overlap the destinations' apply of their last span): the next
        compare, or anything else that touches the reference
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
        # A span left uncompared would leave its spaces' reference behind: the next push is then dense.
        whole = self.base < 0 or len(self._compared) == SPANS
        self._chunk_changed, self._hits, self._compared = {}, {}, set()
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()  # not the side stream
        self.ref_version = version if ok and whole and self.enabled and self._referenced else -1
        self.phases["finish"] = time.perf_counter() - t0
        self.encode_seconds += self.phases["finish"]
