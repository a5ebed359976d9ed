"""One push of one source, from its announces to its ``PushStats`` (``Push``; ``Source.push`` runs one).

Every source does this at the same time (SPMD), each for its own writes, once its plan part is current
(the source fetches a new one first if the coordinator's epoch moved):

1. *announce*: per destination a 24-byte record (weightsync.wire.ANNOUNCE_RECORD: epoch, version) into
   its mailbox slot with immediate ``ANNOUNCE``;
2. *grants*: each destination answers with a grant (weightsync.wire.GRANT_RECORD, read only once its
   immediate ``grant_imm(rank, version)`` is in, weightsync.runtime.grants): it decides whether it takes
   the version (newer than what it holds, of its plan) and into which shadow, and raises ``updating``
   before it grants, so no byte is written before that. The first staged chunks are prepared while the
   grants travel;
3. *rounds*: the direct writes (contiguous or 2-D, no transform) into the granted shadows round by round
   with immediate ``data_imm(epoch, version)``;
4. *spans* (delta pushes only): per span of the tensors, which direct writes go as planned and which as
   encoded changes, those changes' payload and header into the destination's inbox;
5. *chunks*: the staged chunks (weightsync.runtime.staging), gathers of FP8 tile rows other sources own
   first, then packed blocks and casts, then FP8 units, each chunk prepared while the previous ones are
   written;
6. *tails*: once the engine has read the tensors for every other write, the check that none of them
   changed (weightsync.runtime.push_handle), then one held-back write per destination
   (weightsync.runtime.tails) and a delta's final payload and header: only now can a destination
   complete the version;
7. *settle*: the local completion of every write;
8. *acks*: each destination's ack (weightsync.wire.ACK_RECORD) with immediate ``ACK`` (and, as a provider
   of gathers, the gatherers' ``GATHERED``);
9. *stats*: ``PushStats``, and the failed destinations reported to the coordinator.

Versions must increase: one not newer than what a destination holds is refused by its grant (a restarted
trainer): nothing is written to it, and the push raises ``WeightSyncError`` saying so.

Failures: a destination whose writes fail or that does not grant or ack within the timeout is reported in
``PushStats.failed_destinations`` (the push does not raise for it) and reported to the coordinator, which
re-plans without it; the other destinations still complete. If no destination acks at all, or a source
is missing (every destination waits for all sources), the push raises ``weightsync.TimeoutError``.
Reported are only destinations with evidence against them: a write to it that failed, or its silence while
another destination acked. When none acked, silence is no evidence (a source may be what is missing, or
the destinations are stopped, not dead), so each silent destination gets one more write, a probe (see
``Push.probe``): a destination whose process died after its announce (or every write it granted) landed is
reported once its probe fails; a stopped one's probe does not fail, and it is kept.

Delta pushes (``Source(delta=True)``, weightsync.delta.sender): the source keeps what it last pushed; a
destination with a delta inbox whose grant says it holds that version gets, per planned write, either the
write or only its changed words (encoded into the inbox, with a header posted like a tail); every other
destination gets the push dense. The push calls the delta sender through ``DeltaSteps`` alone.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, Protocol

import numpy as np

from weightsync.delta import SPANS, DeltaWork
from weightsync.engine import Region, TransferEngine
from weightsync.errors import TimeoutError, TransportError, WeightSyncError  # noqa: A004
from weightsync.plan.lower import Round
from weightsync.plan.parts import DESTINATION
from weightsync.runtime.grants import Grants
from weightsync.runtime.links import DestinationLink, PeerLink
from weightsync.runtime.push_handle import PushHandle
from weightsync.runtime.push_stats import PushStats
from weightsync.runtime.staging import Staging
from weightsync.runtime.tails import HeldTails, subset
from weightsync.runtime.trace import mark
from weightsync.wire import (
    ACK,
    ANNOUNCE,
    ANNOUNCE_RECORD,
    EMPTY,
    SLOT_BYTES,
    data_imm,
    gathered_imm,
    relay_version_bits,
)

ROUNDS_IN_FLIGHT = 2  # direct-write rounds a source keeps posted: one running, one queued behind it
# Rounds into peers whose lane runs copies in the order they are posted (the cuda lane, one stream by
# default) are not held back: posting ahead keeps the schedule, and waiting costs a bubble per round
# (scenario 2's 75 MB cross rounds take 0.19 ms on H100, about a wake-up and a post). None: no limit.
ORDERED_ROUNDS_IN_FLIGHT: int | None = None
# When no destination acked, how long the probes of the silent ones get (at most the push's timeout): a
# destination whose process is gone answers a write with a refused connection or a reset at once, from its
# host's kernel; one that does not answer in this time (stopped, or its host gone) is kept, as before.
PROBE_WAIT_S = 2.0


def keeps_posting_order(peer: Any) -> bool:
    """Whether writes to ``peer`` run as one queue in the order they are posted, so that posting every
    round at once keeps the plan's schedule: the cuda lane (copies on one stream by default). A NIC lane
    stripes writes over several NICs and paths, which finish in any order."""
    return peer.lane == "cuda"


class DeltaSteps(Protocol):
    """What a push asks of the source's delta sender (weightsync.delta.sender.DeltaSender), in the order it
    asks. A dense source's sender has no inbox destination and compares nothing."""

    lead: int | None  # in a relay chain: the member whose inbox holds the push's work

    def start(self) -> None: ...  # announce: the compare launched (GPU) or the first reference taken
    def overlap_grants(self) -> None: ...  # announce: what overlaps the grants' round trip
    def has_inbox(self, rank: int) -> bool: ...
    def begin(self, rank: int, base: int, dense_bytes: int) -> DeltaWork: ...  # grants: one work each
    def share(self, work: DeltaWork, ranks: Sequence[int]) -> None: ...  # a relay chain's one work
    def decide(self, rank: int, span: int) -> dict[int, np.ndarray] | None: ...  # rounds: as planned?
    def post_span(self, rank: int, epoch: int, version: int, span: int, peer: Any,
                  failed: dict[int, str]) -> list[tuple[int, Any]]: ...  # spans
    def compare_all(self) -> None: ...  # every span compared, before the tensors' check
    def chunk(self, c: int, view: Any) -> None: ...  # chunks: compared with its reference
    def staged(self, rank: int, c: int, src_off: np.ndarray, di: np.ndarray, dst_off: np.ndarray,
               nbytes: np.ndarray) -> np.ndarray | None: ...  # chunks: writes as planned
    def post_finals(self, ranks: Sequence[int], epoch: int, version: int, imm: int, peers: Mapping[int, Any],
                    failed: dict[int, str]) -> list[tuple[int, Any]]: ...  # tails
    def finish(self, version: int, ok: bool) -> None: ...  # acks: the reference takes the changes
    def stats(self, works: Mapping[int, DeltaWork], sent: Sequence[int]) -> dict[str, Any]: ...
    def overflow_note(self, rank: int) -> str | None: ...


class PushSource(Protocol):
    """What a push reads of its source (weightsync.runtime.source.Source): who it is, its engine and wire
    records, and its current plan part's destinations, rounds, tails, staging and delta sender."""

    group: str
    rank: int
    epoch: int
    engine: TransferEngine
    device: Any
    log: Any
    staging_limit: int
    one_writer_at_a_time: bool
    _closing: bool  # Source.close() has begun
    _control: Any  # its ControlClient: report_dead, record_push
    _mailbox: np.ndarray  # ACK_RECORD per destination rank
    _outbox: np.ndarray  # ANNOUNCE_RECORD per destination rank
    _outbox_region: Region
    _grant_box: np.ndarray
    _dests: dict[int, DestinationLink]
    _rounds: list[Round]
    _direct_srcs: list[Region]
    _relay: list[int]  # the relay chain (destination ranks, head first), empty without one
    _gatherers: dict[int, PeerLink]
    _held: HeldTails
    _staging: Staging
    _delta: DeltaSteps
    _overflow_told: set[int]  # destinations told their inbox was too small (logged once)


def _settle(rank: int, transfer: Any, deadline: float, failed: dict[int, str]) -> None:
    """Waits for one posted batch to destination ``rank``; a failure marks the destination failed."""
    try:
        transfer.wait(max(deadline - time.monotonic(), 0.0))
    except (TransportError, TimeoutError) as exc:
        failed.setdefault(rank, str(exc))


class Push:
    """One push of ``handle.version`` from source ``src``. ``run`` is the whole push; the calls it makes,
    directly or through Staging, in the order they run (the methods below are in this order; the module
    doc says what each step puts on the wire):

    1. ``announce``: the delta compare started, the direct tails' bytes snapshotted, every destination
       announced to; the grants are awaited from here on (``Grants``).
    2. ``Staging.run(..., gate=self)`` prepares the first staged chunks; its first post calls ``open``:
       the grants (every destination's, or the first's and a grace), then ``rounds`` for those granted.
    3. ``rounds``: their direct writes, and for delta destinations span by span the decided writes and
       the span's payload and header.
    4. Staging posts each chunk into the destinations ``allowed``, asking ``prepared`` (the tails' bytes,
       the delta's compare) and ``staged`` (which writes a delta sends as planned).
    5. ``late``: destinations granted after the gate opened, served as their grants arrive (``rounds``,
       then Staging's chunks, then ``tails``); the open gate's destinations get ``tails`` first.
    6. ``tails``: the check that no tensor changed, then the held-back writes and the delta's finals.
    7. ``settle``: every write completed locally; a changed tensor raises now; the delta reference
       updated.
    8. ``acks``: the destinations' acks; silent ones probed when none acked.
    9. ``stats``, then ``report``: failures to the coordinator; no ack at all or a refusal raises.

    ``failed`` (destination -> why) grows at every step: a destination in it gets no further write. The
    gate methods (``open``, ``prepared``, ``allowed``, ``staged``, ``late``) are what Staging asks of a push
    (weightsync.runtime.staging.Gate)."""

    def __init__(self, src: PushSource, handle: PushHandle, t0: float, deadline: float,
                 phases: dict[str, float]) -> None:
        self.src = src
        self.handle = handle
        self.version = handle.version
        self.timeout = handle.timeout
        self.t0 = t0  # the push's start (perf_counter), the plan epoch's check included
        self.deadline = deadline  # monotonic
        self.phases = phases
        self.engine = src.engine
        self.epoch = src.epoch
        self.dests = src._dests
        self.delta = src._delta
        self.imm = data_imm(self.epoch, self.version)
        self.relay_bits = relay_version_bits(self.version)
        self.chain = [r for r in src._relay if self.delta.has_inbox(r)]  # relay members with inboxes
        self.failed: dict[int, str] = {}
        self.announces: list[tuple[int, Any]] = []
        self.transfers: list[tuple[int, Any]] = []  # direct rounds and delta spans, until settled
        self.posted_tails: list[tuple[int, Any]] = []  # tails and delta finals
        self.works: dict[int, DeltaWork] = {}  # inbox destination -> its delta work
        self.opened: set[int] | None = None  # destinations written from the start (the gate opened)
        self.stopped = False  # the push failed its check: serve no more late destinations
        self.committed: set[int] = set()  # destinations whose tails are posted
        self.sent_finals: set[int] = set()  # inbox destinations whose final payload and header are posted
        self.changed_error: WeightSyncError | None = None  # raised once every posted write has completed
        self.write_start = 0.0
        self.staged_figures: dict[str, float] = {}
        self.waiting: set[int] = set()  # destinations whose ack is awaited
        self.grants: Grants

    def run(self) -> PushStats:
        """The push, steps 1 to 9."""
        self.announce()
        # The staged pipeline prepares its first chunks while the grants travel; its first post opens the
        # gate (the direct rounds go first), and it serves destinations granted late.
        self.staged_figures = self.src._staging.run(self.version, self.deadline, self.dests, self.failed,
                                                    self.src.one_writer_at_a_time, self)
        for _ in self.late():  # without staged chunks: the gate and the late ones' direct rounds
            pass
        self.settle()
        acked = self.acks()
        stats = self.stats(acked)
        self.report(acked)
        return stats

    # -- 1. announce ---------------------------------------------------------------------------------------
    def announce(self) -> None:
        """Forgets the previous push's acks, then announces (epoch, version) to every destination: it
        answers with a grant before any data is written."""
        src, version = self.src, self.version
        self.write_start = time.perf_counter()
        # The delta compare first: on a GPU it is only launched, and the device reads the tensors while
        # the host snapshots the tails and announces; the grants travel meanwhile (nothing in a grant
        # depends on the compare; its outcome is used only once a grant is in). On CPU it runs once the
        # announces are out (overlap_grants).
        mark("source %d push %d: start", src.rank, version)
        self.delta.start()
        src._held.snapshot_direct()
        # An ack is recognised by its version, and a stale slot must not pass for this push's (it did for
        # version 0 when slots started as zeros).
        for rank in self.dests:
            src._mailbox[rank] = (EMPTY, EMPTY, EMPTY)
        for rank, d in self.dests.items():
            src._outbox[rank] = (self.epoch, version, 0)
            d.descs = None
            try:
                self.announces.append((rank, self.engine.write(
                    src._outbox_region, rank * SLOT_BYTES, d.peer, d.target.mailbox, src.rank * SLOT_BYTES,
                    SLOT_BYTES, imm=ANNOUNCE)))
            except TransportError as exc:
                self.failed[rank] = str(exc)
        mark("source %d: announced", src.rank)
        self.delta.overlap_grants()
        self.grants = Grants(self.engine, src._grant_box, self.dests, src.group, self.epoch, version,
                             self.deadline, self.announces, self.failed)

    # -- 2. grants: the gate Staging's first post opens ----------------------------------------------------
    def open(self) -> None:
        """Waits for the grants (every destination's, or, once one answered, a grace for the others),
        then posts the direct rounds of the destinations granted. Idempotent."""
        if self.opened is not None:
            return
        self.opened = self.grants.wait()
        if self.opened:
            self.rounds(self.opened)

    # -- 3. rounds (and a delta's spans) -------------------------------------------------------------------
    def rounds(self, ranks: set[int]) -> None:
        """The direct writes into ``ranks`` (just granted): those of destinations without an inbox at
        once; for the inbox destinations span by span, each span compared, decided, its writes as
        planned posted and its payload and header sent before the next span is compared (the
        destination scatters it meanwhile)."""
        src, delta, works, failed = self.src, self.delta, self.works, self.failed
        owner: dict[int, int] = {}  # destination whose direct rounds are posted -> whose work decides
        if self.chain:
            relay = src._relay
            lead = delta.lead
            assert lead is not None
            if lead not in works:  # at the gate: one work for the whole chain
                # A delta only if every member holds the reference's version (each gets the same
                # entries; the writes sent as planned reach all of them through the chain).
                held = {self.grants.bases.get(r, -1) for r in relay}
                base = held.pop() if len(held) == 1 and len(self.chain) == len(relay) else -1
                work = delta.begin(lead, base, self.dests[relay[0]].batch.bytes)
                delta.share(work, self.chain)
                works.update(dict.fromkeys(self.chain, work))
            if relay[0] in ranks:
                owner[relay[0]] = lead
            spanned = [r for r in self.chain if r in ranks and r not in failed]
            deciders = [lead]
        else:
            for r in sorted(r for r in ranks if delta.has_inbox(r)):
                if r not in failed:  # its changes encoded against the version its grant says it holds
                    works[r] = delta.begin(r, self.grants.bases.get(r, -1), self.dests[r].batch.bytes)
                    owner[r] = r
            spanned = deciders = sorted(owner)
        mark("source %d: granted by %s", src.rank, sorted(ranks))
        plain = {r for r in ranks if r not in owner and not delta.has_inbox(r)}
        self.transfers.extend(self._post_rounds(plain))
        for span in range(SPANS):
            decided = {o: delta.decide(o, span) for o in deciders}
            keeps = {r: decided[o] for r, o in owner.items()}
            if keeps:
                self.transfers.extend(self._post_rounds(set(keeps), keeps))
            mark("source %d: span %d decided", src.rank, span)
            for r in spanned:
                if r not in failed:
                    peer = self.dests[r].peer
                    self.transfers.extend(delta.post_span(r, self.epoch, self.version, span, peer, failed))
            mark("source %d: span %d posted", src.rank, span)
        # The reference takes every change of this push, asked for or not (before the tensors' check).
        delta.compare_all()

    def _post_rounds(self, ranks: set[int], keeps: Mapping[int, dict[int, np.ndarray] | None] | None = None
                     ) -> list[tuple[int, Any]]:
        """Posts the direct writes into destinations ``ranks`` round by round with at most
        ROUNDS_IN_FLIGHT posted per kind of lane: the plan's schedule gives each destination as few
        writers at a time as it can, and a source that posted every round at once would undo it (two
        writers into one GPU share its links: both go at half speed). ``keeps``: per delta destination,
        the writes of each round it sends as planned. Returns the batches still in flight."""
        src, failed, deadline = self.src, self.failed, self.deadline
        imm, relay_bits = self.imm, self.relay_bits
        rounds = src._rounds
        in_flight: dict[bool, list[tuple[int, Any]]] = {False: [], True: []}  # by lane: keeps order or not
        for ri, r in enumerate(rounds):
            rank = r.rank
            if rank in failed or rank not in ranks:
                continue
            keep = (keeps or {}).get(rank)
            if keep is not None:  # a delta: only the writes it sends as planned
                mask = keep.get(ri)
                if mask is None or not mask.any():
                    continue
                if not mask.all():
                    r = subset(r, mask)
            d = self.dests[rank]
            limit = (ORDERED_ROUNDS_IN_FLIGHT if d.ordered else ROUNDS_IN_FLIGHT) or len(rounds)
            queue = in_flight[d.ordered]
            while len(queue) >= limit:
                _settle(*queue.pop(0), deadline, failed)
            # Relay chunks: the plan's immediates with this version's bits (each version its own counters).
            imms = (np.full(len(r.nbytes), imm, dtype=np.uint32) if r.imms is None else
                    r.imms | np.uint32(relay_bits))
            try:
                queue.append((rank, self.engine.write_batch(
                    src._direct_srcs, d.descs, r.src_index, r.src_off, r.dst_index, r.dst_off, r.nbytes,
                    imms, *r.geometry)))
            except TransportError as exc:
                failed[rank] = str(exc)
        return in_flight[False] + in_flight[True]

    # -- 4. staged chunks: what Staging asks before it posts one -------------------------------------------
    def prepared(self, chunk: int, view: Any) -> None:
        """Staged chunk ``chunk`` is prepared in ``view`` (its staging slot): keeps the bytes of the tails
        it holds, and compares it with what the last push sent (delta pushes)."""
        self.src._held.snapshot_staged(chunk, view)
        self.delta.chunk(chunk, view)

    def allowed(self, rank: int) -> bool:
        """Whether ``rank`` is written from the start (granted when the gate opened)."""
        return self.opened is not None and rank in self.opened

    def staged(self, rank: int, chunk: int, src_off: np.ndarray, di: np.ndarray, dst_off: np.ndarray,
               nbytes: np.ndarray) -> np.ndarray | None:
        """Which of staged chunk ``chunk``'s writes into ``rank`` go as planned (None: all of them); the
        others travel in its delta payload (weightsync.delta.sender)."""
        return self.delta.staged(rank, chunk, src_off, di, dst_off, nbytes)

    # -- 5. late grants ------------------------------------------------------------------------------------
    def late(self) -> Iterator[int]:
        """Destinations granted after the gate opened, as their grants arrive (until the deadline): their
        direct rounds are posted before each is yielded (the caller posts its staged chunks), and its
        tail once the caller asks for the next one. The destinations of the open gate get their tails
        first: every staged chunk of theirs is prepared by now (a late grant must not hold them up)."""
        self.open()
        self.tails(self.opened or set())
        grants = self.grants
        while grants.pending and not self.stopped and time.monotonic() < self.deadline:
            for r in grants.step(self.deadline):
                self.rounds({r})
                yield r
                self.tails({r})
        grants.close()

    # -- 6. tails ------------------------------------------------------------------------------------------
    def tails(self, ranks: set[int]) -> None:
        """Once the engine has read the live tensors for every write but the tails into ``ranks``
        (direct writes: until they complete locally; staged chunks: while they were prepared), checks
        that the tensors did not change since the push started (so neither did they meanwhile), then
        posts those tails from the snapshot: they let the destinations complete the version."""
        src, h, failed = self.src, self.handle, self.failed
        ranks = ranks - self.committed
        if not ranks or self.changed_error is not None:
            return
        for rank, tr in self.transfers:
            if rank in ranks:
                _settle(rank, tr, self.deadline, failed)
        h.check_cancelled()
        changed = h.changed()
        if changed:
            took = f"destinations {sorted(self.committed)} took it before" if self.committed else \
                "no destination takes this version"
            self.stopped = True
            self.changed_error = WeightSyncError(
                f"group {src.group!r}: push of version {self.version} from source {src.rank} failed: "
                f"tensors {changed[:5]}{' ...' if len(changed) > 5 else ''} changed while the push read "
                "them (an optimizer step during the push? wait for it first: handle.wait(), "
                f"src.wait_pushed() or src.guard(optimizer)); {took}")
            return
        if src.device.type == "cuda":
            import torch

            torch.cuda.current_stream(src.device).synchronize()  # the tails' snapshot copies
        h.commit()
        self.committed.update(ranks)
        self.posted_tails.extend(src._held.post(self.dests, self.imm, self.relay_bits, failed,
                                                ranks & set(self.grants.granted)))
        # Delta inboxes: the payload (every staged chunk of theirs is encoded by now), then the header
        # (the destination cannot count without it). A relay chain's are the head's: they wait for
        # its commit (the staged chunks are all written into the head).
        if self.chain:
            ready = self.committed if src._relay[0] in self.committed else set()
        else:
            ready = ranks
        finals = [r for r in ready if r in self.works and r not in self.sent_finals]
        self.sent_finals.update(finals)
        self.posted_tails.extend(self.delta.post_finals(finals, self.epoch, self.version, self.imm,
                                                        {r: self.dests[r].peer for r in finals}, failed))
        mark("source %d: committed, tails and final spans posted to %s", src.rank, sorted(ranks))

    # -- 7. every write completed locally ------------------------------------------------------------------
    def settle(self) -> None:
        """Waits for every posted write to complete locally (a failure marks its destination), raises the
        tensors' changes if the check found any, and lets the delta reference take this version's
        changes."""
        failed, deadline = self.failed, self.deadline
        for rank, tr in self.transfers + self.posted_tails:
            _settle(rank, tr, deadline, failed)
        for rank, tr in self.announces:
            try:
                tr.wait(max(deadline - time.monotonic(), 0.0))
            except TransportError as exc:
                failed.setdefault(rank, str(exc))
            except TimeoutError:
                # Not sent yet (a stopped peer's socket is full, say): no evidence that it died, like a
                # missing grant or ack (judged in acks with the others).
                pass
        if self.changed_error is not None:
            # Only now: a write of this version still in flight could land after the next version's.
            raise self.changed_error
        # The delta reference takes this version's changes while the destinations apply theirs.
        self.delta.finish(self.version, ok=True)
        self.phases["grant"] = self.grants.seconds
        self.phases["write"] = time.perf_counter() - self.write_start
        self.phases["prepare"] = self.staged_figures["prepare"]
        self.phases["gather_wait"] = self.staged_figures["gather_wait"]

    # -- 8. acks -------------------------------------------------------------------------------------------
    def acks(self) -> set[int]:
        """Waits for the acks of the destinations written (and, as a provider of FP8 gathers, for the
        gatherers' GATHERED); the silent ones fail, and when none acked each gets a probe. Returns the
        destinations that acked."""
        src, version, failed, timeout = self.src, self.version, self.failed, self.timeout
        t = time.perf_counter()
        waiting = self.waiting = {r for r in self.dests if r not in failed and r not in self.grants.refused}
        acked = self._await_acks(waiting)
        mark("source %d: acked by %s", src.rank, sorted(acked))
        self.phases["ack"] = time.perf_counter() - t
        for r in waiting - acked:
            failed[r] = (f"no grant of version {version} within {timeout} s" if r in self.grants.ungranted
                         else f"no confirmation of version {version} within {timeout} s")
        if not acked and waiting and not src._closing:
            # Silence is evidence only beside an ack; without one, a destination no write to it failed
            # may be dead all the same: its announce (and every write it granted) landed before it died,
            # and nothing more was written to find out. One more write to each tells dead from stopped.
            for r, why in self.probe(sorted(waiting)).items():
                failed[r] = f"{failed[r]}, and a probe write to it failed: {why}"
                waiting.discard(r)  # a failed write: evidence against it (report)
        if src._closing and self.engine.closed:
            # Failures seen now may be the closing engine's doing: none is reported against a destination.
            raise WeightSyncError(f"group {src.group!r}: push of version {version} from source {src.rank}: "
                                  f"the source was closed before every destination confirmed it "
                                  f"(confirmed: {sorted(acked)})")
        return acked

    def _await_acks(self, waiting: set[int]) -> set[int]:
        """Waits for the acks of this version from ``waiting`` (and, as a provider of FP8 gathers, for the
        gatherers' GATHERED); returns the destinations that acked."""
        src, deadline = self.src, self.deadline
        acks = self.engine.counter(ACK)
        acked: set[int] = set()
        while waiting - acked:
            try:
                acks.wait(1, timeout=min(max(deadline - time.monotonic(), 0.0), 0.5))
            except TimeoutError:
                if time.monotonic() >= deadline:
                    break
            for r in waiting - acked:
                slot = src._mailbox[r]
                if int(slot["version"]) == self.version:
                    acked.add(r)
        if src._gatherers:
            # The gatherers' receive buffers hold this version's rows until they have quantized them.
            self.engine.counter(gathered_imm(self.epoch, self.version)).wait(
                len(src._gatherers), max(deadline - time.monotonic(), 0.0))
        return acked

    def probe(self, ranks: list[int]) -> dict[int, str]:
        """Writes to each destination of ``ranks`` once more and returns those whose write failed, with
        why (the engine's error names the peer). The write rewrites the ``buffer`` field of this source's
        announce slot there, which every announce sets to 0 and no destination reads: harmless to a live
        destination, whatever it is doing and in whichever order it lands. Completion means delivered, so
        a stopped destination's probe neither completes nor fails within PROBE_WAIT_S: no evidence."""
        src = self.src
        field_off = ANNOUNCE_RECORD.fields["buffer"][1]
        nbytes = ANNOUNCE_RECORD["buffer"].itemsize
        failed: dict[int, str] = {}
        probes: list[tuple[int, Any]] = []
        for rank in ranks:
            d = self.dests[rank]
            try:
                probes.append((rank, self.engine.write(
                    src._outbox_region, rank * SLOT_BYTES + field_off, d.peer, d.target.mailbox,
                    src.rank * SLOT_BYTES + field_off, nbytes)))
            except TransportError as exc:
                failed[rank] = str(exc)
        until = time.monotonic() + min(PROBE_WAIT_S, self.timeout)
        for rank, tr in probes:
            try:
                tr.wait(max(until - time.monotonic(), 0.0))
            except TransportError as exc:
                failed[rank] = str(exc)
            except TimeoutError:
                pass  # not delivered in time: stopped or slow, not known to be dead
        if probes or failed:
            mark("source %d: probed silent destinations %s, failed %s", src.rank, ranks, sorted(failed))
        return failed

    # -- 9. stats and failures -----------------------------------------------------------------------------
    def stats(self, acked: set[int]) -> PushStats:
        """This push's ``PushStats`` (recorded with the coordinator's client); a delta destination whose
        inbox was too small is told so once."""
        src, works, staged = self.src, self.works, self.staged_figures
        seconds = time.perf_counter() - self.t0
        written = [r for r in self.dests if r not in self.failed and r not in self.grants.refused]
        nbytes = sum(self.dests[r].batch.bytes for r in written)
        delta_sent = [r for r in written if r in works and works[r].delta]
        wire = sum(works[r].wire_bytes if r in works else self.dests[r].batch.bytes for r in written)
        if self.chain and works:  # one work for the chain: its writes as planned go once, the payload to each
            work = works[self.chain[0]]
            wire = work.wire_bytes + work.payload_bytes * (sum(r in works for r in written) - 1)
        stats = PushStats(version=self.version, bytes=nbytes, seconds=seconds, gbps=nbytes / seconds / 1e9,
                          writes=sum(d.batch.writes for d in self.dests.values()),
                          destinations=sorted(self.dests), failed_destinations=sorted(self.failed),
                          phases=self.phases, epoch=self.epoch, prepare_seconds=staged["prepare"],
                          grant_seconds=self.grants.seconds,
                          write_seconds=self.phases["write"], peak_staging_bytes=int(staged["peak"]),
                          staging_limit_bytes=src.staging_limit, chunks=int(staged["chunks"]),
                          gather_bytes=int(src._staging.prep.received["nbytes"].sum()),
                          relayed=[r for r in src._relay[1:] if r in self.dests],
                          wire_bytes=wire, dense_bytes=nbytes,
                          apply_seconds=max([float(src._mailbox[r]["reserved"]) * 1e-6 for r in written
                                             if r in works] or [0.0]),
                          delta_destinations=delta_sent, **self.delta.stats(works, delta_sent))
        for r in (r for r in written if r in works):  # a dense one too: its inbox may hold no entries
            note = self.delta.overflow_note(r) if r not in src._overflow_told else None
            if note is not None:
                src._overflow_told.add(r)
                src.log.warning("source %d, version %d: %s", src.rank, self.version, note)
        src._control.record_push(stats.seconds, stats.bytes)
        return stats

    def report(self, acked: set[int]) -> None:
        """Reports the failed destinations with evidence against them to the coordinator; raises
        ``TimeoutError`` if none acked, and ``WeightSyncError`` if a destination refused the version."""
        src, version, failed, waiting = self.src, self.version, self.failed, self.waiting
        refused = self.grants.refused
        if failed:
            for r, why in sorted(failed.items()):
                src.log.warning("group %s: push %d to destination %d failed: %s", src.group, version, r, why)
            # Writes that failed (a probe's included) are evidence against the destination; a missing grant
            # or ack only when others acked (otherwise a source may be what is missing, or the destinations
            # are stopped). A destination of another plan epoch is not.
            stale = self.grants.stale
            dead = sorted(r for r in failed if (r not in waiting or acked) and r not in stale)
            if src._relay and acked:
                # A chain member that did not confirm starves the ones after it: only the first of them is
                # evidence of a failure (its predecessor confirmed); the others are healthy and stay.
                missing = [r for r in src._relay if r in failed and r in waiting]
                dead = sorted({r for r in failed if r not in waiting and r not in stale} | set(missing[:1]))
            if dead:
                # Not awaited here (the push's caller gets its answer now): the next push awaits it.
                src._control.report_dead(DESTINATION, dead, self.epoch)
            if not acked and not refused:
                raise TimeoutError(f"group {src.group!r}: push of version {version} from source {src.rank}: "
                                   f"no destination confirmed within {self.timeout} s (destination "
                                   f"{min(failed)}: {failed[min(failed)]})")
        if refused:
            r = min(refused)
            others = f"; destinations {sorted(acked)} confirmed it" if acked else ""
            raise WeightSyncError(refused[r] + others)
