"""Typed, frozen parts: what the coordinator hands each participant, and what participants tell it.

A plan *part* is one participant's program for one plan epoch: a :class:`SourcePart` (its writes,
staging chunks and who it announces to) or a :class:`DestinationPart` (the immediates it expects,
whose acks it owes, and its place in a relay chain). Parts cross the control plane as msgpack with a
format number (:data:`PART_FORMAT`): a participant refuses a part of another format instead of reading
fields it does not know.

:class:`EngineInfo` and :class:`Member` go the other way: what a participant says about itself when it
joins (its engine's piece rule, its layout, addresses and descriptors).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import msgpack
import numpy as np

from weightsync.errors import LayoutError, PlanError, WeightSyncError
from weightsync.plan.ops import Plan
from weightsync.plan.writes import (
    CHUNK_DTYPE,
    COPY_DTYPE,
    DEFAULT_CHUNK_BYTES,
    UNIT_DTYPE,
    WRITE_DTYPE,
    Writes,
)
from weightsync.wire import imm_counts

PART_FORMAT = 4  # 1: the untyped dicts before the parts had types; 2: relay parts without predecessor;
# 3: source parts without the plan's destination count
SOURCE, DESTINATION = "source", "destination"


def _pack(d: Mapping[str, Any]) -> bytes:
    return msgpack.packb(d, use_bin_type=True)


def _unpack(blob: bytes) -> dict[Any, Any]:
    return msgpack.unpackb(blob, raw=False, strict_map_key=False)


def _array(b: bytes, dtype: Any) -> np.ndarray:
    return np.frombuffer(b, dtype=dtype)


@dataclass(frozen=True)
class EngineInfo:
    """How a participant's engine cuts writes (so that the planner counts the immediates it delivers),
    and, for a source, how its ops are to be lowered."""

    nics: int
    stripe_threshold: int
    max_piece: int
    chunk_bytes: int = DEFAULT_CHUNK_BYTES  # the largest staged write (sources)
    pack_strided: bool = True  # pack strided source rows into staging (False where 2-D copies are fast)

    def imm_counts(self, nbytes: np.ndarray, rows: np.ndarray) -> np.ndarray:
        """Immediates each of these writes delivers when this engine sends it."""
        return imm_counts(nbytes, rows, self.nics, self.stripe_threshold, self.max_piece)

    def to_dict(self) -> dict[str, int]:
        return {"nics": self.nics, "stripe_threshold": self.stripe_threshold, "max_piece": self.max_piece,
                "chunk_bytes": self.chunk_bytes, "pack_strided": int(self.pack_strided)}

    @staticmethod
    def from_dict(d: Mapping[str, Any]) -> EngineInfo:
        return EngineInfo(int(d["nics"]), int(d["stripe_threshold"]), int(d["max_piece"]),
                          int(d.get("chunk_bytes", DEFAULT_CHUNK_BYTES)), bool(d.get("pack_strided", 1)))


@dataclass(frozen=True)
class Member:
    """A participant as it joined: its layout (msgpack of a ``Layout``), engine, where to reach it
    (engine address, host id), the descriptors of its local tensors (per key, one per buffer: staged
    destinations have 2 shadows) and of its mailbox."""

    role: str
    rank: int
    layout: bytes
    address: bytes
    host: str
    engine: EngineInfo
    descriptors: Mapping[str, list[bytes]] = field(default_factory=dict)
    mailbox: bytes = b""


@dataclass(frozen=True)
class PeerInfo:
    """A peer a participant signals: its engine address and mailbox descriptor."""

    rank: int
    address: bytes
    mailbox: bytes

    def to_dict(self) -> dict[str, Any]:
        return {"rank": self.rank, "address": self.address, "mailbox": self.mailbox}

    @staticmethod
    def from_dict(d: Mapping[str, Any]) -> PeerInfo:
        return PeerInfo(int(d["rank"]), bytes(d["address"]), bytes(d["mailbox"]))


@dataclass(frozen=True)
class Target:
    """A destination a source writes into or announces to. ``slot`` is its index in the plan's
    ``dst_rank`` column (-1: a relay chain member no write of this source names); ``successor`` its next
    chain member's rank (-1: none, or no relay)."""

    rank: int
    slot: int
    address: bytes
    mailbox: bytes
    descriptors: Mapping[str, list[bytes]]
    successor: int = -1

    def to_dict(self) -> dict[str, Any]:
        return {"rank": self.rank, "slot": self.slot, "address": self.address, "mailbox": self.mailbox,
                "descriptors": dict(self.descriptors), "successor": self.successor}

    @staticmethod
    def from_dict(d: Mapping[str, Any]) -> Target:
        return Target(int(d["rank"]), int(d["slot"]), bytes(d["address"]), bytes(d["mailbox"]),
                      {str(k): [bytes(x) for x in v] for k, v in d["descriptors"].items()},
                      int(d["successor"]))


@dataclass(frozen=True, eq=False)
class SourcePart:
    """One source's program for plan ``epoch``.

    ``writes`` (``WRITE_DTYPE``), ``copies``, ``chunks``, ``units`` and ``chunk_bytes`` are its ops
    lowered (weightsync.plan.writes); ``imms`` per write the immediate of its relay chunk (0: the
    version's shared data immediate); ``plan`` the plan restricted to this source (the FP8 boxes and
    gathers its staging reads); ``keys`` the plan's local tensor keys (``src_key``/``dst_key`` index
    them); ``destinations`` by rank (only those this source writes to or, in a relay chain, waits for);
    ``plan_destinations`` how many destinations the whole plan has (0: every one was dropped, a push
    reaches nobody); ``relay`` the chain (destination ranks, head first) when this source writes into
    its head; ``bytes`` its data bytes; ``gather_expected`` the gather immediates it
    receives; ``gatherers``/``providers`` the sources it sends FP8 tile rows to / receives them from."""

    epoch: int
    writes: np.ndarray
    imms: np.ndarray
    copies: np.ndarray
    chunks: np.ndarray
    units: np.ndarray
    chunk_bytes: int
    plan: Plan
    keys: list[str]
    destinations: Mapping[int, Target]
    bytes: int
    plan_destinations: int
    gather_expected: int = 0
    gatherers: Mapping[int, PeerInfo] = field(default_factory=dict)
    providers: Mapping[int, PeerInfo] = field(default_factory=dict)
    relay: list[int] = field(default_factory=list)

    @property
    def lowered(self) -> Writes:
        return Writes(self.writes, self.copies, self.chunks, self.units, self.chunk_bytes)

    def to_msgpack(self) -> bytes:
        return _pack({
            "format": PART_FORMAT, "role": SOURCE, "epoch": self.epoch,
            "writes": np.ascontiguousarray(self.writes, WRITE_DTYPE).tobytes(),
            "imms": np.ascontiguousarray(self.imms, np.uint32).tobytes(),
            "copies": np.ascontiguousarray(self.copies, COPY_DTYPE).tobytes(),
            "chunks": np.ascontiguousarray(self.chunks, CHUNK_DTYPE).tobytes(),
            "units": np.ascontiguousarray(self.units, UNIT_DTYPE).tobytes(),
            "chunk_bytes": self.chunk_bytes, "plan": self.plan.to_msgpack(), "keys": list(self.keys),
            "destinations": [t.to_dict() for t in self.destinations.values()], "bytes": self.bytes,
            "plan_destinations": self.plan_destinations, "gather_expected": self.gather_expected,
            "gatherers": [g.to_dict() for g in self.gatherers.values()],
            "providers": [p.to_dict() for p in self.providers.values()], "relay": list(self.relay),
        })

    @staticmethod
    def from_dict(d: Mapping[str, Any]) -> SourcePart:
        writes = _array(d["writes"], WRITE_DTYPE)
        return SourcePart(
            epoch=int(d["epoch"]), writes=writes, imms=_array(d["imms"], np.uint32),
            copies=_array(d["copies"], COPY_DTYPE), chunks=_array(d["chunks"], CHUNK_DTYPE),
            units=_array(d["units"], UNIT_DTYPE), chunk_bytes=int(d["chunk_bytes"]),
            plan=Plan.from_msgpack(d["plan"]), keys=[str(k) for k in d["keys"]],
            destinations={t.rank: t for t in map(Target.from_dict, d["destinations"])},
            bytes=int(d["bytes"]), plan_destinations=int(d["plan_destinations"]),
            gather_expected=int(d["gather_expected"]),
            gatherers={g.rank: g for g in map(PeerInfo.from_dict, d["gatherers"])},
            providers={p.rank: p for p in map(PeerInfo.from_dict, d["providers"])},
            relay=[int(r) for r in d["relay"]])


@dataclass(frozen=True)
class Successor:
    """The next member of a relay chain: where a member forwards each chunk."""

    rank: int
    address: bytes
    descriptors: Mapping[str, list[bytes]]


@dataclass(frozen=True, eq=False)
class RelayPart:
    """A destination's place in the relay chain: per relay chunk (in chunk order) its immediate, the
    immediates one push of it delivers here (``pieces``, by the sending engine's rule), and where it
    lands (local key, offset, row bytes, rows, pitch), which is where it is forwarded to as well.
    ``imm`` are the immediates of version bits 0 (weightsync.wire.relay_version_bits: a push ORs its
    version in). ``predecessor``: the member that forwards into this one (None for the head, which the
    sources write): it gets this member's grants."""

    chain: list[int]
    position: int
    successor: Successor | None
    imm: np.ndarray
    pieces: np.ndarray
    keys: list[str]
    offset: np.ndarray
    row_bytes: np.ndarray
    rows: np.ndarray
    pitch: np.ndarray
    predecessor: PeerInfo | None = None

    def to_dict(self) -> dict[str, Any]:
        s = self.successor
        p = self.predecessor
        return {"chain": list(self.chain), "position": self.position,
                "predecessor": None if p is None else p.to_dict(),
                "successor": None if s is None else {"rank": s.rank, "address": s.address,
                                                     "descriptors": dict(s.descriptors)},
                "imm": np.ascontiguousarray(self.imm, np.uint32).tobytes(),
                "pieces": np.ascontiguousarray(self.pieces, np.int64).tobytes(), "keys": list(self.keys),
                **{k: np.ascontiguousarray(getattr(self, k), np.int64).tobytes()
                   for k in ("offset", "row_bytes", "rows", "pitch")}}

    @staticmethod
    def from_dict(d: Mapping[str, Any]) -> RelayPart:
        s = d["successor"]
        return RelayPart(
            chain=[int(r) for r in d["chain"]], position=int(d["position"]),
            successor=None if s is None else Successor(
                int(s["rank"]), bytes(s["address"]),
                {str(k): [bytes(x) for x in v] for k, v in s["descriptors"].items()}),
            imm=_array(d["imm"], np.uint32), pieces=_array(d["pieces"], np.int64),
            keys=[str(k) for k in d["keys"]],
            **{k: _array(d[k], np.int64) for k in ("offset", "row_bytes", "rows", "pitch")},
            predecessor=None if d["predecessor"] is None else PeerInfo.from_dict(d["predecessor"]))


@dataclass(frozen=True, eq=False)
class DestinationPart:
    """One destination's program for plan ``epoch``: the data immediates a version delivers
    (``expected``; 0 under relay, whose chunks count by ``relay.pieces``), its bytes, and the sources
    whose announces it receives and that it acks."""

    epoch: int
    expected: int
    bytes: int
    sources: Mapping[int, PeerInfo]
    relay: RelayPart | None = None

    def to_msgpack(self) -> bytes:
        return _pack({"format": PART_FORMAT, "role": DESTINATION, "epoch": self.epoch,
                      "expected": self.expected, "bytes": self.bytes,
                      "sources": [s.to_dict() for s in self.sources.values()],
                      "relay": None if self.relay is None else self.relay.to_dict()})

    @staticmethod
    def from_dict(d: Mapping[str, Any]) -> DestinationPart:
        return DestinationPart(int(d["epoch"]), int(d["expected"]), int(d["bytes"]),
                               {s.rank: s for s in map(PeerInfo.from_dict, d["sources"])},
                               None if d["relay"] is None else RelayPart.from_dict(d["relay"]))


@dataclass(frozen=True)
class PlanFailure:
    """Planning epoch ``epoch`` failed: every participant gets this instead of a part."""

    epoch: int
    kind: str  # "LayoutError" or "PlanError"
    message: str

    def to_msgpack(self) -> bytes:
        return _pack({"format": PART_FORMAT, "role": "error", "epoch": self.epoch, "kind": self.kind,
                      "message": self.message})

    def error(self, context: str) -> WeightSyncError:
        cls = LayoutError if self.kind == "LayoutError" else PlanError
        return cls(f"{context}: {self.message}")


Part = SourcePart | DestinationPart | PlanFailure


def unpack_part(blob: bytes) -> Part:
    """A part from its msgpack, of whichever role it was packed for."""
    d = _unpack(blob)
    if not isinstance(d, dict) or d.get("format") != PART_FORMAT:
        got = d.get("format", 1) if isinstance(d, dict) else "?"
        raise WeightSyncError(f"plan part of format {got}, this participant reads format {PART_FORMAT} "
                              "(coordinator and participants run different weightsync versions)")
    role = d["role"]
    if role == SOURCE:
        return SourcePart.from_dict(d)
    if role == DESTINATION:
        return DestinationPart.from_dict(d)
    return PlanFailure(int(d["epoch"]), str(d["kind"]), str(d["message"]))
