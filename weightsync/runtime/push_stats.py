"""``PushStats``: what one source's push did (``ws.push``, ``PushHandle.wait``). A module of its own so that
the push (weightsync.runtime.push), its handle (weightsync.runtime.push_handle) and the source
(weightsync.runtime.source) all name it without importing each other."""

from __future__ import annotations

from dataclasses import dataclass, field


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
