"""One push's grants as they come in (weightsync.wire.GRANT_RECORD): a destination answers each announce
with a grant into this source's grant slot for it, then the grant's immediate (``grant_imm(rank,
version)``). A slot is read only once that immediate is in. ``Grants`` says which destinations granted
(into which shadow, taking a delta on which version), refused the version, answered for another plan
epoch, failed their announce, or did not answer by the deadline; the push (weightsync.runtime.push)
decides what to write on that."""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

import numpy as np

from weightsync.engine import TransferEngine
from weightsync.errors import TimeoutError, TransportError  # noqa: A004
from weightsync.runtime.links import DestinationLink
from weightsync.wire import GRANTED, MAX_SLOTS, REFUSED_EPOCH, grant_imm, grant_slot

GRANT_SLICE_S = 0.02  # between looks at announce transfers that failed (a dead destination)
# Each destination's grant has a counter of its own and a wait watches one: while several are pending,
# the one watched is changed this often, so that another's grant is seen at most this late (it only
# matters while one is slow: when every destination answers at once, each wait returns at its arrival).
GRANT_TURN_S = 0.002
# Once the first destination has answered, how much longer the others get before the writes start
# without them (they are then served as their grants come in): at least this, or twice the first's time.
GRANT_GRACE_S = 0.05


class Grants:
    """The grants of one push of version ``version`` from a source of plan epoch ``epoch``: created once
    its announces (``announces``, the posted writes by destination) are out. A destination granted gets
    its descriptor table for the shadow it granted (``DestinationLink.descs``)."""

    def __init__(self, engine: TransferEngine, box: np.ndarray, dests: Mapping[int, DestinationLink],
                 group: str, epoch: int, version: int, deadline: float, announces: list[tuple[int, Any]],
                 failed: dict[int, str]) -> None:
        self.box = box  # the source's grant slots (indexed by grant_slot() - MAX_SLOTS)
        self.dests = dests
        self.group = group
        self.epoch = epoch
        self.version = version
        self.deadline = deadline
        self.failed = failed
        self.announces = dict(announces)
        # Per destination, the counter of its grant's immediate: its slot is read only once a credit is in.
        # Its credits are not dropped here: a destination grants a version to all its sources at the first
        # announce of it, so the grant can be in before this source has announced.
        self.counters = {r: engine.counter(grant_imm(r, version)) for r in dests}
        self.credited: set[int] = set()  # credit taken by a wait, slot not read yet
        self.turn = 0  # which pending destination's counter the next wait watches
        self.pending = {r for r in dests if r not in failed}
        self.granted: dict[int, int] = {}  # rank -> shadow
        self.bases: dict[int, int] = {}  # rank -> the version a delta into its shadow may be taken on
        self.refused: dict[int, str] = {}  # not newer / busy: nothing written, the push raises
        self.stale: set[int] = set()  # another plan epoch: failed for this push, not reported
        self.ungranted: set[int] = set()  # no answer by the deadline
        self.started = time.monotonic()
        self.seconds = 0.0  # the announces' grants in: every destination's, or the first's and a grace

    def wait(self) -> set[int]:
        """Waits for every destination's answer, or, once one answered, a grace for the others; returns
        the destinations granted by then (the writes start with them)."""
        until = self.deadline
        first = None
        while self.pending and time.monotonic() < until:
            self.step(until)
            if first is None and (self.granted or self.refused):
                first = time.monotonic()
                until = min(self.deadline, first + max(GRANT_GRACE_S, 2 * (first - self.started)))
        self.seconds = time.monotonic() - self.started
        return set(self.granted)

    def step(self, until: float) -> list[int]:
        """The destinations newly granted: those whose grant is in now, else after one wait (until
        ``until`` at most) on a pending destination's counter, turn by turn."""
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

    def _poll(self) -> list[int]:
        """Reads the grant slots of the destinations still pending; returns those newly granted."""
        v = self.version
        newly = []
        for r in sorted(self.pending):
            # The slot only once the immediate of the write that filled it is in: until then it may hold
            # any mix of this record's bytes and the last one's, version included (the counter's lock
            # also orders the reads below after the engine thread's count, on a weakly ordered CPU).
            credited = self.counters[r].reset() > 0 or r in self.credited
            self.credited.discard(r)
            g = self.box[grant_slot(r, v) - MAX_SLOTS]
            # Credit beside another version: a late grant of an earlier version with the same low bits.
            if credited and int(g["version"]) == v:
                epoch, status = int(g["epoch"]), int(g["status"])
                if epoch < self.epoch or (epoch == self.epoch and status == REFUSED_EPOCH):
                    pass  # an answer to an announce of an earlier plan
                elif epoch > self.epoch:
                    self.pending.discard(r)
                    self.stale.add(r)
                    self.failed[r] = (f"destination {r} holds plan epoch {epoch}, this source {self.epoch}: "
                                      "nothing written (the next push uses the new plan)")
                    continue
                elif status == GRANTED:
                    self.pending.discard(r)
                    self.granted[r] = int(g["shadow"])
                    self.bases[r] = int(g["held"])
                    d = self.dests[r]
                    d.descs = d.descriptors(int(g["shadow"]))
                    newly.append(r)
                    continue
                else:
                    self.pending.discard(r)
                    self.refused[r] = (f"group {self.group!r}: version {v} is not newer than version "
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

    def close(self) -> None:
        """No more waiting (the deadline, or the push gave up): the destinations still pending did not
        grant in time."""
        self.ungranted |= self.pending
        self.pending = set()
        # Grants that come after this (past the deadline) must not count for a version 256 later.
        for counter in self.counters.values():
            counter.reset()
