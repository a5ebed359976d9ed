"""A trainer rank's side of a push: ``Source`` (its ``push`` method) and ``PushStats``.

A push, from one source's point of view (every source does this at the same time, SPMD):

1. fetch a new plan part only if the coordinator's epoch moved (membership changed): the source's epoch
   watcher (a thread long-polling the coordinator) keeps the epoch at hand, so this costs no round trip
   unless the watcher is unhealthy;
2. per destination write a 24-byte *announce* (weightsync.wire.ANNOUNCE_RECORD: epoch, version) into
   its mailbox slot with immediate ``ANNOUNCE``, and wait for its *grant* (weightsync.wire.GRANT_RECORD,
   immediate ``GRANT``): the destination decides whether it takes the version (newer than what it
   holds, of its plan) and into which shadow, and raises ``updating`` before it grants, so no byte is
   written before that. The first staged chunks are prepared while the grants travel;
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
is missing (every destination waits for all sources), the push raises ``weightsync.TimeoutError``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from weightsync.engine import Region, TransferEngine
from weightsync.errors import TimeoutError, TransportError, WeightSyncError  # noqa: A004
from weightsync.plan.lower import Round, source_program
from weightsync.plan.parts import DESTINATION, SOURCE, EngineInfo, SourcePart
from weightsync.plan.writes import DEFAULT_CHUNK_BYTES, MIN_CHUNK_BYTES
from weightsync.runtime.links import DestinationLink, PeerLink
from weightsync.runtime.participant import Participant, contiguous
from weightsync.runtime.staging import Staging
from weightsync.wire import (
    ACK,
    ACK_RECORD,
    ANNOUNCE,
    ANNOUNCE_RECORD,
    EMPTY,
    GRANT,
    GRANTED,
    MAX_SLOTS,
    REFUSED_EPOCH,
    SLOT_BYTES,
    data_imm,
    gathered_imm,
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
# Once the first destination has answered, how much longer the others get before the writes start
# without them (they are then served as their grants come in): at least this, or twice the first's time.
GRANT_GRACE_S = 0.05


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
                 failed: dict[int, str], post_rounds: Callable[[set[int]], None]) -> None:
        self.src = src
        self.version = version
        self.deadline = deadline
        self.failed = failed
        self.post_rounds = post_rounds
        self.announces = dict(announces)
        self.counter = src.engine.counter(GRANT)
        # Credits of earlier grants: from now on every grant's credit follows its record into the slot.
        self.counter.reset()
        self.pending = {r for r in src._dests if r not in failed}
        self.granted: dict[int, int] = {}  # rank -> shadow
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
            g = src._grant_box[grant_slot(r, v) - MAX_SLOTS]
            if int(g["version"]) == v:
                epoch, status = int(g["epoch"]), int(g["status"])
                if epoch < src.epoch or (epoch == src.epoch and status == REFUSED_EPOCH):
                    pass  # an answer to an announce of an earlier plan (or a slot read half-written)
                elif epoch > src.epoch:
                    self.pending.discard(r)
                    self.stale.add(r)
                    self.failed[r] = (f"destination {r} holds plan epoch {epoch}, this source {src.epoch}: "
                                      "nothing written (the next push uses the new plan)")
                    continue
                elif status == GRANTED:
                    self.pending.discard(r)
                    self.granted[r] = int(g["shadow"])
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
                try:
                    self.counter.wait(1, timeout=min(GRANT_SLICE_S, left))
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

    def allowed(self, rank: int) -> bool:
        """Whether ``rank`` is written from the start (granted when the gate opened)."""
        return self.opened is not None and rank in self.opened

    def late(self) -> Iterator[int]:
        """Destinations granted after the gate opened, as their grants arrive (until the deadline): their
        direct rounds are posted before each is yielded (the caller posts its staged chunks)."""
        self.open()
        while self.pending and time.monotonic() < self.deadline:
            for r in self._step(self.deadline):
                self.post_rounds({r})
                yield r
        self.ungranted |= self.pending
        self.pending = set()


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
                 one_writer_at_a_time: bool = False) -> None:
        import torch

        super().__init__(group, rank, tensors, timeout, engine, secret)
        self._regions: dict[str, Region] = {}
        self._locals: dict[str, Any] = {}
        for key in self.tensors:
            local = contiguous(self._local_tensor(key), key)
            self._locals[key] = local
            self._regions[key] = self.engine.register(local, name=key)
        first = next(iter(self._locals.values()))
        self.device = first.device if isinstance(first, torch.Tensor) else torch.device("cpu")
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
        program = source_program(part, list(self._regions), self.rank)
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
        staged = int((part.writes["staged"] == 1).sum())
        self.log.info("source %d: plan epoch %d, %d writes (%d staged in %d chunks), %d bytes to "
                      "destinations %s", self.rank, self.epoch, len(part.writes), staged,
                      len(part.chunks), part.bytes, sorted(self._dests))

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
        """Stops the epoch watcher and closes the engine."""
        if self._watcher is not None:
            self._watcher.stop()
        super().close()

    # -- the push ----------------------------------------------------------------------------------
    def push(self, version: int, timeout: float = 60.0) -> PushStats:
        """Writes the current contents of this source's tensors to every destination as ``version``.

        Called by every source rank (like a collective). Returns once every destination this source
        writes to has confirmed the complete version, or reports the ones that failed (see the module
        doc)."""
        if not 0 <= version < 1 << 62:
            raise WeightSyncError(f"version {version} must be a non-negative integer")
        if version <= self._last_version:
            raise WeightSyncError(f"group {self.group!r}: source {self.rank}: version {version} is not newer "
                                  f"than version {self._last_version} it pushed before; versions must "
                                  "increase (nothing was written)")
        self._last_version = version
        t0 = time.perf_counter()
        deadline = time.monotonic() + timeout
        phases: dict[str, float] = {}
        # ">": the watcher may not have heard yet an epoch this source already fetched by itself.
        if self._plan_epoch(timeout) > self.epoch:
            self._fetch_part(max(deadline - time.monotonic(), 0.1))
        phases["plan"] = time.perf_counter() - t0

        t = time.perf_counter()
        if self.device.type == "cuda":
            import torch

            # The engine reads the tensors outside torch's streams: the caller's last update must be done.
            torch.cuda.current_stream(self.device).synchronize()
        failed: dict[int, str] = {}
        announces = self._announce(version, failed)
        transfers: list[tuple[int, Any]] = []
        imm = data_imm(self.epoch, version)
        relay_bits = relay_version_bits(version)

        def post_rounds(ranks: set[int]) -> None:
            transfers.extend(self._post_rounds(imm, relay_bits, deadline, failed, ranks))

        grants = _Grants(self, version, deadline, announces, failed, post_rounds)
        # The staged pipeline prepares its first chunks while the grants travel; its first post opens the
        # gate (the direct rounds go first), and it serves destinations granted late.
        staged = self._staging.run(version, deadline, self._dests, failed, self.one_writer_at_a_time, grants)
        for _ in grants.late():  # without staged chunks: the gate and the late ones' direct rounds
            pass
        for rank, tr in transfers:
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
        phases["grant"] = grants.seconds
        phases["write"] = time.perf_counter() - t
        phases["prepare"] = staged["prepare"]
        phases["gather_wait"] = staged["gather_wait"]

        t = time.perf_counter()
        waiting = {r for r in self._dests if r not in failed and r not in grants.refused}
        acked = self._await_acks(version, waiting, deadline)
        phases["ack"] = time.perf_counter() - t
        for r in waiting - acked:
            failed[r] = (f"no grant of version {version} within {timeout} s" if r in grants.ungranted else
                         f"no confirmation of version {version} within {timeout} s")

        seconds = time.perf_counter() - t0
        written = [r for r in self._dests if r not in failed and r not in grants.refused]
        nbytes = sum(self._dests[r].batch.bytes for r in written)
        stats = PushStats(version=version, bytes=nbytes, seconds=seconds, gbps=nbytes / seconds / 1e9,
                          writes=sum(d.batch.writes for d in self._dests.values()),
                          destinations=sorted(self._dests), failed_destinations=sorted(failed),
                          phases=phases, epoch=self.epoch, prepare_seconds=staged["prepare"],
                          grant_seconds=grants.seconds,
                          write_seconds=phases["write"], peak_staging_bytes=int(staged["peak"]),
                          staging_limit_bytes=self.staging_limit, chunks=int(staged["chunks"]),
                          gather_bytes=int(self._staging.prep.received["nbytes"].sum()),
                          relayed=[r for r in self._relay[1:] if r in self._dests])
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
                     ranks: set[int]) -> list[tuple[int, Any]]:
        """Posts the direct writes into destinations ``ranks`` round by round with at most
        ROUNDS_IN_FLIGHT posted per kind of lane: the plan's schedule gives each destination as few
        writers at a time as it can, and a source that posted every round at once would undo it (two
        writers into one GPU share its links: both go at half speed). Returns the batches still in
        flight."""
        in_flight: dict[bool, list[tuple[int, Any]]] = {False: [], True: []}  # by lane: keeps order or not
        for r in self._rounds:
            rank = r.rank
            if rank in failed or rank not in ranks:
                continue
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

    def _report_failures(self, version: int, timeout: float, failed: dict[int, str], waiting: set[int],
                         acked: set[int], stale: set[int], refused: bool) -> None:
        for r, why in sorted(failed.items()):
            self.log.warning("group %s: push %d to destination %d failed: %s", self.group, version, r, why)
        # Writes that failed are evidence against the destination; a missing grant or ack only when others
        # acked (otherwise a source may be what is missing). A destination of another plan epoch is not.
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
                               f"no destination confirmed within {timeout} s ({failed[min(failed)]})")


def push(src: Source, version: int, timeout: float = 60.0) -> PushStats:
    """Writes the current contents of ``src``'s tensors to every destination as ``version``
    (``src.push``). Called by every source rank (like a collective)."""
    return src.push(version, timeout)
