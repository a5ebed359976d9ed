"""Lowering: a group's plan into one typed part per participant, and a source's part into the batches a
push submits.

:func:`lower_group` is what the coordinator runs once every participant has joined: it plans, lowers
each source's ops to engine writes (weightsync.plan.writes), splits relay chunks and gives them their
immediates, counts the immediates every destination must expect (by the sending engine's rule,
weightsync.wire.imm_counts) and packs a :class:`~weightsync.plan.parts.SourcePart` or
:class:`~weightsync.plan.parts.DestinationPart` per participant.

:func:`source_program` is what a source runs once per part: its direct writes cut into one batch per
plan round and its staged writes grouped per chunk and target, as the columns ``write_batch`` takes,
so that a push does no per-write Python work.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from weightsync.errors import PlanError
from weightsync.plan.layout import Layout
from weightsync.plan.ops import LOCAL_ROUND_BYTES, ROUND_BYTES
from weightsync.plan.parts import (
    DESTINATION,
    SOURCE,
    DestinationPart,
    Member,
    PeerInfo,
    RelayPart,
    SourcePart,
    Successor,
    Target,
)
from weightsync.plan.planner import plan as make_plan
from weightsync.plan.writes import K_DATA, K_GATHER, WRITE_DTYPE, lower
from weightsync.wire import RELAY_MAX_CHUNKS, relay_imm

# Relay: the largest write a chain member forwards at once. Each relay chunk is forwarded as soon as it
# has landed, so a chunk is the pipeline's step: smaller chunks shorten the chain's fill time (64 MiB:
# about 170 us per hop on NVLink), larger ones cost fewer copies and triggers (the cuda lane comes
# closer to the copy bound the larger each copy is).
RELAY_CHUNK_BYTES = 64 << 20


@dataclass(frozen=True)
class GroupOptions:
    """The group-wide planning options ``Group.create`` takes (see its docstring)."""

    allow_cast: bool = False
    fp8_block: tuple[int, int] | None = (128, 128)
    relay: bool | None = None
    relay_chunk_bytes: int = RELAY_CHUNK_BYTES
    round_bytes: int = ROUND_BYTES
    local_round_bytes: int = LOCAL_ROUND_BYTES


def split_writes(w: np.ndarray, cap: int) -> np.ndarray:
    """Data writes larger than ``cap`` bytes cut into consecutive writes of at most ``cap`` (2-D writes
    by whole rows), in place in the order: a relay forwards a chunk once all of it landed, so a chunk is
    the pipeline's step. Staged writes keep their staging chunk (their offsets move inside it)."""
    rows = np.maximum(w["rows"].astype(np.int64), 1)
    row_bytes = w["nbytes"].astype(np.int64) // rows
    one_d = rows == 1
    per_rows = np.where(one_d, 1, np.maximum(cap // np.maximum(row_bytes, 1), 1))  # rows per piece (2-D)
    pieces_1d = np.maximum(-(-w["nbytes"].astype(np.int64) // cap), 1)
    n = np.where(w["kind"] != K_DATA, 1, np.where(one_d, pieces_1d, -(-rows // per_rows)))
    if (n == 1).all():
        return w
    k = np.repeat(np.arange(len(w)), n)
    j = np.arange(len(k)) - np.repeat(np.cumsum(n) - n, n)
    out = w[k].copy()
    od = one_d[k]
    cut = w["kind"][k] == K_DATA  # other writes (gathers) stay whole
    total = w["nbytes"][k].astype(np.int64)
    # 1-D: bytes j*cap.. ; 2-D: rows j*per_rows..
    start_b = j * cap
    nb_1d = np.minimum(cap, total - start_b)
    r0 = j * per_rows[k]
    nr = np.minimum(per_rows[k], rows[k] - r0)
    for side in ("src", "dst"):
        base = w[f"{side}_offset"][k]
        out[f"{side}_offset"] = np.where(cut, np.where(od, base + start_b, base + r0 * w[f"{side}_pitch"][k]),
                                         base)
    out["nbytes"] = np.where(cut, np.where(od, nb_1d, nr * row_bytes[k]), total)
    out["rows"] = np.where(cut, np.where(od, 1, nr), w["rows"][k])
    return out.astype(WRITE_DTYPE)


def use_relay(options: GroupOptions, sources: Sequence[Member], dests: Sequence[Member]) -> bool:
    """Whether the destinations get the model through a relay chain (see ``Group.create``)."""
    if options.relay is False or len(dests) < 2:
        return False
    if options.relay is None and len(dests) <= len(sources):
        return False
    # Full replicas only: a chain member forwards what it received at the same keys and offsets.
    return all(d.layout == dests[0].layout for d in dests[1:])


@dataclass(frozen=True)
class GroupParts:
    """A lowered plan: the part of every participant, by (role, rank), and the relay chain (destination
    ranks head first; empty: direct)."""

    parts: dict[tuple[str, int], SourcePart | DestinationPart]
    chain: list[int]


def _peer(m: Member) -> PeerInfo:
    return PeerInfo(m.rank, m.address, m.mailbox)


def lower_group(sources: Sequence[Member], dests: Sequence[Member], epoch: int,
                options: GroupOptions) -> GroupParts:
    """Plans and lowers for these members (sources by rank: plan index i is ``sources[i]``; they are all
    present when planning). Raises LayoutError / PlanError as ``plan`` does."""
    relay = use_relay(options, sources, dests)
    # With relay the sources write only into the head of the chain; the others get it by forwarding.
    targets = dests[:1] if relay else dests
    p = make_plan([Layout.from_msgpack(m.layout) for m in sources],
                  [Layout.from_msgpack(m.layout) for m in targets],
                  source_hosts=[m.host for m in sources], destination_hosts=[m.host for m in targets],
                  allow_cast=options.allow_cast, fp8_block=options.fp8_block,
                  round_bytes=options.round_bytes, local_round_bytes=options.local_round_bytes)
    expected = np.zeros(len(targets), dtype=np.int64)
    dst_bytes = p.bytes_per_destination() if len(p.ops) else np.zeros(len(targets), np.int64)
    writers: list[set[int]] = [set() for _ in targets]
    gather_expected = np.zeros(len(sources), dtype=np.int64)
    providers: list[set[int]] = [set() for _ in sources]
    gatherers: list[set[int]] = [set() for _ in sources]
    lowered_by = []
    relay_imms: list[np.ndarray] = []
    chunk_writes: list[np.ndarray] = []  # relay: the head's incoming data writes, in chunk order
    chunk_base = 0
    for i, src in enumerate(sources):
        part = p.part(sources=[i])
        provided = part.gathers[part.gathers["provider"] == i]
        lowered = lower(p.for_source(i), src.engine.chunk_bytes, part, provided,
                        pack_strided=src.engine.pack_strided)
        if relay:
            lowered.writes = split_writes(lowered.writes, options.relay_chunk_bytes)
        lowered_by.append((part, lowered))
        w = lowered.writes
        imms = src.engine.imm_counts(w["nbytes"], w["rows"])
        data = w["kind"] == K_DATA
        ri = np.zeros(len(w), np.uint32)
        if relay:
            # Every data write into the head is a relay chunk with an immediate of its own (of version bits
            # 0: a push ORs its version in, weightsync.wire.relay_version_bits).
            idx = np.flatnonzero(data)
            if chunk_base + len(idx) > RELAY_MAX_CHUNKS:
                raise PlanError(f"{chunk_base + len(idx)} relay chunks, more than {RELAY_MAX_CHUNKS} "
                                "(raise relay_chunk_bytes)")
            ri[idx] = [relay_imm(epoch, chunk_base + c) for c in range(len(idx))]
            chunk_base += len(idx)
            chunk_writes.append(w[idx])
        else:
            np.add.at(expected, w["dst_rank"][data], imms[data])
        relay_imms.append(ri)
        # a gather to oneself is a local copy: no immediate
        remote = (w["kind"] == K_GATHER) & (w["dst_rank"] != i)
        np.add.at(gather_expected, w["dst_rank"][remote], imms[remote])
        for g in np.unique(w["dst_rank"][remote]):
            gatherers[i].add(int(g))
            providers[int(g)].add(i)
        for j in np.unique(w["dst_rank"][data]):
            writers[int(j)].add(src.rank)
    chain = [d.rank for d in dests] if relay else []
    parts: dict[tuple[str, int], SourcePart | DestinationPart] = {}
    for i, src in enumerate(sources):
        part, lowered = lowered_by[i]
        w = lowered.writes
        data = w["kind"] == K_DATA
        used = {int(j) for j in np.unique(w["dst_rank"][data])}
        destinations: dict[int, Target] = {}
        for j in sorted(used):
            d = dests[j]
            destinations[d.rank] = Target(d.rank, j, d.address, d.mailbox, d.descriptors)
        if relay and used:
            # A source that writes into the head announces to and waits for every chain member
            # (slot -1: no write of this source names them).
            for j, d in enumerate(dests):
                succ = dests[j + 1].rank if j + 1 < len(dests) else -1
                slot = destinations[d.rank].slot if d.rank in destinations else -1
                destinations[d.rank] = Target(d.rank, slot, d.address, d.mailbox, d.descriptors, succ)
        parts[(SOURCE, src.rank)] = SourcePart(
            epoch=epoch, writes=w, imms=relay_imms[i], copies=lowered.copies, chunks=lowered.chunks,
            units=lowered.units, chunk_bytes=lowered.chunk_bytes, plan=part, keys=p.keys,
            destinations=destinations, bytes=int(w["nbytes"][data].sum()), plan_destinations=len(dests),
            gather_expected=int(gather_expected[i]),
            gatherers={sources[g].rank: _peer(sources[g]) for g in sorted(gatherers[i])},
            providers={sources[g].rank: _peer(sources[g]) for g in sorted(providers[i])},
            relay=chain if used else [])
    if not relay:
        for j, dst in enumerate(dests):
            parts[(DESTINATION, dst.rank)] = DestinationPart(
                epoch, int(expected[j]), int(dst_bytes[j]),
                {s.rank: _peer(s) for s in sources if s.rank in writers[j]})
        return GroupParts(parts, chain)
    cw = np.concatenate(chunk_writes) if chunk_writes else np.zeros(0, WRITE_DTYPE)
    cimm = np.concatenate([ri[ri != 0] for ri in relay_imms]).astype(np.uint32)
    # What the head receives per chunk from its source, and each later member from its predecessor: the
    # same write, so the same bytes, counted with the sending engine's piece rule.
    src_of = (np.concatenate([np.full(len(c), i, np.int64) for i, c in enumerate(chunk_writes)])
              if chunk_writes else np.zeros(0, np.int64))
    head_pieces = np.zeros(len(cw), np.int64)
    for i, src in enumerate(sources):
        sel = src_of == i
        head_pieces[sel] = src.engine.imm_counts(cw["nbytes"][sel], cw["rows"][sel])
    rows = np.maximum(cw["rows"].astype(np.int64), 1)
    keys = [p.keys[int(k)] for k in cw["dst_key"]]
    head_writers = sorted(writers[0])
    for j, dst in enumerate(dests):
        pieces = head_pieces if j == 0 else dests[j - 1].engine.imm_counts(cw["nbytes"], cw["rows"])
        succ = dests[j + 1] if j + 1 < len(dests) else None
        parts[(DESTINATION, dst.rank)] = DestinationPart(
            epoch, 0, int(dst_bytes[0]), {s.rank: _peer(s) for s in sources if s.rank in head_writers},
            RelayPart(chain=chain, position=j,
                      successor=None if succ is None else Successor(succ.rank, succ.address,
                                                                    succ.descriptors),
                      imm=cimm, pieces=pieces.astype(np.int64), keys=keys,
                      offset=cw["dst_offset"].astype(np.int64),
                      row_bytes=cw["nbytes"].astype(np.int64) // rows, rows=rows,
                      pitch=cw["dst_pitch"].astype(np.int64),
                      predecessor=None if j == 0 else _peer(dests[j - 1])))
    return GroupParts(parts, chain)


# --------------------------------------------------------------------------------------------------
# A source's part as write_batch columns


@dataclass(frozen=True)
class DestinationBatch:
    """What a source sends one destination: its local keys in descriptor-table order (``dkeys``, index
    ``dpos``), and the number and bytes of its data writes."""

    dkeys: list[str]
    dpos: dict[str, int]
    writes: int
    bytes: int


@dataclass(frozen=True, eq=False)
class Round:
    """One plan round of direct writes into destination ``rank``, as ``write_batch`` columns: source
    index into ``SourceProgram.src_keys``, destination index into that destination's ``dkeys``, byte
    offsets, bytes per row, the relay immediates (None: the version's data immediate) and the 2-D
    geometry (rows, source pitch, destination pitch; all None where every write is 1-D)."""

    rank: int
    src_index: np.ndarray
    src_off: np.ndarray
    dst_index: np.ndarray
    dst_off: np.ndarray
    nbytes: np.ndarray
    imms: np.ndarray | None
    geometry: tuple[np.ndarray | None, np.ndarray | None, np.ndarray | None]


# Per staged chunk: (gathers, data). A gather: (gatherer rank, src_off, dst_off, nbytes); data:
# (destination rank, src_off, dst_index, dst_off, nbytes, imms or None). Offsets inside the chunk.
ChunkGroup = tuple[list[tuple[int, np.ndarray, np.ndarray, np.ndarray]],
                   list[tuple[int, np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray | None]]]


@dataclass(frozen=True, eq=False)
class SourceProgram:
    """A source's part in the form a push runs: ``src_keys`` (the local tensors direct writes read, in
    ``src_index`` order), per destination a :class:`DestinationBatch`, the direct writes as
    :class:`Round` s in schedule order, and the staged writes per chunk (:data:`ChunkGroup`)."""

    src_keys: list[str]
    batches: dict[int, DestinationBatch]
    rounds: list[Round]
    chunk_groups: list[ChunkGroup]


def _u64(*cols: np.ndarray) -> tuple[np.ndarray, ...]:
    return tuple(np.ascontiguousarray(c, dtype=np.uint64) for c in cols)


def source_program(part: SourcePart, held: Sequence[str], rank: int) -> SourceProgram:
    """Cuts ``part`` into batches for a source holding local tensors ``held`` (its keys)."""
    keys, writes, imms = part.keys, part.writes, part.imms
    relay = bool(part.relay)
    held_set = set(held)
    src_keys = [k for k in keys if k in held_set]
    src_index = {k: i for i, k in enumerate(src_keys)}
    key_to_src = np.array([src_index.get(k, -1) for k in keys] or [-1], dtype=np.int64)
    direct_mask = (writes["staged"] == 0) & (writes["kind"] == K_DATA)
    direct = writes[direct_mask]
    direct_imms = imms[direct_mask]
    data = writes[writes["kind"] == K_DATA]
    slot_rank = {t.slot: r for r, t in part.destinations.items()}
    batches: dict[int, DestinationBatch] = {}
    for r, t in part.destinations.items():
        # Destination descriptors: one table entry per (dst key, buffer); index chosen per push.
        mine = data[data["dst_rank"] == t.slot]
        dkeys = sorted({keys[int(k)] for k in np.unique(mine["dst_key"])})
        batches[r] = DestinationBatch(dkeys, {k: i for i, k in enumerate(dkeys)}, len(mine),
                                      int(mine["nbytes"].sum()))
    si = key_to_src[direct["src_key"]]
    if (si < 0).any():
        raise PlanError(f"source {rank}: plan reads a tensor this source does not hold")
    rounds: list[Round] = []
    order = np.lexsort((direct["dst_rank"], direct["round"]))  # stable: plan order inside a round
    direct, si, direct_imms = direct[order], si[order], direct_imms[order]
    key = direct["round"].astype(np.int64) * (1 << 20) + direct["dst_rank"]
    cuts = np.concatenate([[0], np.flatnonzero(np.diff(key)) + 1, [len(direct)]])
    for lo, hi in itertools.pairwise(cuts):
        if lo == hi:
            continue
        w = direct[lo:hi]
        r = slot_rank[int(w["dst_rank"][0])]
        dpos = batches[r].dpos
        rows = np.maximum(w["rows"], 1)
        rounds.append(Round(
            rank=r, src_index=si[lo:hi].astype(np.uint32), src_off=w["src_offset"].astype(np.uint64),
            dst_index=np.array([dpos[keys[int(k)]] for k in w["dst_key"]], dtype=np.uint32),
            dst_off=w["dst_offset"].astype(np.uint64), nbytes=(w["nbytes"] // rows).astype(np.uint64),
            imms=direct_imms[lo:hi].copy() if relay else None,
            # 2-D columns only where the round has a strided write: plain batches stay plain
            geometry=((rows.astype(np.uint64), w["src_pitch"].astype(np.uint64),
                       w["dst_pitch"].astype(np.uint64)) if (rows > 1).any() else (None, None, None))))
    return SourceProgram(src_keys, batches, rounds, _group_chunks(part, batches, slot_rank))


def _group_chunks(part: SourcePart, batches: dict[int, DestinationBatch],
                  slot_rank: dict[int, int]) -> list[ChunkGroup]:
    """Per staged chunk, its writes as batch columns per target (gatherer sources, destinations)."""
    staged_mask = part.writes["staged"] == 1
    st, st_imms = part.writes[staged_mask], part.imms[staged_mask]
    nch = len(part.chunks)
    bounds = np.searchsorted(st["chunk"], np.arange(nch + 1))
    out: list[ChunkGroup] = []
    for c in range(nch):
        w = st[bounds[c]:bounds[c + 1]]
        w_imms = st_imms[bounds[c]:bounds[c + 1]]
        gathers, data = [], []
        gw = w[w["kind"] == K_GATHER]
        for g in np.unique(gw["dst_rank"]).tolist():
            sel = gw[gw["dst_rank"] == g]
            src_off, dst_off, nbytes = _u64(sel["src_offset"], sel["dst_offset"], sel["nbytes"])
            gathers.append((int(g), src_off, dst_off, nbytes))
        dmask = w["kind"] == K_DATA
        dw, d_imms = w[dmask], w_imms[dmask]
        for slot in np.unique(dw["dst_rank"]).tolist():
            sel = dw[dw["dst_rank"] == slot]
            imms = d_imms[dw["dst_rank"] == slot].copy() if part.relay else None
            r = slot_rank[int(slot)]
            dpos = batches[r].dpos
            di = np.array([dpos[part.keys[int(k)]] for k in sel["dst_key"]], np.uint32)
            src_off, dst_off, nbytes = _u64(sel["src_offset"], sel["dst_offset"], sel["nbytes"])
            data.append((r, src_off, di, dst_off, nbytes, imms))
        out.append((gathers, data))
    return out
