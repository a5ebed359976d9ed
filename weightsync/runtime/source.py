"""A trainer rank's side of a push: ``Source`` (its ``push`` method) and ``PushStats``.

A push, from one source's point of view (every source does this at the same time, SPMD):

1. fetch a new plan part only if the coordinator's epoch moved (membership changed): the source's epoch
   watcher (a thread long-polling the coordinator) keeps the epoch at hand, so this costs no round trip
   unless the watcher is unhealthy;
2. per destination write a 24-byte *announce* (weightsync.wire.ANNOUNCE_RECORD: epoch, version) into
   its mailbox slot with immediate ``ANNOUNCE``, and wait for its *grant* (weightsync.wire.GRANT_RECORD,
   read only once its immediate ``grant_imm(rank, version)`` is in): the destination decides whether it
   takes the version (newer than what it holds, of its plan) and into which shadow, and raises
   ``updating`` before it grants, so no byte is written before that. The first staged chunks are
   prepared while the grants travel;
3. post the direct writes (contiguous or 2-D, no transform) into the granted shadows round by round
   with immediate ``data_imm(epoch, version)``;
4. run the staged chunks (weightsync.runtime.staging): gathers of FP8 tile rows other sources own
   first, then packed blocks and casts, then FP8 units, each chunk prepared while the previous ones
   are written;
5. wait for the local completion of every batch, then for each destination's *ack*
   (weightsync.wire.ACK_RECORD) with immediate ``ACK`` (and, as a provider of gathers, for the
   gatherers' ``GATHERED``).

Versions must increase: a version not newer than the last one this source pushed is refused at once,
and one not newer than what a destination holds is refused by that destination's grant (a restarted
trainer): nothing is written to it, and the push raises ``WeightSyncError`` saying so.

Failures: a destination whose writes fail or that does not grant or ack within the timeout is reported in
``PushStats.failed_destinations`` (the push does not raise for it) and reported to the coordinator, which
re-plans without it; the other destinations still complete. If no destination acks at all, or a source
is missing (every destination waits for all sources), the push raises ``weightsync.TimeoutError``; if the
plan has no destination left (all dropped, none joined again), it raises ``WeightSyncError`` at once.
Reported are only destinations with evidence against them: a write to it that failed, or its silence while
another destination acked. When none acked, silence is no evidence (a source may be what is missing, or
the destinations are stopped, not dead), so each silent destination gets one more write, a probe (see
``_probe``): a destination whose process died after its announce (or every write it granted) landed is
reported once its probe fails; a stopped one's probe does not fail, and it is kept.

Delta pushes (``Source(delta=True)``, weightsync.delta.sender): the source keeps what it last pushed; a
destination with a delta inbox whose grant says it holds that version gets, per planned write, either the
write or only its changed words (encoded into the inbox, with a header posted like a tail); every other
destination gets the push dense.

Non-blocking: ``push_async`` (``ws.push_async``) runs the same push in a thread of its own and returns a
``PushHandle`` (weightsync.runtime.push_handle) at once; ``push`` is ``push_async`` and ``wait`` without the
thread. One push per source at a time: a push started while another is in flight is refused with
``WeightSyncError`` (nothing written, its version still free). Each push holds back one write per
destination (its tail, from a private copy) until it has checked that none of its tensors changed while
it read them (push_handle's doc); ``wait_pushed`` and ``guard`` are what the trainer calls before
``optimizer.step()``.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from weightsync.delta import SPANS, DeltaSender, DeltaWork
from weightsync.engine import Region, TransferEngine
from weightsync.errors import TimeoutError, TransportError, WeightSyncError  # noqa: A004
from weightsync.plan.lower import ChunkGroup, Round, SourceProgram, source_program
from weightsync.plan.parts import DESTINATION, SOURCE, EngineInfo, SourcePart
from weightsync.plan.writes import DEFAULT_CHUNK_BYTES, MIN_CHUNK_BYTES
from weightsync.runtime.links import DestinationLink, PeerLink
from weightsync.runtime.participant import Participant, contiguous
from weightsync.runtime.push_handle import CLOSE_WAIT_S, PushHandle, PushWorker, watched_tensors
from weightsync.runtime.staging import Staging
from weightsync.runtime.trace import mark
from weightsync.wire import (
    ACK,
    ACK_RECORD,
    ANNOUNCE,
    ANNOUNCE_RECORD,
    EMPTY,
    GRANTED,
    MAX_SLOTS,
    REFUSED_EPOCH,
    SLOT_BYTES,
    data_imm,
    gathered_imm,
    grant_imm,
    grant_slot,
    relay_version_bits,
)

ROUNDS_IN_FLIGHT = 2  # direct-write rounds a source keeps posted: one running, one queued behind it
# Rounds into peers whose lane runs copies in the order they are posted (the cuda lane, one stream by
# default) are not held back: posting ahead keeps the schedule, and waiting costs a bubble per round
# (scenario 2's 75 MB cross rounds take 0.19 ms on H100, about a wake-up and a post). None: no limit.
ORDERED_ROUNDS_IN_FLIGHT: int | None = None
DEFAULT_CPU_STAGING = 256 << 20
GRANT_SLICE_S = 0.02  # between looks at announce transfers that failed (a dead destination)
# Each destination's grant has a counter of its own and a wait watches one: while several are pending,
# the one watched is changed this often, so that another's grant is seen at most this late (it only
# matters while one is slow: when every destination answers at once, each wait returns at its arrival).
GRANT_TURN_S = 0.002
# Once the first destination has answered, how much longer the others get before the writes start
# without them (they are then served as their grants come in): at least this, or twice the first's time.
GRANT_GRACE_S = 0.05
# When no destination acked, how long the probes of the silent ones get (at most the push's timeout): a
# destination whose process is gone answers a write with a refused connection or a reset at once, from its
# host's kernel; one that does not answer in this time (stopped, or its host gone) is kept, as before.
PROBE_WAIT_S = 2.0
TAIL_ALIGN = 256  # tails' places in the snapshot buffer (alignment the copy engines like)


def keeps_posting_order(peer: Any) -> bool:
    """Whether writes to ``peer`` run as one queue in the order they are posted, so that posting every
    round at once keeps the plan's schedule: the cuda lane (copies on one stream by default). A NIC lane
    stripes writes over several NICs and paths, which finish in any order."""
    return peer.lane == "cuda"


@dataclass
class PushStats:
    """What one source's push did. Times are seconds; ``gbps`` is GB/s of this source's bytes."""

    version: int
    bytes: int
    seconds: float
    gbps: float
    writes: int
    destinations: list[int]
    failed_destinations: list[int] = field(default_factory=list)
    phases: dict[str, float] = field(default_factory=dict)
    epoch: int = 0
    prepare_seconds: float = 0.0      # packing, casting, quantizing into staging (overlaps the writes)
    grant_seconds: float = 0.0        # announces posted to the destinations' grants in (the writes wait)
    write_seconds: float = 0.0        # first write posted to the last one completed locally
    peak_staging_bytes: int = 0       # most staging bytes held at once (never above the watermark)
    staging_limit_bytes: int = 0      # the watermark
    chunks: int = 0                   # staged chunks written
    gather_bytes: int = 0             # FP8 tile rows this source received from other sources
    relayed: list[int] = field(default_factory=list)  # destinations reached through the relay chain
    # Delta pushes (Source(delta=True), weightsync.delta.sender). ``bytes`` stays what the destinations
    # received (the dense size); ``wire_bytes`` is what crossed the wire for it (encoded changes, entries,
    # writes sent as planned): equal to ``dense_bytes`` in a dense push.
    wire_bytes: int = 0
    dense_bytes: int = 0
    changed_fraction: float = -1.0    # changed words / compared words of the delta destinations (-1: none)
    encode_seconds: float = 0.0       # compare, encode and reference update on this source
    apply_seconds: float = 0.0        # the slowest destination's scatter of the changes (its ack says)
    delta_ref_bytes: int = 0          # the reference this source keeps (what it last pushed)
    # The compare's outputs and scratch of this push, beside the reference (on a GPU every span's compare
    # is launched at the push's start: all of it alive at once; on CPU kept from push to push)
    delta_scratch_bytes: int = 0
    delta_destinations: list[int] = field(default_factory=list)  # destinations sent a delta this push
    # bytes of writes sent as planned though their changes would have gone smaller: the destination's
    # inbox (Destination(delta_bytes=...)) had no room left in this source's share (logged once per
    # destination)
    delta_overflow_bytes: int = 0


@dataclass(frozen=True)
class _Tail:
    """The write a push holds back for one destination until it has checked its tensors: where its bytes
    come from (``chunk`` -1: a direct write reading local tensor ``key`` at ``src_off``; else staged chunk
    ``chunk`` at ``src_off`` inside it), where they are kept (``snap_off``, ``span`` bytes of the snapshot
    buffer) and the write itself, as the plan made it (same size and rows: same immediates)."""

    rank: int
    chunk: int
    key: str
    src_off: int
    snap_off: int
    span: int
    dst_index: int
    dst_off: int
    nbytes: int  # per row
    imm: int | None  # the plan's relay immediate, or None: the version's data immediate
    rows: int | None = None
    src_pitch: int = 0
    dst_pitch: int = 0


def _byte_view(t: Any) -> Any:
    """A flat uint8 torch view of a contiguous local tensor (torch or numpy)."""
    import torch

    if isinstance(t, np.ndarray):
        return torch.from_numpy(np.ascontiguousarray(t).reshape(-1).view(np.uint8))
    return t.detach().reshape(-1).view(torch.uint8)


def _without(r: Round, i: int) -> Round | None:
    """Round ``r`` less its write ``i`` (None if nothing is left)."""
    keep = np.ones(len(r.nbytes), dtype=bool)
    keep[i] = False
    if not keep.any():
        return None
    return Round(r.rank, r.src_index[keep], r.src_off[keep], r.dst_index[keep], r.dst_off[keep],
                 r.nbytes[keep], None if r.imms is None else r.imms[keep],
                 tuple(None if g is None else g[keep] for g in r.geometry))  # type: ignore[arg-type]


def _subset(r: Round, keep: np.ndarray) -> Round:
    """Round ``r`` with only its writes ``keep`` (a boolean mask)."""
    return Round(r.rank, r.src_index[keep], r.src_off[keep], r.dst_index[keep], r.dst_off[keep],
                 r.nbytes[keep], None if r.imms is None else r.imms[keep],
                 tuple(None if g is None else g[keep] for g in r.geometry))  # type: ignore[arg-type]


def _settle(rank: int, transfer: Any, deadline: float, failed: dict[int, str]) -> None:
    """Waits for one posted batch to destination ``rank``; a failure marks the destination failed."""
    try:
        transfer.wait(max(deadline - time.monotonic(), 0.0))
    except (TransportError, TimeoutError) as exc:
        failed.setdefault(rank, str(exc))


class _Grants:
    """One push's grants: which destinations answered, with which shadow or refusal, and the gate the
    data writes wait behind (``open``: the direct rounds of every destination granted by then are posted;
    ``late``: destinations granted after it, served as their grants arrive)."""

    def __init__(self, src: Source, version: int, deadline: float, announces: list[tuple[int, Any]],
                 failed: dict[int, str], post_rounds: Callable[[set[int]], None],
                 commit: Callable[[set[int]], None]) -> None:
        self.src = src
        self.version = version
        self.deadline = deadline
        self.failed = failed
        self.post_rounds = post_rounds
        self.commit = commit  # the tails of destinations whose other writes are all posted
        self.stopped = False  # the push failed its check: serve no more late destinations
        self.announces = dict(announces)
        # Per destination, the counter of its grant's immediate: its slot is read only once a credit is in.
        # Its credits are not dropped here: a destination grants a version to all its sources at the first
        # announce of it, so the grant can be in before this source has announced.
        self.counters = {r: src.engine.counter(grant_imm(r, version)) for r in src._dests}
        self.credited: set[int] = set()  # credit taken by a wait, slot not read yet
        self.turn = 0  # which pending destination's counter the next wait watches
        self.pending = {r for r in src._dests if r not in failed}
        self.granted: dict[int, int] = {}  # rank -> shadow
        self.bases: dict[int, int] = {}  # rank -> the version a delta into its shadow may be taken on
        self.refused: dict[int, str] = {}  # not newer / busy: nothing written, the push raises
        self.stale: set[int] = set()  # another plan epoch: failed for this push, not reported
        self.opened: set[int] | None = None  # destinations written from the start
        self.ungranted: set[int] = set()  # no answer by the deadline
        self.started = time.monotonic()
        self.seconds = 0.0

    def _poll(self) -> list[int]:
        """Reads the grant slots of the destinations still pending; returns those newly granted."""
        src, v = self.src, self.version
        newly = []
        for r in sorted(self.pending):
            # The slot only once the immediate of the write that filled it is in: until then it may hold
            # any mix of this record's bytes and the last one's, version included (the counter's lock
            # also orders the reads below after the engine thread's count, on a weakly ordered CPU).
            credited = self.counters[r].reset() > 0 or r in self.credited
            self.credited.discard(r)
            g = src._grant_box[grant_slot(r, v) - MAX_SLOTS]
            # Credit beside another version: a late grant of an earlier version with the same low bits.
            if credited and int(g["version"]) == v:
                epoch, status = int(g["epoch"]), int(g["status"])
                if epoch < src.epoch or (epoch == src.epoch and status == REFUSED_EPOCH):
                    pass  # an answer to an announce of an earlier plan
                elif epoch > src.epoch:
                    self.pending.discard(r)
                    self.stale.add(r)
                    self.failed[r] = (f"destination {r} holds plan epoch {epoch}, this source {src.epoch}: "
                                      "nothing written (the next push uses the new plan)")
                    continue
                elif status == GRANTED:
                    self.pending.discard(r)
                    self.granted[r] = int(g["shadow"])
                    self.bases[r] = int(g["held"])
                    d = src._dests[r]
                    d.descs = d.descriptors(int(g["shadow"]))
                    newly.append(r)
                    continue
                else:
                    self.pending.discard(r)
                    self.refused[r] = (f"group {src.group!r}: version {v} is not newer than version "
                                       f"{int(g['held'])} that destination {r} holds or is landing; versions "
                                       "must increase (nothing was written to it)")
                    continue
            t = self.announces.get(r)
            if t is not None and t.done:
                try:
                    t.wait(0.0)
                except (TransportError, TimeoutError) as exc:  # the announce failed: no grant will come
                    self.pending.discard(r)
                    self.failed.setdefault(r, str(exc))
        return newly

    def _step(self, until: float) -> list[int]:
        newly = self._poll()
        if self.pending and not newly:
            left = until - time.monotonic()
            if left > 0:
                pending = sorted(self.pending)
                r = pending[self.turn % len(pending)]
                self.turn += 1
                turn = GRANT_SLICE_S if len(pending) == 1 else GRANT_TURN_S
                try:
                    self.counters[r].wait(1, timeout=min(turn, left))
                    self.credited.add(r)
                except TimeoutError:
                    pass
                newly = self._poll()
        return newly

    def open(self) -> None:
        """Waits for the grants (every destination's, or, once one answered, a grace for the others),
        then posts the direct rounds of the destinations granted. Idempotent."""
        if self.opened is not None:
            return
        until = self.deadline
        first = None
        while self.pending and time.monotonic() < until:
            self._step(until)
            if first is None and (self.granted or self.refused):
                first = time.monotonic()
                until = min(self.deadline, first + max(GRANT_GRACE_S, 2 * (first - self.started)))
        self.seconds = time.monotonic() - self.started
        self.opened = set(self.granted)
        if self.opened:
            self.post_rounds(self.opened)

    def prepared(self, chunk: int, view: Any) -> None:
        """Staged chunk ``chunk`` is prepared in ``view`` (its staging slot): keeps the bytes of the tails
        it holds (weightsync.runtime.staging calls this before it posts the chunk's writes), and compares
        it with what the last push sent (delta pushes)."""
        self.src._snapshot_staged_tails(chunk, view)
        self.src._delta.chunk(chunk, view)

    def staged(self, rank: int, chunk: int, src_off: np.ndarray, di: np.ndarray, dst_off: np.ndarray,
               nbytes: np.ndarray) -> np.ndarray | None:
        """Which of staged chunk ``chunk``'s writes into ``rank`` go as planned (None: all of them); the
        others travel in its delta payload (weightsync.delta.sender)."""
        return self.src._delta.staged(rank, chunk, src_off, di, dst_off, nbytes)

    def allowed(self, rank: int) -> bool:
        """Whether ``rank`` is written from the start (granted when the gate opened)."""
        return self.opened is not None and rank in self.opened

    def late(self) -> Iterator[int]:
        """Destinations granted after the gate opened, as their grants arrive (until the deadline): their
        direct rounds are posted before each is yielded (the caller posts its staged chunks), and its
        tail once the caller asks for the next one. The destinations of the open gate get their tails
        first: every staged chunk of theirs is prepared by now (a late grant must not hold them up)."""
        self.open()
        self.commit(self.opened or set())
        while self.pending and not self.stopped and time.monotonic() < self.deadline:
            for r in self._step(self.deadline):
                self.post_rounds({r})
                yield r
                self.commit({r})
        self.ungranted |= self.pending
        self.pending = set()
        # Grants that come after this (past the deadline) must not count for a version 256 later.
        for counter in self.counters.values():
            counter.reset()


class Source(Participant):
    """A trainer rank: holds (shards of) the weights and pushes them. See ``push``.

    ``staging_bytes`` is the watermark of the staging pool (packed blocks, casts, FP8 tiles and gathers
    are prepared there, one chunk per slot, and written from there): by default 5% of the GPU's memory
    when the tensors are on a GPU, 256 MiB otherwise. ``chunk_bytes`` (default: 8 MiB, 256 MiB on a
    GPU, at most half the watermark) is the largest staged write; the coordinator lowers this source's
    ops with it.
    """

    role = SOURCE
    inbox_record = ACK_RECORD  # destinations ack into this source's mailbox
    outbox_record = ANNOUNCE_RECORD  # and it announces from its outbox
    grant_slots = 2 * MAX_SLOTS  # destinations grant into grant_slot(rank, version)

    def __init__(self, group: str, rank: int, tensors: Mapping[str, Any], *, timeout: float = 120.0,
                 engine: TransferEngine | None = None, secret: str | None = None,
                 staging_bytes: int | None = None, chunk_bytes: int | None = None,
                 one_writer_at_a_time: bool = False, delta: bool = False) -> None:
        import torch

        super().__init__(group, rank, tensors, timeout, engine, secret)
        live = {key: contiguous(self._local_tensor(key), key) for key in self.tensors}
        # What a push checks, and what it sends: host tensors from a private copy (push_handle's doc).
        self._watched = watched_tensors(self.tensors, live)
        self._locals: dict[str, Any] = self._watched.sent(live)
        self._regions: dict[str, Region] = {key: self.engine.register(local, name=key)
                                            for key, local in self._locals.items()}
        first = next(iter(self._locals.values()))
        self.device = first.device if isinstance(first, torch.Tensor) else torch.device("cpu")
        self._bytes = {key: _byte_view(local) for key, local in self._locals.items()}
        # Pushes: one at a time (``_last_push`` until it is done); a background push's staging kernels run
        # on a stream of its own, not on the trainer's.
        self._push_lock = threading.Lock()
        self._last_push: PushHandle | None = None
        self._push_worker: PushWorker | None = None  # background pushes' thread, from the first one on
        self._closing = False
        # Every push's own device work (the tails' snapshot, a delta's order and encode kernels) runs on
        # this stream, at a higher priority than the delta compare's (weightsync.delta.sender.
        # DeltaSender.prefetch): a span's encode is not queued behind the next span's compare, whose
        # blocks would otherwise fill the device first.
        self._push_stream = (torch.cuda.Stream(self.device, priority=-1) if self.device.type == "cuda"
                             else None)
        self._tails: dict[int, _Tail] = {}
        self._staged_tails: dict[int, list[_Tail]] = {}
        self._snap: Any = None
        self._snap_region: Region | None = None
        if staging_bytes is None:
            if self.device.type == "cuda":
                staging_bytes = torch.cuda.get_device_properties(self.device).total_memory // 20
            else:
                staging_bytes = DEFAULT_CPU_STAGING
        self.staging_limit = int(staging_bytes)
        # Staged chunks in one pass per destination (see Staging._passes). Off by default: on 4 x H100
        # the 8B FP8 push took 103 ms with it against 65 ms without (the second pass re-prepares every
        # chunk and waits for its slot), more than the contention it avoids (docs/BENCHMARKS.md).
        self.one_writer_at_a_time = bool(one_writer_at_a_time)
        if chunk_bytes is None:
            # On a GPU, fewer and larger chunks: the copy engine and the quantization kernels want
            # large pieces, and each chunk costs a few Python calls and a stream synchronization.
            default = DEFAULT_CHUNK_BYTES * 32 if self.device.type == "cuda" else DEFAULT_CHUNK_BYTES
            chunk_bytes = min(default, self.staging_limit // 2)
        self.chunk_bytes = int(chunk_bytes)
        if self.chunk_bytes < MIN_CHUNK_BYTES or self.chunk_bytes > self.staging_limit:
            raise WeightSyncError(
                f"group {group!r}: source rank {rank}: staging watermark {self.staging_limit} bytes and "
                f"chunk {self.chunk_bytes} bytes: a chunk must be at least {MIN_CHUNK_BYTES} bytes and "
                f"fit the watermark")
        self._staging = Staging(self.engine, self._control, self.rank, self.device, self.staging_limit,
                                self._locals, self._outbox_region, self.log)
        self._dests: dict[int, DestinationLink] = {}
        # Delta pushes: the reference of what this source last pushed, and the inboxes of destinations
        # that take deltas (those get a header per version from every source, delta or not).
        self._delta = DeltaSender(self.engine, self._locals, self.device, self.rank, bool(delta))
        self._overflow_told: set[int] = set()  # destinations told their inbox was too small (logged once)
        self._last_version = -1  # the last version this source pushed (versions must increase)
        self._watcher: Any = None
        self._epoch_fallbacks = 0  # pushes that asked the coordinator for the epoch (watcher unhealthy)
        self._join({})
        self._watcher = self._control.start_watcher(self)

    def _engine_info(self) -> EngineInfo:
        # A GPU source's writes go over the cuda lane, where a 2-D copy reads strided rows at full speed:
        # no packing into staging for it (weightsync/plan/writes.py, ``pack_strided``).
        base = super()._engine_info()
        return EngineInfo(base.nics, base.stripe_threshold, base.max_piece, self.chunk_bytes,
                          self.device.type != "cuda")

    def _apply_part(self, part: SourcePart) -> None:
        program = self._hold_tails(source_program(part, list(self._regions), self.rank))
        self._part = part
        self._relay = part.relay
        gatherers = {r: PeerLink(g, self._peer(g.address)) for r, g in part.gatherers.items()}
        providers = {r: PeerLink(p, self._peer(p.address)) for r, p in part.providers.items()}
        self._gatherers, self._providers = gatherers, providers
        self._staging.load(part, program, gatherers, providers, self._timeout)
        # Per destination: its peer and descriptors (the shadow comes with each push's grant).
        self._dests = {}
        for rank, t in part.destinations.items():
            peer = self._peer(t.address)
            self._dests[rank] = DestinationLink(t, peer, program.batches[rank],
                                                ordered=keeps_posting_order(peer))
        self._direct_srcs = [self._regions[k] for k in program.src_keys]
        self._rounds: list[Round] = program.rounds
        self._delta.load(part, self._rounds, program.src_keys, self._tails, self._dests,
                         {r: b.dkeys for r, b in program.batches.items()}, part.plan.num_sources)
        staged = int((part.writes["staged"] == 1).sum())
        self.log.info("source %d: plan epoch %d, %d writes (%d staged in %d chunks), %d bytes to "
                      "destinations %s", self.rank, self.epoch, len(part.writes), staged,
                      len(part.chunks), part.bytes, sorted(self._dests))

    def _hold_tails(self, program: SourceProgram) -> SourceProgram:
        """Takes one write per destination out of ``program``: the push posts it only after checking that
        no tensor changed while it read them (weightsync.runtime.push_handle). The smallest direct write
        (by the bytes it spans), else, for a destination that gets only staged writes from this source,
        the smallest staged one; its bytes are copied into the snapshot buffer registered here."""
        import torch

        tails: dict[int, _Tail] = {}
        at = 0

        def place(span: int) -> int:
            nonlocal at
            off, at = at, at + -(-span // TAIL_ALIGN) * TAIL_ALIGN
            return off

        best: dict[int, tuple[int, int, int]] = {}  # rank -> (span, round, write)
        for ri, r in enumerate(program.rounds):
            rows, src_pitch, _ = r.geometry
            span = r.nbytes.astype(np.int64)
            if rows is not None:
                span = (rows.astype(np.int64) - 1) * src_pitch.astype(np.int64) + span
            i = int(np.argmin(span))
            if r.rank not in best or int(span[i]) < best[r.rank][0]:
                best[r.rank] = (int(span[i]), ri, i)
        rounds: list[Round | None] = list(program.rounds)
        for rank, (span, ri, i) in sorted(best.items()):
            r = program.rounds[ri]
            rows, src_pitch, dst_pitch = r.geometry
            two_d = rows is not None and int(rows[i]) > 1
            tails[rank] = _Tail(rank, -1, program.src_keys[int(r.src_index[i])], int(r.src_off[i]),
                                place(span), span, int(r.dst_index[i]), int(r.dst_off[i]), int(r.nbytes[i]),
                                None if r.imms is None else int(r.imms[i]),
                                int(rows[i]) if two_d else None,  # type: ignore[index]
                                int(src_pitch[i]) if two_d else 0,  # type: ignore[index]
                                int(dst_pitch[i]) if two_d else 0)  # type: ignore[index]
            rounds[ri] = _without(r, i)
        staged_best: dict[int, tuple[int, int, int, int]] = {}  # rank -> (bytes, chunk, entry, write)
        for c, (_, data) in enumerate(program.chunk_groups):
            for j, (rank, _src_off, _di, _dst_off, nbytes, _imms) in enumerate(data):
                if rank in tails or not len(nbytes):
                    continue
                i = int(np.argmin(nbytes))
                if rank not in staged_best or int(nbytes[i]) < staged_best[rank][0]:
                    staged_best[rank] = (int(nbytes[i]), c, j, i)
        groups: list[ChunkGroup] = [(g, list(d)) for g, d in program.chunk_groups]
        staged: dict[int, list[_Tail]] = {}
        for rank, (nb, c, j, i) in sorted(staged_best.items()):
            _, src_off, di, dst_off, nbytes, imms = groups[c][1][j]
            tail = _Tail(rank, c, "", int(src_off[i]), place(nb), nb, int(di[i]), int(dst_off[i]), nb,
                         None if imms is None else int(imms[i]))
            tails[rank] = tail
            staged.setdefault(c, []).append(tail)
            keep = np.arange(len(nbytes)) != i
            if keep.any():
                groups[c][1][j] = (rank, src_off[keep], di[keep], dst_off[keep], nbytes[keep],
                                   None if imms is None else imms[keep])
            else:
                groups[c][1][j] = None  # type: ignore[call-overload]
        groups = [(g, [e for e in d if e is not None]) for g, d in groups]
        if self._snap_region is not None:
            self.engine.deregister(self._snap_region)
            self._snap_region = None
        self._snap = torch.empty(max(at, 1), dtype=torch.uint8, device=self.device)
        self._snap_region = self.engine.register(self._snap, name=f"source {self.rank} push tails")
        self._tails, self._staged_tails = tails, staged
        return replace(program, rounds=[r for r in rounds if r is not None], chunk_groups=groups)

    def _snapshot_direct_tails(self) -> None:
        """Copies the bytes of the direct tails out of the live tensors (at the push's start)."""
        for t in self._tails.values():
            if t.chunk < 0:
                live = self._bytes[t.key][t.src_off:t.src_off + t.span]
                self._snap[t.snap_off:t.snap_off + t.span].copy_(live)

    def _snapshot_staged_tails(self, chunk: int, view: Any) -> None:
        for t in self._staged_tails.get(chunk, ()):
            self._snap[t.snap_off:t.snap_off + t.span].copy_(view[t.src_off:t.src_off + t.span])

    def _post_tails(self, imm: int, relay_bits: int, failed: dict[int, str], granted: Mapping[int, int]
                    ) -> list[tuple[int, Any]]:
        """Posts the tails of the destinations granted and not failed (they complete the version)."""
        out: list[tuple[int, Any]] = []
        for rank, t in sorted(self._tails.items()):
            if rank in failed or rank not in granted:
                continue
            d = self._dests[rank]
            geometry: tuple[Any, Any, Any] = (None, None, None)
            if t.rows is not None:
                geometry = (np.array([t.rows], np.uint64), np.array([t.src_pitch], np.uint64),
                            np.array([t.dst_pitch], np.uint64))
            try:
                out.append((rank, self.engine.write_batch(
                    [self._snap_region], d.descs, np.zeros(1, np.uint32), np.array([t.snap_off], np.uint64),
                    np.array([t.dst_index], np.uint32), np.array([t.dst_off], np.uint64),
                    np.array([t.nbytes], np.uint64),
                    np.array([imm if t.imm is None else t.imm | relay_bits], np.uint32), *geometry)))
            except TransportError as exc:
                failed[rank] = str(exc)
        return out

    def _plan_epoch(self, timeout: float) -> int:
        """The coordinator's plan epoch as this push must see it.

        From the epoch watcher, without a round trip. Like the round trip it replaces, it may lag a
        re-plan: a re-plan could always land just after the coordinator answered; now the lag is the
        long-poll's delivery (a one-way Ray reply, well under a push). Membership changes wait for the
        watchers to hear them before they return (Coordinator._await_watchers), so a push that starts
        after a join or report returned sees the new plan. A report this source made itself is awaited
        (its answer is the epoch after it); with the watcher unhealthy the coordinator is asked."""
        epoch = self._control.reported_epoch(timeout)
        heard = self._watcher.epoch() if self._watcher is not None else None
        if heard is None:
            self._epoch_fallbacks += 1
            heard = self._control.current_epoch(timeout)
        return max(epoch, heard)

    def close(self) -> None:
        """Stops the epoch watcher and closes the engine. A push in flight is cancelled (it fails, and no
        destination takes its version), unless it has already released its last writes: then it gets up
        to CLOSE_WAIT_S to finish."""
        with self._push_lock:
            self._closing = True
            h = self._last_push
        if h is not None and not h.done() and not h.cancel("the source was closed"):
            h.join(CLOSE_WAIT_S)
        if self._watcher is not None:
            self._watcher.stop()
        super().close()  # a cancelled push's waits end here (the engine fails them)
        if h is not None and not h.join(CLOSE_WAIT_S):
            self.log.warning("source %d: push of version %d still running %.0f s after close", self.rank,
                             h.version, CLOSE_WAIT_S)
        if self._push_worker is not None:
            self._push_worker.stop(1.0)  # ends at once unless the push above is still running

    # -- pushes in flight --------------------------------------------------------------------------
    def wait_pushed(self, timeout: float | None = None) -> PushStats | None:
        """Waits for this source's push (the one in flight, or the last one if nobody waited for it yet)
        and returns its ``PushStats`` or raises its error, as ``PushHandle.wait``; None if there is none.
        Call it before ``optimizer.step()``: a push reads the tensors until it ends."""
        h = self._last_push
        if h is None or (h.done() and h._observed):
            return None
        return h.wait(timeout)

    def guard(self, optimizer: Any, timeout: float | None = None) -> Any:
        """Makes every ``optimizer.step()`` wait for this source's push first (a step pre-hook calling
        ``wait_pushed``; the push's error, if any, is raised from the step). Returns the hook's handle
        (``.remove()`` undoes it)."""
        def before_step(_optimizer: Any, _args: Any, _kwargs: Any) -> None:
            self.wait_pushed(timeout)

        return optimizer.register_step_pre_hook(before_step)

    # -- the push ----------------------------------------------------------------------------------
    def push(self, version: int, timeout: float = 60.0) -> PushStats:
        """Writes the current contents of this source's tensors to every destination as ``version``.

        Called by every source rank (like a collective). Returns once every destination this source
        writes to has confirmed the complete version, or reports the ones that failed (see the module
        doc)."""
        return self._start(version, timeout, background=False).wait()

    def push_async(self, version: int, timeout: float = 60.0) -> PushHandle:
        """Starts ``push(version, timeout)`` in a thread of its own and returns its ``PushHandle`` at once.

        The tensors must not change until the push has ended (``handle.wait()``, ``wait_pushed()`` or
        ``guard(optimizer)`` before the next ``optimizer.step()``); a push that sees them change fails
        and no destination takes its version. Refused (``WeightSyncError``, nothing written) while
        another push of this source is in flight."""
        return self._start(version, timeout, background=True)

    def _start(self, version: int, timeout: float, background: bool) -> PushHandle:
        if not 0 <= version < 1 << 62:
            raise WeightSyncError(f"version {version} must be a non-negative integer")
        with self._push_lock:
            if self._closing:
                raise WeightSyncError(f"group {self.group!r}: source {self.rank} is closed")
            prev = self._last_push
            if prev is not None and not prev.done():
                raise WeightSyncError(
                    f"group {self.group!r}: source {self.rank}: version {version} refused, the push of "
                    f"version {prev.version} is still in flight (one push per source at a time: wait for "
                    "it with handle.wait() or src.wait_pushed() first; nothing was written)")
            if version <= self._last_version:
                raise WeightSyncError(f"group {self.group!r}: source {self.rank}: version {version} is not "
                                      f"newer than version {self._last_version} it pushed before; versions "
                                      "must increase (nothing was written)")
            self._last_version = version
            h = PushHandle(self, version, timeout, background)
            if background and self.device.type == "cuda":
                import torch

                # What the caller queued before this call (the optimizer step) must be done before the
                # engine reads the tensors: the push thread waits for this event, the caller does not.
                h._ready = torch.cuda.Event()
                h._ready.record(torch.cuda.current_stream(self.device))
            self._last_push = h
            if background and self._push_worker is None:
                self._push_worker = PushWorker(f"weightsync-{self.group}-push{self.rank}", self)
        h.start(self._push_worker)
        return h

    def _run_push(self, h: PushHandle) -> PushStats:
        """The push of ``h``, in its thread: on a GPU with the device and the push's own stream current,
        once the caller's last kernels are done."""
        if self.device.type != "cuda":
            return self._push_body(h)
        import torch

        with torch.cuda.device(self.device):
            if h.background:
                h._ready.synchronize()
            else:
                # The engine reads the tensors outside torch's streams: the caller's last update must be
                # done.
                torch.cuda.current_stream(self.device).synchronize()
            with torch.cuda.stream(self._push_stream):
                return self._push_body(h)

    def _push_body(self, h: PushHandle) -> PushStats:
        version, timeout = h.version, h.timeout
        t0 = time.perf_counter()
        deadline = time.monotonic() + timeout
        phases: dict[str, float] = {}
        # ">": the watcher may not have heard yet an epoch this source already fetched by itself.
        if self._plan_epoch(timeout) > self.epoch:
            self._fetch_part(max(deadline - time.monotonic(), 0.1))
        phases["plan"] = time.perf_counter() - t0
        if self._part.plan_destinations == 0:
            # Every destination was dropped (reported failed) and none has joined again: a push that
            # returned stats would read as "version delivered" while it reached nobody.
            raise WeightSyncError(f"group {self.group!r}: push of version {version} from source {self.rank} "
                                  f"reaches no destination: plan epoch {self.epoch} has none (every one was "
                                  "dropped as failed and none has joined again); nothing was written")

        t = time.perf_counter()
        # The delta compare first: on a GPU it is only launched, and the device reads the tensors while
        # the host snapshots the tails and announces; the grants travel meanwhile (nothing in a grant
        # depends on the compare; its outcome is used only once a grant is in). On CPU it runs once the
        # announces are out (overlap_grants).
        mark("source %d push %d: start", self.rank, version)
        self._delta.start()
        self._snapshot_direct_tails()
        works: dict[int, DeltaWork] = {}
        failed: dict[int, str] = {}
        announces = self._announce(version, failed)
        mark("source %d: announced", self.rank)
        self._delta.overlap_grants()
        transfers: list[tuple[int, Any]] = []
        imm = data_imm(self.epoch, version)
        relay_bits = relay_version_bits(version)

        chain = [r for r in self._relay if self._delta.has_inbox(r)]  # relay members with inboxes

        def post_rounds(ranks: set[int]) -> None:
            """The direct writes into ``ranks`` (just granted): those of destinations without an inbox at
            once; for the inbox destinations span by span, each span compared, decided, its writes as
            planned posted and its payload and header sent before the next span is compared (the
            destination scatters it meanwhile)."""
            owner: dict[int, int] = {}  # destination whose direct rounds are posted -> whose work decides
            if chain:
                lead = self._delta.lead
                assert lead is not None
                if lead not in works:  # at the gate: one work for the whole chain
                    # A delta only if every member holds the reference's version (each gets the same
                    # entries; the writes sent as planned reach all of them through the chain).
                    held = {grants.bases.get(r, -1) for r in self._relay}
                    base = held.pop() if len(held) == 1 and len(chain) == len(self._relay) else -1
                    work = self._delta.begin(lead, base, self._dests[self._relay[0]].batch.bytes)
                    self._delta.share(work, chain)
                    works.update(dict.fromkeys(chain, work))
                if self._relay[0] in ranks:
                    owner[self._relay[0]] = lead
                spanned = [r for r in chain if r in ranks and r not in failed]
                deciders = [lead]
            else:
                for r in sorted(r for r in ranks if self._delta.has_inbox(r)):
                    if r not in failed:  # its changes encoded against the version its grant says it holds
                        works[r] = self._delta.begin(r, grants.bases.get(r, -1), self._dests[r].batch.bytes)
                        owner[r] = r
                spanned = deciders = sorted(owner)
            mark("source %d: granted by %s", self.rank, sorted(ranks))
            plain = {r for r in ranks if r not in owner and not self._delta.has_inbox(r)}
            transfers.extend(self._post_rounds(imm, relay_bits, deadline, failed, plain))
            for span in range(SPANS):
                decided = {o: self._delta.decide(o, span) for o in deciders}
                keeps = {r: decided[o] for r, o in owner.items()}
                if keeps:
                    transfers.extend(self._post_rounds(imm, relay_bits, deadline, failed, set(keeps), keeps))
                mark("source %d: span %d decided", self.rank, span)
                for r in spanned:
                    if r not in failed:
                        peer = self._dests[r].peer
                        transfers.extend(self._delta.post_span(r, self.epoch, version, span, peer, failed))
                mark("source %d: span %d posted", self.rank, span)
            # The reference takes every change of this push, asked for or not (before the tensors' check).
            self._delta.compare_all()

        tails: list[tuple[int, Any]] = []
        committed: set[int] = set()
        sent_headers: set[int] = set()
        changed_error: list[WeightSyncError] = []  # raised once every write posted has completed locally

        def commit(ranks: set[int]) -> None:
            """Once the engine has read the live tensors for every write but the tails into ``ranks``
            (direct writes: until they complete locally; staged chunks: while they were prepared), checks
            that the tensors did not change since the push started (so neither did they meanwhile), then
            posts those tails from the snapshot: they let the destinations complete the version."""
            ranks = ranks - committed
            if not ranks or changed_error:
                return
            for rank, tr in transfers:
                if rank in ranks:
                    _settle(rank, tr, deadline, failed)
            h.check_cancelled()
            changed = h.changed()
            if changed:
                took = f"destinations {sorted(committed)} took it before" if committed else \
                    "no destination takes this version"
                grants.stopped = True
                changed_error.append(WeightSyncError(
                    f"group {self.group!r}: push of version {version} from source {self.rank} failed: "
                    f"tensors {changed[:5]}{' ...' if len(changed) > 5 else ''} changed while the push read "
                    "them (an optimizer step during the push? wait for it first: handle.wait(), "
                    f"src.wait_pushed() or src.guard(optimizer)); {took}"))
                return
            if self.device.type == "cuda":
                import torch

                torch.cuda.current_stream(self.device).synchronize()  # the tails' snapshot copies
            h.commit()
            committed.update(ranks)
            tails.extend(self._post_tails(imm, relay_bits, failed, ranks & set(grants.granted)))
            # Delta inboxes: the payload (every staged chunk of theirs is encoded by now), then the header
            # (the destination cannot count without it). A relay chain's are the head's: they wait for
            # its commit (the staged chunks are all written into the head).
            ready = (committed if self._relay[0] in committed else set()) if chain else ranks
            headed = [r for r in ready if r in works and r not in sent_headers]
            sent_headers.update(headed)
            tails.extend(self._delta.post_finals(headed, self.epoch, version, imm,
                                                 {r: self._dests[r].peer for r in headed}, failed))
            mark("source %d: committed, tails and final spans posted to %s", self.rank, sorted(ranks))

        grants = _Grants(self, version, deadline, announces, failed, post_rounds, commit)
        # The staged pipeline prepares its first chunks while the grants travel; its first post opens the
        # gate (the direct rounds go first), and it serves destinations granted late.
        staged = self._staging.run(version, deadline, self._dests, failed, self.one_writer_at_a_time, grants)
        for _ in grants.late():  # without staged chunks: the gate and the late ones' direct rounds
            pass
        for rank, tr in transfers + tails:
            _settle(rank, tr, deadline, failed)
        for rank, tr in announces:
            try:
                tr.wait(max(deadline - time.monotonic(), 0.0))
            except TransportError as exc:
                failed.setdefault(rank, str(exc))
            except TimeoutError:
                # Not sent yet (a stopped peer's socket is full, say): no evidence that it died, like a
                # missing grant or ack (judged below with the others).
                pass
        if changed_error:
            # Only now: a write of this version still in flight could land after the next version's.
            raise changed_error[0]
        # The delta reference takes this version's changes while the destinations apply theirs.
        self._delta.finish(version, ok=True)
        phases["grant"] = grants.seconds
        phases["write"] = time.perf_counter() - t
        phases["prepare"] = staged["prepare"]
        phases["gather_wait"] = staged["gather_wait"]

        t = time.perf_counter()
        waiting = {r for r in self._dests if r not in failed and r not in grants.refused}
        acked = self._await_acks(version, waiting, deadline)
        mark("source %d: acked by %s", self.rank, sorted(acked))
        phases["ack"] = time.perf_counter() - t
        for r in waiting - acked:
            failed[r] = (f"no grant of version {version} within {timeout} s" if r in grants.ungranted else
                         f"no confirmation of version {version} within {timeout} s")
        if not acked and waiting and not self._closing:
            # Silence is evidence only beside an ack; without one, a destination no write to it failed
            # may be dead all the same: its announce (and every write it granted) landed before it died,
            # and nothing more was written to find out. One more write to each tells dead from stopped.
            for r, why in self._probe(sorted(waiting), timeout).items():
                failed[r] = f"{failed[r]}, and a probe write to it failed: {why}"
                waiting.discard(r)  # a failed write: evidence against it (_report_failures)
        if self._closing and self.engine.closed:
            # Failures seen now may be the closing engine's doing: none is reported against a destination.
            raise WeightSyncError(f"group {self.group!r}: push of version {version} from source {self.rank}: "
                                  f"the source was closed before every destination confirmed it "
                                  f"(confirmed: {sorted(acked)})")

        seconds = time.perf_counter() - t0
        written = [r for r in self._dests if r not in failed and r not in grants.refused]
        nbytes = sum(self._dests[r].batch.bytes for r in written)
        delta_sent = [r for r in written if r in works and works[r].delta]
        wire = sum(works[r].wire_bytes if r in works else self._dests[r].batch.bytes for r in written)
        if chain and works:  # one work for the chain: its writes as planned go once, the payload to each
            work = works[chain[0]]
            wire = work.wire_bytes + work.payload_bytes * (sum(r in works for r in written) - 1)
        stats = PushStats(version=version, bytes=nbytes, seconds=seconds, gbps=nbytes / seconds / 1e9,
                          writes=sum(d.batch.writes for d in self._dests.values()),
                          destinations=sorted(self._dests), failed_destinations=sorted(failed),
                          phases=phases, epoch=self.epoch, prepare_seconds=staged["prepare"],
                          grant_seconds=grants.seconds,
                          write_seconds=phases["write"], peak_staging_bytes=int(staged["peak"]),
                          staging_limit_bytes=self.staging_limit, chunks=int(staged["chunks"]),
                          gather_bytes=int(self._staging.prep.received["nbytes"].sum()),
                          relayed=[r for r in self._relay[1:] if r in self._dests],
                          wire_bytes=wire, dense_bytes=nbytes,
                          apply_seconds=max([float(self._mailbox[r]["reserved"]) * 1e-6 for r in written
                                             if r in works] or [0.0]),
                          delta_destinations=delta_sent, **self._delta.stats(works, delta_sent))
        for r in delta_sent:
            note = self._delta.overflow_note(r) if r not in self._overflow_told else None
            if note is not None:
                self._overflow_told.add(r)
                self.log.warning("source %d, version %d: %s", self.rank, version, note)
        self._control.record_push(stats.seconds, stats.bytes)
        if failed:
            self._report_failures(version, timeout, failed, waiting, acked, grants.stale,
                                  bool(grants.refused))
        if grants.refused:
            r = min(grants.refused)
            others = f"; destinations {sorted(acked)} confirmed it" if acked else ""
            raise WeightSyncError(grants.refused[r] + others)
        return stats

    def _announce(self, version: int, failed: dict[int, str]) -> list[tuple[int, Any]]:
        """Forgets the previous push's acks, then announces (epoch, version) to every destination: it
        answers with a grant before any data is written."""
        # An ack is recognised by its version, and a stale slot must not pass for this push's (it did for
        # version 0 when slots started as zeros).
        for rank in self._dests:
            self._mailbox[rank] = (EMPTY, EMPTY, EMPTY)
        transfers: list[tuple[int, Any]] = []
        for rank, d in self._dests.items():
            self._outbox[rank] = (self.epoch, version, 0)
            d.descs = None
            try:
                transfers.append((rank, self.engine.write(
                    self._outbox_region, rank * SLOT_BYTES, d.peer, d.target.mailbox, self.rank * SLOT_BYTES,
                    SLOT_BYTES, imm=ANNOUNCE)))
            except TransportError as exc:
                failed[rank] = str(exc)
        return transfers

    def _post_rounds(self, imm: int, relay_bits: int, deadline: float, failed: dict[int, str],
                     ranks: set[int], keeps: Mapping[int, dict[int, np.ndarray] | None] | None = None
                     ) -> list[tuple[int, Any]]:
        """Posts the direct writes into destinations ``ranks`` round by round with at most
        ROUNDS_IN_FLIGHT posted per kind of lane: the plan's schedule gives each destination as few
        writers at a time as it can, and a source that posted every round at once would undo it (two
        writers into one GPU share its links: both go at half speed). Returns the batches still in
        flight."""
        in_flight: dict[bool, list[tuple[int, Any]]] = {False: [], True: []}  # by lane: keeps order or not
        for ri, r in enumerate(self._rounds):
            rank = r.rank
            if rank in failed or rank not in ranks:
                continue
            keep = (keeps or {}).get(rank)
            if keep is not None:  # a delta: only the writes it sends as planned
                mask = keep.get(ri)
                if mask is None or not mask.any():
                    continue
                if not mask.all():
                    r = _subset(r, mask)
            d = self._dests[rank]
            limit = (ORDERED_ROUNDS_IN_FLIGHT if d.ordered else ROUNDS_IN_FLIGHT) or len(self._rounds)
            queue = in_flight[d.ordered]
            while len(queue) >= limit:
                _settle(*queue.pop(0), deadline, failed)
            # Relay chunks: the plan's immediates with this version's bits (each version its own counters).
            imms = (np.full(len(r.nbytes), imm, dtype=np.uint32) if r.imms is None else
                    r.imms | np.uint32(relay_bits))
            try:
                queue.append((rank, self.engine.write_batch(
                    self._direct_srcs, d.descs, r.src_index, r.src_off, r.dst_index, r.dst_off, r.nbytes,
                    imms, *r.geometry)))
            except TransportError as exc:
                failed[rank] = str(exc)
        return in_flight[False] + in_flight[True]

    def _await_acks(self, version: int, waiting: set[int], deadline: float) -> set[int]:
        """Waits for the acks of ``version`` from ``waiting`` (and, as a provider of FP8 gathers, for the
        gatherers' GATHERED); returns the destinations that acked."""
        acks = self.engine.counter(ACK)
        acked: set[int] = set()
        while waiting - acked:
            try:
                acks.wait(1, timeout=min(max(deadline - time.monotonic(), 0.0), 0.5))
            except TimeoutError:
                if time.monotonic() >= deadline:
                    break
            for r in waiting - acked:
                slot = self._mailbox[r]
                if int(slot["version"]) == version:
                    acked.add(r)
        if self._gatherers:
            # The gatherers' receive buffers hold this version's rows until they have quantized them.
            self.engine.counter(gathered_imm(self.epoch, version)).wait(
                len(self._gatherers), max(deadline - time.monotonic(), 0.0))
        return acked

    def _probe(self, ranks: list[int], timeout: float) -> dict[int, str]:
        """Writes to each destination of ``ranks`` once more and returns those whose write failed, with
        why (the engine's error names the peer). The write rewrites the ``buffer`` field of this source's
        announce slot there, which every announce sets to 0 and no destination reads: harmless to a live
        destination, whatever it is doing and in whichever order it lands. Completion means delivered, so
        a stopped destination's probe neither completes nor fails within PROBE_WAIT_S: no evidence."""
        field_off = ANNOUNCE_RECORD.fields["buffer"][1]
        nbytes = ANNOUNCE_RECORD["buffer"].itemsize
        failed: dict[int, str] = {}
        probes: list[tuple[int, Any]] = []
        for rank in ranks:
            d = self._dests[rank]
            try:
                probes.append((rank, self.engine.write(
                    self._outbox_region, rank * SLOT_BYTES + field_off, d.peer, d.target.mailbox,
                    self.rank * SLOT_BYTES + field_off, nbytes)))
            except TransportError as exc:
                failed[rank] = str(exc)
        until = time.monotonic() + min(PROBE_WAIT_S, timeout)
        for rank, tr in probes:
            try:
                tr.wait(max(until - time.monotonic(), 0.0))
            except TransportError as exc:
                failed[rank] = str(exc)
            except TimeoutError:
                pass  # not delivered in time: stopped or slow, not known to be dead
        if probes or failed:
            mark("source %d: probed silent destinations %s, failed %s", self.rank, ranks, sorted(failed))
        return failed

    def _report_failures(self, version: int, timeout: float, failed: dict[int, str], waiting: set[int],
                         acked: set[int], stale: set[int], refused: bool) -> None:
        for r, why in sorted(failed.items()):
            self.log.warning("group %s: push %d to destination %d failed: %s", self.group, version, r, why)
        # Writes that failed (a probe's included) are evidence against the destination; a missing grant or
        # ack only when others acked (otherwise a source may be what is missing, or the destinations are
        # stopped). A destination of another plan epoch is not.
        dead = sorted(r for r in failed if (r not in waiting or acked) and r not in stale)
        if self._relay and acked:
            # A chain member that did not confirm starves the ones after it: only the first of them is
            # evidence of a failure (its predecessor confirmed); the others are healthy and stay.
            missing = [r for r in self._relay if r in failed and r in waiting]
            dead = sorted({r for r in failed if r not in waiting and r not in stale} | set(missing[:1]))
        if dead:
            # Not awaited here (the push's caller gets its answer now): the next push awaits it.
            self._control.report_dead(DESTINATION, dead, self.epoch)
        if not acked and not refused:
            raise TimeoutError(f"group {self.group!r}: push of version {version} from source {self.rank}: "
                               f"no destination confirmed within {timeout} s (destination {min(failed)}: "
                               f"{failed[min(failed)]})")


def push(src: Source, version: int, timeout: float = 60.0) -> PushStats:
    """Writes the current contents of ``src``'s tensors to every destination as ``version``
    (``src.push``). Called by every source rank (like a collective)."""
    return src.push(version, timeout)


def push_async(src: Source, version: int, timeout: float = 60.0) -> PushHandle:
    """Starts the push of ``version`` and returns its ``PushHandle`` at once (``src.push_async``):
    ``handle.wait()`` gives the ``PushStats`` of ``push``. Every source rank calls it, like ``push``; the
    tensors must not change until the push has ended (``src.guard(optimizer)`` enforces it)."""
    return src.push_async(version, timeout)
