"""A source's staged writes: the staging pool, chunk preparation (packs, casts, FP8 tiles) with CUDA-graph
replay, and the pipeline that writes chunk k while chunk k+1 is prepared.

Gathers go first (their chunks come first), then packs and casts; the first FP8 unit waits for the
rows this source gathers. A slot of the pool is reused once its writes have completed locally, so the
staging watermark bounds the bytes held at once.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from weightsync.control.client import ControlClient
from weightsync.engine import Region, TransferEngine
from weightsync.errors import TimeoutError, TransportError  # noqa: A004
from weightsync.plan.lower import SourceProgram
from weightsync.plan.parts import SourcePart
from weightsync.runtime.links import DestinationLink, PeerLink
from weightsync.runtime.transforms import Preparer
from weightsync.wire import data_imm, gather_imm, gathered_imm, relay_version_bits

_CUDA_GRAPHS = os.environ.get("WEIGHTSYNC_CUDA_GRAPHS", "1") != "0"


class Gate(Protocol):
    """What the staged pipeline asks of the push it runs in (weightsync.runtime.push.Push), in the order it
    asks."""

    def open(self) -> None:
        """Before the first chunk is posted: waits for the grants and posts the direct rounds of the
        destinations granted (the first chunks are prepared while the grants travel). Idempotent."""

    def prepared(self, chunk: int, view: Any) -> None:
        """Chunk ``chunk`` is prepared in ``view`` (its slot), about to be posted: the push keeps what it
        needs of its bytes (the tails it holds, a delta's compare)."""

    def allowed(self, rank: int) -> bool:
        """Whether destination ``rank`` is written from the start (granted when the gate opened)."""

    def staged(self, rank: int, chunk: int, src_off: np.ndarray, di: np.ndarray, dst_off: np.ndarray,
               nbytes: np.ndarray) -> np.ndarray | None:
        """Which of chunk ``chunk``'s writes into ``rank`` go as planned (None: all of them)."""

    def late(self) -> Iterator[int]:
        """Destinations granted after the gate opened, as their grants arrive (until the deadline); each
        gets its chunks in a pass of its own before the next is asked for."""


class ChunkGraphs:
    """CUDA graphs of chunk preparations, replayed from the second push on.

    A chunk's preparation is a few hundred small torch ops (quantize a unit: reductions, a division,
    a cast; copy slices into staging) whose addresses never change within a plan epoch: local
    tensors, the staging pool and the receive buffer are all registered and fixed. Launching them
    one by one from Python costs more than the GPU work itself, so each chunk's ops are captured
    once (the second push; the first runs them eagerly, which also loads every kernel) and replayed
    as one launch. Graphs share one memory pool and are captured and replayed in the same order, so
    a unit quantized in one chunk's graph is still in place when the next chunk's graph reads it.
    ``WEIGHTSYNC_CUDA_GRAPHS=0`` turns this off.
    """

    def __init__(self) -> None:
        self.graphs: dict[tuple[int, int], Any] = {}  # (chunk, slot) -> captured preparation
        self.pool: Any = None
        self.capturing = False  # this push captures its chunks' graphs
        self.stale = False  # a chunk ran eagerly beside captured graphs: capture afresh next push
        self.eager_pushes = 0
        self.fills = 0  # chunk preparations so far in this push

    def start_push(self) -> None:
        self.fills, self.capturing = 0, False  # also after a push that failed half-way

    def fill(self, prep: Preparer, c: int, slot: int, view: Any) -> None:
        """Prepares chunk ``c`` into ``view`` (slot ``slot``) on the GPU, replaying its graph if captured."""
        import torch

        g = self.graphs.get((c, slot))
        if g is None:
            # Capture only a whole push's chunks in order from chunk 0 (replays must run in capture order
            # for the shared pool to hold what the next graph reads); a chunk missing later (the slots
            # came out differently) runs eagerly and the graphs are captured afresh next push.
            if not self.fills and _CUDA_GRAPHS and self.eager_pushes >= 1:
                self.graphs = {}
                self.pool = torch.cuda.graph_pool_handle()
                self.capturing = True
            if not self.capturing:
                if self.graphs:
                    self.stale = True
                prep.fill(c, view)
                self.fills += 1
                return
            g = torch.cuda.CUDAGraph()
            # thread_local: the engine's cuda worker keeps polling its own streams while this thread captures
            with torch.cuda.graph(g, pool=self.pool, capture_error_mode="thread_local"):
                prep.fill(c, view)
            self.graphs[(c, slot)] = g
        g.replay()
        self.fills += 1

    def end_push(self) -> None:
        self.fills = 0
        self.eager_pushes += 1
        self.capturing = False
        if self.stale:
            self.graphs, self.stale = {}, False


class Staging:
    """The staging pool and receive buffer of one plan epoch, and the staged part of every push.

    Slots of one chunk each, as many as the watermark allows (no more than the plan has chunks),
    registered once per plan; the previous plan's are released once unreferenced."""

    def __init__(self, engine: TransferEngine, control: ControlClient, rank: int, device: Any,
                 limit: int, locals_: Mapping[str, Any], outbox: Region, log: Any) -> None:
        self.engine = engine
        self.control = control
        self.rank = rank
        self.device = device
        self.limit = limit
        self.locals = locals_
        self.outbox = outbox  # a registered region: the zero-length GATHERED writes read from it
        self.log = log
        self.pool_region: Region | None = None
        self.recv_region: Region | None = None
        self.gatherer_descs: dict[int, bytes] | None = None

    def load(self, part: SourcePart, program: SourceProgram, gatherers: dict[int, PeerLink],
             providers: dict[int, PeerLink], timeout: float) -> None:
        """Sets up staging for a new part (registers the pool and, for FP8 gathers, the receive buffer,
        which it publishes)."""
        import torch

        for attr in ("pool_region", "recv_region"):
            old = getattr(self, attr)
            if old is not None:
                self.engine.deregister(old)
                setattr(self, attr, None)
        self.part = part
        self.lowered = part.lowered
        self.chunk_groups = program.chunk_groups
        self.epoch = part.epoch
        slot = self.lowered.chunk_bytes
        nch = len(part.chunks)
        self.slots = max(1, min(self.limit // slot, nch))
        self.pool = torch.empty(self.slots * slot if nch else 1, dtype=torch.uint8, device=self.device)
        self.pool_region = self.engine.register(self.pool, name=f"source {self.rank} staging")
        self.prep = Preparer(self.locals, part.plan, self.lowered, self.rank)
        self.graphs = ChunkGraphs()
        recv_bytes = self.prep.recv_bytes
        self.recv = torch.empty(max(recv_bytes, 1), dtype=torch.uint8, device=self.device)
        self.prep.recv = self.recv
        self.gather_expected = part.gather_expected
        self.gatherers = gatherers
        self.providers = providers
        self.gatherer_descs = None
        if recv_bytes:
            self.recv_region = self.engine.register(self.recv, name=f"source {self.rank} gather receive")
            self.control.publish_receive(part.epoch, self.recv_region.descriptor, timeout)

    def run(self, version: int, deadline: float, dests: dict[int, DestinationLink], failed: dict[int, str],
            one_writer_at_a_time: bool, gate: Gate) -> dict[str, float]:
        """Prepares chunk k+1 while chunk k is on the wire; at most ``slots`` chunks hold staging.
        ``gate`` (the push): the first post opens it (so the first chunks are prepared while the grants
        travel); chunks go to the destinations it allows, and destinations it grants late get their
        chunks in a pass of their own. Returns timing and staging figures for PushStats."""
        nch = len(self.lowered.chunks)
        self.prep.reset()
        self.graphs.start_push()
        if nch == 0:
            return {"prepare": 0.0, "gather_wait": 0.0, "peak": 0, "chunks": nch}
        if self.gatherers and self.gatherer_descs is None:
            self.gatherer_descs = self.control.receive_buffers(self.epoch, sorted(self.gatherers), deadline)
        run = _ChunkRun(self, version, deadline, dests, failed, gate)
        for only, chunks, first in self._passes(dests, one_writer_at_a_time):
            for c in chunks:
                run.step(c, only, first)
        run.finish()  # also opens the gate if no chunk was posted yet
        for rank in gate.late():
            # Granted after the writes started: its chunks again, for it alone (like one_writer passes).
            for c in range(nch):
                if any(d[0] == rank for d in self.chunk_groups[c][1]):
                    run.step(c, rank, False, late=True)
            run.finish()
        if self.device.type == "cuda":
            self.graphs.end_push()
        run.drain()
        self._tell_providers(version, deadline)
        return run.out

    def _passes(self, dests: Mapping[int, DestinationLink], one_writer_at_a_time: bool
                ) -> list[tuple[int | None, range | list[int], bool]]:
        """(destination or None for all, chunks, first pass) per pass over the chunks. With
        ``one_writer_at_a_time``, one pass per destination, each source starting with a different one:
        like the direct writes' rounds, every destination then has one writer at a time. Each pass
        prepares its chunks again; measured slower than one pass that writes every destination, so it is
        an option, not the default."""
        nch = len(self.lowered.chunks)
        order = sorted(dests)
        passes: list[int | None] = [None]
        if one_writer_at_a_time and len(order) > 1:
            k = self.rank % len(order)
            passes = list(order[k:] + order[:k])
        with_data = [c for c in range(nch) if self.chunk_groups[c][1]]
        return [(only, range(nch) if pi == 0 else with_data, pi == 0) for pi, only in enumerate(passes)]

    def _tell_providers(self, version: int, deadline: float) -> None:
        """Tells providers their rows were used: they may overwrite the receive buffer with the next
        version."""
        for r, pv in self.providers.items():
            try:
                self.engine.write(self.outbox, 0, pv.peer, pv.mailbox, 0, 0,
                                  imm=gathered_imm(self.epoch, version)).wait(
                                      max(deadline - time.monotonic(), 0.1))
            except (TransportError, TimeoutError) as exc:
                self.log.warning("source %d: telling provider %d its gathers were used failed: %s",
                                 self.rank, r, exc)


@dataclass
class _Pending:
    """A chunk prepared into its slot but not yet posted (on a GPU, its kernels may still run)."""

    chunk: int
    slot: int
    nbytes: int
    event: Any
    only: int | None
    first: bool
    late: bool = False  # a pass for a destination granted after the gate opened


@dataclass
class _ChunkRun:
    """One push's pass through the staged chunks: free slots, chunks in flight, the one prepared and
    not yet posted.

    On a GPU the chunk's kernels run on torch's stream while Python goes on: chunk c is posted once its
    event has completed, after chunk c + 1's kernels were queued behind it, so the GPU prepares the next
    chunk while this one is handed to the engine (whose copies run on streams of their own and cannot
    wait for a torch event themselves)."""

    st: Staging
    version: int
    deadline: float
    dests: dict[int, DestinationLink]
    failed: dict[int, str]
    gate: Gate
    out: dict[str, float] = field(default_factory=dict)
    free: list[int] = field(default_factory=list)
    inflight: list[tuple[int, int, list[tuple[int | None, Any]]]] = field(default_factory=list)
    held: int = 0
    pending: _Pending | None = None
    gathered: bool = False

    def __post_init__(self) -> None:
        st = self.st
        self.out = {"prepare": 0.0, "gather_wait": 0.0, "peak": 0, "chunks": len(st.lowered.chunks)}
        self.free = list(range(st.slots))
        self.gathered = st.gather_expected == 0
        self.data_imm = data_imm(st.epoch, self.version)
        self.relay_bits = np.uint32(relay_version_bits(self.version))
        self.gather_imm = gather_imm(st.epoch, self.version)
        self.cuda = st.device.type == "cuda"

    def step(self, c: int, only: int | None, first: bool, late: bool = False) -> None:
        """Prepares chunk ``c`` into its slot, posting what came before it."""
        st = self.st
        if not self.gathered and int(st.lowered.chunks["unit"][c]) >= 0:
            self._post_pending()  # the rows this source gathers may come from its own chunk
            self.wait_gathered()
        # Chunk c always takes slot c mod slots, so that its CUDA graph (captured with that slot's
        # address) replays in every pass and push.
        slot = c % st.slots
        if self.pending is not None and self.pending.slot == slot:
            self._post_pending()
        while slot not in self.free:
            self._release_oldest()
        self.free.remove(slot)
        nb = int(st.lowered.chunks["nbytes"][c])
        event = self._prepare(c, slot, nb)
        self.held += nb
        self.out["peak"] = max(self.out["peak"], self.held)
        self._post_pending()
        self.pending = _Pending(c, slot, nb, event, only, first, late)
        if not self.cuda:  # on the CPU the preparation is already done: nothing to overlap it with
            self._post_pending()

    def _prepare(self, c: int, slot: int, nb: int) -> Any:
        """Fills chunk ``c`` into ``slot``; on a GPU returns the event its kernels complete."""
        st = self.st
        base = slot * st.lowered.chunk_bytes
        view = st.pool[base:base + nb]
        t = time.perf_counter()
        event = None
        if self.cuda:
            import torch

            st.graphs.fill(st.prep, c, slot, view)
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(st.device))
        else:
            st.prep.fill(c, view)
        self.out["prepare"] += time.perf_counter() - t
        return event

    def wait_gathered(self) -> None:
        """Waits for the FP8 tile rows other sources gather to this one."""
        t = time.perf_counter()
        self.st.engine.counter(self.gather_imm).wait(self.st.gather_expected,
                                                     max(self.deadline - time.monotonic(), 0.0))
        self.gathered = True
        self.out["gather_wait"] += time.perf_counter() - t

    def _post_pending(self) -> None:
        if self.pending is not None:
            p, self.pending = self.pending, None
            self._post(p)

    def _post(self, p: _Pending) -> None:
        """Submits a prepared chunk's writes: its gathers (first pass only), then its data writes (into
        the destinations granted)."""
        st = self.st
        self.gate.open()  # the first post waits for the grants (and posts the direct rounds first)
        if p.event is not None:
            t = time.perf_counter()
            p.event.synchronize()
            self.out["prepare"] += time.perf_counter() - t
        trs: list[tuple[int | None, Any]] = []
        base = p.slot * st.lowered.chunk_bytes
        self.gate.prepared(p.chunk, st.pool[base:base + p.nbytes])  # the writes the push holds back
        gathers, data = st.chunk_groups[p.chunk]
        for g, src_off, dst_off, nbytes in (gathers if p.first else []):
            if g == st.rank:  # a tile's missing rows held by another region of this rank
                for a, d, n in zip(src_off.tolist(), dst_off.tolist(), nbytes.tolist(), strict=True):
                    st.recv[d:d + n].copy_(st.pool[base + a:base + a + n])
                continue
            peer = st.gatherers[g].peer
            zeros = np.zeros(len(src_off), np.uint32)
            trs.append((None, st.engine.write_batch(
                [st.pool_region], [(peer, st.gatherer_descs[g])],  # type: ignore[index]
                zeros, src_off + base, zeros, dst_off, nbytes, self.gather_imm)))
        for rank, src_off, di, dst_off, nbytes, imms in data:
            if rank in self.failed or (p.only is not None and rank != p.only):
                continue
            if not p.late and not self.gate.allowed(rank):
                continue  # not granted (yet): a late pass serves it once it is
            keep = self.gate.staged(rank, p.chunk, src_off, di, dst_off, nbytes)
            if keep is not None and not keep.all():  # a delta push: the rest travel encoded
                if not keep.any():
                    continue
                src_off, di, dst_off, nbytes = src_off[keep], di[keep], dst_off[keep], nbytes[keep]
                imms = None if imms is None else imms[keep]
            descs = self.dests[rank].descs
            try:
                zeros = np.zeros(len(src_off), np.uint32)
                tr = st.engine.write_batch([st.pool_region], descs, zeros, src_off + base, di, dst_off,
                                           nbytes, self.data_imm if imms is None else imms | self.relay_bits)
                trs.append((rank, tr))
            except TransportError as exc:
                self.failed[rank] = str(exc)
        self.inflight.append((p.slot, p.nbytes, trs))

    def _release_oldest(self) -> None:
        """Waits for the oldest chunk in flight to complete locally and frees its slot."""
        slot, nb, trs = self.inflight.pop(0)
        for rank, tr in trs:
            try:
                tr.wait(max(self.deadline - time.monotonic(), 0.0))
            except (TransportError, TimeoutError) as exc:
                if rank is None:
                    raise
                self.failed.setdefault(rank, str(exc))
        self.free.append(slot)
        self.held -= nb

    def finish(self) -> None:
        """Posts the last prepared chunk (and opens the gate if nothing was posted)."""
        self._post_pending()
        self.gate.open()

    def drain(self) -> None:
        """Waits for every chunk in flight, and for the gathered rows if no FP8 unit waited for them."""
        while self.inflight:
            self._release_oldest()
        if not self.gathered:
            self.st.engine.counter(self.gather_imm).wait(self.st.gather_expected,
                                                         max(self.deadline - time.monotonic(), 0.0))
