"""A rollout rank's side of a push: ``Destination``.

A destination's own thread (never the user's code) waits for announces (weightsync.wire.ANNOUNCE_RECORD
in its mailbox) and answers each with a *grant* (weightsync.wire.GRANT_RECORD) before any data byte of
that version may be written: it takes a version only when it is newer than the one it holds and of the
plan it holds, picks the shadow it receives it into, raises ``updating``, and only then grants every
writer (its sources; in a relay chain also its predecessor). It then waits for the expected number of
data immediates of that version (computed by the coordinator from the same lowering the sources run),
flips its version, and acks (weightsync.wire.ACK_RECORD into each source's mailbox). A version is
visible only when all of its immediates have arrived: immediates arrive after their bytes are placed,
and nothing assumes ordering between writes.

Staged destinations receive into one of two shadow copies, always the one that does not hold the newest
complete version, chosen here and granted to every writer of the version alike, so ``apply()`` (one
local copy of the newest complete shadow into the live tensors) never reads a shadow that is being
written and no two writers of a version can disagree. Inplace destinations receive straight into the
live tensors.

With a delta inbox (``delta_bytes``, weightsync.delta.sender) a destination's grant also says which
version a delta may be taken on, and a version lands by the sources' headers: their data immediates,
then the changes scattered into place, then the flip and the ack (from this thread). In a relay chain
each member's header and payload come from the sources directly, and the writes the entries say went as
planned come through the chain (weightsync.runtime.relay).

A destination the sources reported failed (stopped past the push timeout, its link cut) is dropped from
the plan, and a plan without it sends it nothing. If this process lives on, its membership watcher (a
long-poll on the coordinator) hears that it was dropped; the receiving thread abandons what it was landing
and joins again under its rank (refused if another process took the rank: this one then stops and
``wait`` raises), and the re-plan gives it every byte of the next version. While it is behind, ``version``
stays the last complete one and ``dirty`` stays until the next complete version.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from weightsync.control.client import ControlClient
from weightsync.delta import DELTA_KEY, SPANS, DeltaReceiver
from weightsync.engine import Region, TransferEngine
from weightsync.errors import PlanError, TimeoutError, TransportError, WeightSyncError  # noqa: A004
from weightsync.plan.parts import DESTINATION, DestinationPart
from weightsync.runtime.links import PeerLink
from weightsync.runtime.participant import Participant, contiguous
from weightsync.runtime.relay import RelayMember, consumed
from weightsync.runtime.trace import mark
from weightsync.wire import (
    ACK,
    ACK_RECORD,
    ANNOUNCE,
    ANNOUNCE_RECORD,
    EMPTY,
    GRANTED,
    MAX_SLOTS,
    REFUSED_BUSY,
    REFUSED_EPOCH,
    REFUSED_NOT_NEWER,
    SLOT_BYTES,
    data_imm,
    delta_header_imm,
    delta_part_imm,
    grant_imm,
    grant_slot,
)

# How often a waiting destination looks for a newer plan or version (the native wait itself returns the
# moment the last immediate arrives; this bounds only how late a dead version is given up).
WAIT_SLICE_S = 0.02
# A relay member's wait slices while its successor has not granted yet: the forwards are armed between
# slices, and every chunk that lands before is forwarded only then.
WATCH_SLICE_S = 0.0005
DROPPED, SUPERSEDED = ControlClient.DROPPED, ControlClient.SUPERSEDED
# A destination dropped again within READMIT_QUICK_S of joining again (its link is still cut, say) waits
# READMIT_BACKOFF_S before the next join, doubled per quick drop up to READMIT_MAX_S: each join re-plans
# the whole group.
READMIT_BACKOFF_S, READMIT_MAX_S, READMIT_QUICK_S = 0.5, 8.0, 30.0
# Outbox slots grants are written from (a ring: a NIC may still read a slot while the next grant is
# prepared; a slot is reused only once its writes completed). Acks use slots 0 and 1.
GRANT_OUT, GRANT_RING = 8, 32
_ANSWERED = np.dtype([("epoch", "<i8"), ("version", "<i8")])


class Destination(Participant):
    """A rollout rank: receives into its tensors (``inplace``) or into shadows (``staged``)."""

    role = DESTINATION
    inbox_record = ANNOUNCE_RECORD  # sources announce into this destination's mailbox
    outbox_record = ACK_RECORD  # and it acks from its outbox
    grant_slots = 2  # its relay successor's grants (grant_slot(0, version))

    def __init__(self, group: str, rank: int, tensors: Mapping[str, Any], mode: str = "staged", *,
                 timeout: float = 120.0, push_timeout: float = 60.0, engine: TransferEngine | None = None,
                 secret: str | None = None, delta_bytes: int = 0) -> None:
        if mode not in ("inplace", "staged"):
            raise WeightSyncError(f"destination mode must be 'inplace' or 'staged', not {mode!r}")
        super().__init__(group, rank, tensors, timeout, engine, secret)
        self.mode = mode
        self._push_timeout = push_timeout
        self._lock = threading.Condition()
        self._version = -1
        self._live_version = -1
        self._landing: int | None = None
        self._landing_shadow = 0  # the shadow granted to the version landing
        self._dirty = False  # inplace: an abandoned version may have left bytes in the live tensors
        self._applying = False
        self._complete_buffer = 0  # staged: the shadow that holds the newest complete version
        self._live: dict[str, Any] = {k: contiguous(self._local_tensor(k), k) for k in self.tensors}
        self._buffers: dict[str, list[Any]] = {}
        descriptors: dict[str, list[bytes]] = {}
        self._regions: list[Region] = []
        self._key_regions: dict[str, list[Region]] = {}  # per key, per shadow (inplace: the live one twice)
        for key, live in self._live.items():
            bufs = [live] if mode == "inplace" else [live.clone() for _ in range(2)]
            self._buffers[key] = bufs
            regs = [self.engine.register(b, name=f"{key}[{i}]") for i, b in enumerate(bufs)]
            self._regions += regs
            self._key_regions[key] = regs * (2 if mode == "inplace" else 1)
            descriptors[key] = [r.descriptor for r in regs] * (2 if mode == "inplace" else 1)
        # Delta pushes (weightsync.delta.sender): an inbox of ``delta_bytes`` for the sources' encoded
        # changes; with it every version lands by the sources' headers, and sparse entries are scattered
        # into place before the version flips.
        self._delta: DeltaReceiver | None = None
        if delta_bytes:
            import torch

            first = next(iter(self._live.values()))
            device = first.device if isinstance(first, torch.Tensor) else torch.device("cpu")
            self._delta = DeltaReceiver(self.engine, self._buffers, mode, device, int(delta_bytes), rank)
            descriptors[DELTA_KEY] = self._delta.descriptor()
        self._sources: dict[int, PeerLink] = {}
        self._expected = 0
        self._relay: RelayMember | None = None  # this member's place in the relay chain, if any
        self._stop = threading.Event()
        self._announces = self.engine.counter(ANNOUNCE)
        # Per source slot, the announce (epoch, version) last answered: a slot holds its last announce
        # forever, and each is answered once.
        self._answered = np.full(MAX_SLOTS, EMPTY, dtype=_ANSWERED)
        self._granted: tuple[int, int] | None = None  # (epoch, version) last granted to every source
        self._grant_next = 0
        self._grant_writes: dict[int, list[Any]] = {}  # outbox ring slot -> its writes in flight
        # Re-admission: the coordinator drops a destination reported failed (stopped past the push timeout,
        # its link cut); if this process lives on, its membership watcher hears it and the receiving thread
        # joins again under the same rank (``_readmit``).
        self._descriptors = descriptors
        self._dropped = threading.Event()
        self._superseded: str | None = None  # why this process no longer receives (another took its rank)
        self._readmit_at: float | None = None  # monotonic time of the next join after a drop (back-off)
        self._readmit_backoff = 0.0
        self._joined_at = time.monotonic()
        self.readmissions = 0  # times this destination joined again after it was dropped
        self._join(descriptors)
        self._member_watcher = self._control.start_member_watcher(self, self.engine.address, self._membership)
        self._thread = threading.Thread(target=self._run, name=f"weightsync-{group}-dst{rank}", daemon=True)
        self._thread.start()

    def _apply_part(self, part: DestinationPart) -> None:
        self._expected = part.expected
        self._sources = {r: PeerLink(s, self._peer(s.address)) for r, s in part.sources.items()}
        if self._relay is not None:
            self._relay.disarm()  # the previous plan's triggers name immediates no one sends any more
        self._relay = None
        if part.relay is not None:
            succ, pred = part.relay.successor, part.relay.predecessor
            self._relay = RelayMember(self.engine, self.rank, part.relay,
                                      None if succ is None else self._peer(succ.address), self._key_regions,
                                      self.log,
                                      None if pred is None else PeerLink(pred, self._peer(pred.address)))
            unknown = self._relay.unknown_keys()
            if unknown:
                raise PlanError(f"destination {self.rank}: relay chunks name tensors {unknown[:3]} it "
                                "does not hold")
        self.log.info("destination %d: plan epoch %d, expecting %d immediates from sources %s%s", self.rank,
                      self.epoch, self._expected, sorted(self._sources),
                      "" if self._relay is None else
                      f", relay position {self._relay.position} of chain {self._relay.chain}")

    # -- what users observe ---------------------------------------------------------------------
    @property
    def version(self) -> int:
        """The newest version completely received (-1 before the first)."""
        with self._lock:
            return self._version

    @property
    def live_version(self) -> int:
        """The version the live tensors hold (staged: the last one ``apply`` made live)."""
        with self._lock:
            return self._live_version if self.mode == "staged" else self._version

    @property
    def updating(self) -> bool:
        """True while an update is landing (inplace: the live tensors are being written). Raised before
        this destination grants the version, so before any byte of it can be written."""
        with self._lock:
            return self._landing is not None

    @property
    def dirty(self) -> bool:
        """Inplace: True from a version that was abandoned after it was granted (some of its bytes may be
        in the live tensors) until the next complete version. ``updating == False`` then means that no
        push is landing, not that the live tensors hold one whole version. Always False when staged."""
        with self._lock:
            return self._dirty

    def wait(self, version: int | None = None, timeout: float = 60.0) -> int:
        """Blocks until a complete version (``>= version``, or newer than now when None) has landed.
        Raises ``WeightSyncError`` once another process has joined under this destination's rank (this one
        then receives nothing more)."""
        deadline = time.monotonic() + timeout
        with self._lock:
            target = self._version + 1 if version is None else version
            while self._version < target:
                if self._superseded is not None:
                    raise WeightSyncError(self._superseded)
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"group {self.group!r}: destination {self.rank} has version "
                                       f"{self._version}, waited {timeout} s for {target}")
                self._lock.wait(left)
            return self._version

    def apply(self) -> int:
        """Staged mode: make the newest complete version live (one local copy); returns the live version."""
        if self.mode != "staged":
            return self.version
        with self._lock:
            if self._version == self._live_version:
                return self._live_version
            version, buf = self._version, self._complete_buffer
            self._applying = True
        try:
            for key, live in self._live.items():
                live.copy_(self._buffers[key][buf])
        finally:
            with self._lock:
                self._applying = False
                self._live_version = version
                self._lock.notify_all()
        return version

    # -- membership: dropped and taken back ------------------------------------------------------
    def _membership(self, state: str, epoch: int) -> None:
        """The membership watcher's answer (its thread): flags a drop for the receiving thread, which
        joins again; a rank taken by another process ends this one's receiving."""
        if state == DROPPED:
            if not self._dropped.is_set():
                self.log.warning("destination %d: dropped from the group's plan (epoch %d; it was reported "
                                 "failed); joining again", self.rank, epoch)
            self._dropped.set()
        elif state == SUPERSEDED and self._superseded is None:
            with self._lock:
                self._superseded = (f"group {self.group!r}: destination rank {self.rank} was taken over by "
                                    f"another process (plan epoch {epoch}); this one receives nothing more")
                self._lock.notify_all()
            self.log.error("%s", self._superseded)
            self._stop.set()

    def _readmit(self) -> None:
        """Receiving thread, after a drop: asks the coordinator what this process is now and, if still
        dropped, joins again under its rank and fetches its part of the re-plan. Nothing it holds changes:
        ``version`` stays the last complete one, ``dirty`` stays until the next complete version (the
        next push that includes it again writes every byte it needs)."""
        now = time.monotonic()
        if self._readmit_at is None:  # the first look at this drop
            # Dropped again soon after it joined again (its link still cut, say): each join is a re-plan
            # of the whole group, so back off before the next one.
            quick = self.readmissions > 0 and now - self._joined_at < READMIT_QUICK_S
            self._readmit_backoff = min(self._readmit_backoff * 2 or READMIT_BACKOFF_S, READMIT_MAX_S) \
                if quick else 0.0
            self._readmit_at = now + self._readmit_backoff
            if quick:
                self.log.warning("destination %d: dropped again %.1f s after it joined again; joining again "
                                 "in %.1f s", self.rank, now - self._joined_at, self._readmit_backoff)
        if now < self._readmit_at:
            return
        self._readmit_at = now + READMIT_BACKOFF_S  # if asking fails, the next try is not at once
        state, epoch = self._control.membership(self.engine.address, self._timeout)
        self._dropped.clear()
        if state != DROPPED:
            self._readmit_at = None
            if state == SUPERSEDED:
                self._membership(state, epoch)
            return  # else a late answer: it is a member again already
        old = self.epoch
        try:
            self._join(self._descriptors, rejoin=True)
        except WeightSyncError as exc:
            if "another process" in str(exc):
                self._membership(SUPERSEDED, self.epoch)
                return
            self._dropped.set()  # tried again after READMIT_BACKOFF_S
            raise
        self._readmit_at = None
        self._joined_at = time.monotonic()
        self.readmissions += 1
        self.log.warning("destination %d: joined again after it was dropped from plan epoch %d: plan epoch "
                         "%d, holds version %d", self.rank, old, self.epoch, self.version)

    # -- the receiving thread --------------------------------------------------------------------
    def _run(self) -> None:
        announce = self._announces
        while not self._stop.is_set():
            try:
                if self._dropped.is_set():
                    self._readmit()
            except Exception as exc:  # tried again after a back-off
                self.log.error("destination %d: joining again failed: %s", self.rank, exc)
            try:
                announce.wait(1, timeout=0.2)
            except TimeoutError:
                continue
            except TransportError:
                return  # engine closed
            try:
                self._receive()
            except Exception as exc:  # keep receiving: a bad push must not kill the destination
                self.log.error("destination %d: receiving failed: %s", self.rank, exc)

    def _receive(self) -> None:
        target = self._answer()
        if target is not None:
            self._land(target)

    # -- announces and grants --------------------------------------------------------------------
    def _new_announces(self) -> np.ndarray:
        """Source slots holding an announce not answered yet."""
        slots = self._mailbox
        fresh = (slots["epoch"] != self._answered["epoch"]) | (slots["version"] != self._answered["version"])
        return np.flatnonzero(fresh & (slots["epoch"] != EMPTY))

    def _mark_answered(self, ranks: np.ndarray, epochs: np.ndarray, versions: np.ndarray) -> None:
        # From the values read, not the slots again: an announce landing in between is answered next time.
        self._answered["epoch"][ranks] = epochs
        self._answered["version"][ranks] = versions

    def _answer(self) -> int | None:
        """Answers the announces not answered yet; returns the version this destination takes now (it has
        raised ``updating`` and granted it to every writer), or None."""
        if int(self._mailbox["epoch"].max()) > self.epoch:
            self._fetch_part(self._timeout)  # a membership change: the announce is of the new plan
        new = self._new_announces()
        if not len(new):
            return None
        epochs, versions = self._mailbox["epoch"][new], self._mailbox["version"][new]
        self._mark_answered(new, epochs, versions)
        current = epochs == self.epoch
        target = int(versions[current].max()) if current.any() else None
        for rank, epoch, version in zip(new.tolist(), epochs.tolist(), versions.tolist(), strict=True):
            if epoch != self.epoch:
                self._refuse(rank, version, REFUSED_EPOCH)
            elif version != target:
                self._refuse(rank, version, REFUSED_NOT_NEWER if version <= self._version else REFUSED_BUSY)
        if target is None or (self.epoch, target) == self._granted:
            return None  # every source of that version was granted at its first announce
        if target <= self._version:
            for rank in new[current & (versions == target)].tolist():
                self._refuse(rank, target, REFUSED_NOT_NEWER)
            return None
        shadow = 1 - self._complete_buffer if self.mode == "staged" else 0
        held = None
        if self._delta is not None:
            # The grant says which version a delta into this shadow may be taken on (-1: none).
            held = self._delta.base(self._version, self._dirty, shadow)
            self._delta.granted(shadow)
        with self._lock:
            # Before the grant: no byte of the version can land before a reader sees ``updating``.
            self._landing = target
            self._landing_shadow = shadow
        self._granted = (self.epoch, target)
        self._grant(target, shadow, GRANTED, list(self._sources), held)
        return target

    def _unanswered_during(self, target: int) -> str | None:
        """While landing ``target``: why it can no longer complete here (a source announced a newer plan
        epoch, or a newer version of this plan: the sources gave up on it), or None. Other new announces
        are answered here (a lagging source's older version is refused); a newer one is left for
        ``_answer``, which the receiving loop runs at once (its announce credit was only peeked at)."""
        if self._announces.value == 0:
            return None
        new = self._new_announces()
        if not len(new):
            return None
        epochs, versions = self._mailbox["epoch"][new], self._mailbox["version"][new]
        newer = (epochs > self.epoch) | ((epochs == self.epoch) & (versions > target))
        if newer.any():
            i = int(np.argmax(newer))
            return (f"source {int(new[i])} announced version {int(versions[i])} of plan epoch "
                    f"{int(epochs[i])}")
        self._mark_answered(new, epochs, versions)
        for rank, epoch, version in zip(new.tolist(), epochs.tolist(), versions.tolist(), strict=True):
            if epoch != self.epoch:
                self._refuse(rank, version, REFUSED_EPOCH)
            elif version != target:  # same version from another source: granted already
                self._refuse(rank, version, REFUSED_NOT_NEWER if version <= self._version else REFUSED_BUSY)
        return None

    def _dropped_during(self) -> str | None:
        """While landing: the coordinator dropped this destination (the sources reported it failed and
        write to a plan without it), so the version can no longer complete here."""
        if self._dropped.is_set() or self._superseded is not None:
            return "the coordinator dropped this destination from the plan (reported failed)"
        return None

    def _grant_record(self, version: int, shadow: int, status: int, held: int | None = None) -> int:
        """Fills the next outbox ring slot with a grant record; returns the slot."""
        slot = GRANT_OUT + self._grant_next % GRANT_RING
        self._grant_next += 1
        for t in self._grant_writes.pop(slot, []):
            try:  # long done in practice: a ring turn is GRANT_RING answers
                t.wait(1.0)
            except (TransportError, TimeoutError):
                pass
        g = self._grant_out[slot:slot + 1]  # a view: the outbox record the engine writes from
        g["held"] = self._version if held is None else held
        g["epoch"], g["shadow"], g["status"], g["version"] = self.epoch, shadow, status, version
        return slot

    def _grant(self, version: int, shadow: int, status: int, ranks: list[int],
               held: int | None = None) -> None:
        """Writes one grant record to sources ``ranks`` (and, for a granted version in a relay chain, to the
        predecessor, which forwards into this member)."""
        slot = self._grant_record(version, shadow, status, held)
        mark("destination %d version %d: grant %d to %s", self.rank, version, status, ranks)
        writes = []
        # (what, link, sender index of the grant slot at the receiver)
        targets = [(f"source {r}", self._sources[r], self.rank) for r in ranks if r in self._sources]
        pred = None if self._relay is None else self._relay.predecessor
        if status == GRANTED and pred is not None:
            targets.append((f"relay predecessor {pred.info.rank}", pred, 0))
        for what, link, sender in targets:
            try:
                writes.append(self.engine.write(
                    self._outbox_region, slot * SLOT_BYTES, link.peer, link.mailbox,
                    grant_slot(sender, version) * SLOT_BYTES, SLOT_BYTES, imm=grant_imm(sender, version)))
            except TransportError as exc:
                self.log.warning("destination %d: grant of version %d to %s failed: %s", self.rank, version,
                                 what, exc)
        self._grant_writes[slot] = writes

    def _refuse(self, rank: int, version: int, status: int) -> None:
        self.log.warning("destination %d: refused version %d announced by source %d (%s; holds version %d, "
                         "plan epoch %d)", self.rank, version, rank,
                         {REFUSED_NOT_NEWER: "not newer", REFUSED_BUSY: "landing a newer one",
                          REFUSED_EPOCH: "another plan epoch"}[status], self._version, self.epoch)
        self._grant(version, 0, status, [rank])

    # -- landing a granted version ---------------------------------------------------------------
    def _land(self, target: int) -> None:
        buffer = self._landing_shadow
        counter = self.engine.counter(data_imm(self.epoch, target))
        deadline = time.monotonic() + self._push_timeout
        complete = False
        reason: str | None = None
        delta = self._delta is not None
        # Delta inboxes ack from here: the changes are scattered after the last immediate, before the flip.
        inplace_trigger = self._relay is None and self.mode == "inplace" and not delta
        acks = self._arm_acks(counter, target) if inplace_trigger else None
        armed = True
        try:
            if self._relay is not None:
                complete, reason, armed = (self._land_relay_delta(target, buffer, counter, deadline) if delta
                                           else self._land_relay(target, buffer, deadline))
            elif delta:
                complete, reason = self._land_delta(target, buffer, counter, deadline)
        except Exception as exc:
            # Entries that do not apply (a corrupt payload), say: part of the version may be in the buffer.
            # It is abandoned, never left "updating" (the receiving loop would only log the error).
            complete, reason = False, f"landing it failed: {exc}"
        while self._relay is None and not delta and not self._stop.is_set() and time.monotonic() < deadline:
            try:
                # Short slices: the native wait returns the moment the last immediate arrives, and between
                # slices a newer plan or version that makes this one dead is noticed at once.
                left = max(deadline - time.monotonic(), 0.001)
                counter.wait(self._expected, timeout=min(WAIT_SLICE_S, left))
                complete = True
                break
            except TimeoutError:
                reason = self._unanswered_during(target) or self._dropped_during()
                if reason is not None:
                    break
        if not complete and acks:
            # Too late for the ack to go out unless it already has: then every immediate was here. Every
            # trigger is cancelled (a list, not all()'s short cut): none may ack an abandoned version later.
            if not all([f.cancel() for _, f in acks]):
                try:
                    counter.wait(self._expected, timeout=1.0)
                    complete = True
                except TimeoutError:
                    pass
        if not complete:
            self._abandon(target, counter, reason or (
                "closing" if self._stop.is_set() else
                f"incomplete after {self._push_timeout} s (a source failed?)"))
            return
        with self._lock:
            # The next push writes the other shadow; wait out an apply() that may be reading it.
            while self._applying:
                self._lock.wait(1.0)
            self._version = target
            self._landing = None
            self._dirty = False
            if self.mode == "staged":
                self._complete_buffer = buffer
                next_buffer = 1 - buffer
            else:
                next_buffer = 0
            self._lock.notify_all()
        if acks is None:
            applied = self._delta.apply_seconds if delta and self._delta is not None else 0.0
            self._ack(target, next_buffer, int(applied * 1e6))
        else:
            for rank, f in acks:
                try:
                    f.transfer.wait(10.0)
                except (TransportError, TimeoutError) as exc:
                    self.log.warning("destination %d: ack to source %d failed: %s", self.rank, rank, exc)
        if delta:
            self._after_delta(target, buffer)
        if self._relay is not None:
            if not armed:
                self._await_successor(target, deadline)
            self._relay.done(target)  # after the ack: it is on the sources' critical path

    def _count(self, counter: Any, n: int, target: int, deadline: float,
               between: Callable[[], bool] | None = None) -> tuple[bool, str | None]:
        """Waits for ``n`` immediates on ``counter`` in short slices (a newer plan or version, a drop or
        closing end it): (complete, why not). ``between()`` runs between slices; while it returns False
        the slices are short (a relay member watching for its successor's grant)."""
        while not self._stop.is_set() and time.monotonic() < deadline:
            slice_s = WAIT_SLICE_S if between is None or between() else WATCH_SLICE_S
            try:
                counter.wait(n, timeout=min(slice_s, max(deadline - time.monotonic(), 0.001)))
                return True, None
            except TimeoutError:
                reason = self._unanswered_during(target) or self._dropped_during()
                if reason is not None:
                    return False, reason
        return False, None

    def _read_part(self, target: int, part: int | None, headers: Any, payloads: Any, deadline: float,
                   between: Callable[[], bool] | None) -> tuple[bool, str | None]:
        """Part ``part`` of ``target`` (None: the final one) read from the inbox: every source's header of
        it (immediates on ``headers``), then the immediates those headers announce (on ``payloads``),
        then the entries from the payloads, which are in place only now (a header can land before its
        payload). The next :meth:`DeltaReceiver.apply` scatters them."""
        inbox = self._delta
        assert inbox is not None
        sources = sorted(self._sources)
        complete, reason = self._count(headers, len(sources), target, deadline, between)
        if not complete:
            return False, reason
        mark("destination %d version %d: part %s headers in", self.rank, target, part)
        try:
            total = inbox.read_headers(sources, self.epoch, target, part)
        except WeightSyncError as exc:
            return False, str(exc)
        complete, reason = self._count(payloads, total, target, deadline, between)
        if complete:
            mark("destination %d: part %s payloads in", self.rank, part)
            inbox.read_entries()
            mark("destination %d: part %s entries read", self.rank, part)
        return complete, reason

    def _land_parts(self, target: int, buffer: int, counter: Any, deadline: float,
                    between: Callable[[], bool] | None = None) -> tuple[bool, str | None]:
        """A delta inbox destination: the early parts of ``target`` in order, each scattered into
        ``buffer`` as it lands (while the sources compare and send the next part), then the final part
        read, its data immediates (every write sent as planned, the final payloads) on ``counter``. Its
        entries are left to the caller's apply."""
        assert self._delta is not None
        for part in range(SPANS):
            headers = self.engine.counter(delta_part_imm(self.epoch, target, part, header=True))
            payloads = self.engine.counter(delta_part_imm(self.epoch, target, part, header=False))
            complete, reason = self._read_part(target, part, headers, payloads, deadline, between)
            if not complete:
                return False, reason
            self._delta.apply(buffer, wait=False)  # the final apply waits for it
            mark("destination %d: part %d scatter queued", self.rank, part)
        headers = self.engine.counter(delta_header_imm(self.epoch, target))
        return self._read_part(target, None, headers, counter, deadline, between)

    def _land_delta(self, target: int, buffer: int, counter: Any, deadline: float) -> tuple[bool, str | None]:
        """A delta inbox destination: every part of ``target`` (:meth:`_land_parts`), the final one's sparse
        entries scattered into ``buffer`` last."""
        assert self._delta is not None
        complete, reason = self._land_parts(target, buffer, counter, deadline)
        if complete:
            self._delta.apply(buffer)
        return complete, reason

    def _land_relay_delta(self, target: int, buffer: int, counter: Any, deadline: float
                          ) -> tuple[bool, str | None, bool]:
        """A relay chain member with a delta inbox: every source's header and payload come straight from
        the source (the entries are the same for every member: they hold one layout and, for a delta, one
        version); the relay chunks the entries say went as planned come through the chain and are
        forwarded as they land (the triggers armed once the successor grants); the sparse entries are
        scattered into ``buffer`` once all of that is here. A chunk sent sparse arrives nowhere, so its
        trigger never fires (the next version's begin cancels it). Returns (complete, why not, armed)."""
        relay, inbox = self._relay, self._delta
        assert relay is not None and inbox is not None
        relay.begin(self.epoch, target, buffer, deadline)
        armed = relay.successor is None

        def arm_if_granted() -> bool:
            nonlocal armed
            if not armed:
                armed = self._successor_answered(target)
            return armed

        def superseded() -> str | None:
            arm_if_granted()
            return self._unanswered_during(target) or self._dropped_during()

        complete, reason = self._land_parts(target, buffer, counter, deadline, arm_if_granted)
        if not complete:
            return False, reason, armed
        try:
            planned = inbox.planned_chunks(relay.chunks_at(), len(relay.imm))
        except WeightSyncError as exc:
            return False, str(exc), armed
        complete, reason = relay.wait(deadline, self._stop, superseded, WAIT_SLICE_S, arm_if_granted, planned)
        if complete:
            inbox.apply(buffer)
        return complete, reason, armed

    def _after_delta(self, target: int, buffer: int) -> None:
        """After the ack: ``buffer`` holds ``target``; a staged destination brings its other shadow to it
        too (the next version is granted into it, as a delta on ``target``)."""
        assert self._delta is not None
        self._delta.completed(target, buffer)
        try:
            self._delta.sync_other(target, buffer)
        except Exception as exc:  # the next version into that shadow is then dense
            self.log.error("destination %d: bringing the other shadow to version %d failed: %s", self.rank,
                           target, exc)

    def _land_relay(self, target: int, buffer: int, deadline: float) -> tuple[bool, str | None, bool]:
        """Relay: waits for every chunk of ``target``, arming the forwards into the successor as soon as it
        has granted the version (into the shadow it granted). Returns (complete, why not, armed)."""
        relay = self._relay
        assert relay is not None
        relay.begin(self.epoch, target, buffer, deadline)
        armed = relay.successor is None

        def arm_if_granted() -> None:  # a read of one slot: cheap enough before every chunk's wait
            nonlocal armed
            if not armed:
                armed = self._successor_answered(target)

        def superseded() -> str | None:
            arm_if_granted()
            return self._unanswered_during(target) or self._dropped_during()

        complete, reason = relay.wait(deadline, self._stop, superseded, WAIT_SLICE_S, arm_if_granted)
        return complete, reason, armed

    def _successor_answered(self, target: int, credited: bool = False) -> bool:
        """Whether the relay successor answered ``target``; if it granted it, arms the forwards into the
        shadow it granted. ``credited``: the caller took the grant's immediate with a wait."""
        relay = self._relay
        assert relay is not None and relay.successor is not None
        # The slot only once the immediate of the write that filled it is in (weightsync.wire.GRANT_RECORD:
        # before that it may show the version beside the last grant's shadow).
        if self.engine.counter(grant_imm(0, target)).reset() == 0 and not credited:
            return False
        g = self._grant_box[grant_slot(0, target) - MAX_SLOTS]
        if int(g["version"]) != target or int(g["epoch"]) != self.epoch:
            return False
        if int(g["status"]) == GRANTED:
            try:
                relay.arm(int(g["shadow"]))
            except TransportError as exc:  # the version still lands here; the successor misses it
                self.log.error("destination %d: not forwarding version %d: %s", self.rank, target, exc)
        else:
            self.log.warning("destination %d: relay successor %d refused version %d (status %d): not "
                             "forwarding it", self.rank, relay.successor.rank, target, int(g["status"]))
        return True

    def _await_successor(self, target: int, deadline: float) -> None:
        """``target`` is complete here but the successor has not granted it yet: waits for its grant (until
        the deadline, or a newer announce) and arms the forwards then (they fire at once: every chunk is
        here)."""
        counter = self.engine.counter(grant_imm(0, target))
        credited = False
        while not self._successor_answered(target, credited):
            credited = False
            left = deadline - time.monotonic()
            if self._stop.is_set() or left <= 0:
                self.log.warning("destination %d: relay successor granted no version %d: not forwarding it",
                                 self.rank, target)
                return
            try:
                counter.wait(1, timeout=min(WAIT_SLICE_S, left))
                credited = True
            except TimeoutError:
                if self._announces.value and self._unanswered_during(target) is not None:
                    return  # a newer version is announced: the successor will be asked for that one

    def _abandon(self, target: int, counter: Any, reason: str) -> None:
        """Gives version ``target`` up: it stops landing, its credits (and the relay's) are dropped, so
        that nothing that arrives for it later can count for another version."""
        with self._lock:
            self._landing = None
            if self.mode == "inplace":
                self._dirty = True
        counter.reset()
        if self._delta is not None:
            self.engine.counter(delta_header_imm(self.epoch, target)).reset()
            for part in range(SPANS):
                for header in (True, False):
                    self.engine.counter(delta_part_imm(self.epoch, target, part, header)).reset()
        if self._relay is not None:
            self._relay.abandon(target)
        self.log.warning("destination %d: version %d abandoned: %s", self.rank, target, reason)

    def _arm_acks(self, counter: Any, version: int) -> list[tuple[int, Any]] | None:
        """``inplace``: one trigger per source, so that the engine's own thread acks ``version`` the moment
        its last immediate arrives, without waking this thread on the sources' critical path (0.2 to
        1.3 ms per push on 4 x H100). The ack's slot alternates with the version's parity: a NIC may
        still be reading the previous one. None (the ack is then written by this thread) if arming failed."""
        slot = version & 1
        self._outbox[slot] = (version, 0, 0)
        due = consumed(counter) + self._expected
        armed: list[tuple[int, Any]] = []
        try:
            for rank, s in self._sources.items():
                armed.append((rank, self.engine.forward(
                    counter.imm, due, self._outbox_region, slot * SLOT_BYTES, s.peer, s.mailbox,
                    self.rank * SLOT_BYTES, SLOT_BYTES, imm=ACK)))
        except TransportError as exc:
            for _, f in armed:
                f.cancel()
            self.log.warning("destination %d: arming the acks of version %d failed (%s); acking from "
                             "Python", self.rank, version, exc)
            return None
        return armed

    def _ack(self, version: int, next_buffer: int, apply_us: int = 0) -> None:
        mark("destination %d version %d: ack", self.rank, version)
        slot = version & 1
        # ``reserved``: microseconds this destination spent scattering a delta (PushStats.apply_seconds).
        self._outbox[slot] = (version, next_buffer, apply_us)
        transfers = []
        for rank, s in self._sources.items():
            try:
                transfers.append(self.engine.write(self._outbox_region, slot * SLOT_BYTES, s.peer, s.mailbox,
                                                   self.rank * SLOT_BYTES, SLOT_BYTES, imm=ACK))
            except TransportError as exc:
                self.log.warning("destination %d: ack to source %d failed: %s", self.rank, rank, exc)
        for t in transfers:
            try:
                t.wait(10.0)
            except (TransportError, TimeoutError) as exc:
                self.log.warning("destination %d: ack failed: %s", self.rank, exc)

    def close(self) -> None:
        """Stops the membership watcher and the receiving thread, and closes the engine."""
        self._stop.set()
        watcher = getattr(self, "_member_watcher", None)
        if watcher is not None:
            watcher.stop()
        thread = getattr(self, "_thread", None)
        if thread is not None:
            thread.join(5)
        super().close()
