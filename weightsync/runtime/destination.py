"""A rollout rank's side of a push: ``Destination``.

A destination's own thread (never the user's code) waits for announces (weightsync.wire.ANNOUNCE_RECORD
in its mailbox), then for the expected number of data immediates of that version (computed by the
coordinator from the same lowering the sources run), flips its version, and acks
(weightsync.wire.ACK_RECORD into each source's mailbox). A version is visible only when all of its
immediates have arrived: immediates arrive after their bytes are placed, and nothing assumes ordering
between writes.

Staged destinations receive into one of two shadow copies; the ack tells sources which one the next
push must use, so ``apply()`` (one local copy of the newest complete shadow into the live tensors) never
reads a shadow that is being written. Inplace destinations receive straight into the live tensors.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping
from typing import Any

import numpy as np

from weightsync.engine import Region, TransferEngine
from weightsync.errors import PlanError, TimeoutError, TransportError, WeightSyncError  # noqa: A004
from weightsync.plan.parts import DESTINATION, DestinationPart
from weightsync.runtime.links import PeerLink
from weightsync.runtime.participant import Participant, contiguous
from weightsync.runtime.relay import RelayMember, consumed
from weightsync.wire import ACK, ACK_RECORD, ANNOUNCE, ANNOUNCE_RECORD, SLOT_BYTES, data_imm

# How often a waiting destination looks for a newer plan or version (the native wait itself returns the
# moment the last immediate arrives; this bounds only how late a dead version is given up).
WAIT_SLICE_S = 0.02


class Destination(Participant):
    """A rollout rank: receives into its tensors (``inplace``) or into shadows (``staged``)."""

    role = DESTINATION
    inbox_record = ANNOUNCE_RECORD  # sources announce into this destination's mailbox
    outbox_record = ACK_RECORD  # and it acks from its outbox

    def __init__(self, group: str, rank: int, tensors: Mapping[str, Any], mode: str = "staged", *,
                 timeout: float = 120.0, push_timeout: float = 60.0, engine: TransferEngine | None = None,
                 secret: str | None = None) -> None:
        if mode not in ("inplace", "staged"):
            raise WeightSyncError(f"destination mode must be 'inplace' or 'staged', not {mode!r}")
        super().__init__(group, rank, tensors, timeout, engine, secret)
        self.mode = mode
        self._push_timeout = push_timeout
        self._lock = threading.Condition()
        self._version = -1
        self._live_version = -1
        self._landing: int | None = None
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
        self._sources: dict[int, PeerLink] = {}
        self._expected = 0
        self._relay: RelayMember | None = None  # this member's place in the relay chain, if any
        self._stop = threading.Event()
        self._announces = self.engine.counter(ANNOUNCE)
        self._join(descriptors)
        self._thread = threading.Thread(target=self._run, name=f"weightsync-{group}-dst{rank}", daemon=True)
        self._thread.start()

    def _apply_part(self, part: DestinationPart) -> None:
        self._expected = part.expected
        self._sources = {r: PeerLink(s, self._peer(s.address)) for r, s in part.sources.items()}
        if self._relay is not None:
            self._relay.disarm()  # the previous plan's triggers name immediates no one sends any more
        self._relay = None
        if part.relay is not None:
            succ = part.relay.successor
            self._relay = RelayMember(self.engine, self.rank, part.relay,
                                      None if succ is None else self._peer(succ.address), self._key_regions,
                                      self.log)
            unknown = self._relay.unknown_keys()
            if unknown:
                raise PlanError(f"destination {self.rank}: relay chunks name tensors {unknown[:3]} it "
                                "does not hold")
            if self.mode == "inplace":
                # Inplace forwards read the live tensors: nothing to choose per push, arm now.
                self._relay.arm(self.epoch, 0, 0)
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
        """True while an announced update is landing (inplace: the live tensors are being written)."""
        with self._lock:
            return self._landing is not None

    def wait(self, version: int | None = None, timeout: float = 60.0) -> int:
        """Blocks until a complete version (``>= version``, or newer than now when None) has landed."""
        deadline = time.monotonic() + timeout
        with self._lock:
            target = self._version + 1 if version is None else version
            while self._version < target:
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

    # -- the receiving thread --------------------------------------------------------------------
    def _run(self) -> None:
        announce = self._announces
        while not self._stop.is_set():
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
        slots = self._mailbox[: len(self._mailbox)]
        epochs = slots["epoch"]
        newest_epoch = int(epochs.max())
        if newest_epoch > self.epoch:
            self._fetch_part(self._timeout)
        current = slots[slots["epoch"] == self.epoch]
        if len(current) == 0:
            return
        newest = int(np.argmax(current["version"]))
        # buffer: bit 0 the shadow this push lands in; bit 1 (relay) the one the successor receives into
        target, raw = int(current["version"][newest]), int(current["buffer"][newest])
        buffer, succ_buffer = raw & 1, (raw >> 1) & 1
        with self._lock:
            if target <= self._version:
                return
            self._landing = target
        counter = self.engine.counter(data_imm(self.epoch, target))
        deadline = time.monotonic() + self._push_timeout
        complete = False
        reason: str | None = None
        acks = self._arm_acks(counter, target) if self._relay is None and self.mode == "inplace" else None
        if self._relay is not None:
            if self._relay.armed != self.epoch:
                # Staged: the shadows are known only now; or the first push after a failed one.
                self._relay.arm(self.epoch, buffer, succ_buffer)
            complete, reason = self._relay.wait(deadline, self._stop, lambda: self._superseded(target))
        while self._relay is None and not self._stop.is_set() and time.monotonic() < deadline:
            try:
                # Short slices: the native wait returns the moment the last immediate arrives, and between
                # slices a newer plan or version that makes this one dead is noticed at once.
                left = max(deadline - time.monotonic(), 0.001)
                counter.wait(self._expected, timeout=min(WAIT_SLICE_S, left))
                complete = True
                break
            except TimeoutError:
                reason = self._superseded(target)
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
            if self.mode == "staged":
                self._complete_buffer = buffer
                next_buffer = 1 - buffer
            else:
                next_buffer = 0
            self._lock.notify_all()
        if acks is None:
            self._ack(target, next_buffer)
        else:
            for rank, f in acks:
                try:
                    f.transfer.wait(10.0)
                except (TransportError, TimeoutError) as exc:
                    self.log.warning("destination %d: ack to source %d failed: %s", self.rank, rank, exc)
        if self._relay is not None:
            # After the ack (it is on the sources' critical path): inplace arms the next push's triggers
            # now (a trigger whose data has already arrived fires at once); staged arms at the announce,
            # which names the shadows.
            if self.mode == "inplace":
                self._relay.arm(self.epoch, 0, 0)
            else:
                self._relay.disarm()

    def _superseded(self, target: int) -> str | None:
        """Why version ``target`` can no longer complete here, or None: a source announced a newer plan
        epoch (membership changed: the version's writers are not this plan's any more) or a newer version
        of this epoch (the sources gave up on ``target``). Announces are only peeked at (credits left for
        the receiving loop, which then lands the newer one at once)."""
        if self._announces.value == 0:
            return None
        slots = self._mailbox
        newest_epoch = int(slots["epoch"].max())
        if newest_epoch > self.epoch:
            return f"a source announced plan epoch {newest_epoch} (this version is of epoch {self.epoch})"
        current = slots["version"][slots["epoch"] == self.epoch]
        if len(current) and int(current.max()) > target:
            return f"a source announced version {int(current.max())} of the same plan"
        return None

    def _abandon(self, target: int, counter: Any, reason: str) -> None:
        """Gives version ``target`` up: it stops landing, its credits (and the relay's) are dropped, so
        that nothing that arrives for it later can count for another version."""
        with self._lock:
            self._landing = None
        counter.reset()
        if self._relay is not None:
            # Forget this push's triggers and pieces; the next push re-arms from the totals then.
            self._relay.reset()
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

    def _ack(self, version: int, next_buffer: int) -> None:
        slot = version & 1
        self._outbox[slot] = (version, next_buffer, 0)
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
        """Stops the receiving thread and closes the engine."""
        self._stop.set()
        self._thread.join(5)
        super().close()
