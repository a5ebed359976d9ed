"""A destination's place in a relay chain: it counts each relay chunk as it lands and has its engine
forward the chunk to the next member from the engine's own thread (a trigger armed per chunk), so the
model crosses every link about once.

Every version counts on immediates of its own (weightsync.wire.relay_imm carries the version's low 8
bits): pieces of an abandoned version that arrive late cannot complete a later one. A member arms a
version's forwards only once its successor has granted that version (into the shadow the successor
chose), and only after the forwards of the previous version that fired have completed locally."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from weightsync.engine import Region, TransferEngine
from weightsync.errors import TimeoutError, TransportError  # noqa: A004
from weightsync.plan.parts import RelayPart
from weightsync.wire import RELAY_VERSIONS, relay_version_bits


def consumed(counter: Any) -> int:
    """Immediates of ``counter`` consumed (or dropped) so far: total minus credits still held, read so
    that no arrival falls between the two reads (only the receiving thread consumes them)."""
    while True:
        before = counter.value
        total = counter.total
        if counter.value == before:
            return total - before


class RelayMember:
    """Relay state of one destination for one plan epoch: per chunk its immediate (version bits 0),
    pieces and place, and the version being received with its counters and armed triggers."""

    def __init__(self, engine: TransferEngine, rank: int, part: RelayPart, successor_peer: Any,
                 key_regions: Mapping[str, list[Region]], log: Any, predecessor: Any = None) -> None:
        self.engine = engine
        self.rank = rank
        self.position = part.position
        self.chain = list(part.chain)
        self.successor = part.successor
        self.successor_peer = successor_peer
        self.predecessor = predecessor  # a PeerLink: the member that forwards into this one (None: head)
        self.key_regions = key_regions
        self.log = log
        # Python lists: arming walks every chunk once per push, and list items are cheaper than array items.
        self.imm = [int(i) for i in part.imm.tolist()]
        self.pieces = part.pieces.tolist()
        self.keys = list(part.keys)
        self.offset = part.offset.tolist()
        self.row_bytes = part.row_bytes.tolist()
        self.rows = part.rows.tolist()
        self.pitch = part.pitch.tolist()
        self.epoch = -1
        self.version: int | None = None  # the version being received (None: none)
        self.own = 0  # the shadow it lands in here
        self.counters: list[Any] = []
        self.base: list[int] = []  # per chunk: immediates its counter had consumed when the version began
        self.forwards: list[Any] = []  # triggers armed for ``version`` (or the last one)
        self._at: dict[tuple[str, int], int] | None = None

    def chunks_at(self) -> dict[tuple[str, int], int]:
        """Each chunk by where it lands (key, byte offset; chunks never overlap): a delta header's entries
        name the writes they cover so."""
        if self._at is None:
            self._at = {(k, o): c for c, (k, o) in enumerate(zip(self.keys, self.offset, strict=True))}
        return self._at

    def unknown_keys(self) -> list[str]:
        """Keys the chunks name that this destination does not hold (a plan it cannot run)."""
        return sorted(set(self.keys) - set(self.key_regions))

    def _counters(self, version: int) -> list[Any]:
        bits = relay_version_bits(version)
        return [self.engine.counter(imm | bits) for imm in self.imm]

    def begin(self, epoch: int, version: int, own_buffer: int, deadline: float) -> None:
        """Starts receiving ``version`` into shadow ``own_buffer``. The previous version's forwards that
        fired are waited for (their bytes must not land in the successor after this version's), the
        others cancelled."""
        self._settle_forwards(deadline)
        self.epoch, self.version, self.own = epoch, version, own_buffer
        self.counters = self._counters(version)
        self.base = [consumed(c) for c in self.counters]

    def arm(self, succ_buffer: int) -> None:
        """Arms one trigger per relay chunk of the version begun: once all of the chunk's pieces have
        landed here (the counter's total reaches what was consumed when the version began plus one
        push's pieces: absolute, so a trigger armed after its data arrived, or was consumed here, fires
        at once), the engine's own thread
        writes the chunk from the shadow it landed in to the same place in the successor's shadow
        ``succ_buffer`` (the one the successor granted), with the same immediate, so the successor
        counts and forwards alike."""
        succ = self.successor
        assert succ is not None and self.version is not None
        peer, descs = self.successor_peer, succ.descriptors
        bits = relay_version_bits(self.version)
        forwards = []
        try:
            for c, imm in enumerate(self.imm):
                key, off, rows = self.keys[c], self.offset[c], self.rows[c]
                pitch = self.pitch[c] if rows > 1 else 0
                due = self.base[c] + self.pieces[c]
                forwards.append(self.engine.forward(
                    imm | bits, due, self.key_regions[key][self.own], off, peer, descs[key][succ_buffer], off,
                    self.row_bytes[c], imm=imm | bits, rows=rows, src_pitch=pitch, dst_pitch=pitch))
        except TransportError as exc:
            for f in forwards:
                f.cancel()
            raise TransportError(f"destination {self.rank}: arming relay to destination {succ.rank} "
                                 f"failed: {exc}") from None
        self.forwards = forwards

    def _settle_forwards(self, deadline: float) -> None:
        for f in self.forwards:
            if f.cancel():
                continue
            try:
                f.transfer.wait(max(min(deadline - time.monotonic(), 5.0), 0.0))
            except (TransportError, TimeoutError) as exc:
                self.log.warning("destination %d: a relay forward of version %s failed: %s", self.rank,
                                 self.version, exc)
        self.forwards = []

    def disarm(self) -> None:
        """Cancels the triggers not fired yet (a new plan: they name immediates no one sends any more)."""
        for f in self.forwards:
            f.cancel()
        self.forwards = []

    def landed(self) -> bool:
        """Every chunk of the version begun has landed here (nothing consumed)."""
        return all(c.value >= p for c, p in zip(self.counters, self.pieces, strict=True))

    def wait(self, deadline: float, stop: threading.Event, superseded: Callable[[], str | None],
             slice_s: float = 0.02, before: Callable[[], object] | None = None,
             chunks: Sequence[int] | None = None) -> tuple[bool, str | None]:
        """Every relay chunk of the version begun (or those of ``chunks``: a delta version's chunks sent as
        planned) has landed here (one push's pieces of each, consumed): (True, None); else (False, why;
        None: the deadline). ``superseded()``: why this version can no longer complete (a newer plan or
        version was announced: a member before this one failed, or the sources gave up), or None; asked
        between slices. ``before()`` runs before each chunk's wait."""
        which = range(len(self.counters)) if chunks is None else chunks
        for c in which:
            counter, pieces = self.counters[c], self.pieces[c]
            if before is not None:
                before()
            while True:
                left = deadline - time.monotonic()
                if stop.is_set():
                    return False, "closing"
                if left <= 0:
                    return False, None
                try:
                    counter.wait(pieces, timeout=min(slice_s, max(left, 0.001)))
                    break
                except TimeoutError:
                    reason = superseded()
                    if reason is not None:
                        return False, reason
        return True, None

    def _forget(self, version: int) -> None:
        """Drops credits of the version ``RELAY_VERSIONS / 2`` away from ``version``: its immediates are the
        next to be reused, and a piece that late cannot exist (its push timed out long before)."""
        for c in self._counters(version + RELAY_VERSIONS // 2):
            c.reset()

    def done(self, version: int) -> None:
        """``version`` completed here (its forwards have all fired; the next ``begin`` waits for them)."""
        self._forget(version)

    def abandon(self, version: int) -> None:
        """``version`` was given up: its triggers not fired are cancelled, its credits dropped (late pieces
        then count on its own counters, which no later version reads)."""
        self.forwards = [f for f in self.forwards if not f.cancel()]  # fired: the next begin waits for them
        for c in self.counters:
            c.reset()
        self._forget(version)
