"""A destination's place in a relay chain: it counts each relay chunk as it lands and has its engine
forward the chunk to the next member from the engine's own thread (a trigger armed per chunk), so the
model crosses every link about once."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

from weightsync.engine import Region, TransferEngine
from weightsync.errors import TimeoutError, TransportError  # noqa: A004
from weightsync.plan.parts import RelayPart


def consumed(counter: Any) -> int:
    """Immediates of ``counter`` consumed (or dropped) so far: total minus credits still held, read so
    that no arrival falls between the two reads (only the receiving thread consumes them)."""
    while True:
        before = counter.value
        total = counter.total
        if counter.value == before:
            return total - before


class RelayMember:
    """Relay state of one destination for one plan epoch: per chunk its counter, pieces and place, and
    the triggers armed for the next push."""

    def __init__(self, engine: TransferEngine, rank: int, part: RelayPart, successor_peer: Any,
                 key_regions: Mapping[str, list[Region]], log: Any) -> None:
        self.engine = engine
        self.rank = rank
        self.position = part.position
        self.chain = list(part.chain)
        self.successor = part.successor
        self.successor_peer = successor_peer
        self.key_regions = key_regions
        self.log = log
        # Python lists: arming walks every chunk once per push, and list items are cheaper than array items.
        self.imm = part.imm.tolist()
        self.pieces = part.pieces.tolist()
        self.counters = [engine.counter(int(i)) for i in self.imm]
        self.keys = list(part.keys)
        self.offset = part.offset.tolist()
        self.row_bytes = part.row_bytes.tolist()
        self.rows = part.rows.tolist()
        self.pitch = part.pitch.tolist()
        self.forwards: list[Any] = []  # triggers armed for the next push
        self.armed: int | None = None  # the plan epoch the triggers were armed for (None: not armed)

    def unknown_keys(self) -> list[str]:
        """Keys the chunks name that this destination does not hold (a plan it cannot run)."""
        return sorted(set(self.keys) - set(self.key_regions))

    def arm(self, epoch: int, own_buffer: int, succ_buffer: int) -> None:
        """Arms, for the next push, one trigger per relay chunk: once all of the chunk's pieces of that
        push have landed here (the counter's total reaches what was consumed so far plus one push's
        pieces: absolute, so a trigger armed after its data arrived fires at once), the engine's own
        thread writes the chunk from the shadow it landed in to the same place in the successor's
        shadow ``succ_buffer``, with the same immediate, so the successor counts and forwards alike."""
        self.disarm()
        succ = self.successor
        if succ is None:
            self.armed = epoch
            return
        peer, descs = self.successor_peer, succ.descriptors
        forwards = []
        try:
            for c, imm in enumerate(self.imm):
                key, off, rows = self.keys[c], self.offset[c], self.rows[c]
                pitch = self.pitch[c] if rows > 1 else 0
                due = consumed(self.counters[c]) + self.pieces[c]
                forwards.append(self.engine.forward(
                    imm, due, self.key_regions[key][own_buffer], off, peer, descs[key][succ_buffer], off,
                    self.row_bytes[c], imm=imm, rows=rows, src_pitch=pitch, dst_pitch=pitch))
        except TransportError as exc:
            for f in forwards:
                f.cancel()
            raise TransportError(f"destination {self.rank}: arming relay to destination {succ.rank} "
                                 f"failed: {exc}") from None
        self.forwards = forwards
        self.armed = epoch

    def disarm(self) -> None:
        """Cancels the armed triggers."""
        for f in self.forwards:
            f.cancel()
        self.forwards = []
        self.armed = None

    def wait(self, deadline: float, stop: threading.Event, superseded: Callable[[], str | None],
             slice_s: float = 0.02) -> tuple[bool, str | None]:
        """Every relay chunk of this push has landed here (one push's pieces of each, consumed):
        (True, None); else (False, why). ``superseded()``: why this push can no longer complete (a newer
        plan or version was announced: a member before this one failed, or the sources gave up), or None."""
        for counter, pieces in zip(self.counters, self.pieces, strict=True):
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

    def reset(self) -> None:
        """Forgets this push's triggers and pieces; the next push re-arms from the totals then."""
        self.disarm()
        for c in self.counters:
            c.reset()
