"""The tails: the one write per destination a push holds back until it has checked that none of its
tensors changed while it read them (weightsync.runtime.push_handle's doc). ``HeldTails`` picks them when a
plan part comes (taking them out of the rounds and chunks the push posts otherwise), keeps their bytes in a
registered snapshot buffer while the push reads the tensors, and posts them from there once the check
passed: a destination completes a version only with its tail."""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from weightsync.engine import Region, TransferEngine
from weightsync.errors import TransportError
from weightsync.plan.lower import ChunkGroup, Round, SourceProgram
from weightsync.runtime.links import DestinationLink

TAIL_ALIGN = 256  # tails' places in the snapshot buffer (alignment the copy engines like)


@dataclass(frozen=True)
class Tail:
    """The write a push holds back for one destination until it has checked its tensors: where its bytes
    come from (``chunk`` -1: a direct write reading local tensor ``key`` at ``src_off``; else staged chunk
    ``chunk`` at ``src_off`` inside it), where they are kept (``snap_off``, ``span`` bytes of the snapshot
    buffer) and the write itself, as the plan made it (same size and rows: same immediates)."""

    rank: int
    chunk: int
    key: str
    src_off: int
    snap_off: int
    span: int
    dst_index: int
    dst_off: int
    nbytes: int  # per row
    imm: int | None  # the plan's relay immediate, or None: the version's data immediate
    rows: int | None = None
    src_pitch: int = 0
    dst_pitch: int = 0


def _byte_view(t: Any) -> Any:
    """A flat uint8 torch view of a contiguous local tensor (torch or numpy)."""
    import torch

    if isinstance(t, np.ndarray):
        return torch.from_numpy(np.ascontiguousarray(t).reshape(-1).view(np.uint8))
    return t.detach().reshape(-1).view(torch.uint8)


def subset(r: Round, keep: np.ndarray) -> Round:
    """Round ``r`` with only its writes ``keep`` (a boolean mask)."""
    return Round(r.rank, r.src_index[keep], r.src_off[keep], r.dst_index[keep], r.dst_off[keep],
                 r.nbytes[keep], None if r.imms is None else r.imms[keep],
                 tuple(None if g is None else g[keep] for g in r.geometry))  # type: ignore[arg-type]


def _without(r: Round, i: int) -> Round | None:
    """Round ``r`` less its write ``i`` (None if nothing is left)."""
    keep = np.ones(len(r.nbytes), dtype=bool)
    keep[i] = False
    if not keep.any():
        return None
    return subset(r, keep)


class HeldTails:
    """A source's tails for its current plan part and the snapshot buffer their bytes are posted from."""

    def __init__(self, engine: TransferEngine, rank: int, device: Any, locals_: Mapping[str, Any]) -> None:
        self.engine = engine
        self.rank = rank
        self.device = device
        self.bytes = {key: _byte_view(local) for key, local in locals_.items()}
        self.tails: dict[int, Tail] = {}  # destination -> its tail
        self.staged: dict[int, list[Tail]] = {}  # staging chunk -> the tails taken from it
        self.buffer: Any = None
        self.region: Region | None = None

    def hold(self, program: SourceProgram) -> SourceProgram:
        """Takes one write per destination out of ``program``: the push posts it only after checking that
        no tensor changed while it read them (weightsync.runtime.push_handle). The smallest direct write
        (by the bytes it spans), else, for a destination that gets only staged writes from this source,
        the smallest staged one; its bytes are copied into the snapshot buffer registered here (a new one
        per plan part)."""
        import torch

        tails: dict[int, Tail] = {}
        at = 0

        def place(span: int) -> int:
            nonlocal at
            off, at = at, at + -(-span // TAIL_ALIGN) * TAIL_ALIGN
            return off

        best: dict[int, tuple[int, int, int]] = {}  # rank -> (span, round, write)
        for ri, r in enumerate(program.rounds):
            rows, src_pitch, _ = r.geometry
            span = r.nbytes.astype(np.int64)
            if rows is not None:
                span = (rows.astype(np.int64) - 1) * src_pitch.astype(np.int64) + span
            i = int(np.argmin(span))
            if r.rank not in best or int(span[i]) < best[r.rank][0]:
                best[r.rank] = (int(span[i]), ri, i)
        rounds: list[Round | None] = list(program.rounds)
        for rank, (span, ri, i) in sorted(best.items()):
            r = program.rounds[ri]
            rows, src_pitch, dst_pitch = r.geometry
            two_d = rows is not None and int(rows[i]) > 1
            tails[rank] = Tail(rank, -1, program.src_keys[int(r.src_index[i])], int(r.src_off[i]),
                               place(span), span, int(r.dst_index[i]), int(r.dst_off[i]), int(r.nbytes[i]),
                               None if r.imms is None else int(r.imms[i]),
                               int(rows[i]) if two_d else None,  # type: ignore[index]
                               int(src_pitch[i]) if two_d else 0,  # type: ignore[index]
                               int(dst_pitch[i]) if two_d else 0)  # type: ignore[index]
            rounds[ri] = _without(r, i)
        staged_best: dict[int, tuple[int, int, int, int]] = {}  # rank -> (bytes, chunk, entry, write)
        for c, (_, data) in enumerate(program.chunk_groups):
            for j, (rank, _src_off, _di, _dst_off, nbytes, _imms) in enumerate(data):
                if rank in tails or not len(nbytes):
                    continue
                i = int(np.argmin(nbytes))
                if rank not in staged_best or int(nbytes[i]) < staged_best[rank][0]:
                    staged_best[rank] = (int(nbytes[i]), c, j, i)
        groups: list[ChunkGroup] = [(g, list(d)) for g, d in program.chunk_groups]
        staged: dict[int, list[Tail]] = {}
        for rank, (nb, c, j, i) in sorted(staged_best.items()):
            _, src_off, di, dst_off, nbytes, imms = groups[c][1][j]
            tail = Tail(rank, c, "", int(src_off[i]), place(nb), nb, int(di[i]), int(dst_off[i]), nb,
                        None if imms is None else int(imms[i]))
            tails[rank] = tail
            staged.setdefault(c, []).append(tail)
            keep = np.arange(len(nbytes)) != i
            if keep.any():
                groups[c][1][j] = (rank, src_off[keep], di[keep], dst_off[keep], nbytes[keep],
                                   None if imms is None else imms[keep])
            else:
                groups[c][1][j] = None  # type: ignore[call-overload]
        groups = [(g, [e for e in d if e is not None]) for g, d in groups]
        if self.region is not None:
            self.engine.deregister(self.region)
            self.region = None
        self.buffer = torch.empty(max(at, 1), dtype=torch.uint8, device=self.device)
        self.region = self.engine.register(self.buffer, name=f"source {self.rank} push tails")
        self.tails, self.staged = tails, staged
        return replace(program, rounds=[r for r in rounds if r is not None], chunk_groups=groups)

    def snapshot_direct(self) -> None:
        """Copies the bytes of the direct tails out of the live tensors (at the push's start)."""
        for t in self.tails.values():
            if t.chunk < 0:
                live = self.bytes[t.key][t.src_off:t.src_off + t.span]
                self.buffer[t.snap_off:t.snap_off + t.span].copy_(live)

    def snapshot_staged(self, chunk: int, view: Any) -> None:
        """Copies the bytes of the tails taken from staged chunk ``chunk`` out of its slot ``view``."""
        for t in self.staged.get(chunk, ()):
            self.buffer[t.snap_off:t.snap_off + t.span].copy_(view[t.src_off:t.src_off + t.span])

    def post(self, dests: Mapping[int, DestinationLink], imm: int, relay_bits: int, failed: dict[int, str],
             granted: Collection[int]) -> list[tuple[int, Any]]:
        """Posts the tails of the destinations granted and not failed (they complete the version)."""
        out: list[tuple[int, Any]] = []
        for rank, t in sorted(self.tails.items()):
            if rank in failed or rank not in granted:
                continue
            d = dests[rank]
            geometry: tuple[Any, Any, Any] = (None, None, None)
            if t.rows is not None:
                geometry = (np.array([t.rows], np.uint64), np.array([t.src_pitch], np.uint64),
                            np.array([t.dst_pitch], np.uint64))
            try:
                out.append((rank, self.engine.write_batch(
                    [self.region], d.descs, np.zeros(1, np.uint32), np.array([t.snap_off], np.uint64),
                    np.array([t.dst_index], np.uint32), np.array([t.dst_off], np.uint64),
                    np.array([t.nbytes], np.uint64),
                    np.array([imm if t.imm is None else t.imm | relay_bits], np.uint32), *geometry)))
            except TransportError as exc:
                failed[rank] = str(exc)
        return out
