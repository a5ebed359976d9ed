"""A trainer rank's side of a push: ``Source``, its public API (``push``, ``push_async``, ``wait_pushed``,
``guard``, ``close``) and ``ws.push`` / ``ws.push_async``.

A source holds (shards of) the weights, registered with its engine, and for each plan epoch its part: the
destinations it writes, its direct rounds and staged chunks (weightsync.runtime.staging), the tails it
holds back (weightsync.runtime.tails) and its delta sender's inboxes (weightsync.delta.sender). A push
first makes the plan epoch current: it fetches a new part only if the coordinator's epoch moved
(membership changed); the source's epoch watcher (a thread long-polling the coordinator) keeps the epoch at
hand, so this costs no round trip unless the watcher is unhealthy. If the plan has no destination left
(all dropped, none joined again), the push raises ``WeightSyncError`` at once. Then ``Push``
(weightsync.runtime.push) runs the protocol: announces, grants, rounds, spans, chunks, tails, acks, stats;
its module doc says what each step does and how failures are judged.

Versions must increase: a version not newer than the last one this source pushed is refused at once
(``WeightSyncError``, nothing written); one not newer than what a destination holds is refused by that
destination's grant.

Non-blocking: ``push_async`` (``ws.push_async``) runs the same push in a thread of its own and returns a
``PushHandle`` (weightsync.runtime.push_handle) at once; ``push`` is ``push_async`` and ``wait`` without the
thread. One push per source at a time: a push started while another is in flight is refused with
``WeightSyncError`` (nothing written, its version still free). Each push holds back one write per
destination (its tail, from a private copy) until it has checked that none of its tensors changed while
it read them (push_handle's doc); ``wait_pushed`` and ``guard`` are what the trainer calls before
``optimizer.step()``.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping
from typing import Any

from weightsync.delta import DeltaSender
from weightsync.engine import Region, TransferEngine
from weightsync.errors import WeightSyncError
from weightsync.plan.lower import Round, source_program
from weightsync.plan.parts import SOURCE, EngineInfo, SourcePart
from weightsync.plan.writes import DEFAULT_CHUNK_BYTES, MIN_CHUNK_BYTES
from weightsync.runtime.links import DestinationLink, PeerLink
from weightsync.runtime.participant import Participant, contiguous
from weightsync.runtime.push import Push, keeps_posting_order
from weightsync.runtime.push_handle import CLOSE_WAIT_S, PushHandle, PushWorker, watched_tensors
from weightsync.runtime.push_stats import PushStats
from weightsync.runtime.staging import Staging
from weightsync.runtime.tails import HeldTails
from weightsync.wire import ACK_RECORD, ANNOUNCE_RECORD, MAX_SLOTS

__all__ = ["PushStats", "Source", "push", "push_async"]

DEFAULT_CPU_STAGING = 256 << 20


class Source(Participant):
    """A trainer rank: holds (shards of) the weights and pushes them. See ``push``.

    ``staging_bytes`` is the watermark of the staging pool (packed blocks, casts, FP8 tiles and gathers
    are prepared there, one chunk per slot, and written from there): by default 5% of the GPU's memory
    when the tensors are on a GPU, 256 MiB otherwise. ``chunk_bytes`` (default: 8 MiB, 256 MiB on a
    GPU, at most half the watermark) is the largest staged write; the coordinator lowers this source's
    ops with it.
    """

    role = SOURCE
    inbox_record = ACK_RECORD  # destinations ack into this source's mailbox
    outbox_record = ANNOUNCE_RECORD  # and it announces from its outbox
    grant_slots = 2 * MAX_SLOTS  # destinations grant into grant_slot(rank, version)

    def __init__(self, group: str, rank: int, tensors: Mapping[str, Any], *, timeout: float = 120.0,
                 engine: TransferEngine | None = None, secret: str | None = None,
                 staging_bytes: int | None = None, chunk_bytes: int | None = None,
                 one_writer_at_a_time: bool = False, delta: bool = False) -> None:
        import torch

        super().__init__(group, rank, tensors, timeout, engine, secret)
        live = {key: contiguous(self._local_tensor(key), key) for key in self.tensors}
        # What a push checks, and what it sends: host tensors from a private copy (push_handle's doc).
        self._watched = watched_tensors(self.tensors, live)
        self._locals: dict[str, Any] = self._watched.sent(live)
        self._regions: dict[str, Region] = {key: self.engine.register(local, name=key)
                                            for key, local in self._locals.items()}
        first = next(iter(self._locals.values()))
        self.device = first.device if isinstance(first, torch.Tensor) else torch.device("cpu")
        # Pushes: one at a time (``_last_push`` until it is done); a background push's staging kernels run
        # on a stream of its own, not on the trainer's.
        self._push_lock = threading.Lock()
        self._last_push: PushHandle | None = None
        self._push_worker: PushWorker | None = None  # background pushes' thread, from the first one on
        self._closing = False
        # Every push's own device work (the tails' snapshot, a delta's order and encode kernels) runs on
        # this stream, at a higher priority than the delta compare's (weightsync.delta.sender.
        # DeltaSender.prefetch): a span's encode is not queued behind the next span's compare, whose
        # blocks would otherwise fill the device first.
        self._push_stream = (torch.cuda.Stream(self.device, priority=-1) if self.device.type == "cuda"
                             else None)
        # One write per destination held back until the push has checked its tensors (weightsync.runtime.
        # tails): picked per plan part.
        self._held = HeldTails(self.engine, self.rank, self.device, self._locals)
        if staging_bytes is None:
            if self.device.type == "cuda":
                staging_bytes = torch.cuda.get_device_properties(self.device).total_memory // 20
            else:
                staging_bytes = DEFAULT_CPU_STAGING
        self.staging_limit = int(staging_bytes)
        # Staged chunks in one pass per destination (see Staging._passes). Off by default: on 4 x H100
        # the 8B FP8 push took 103 ms with it against 65 ms without (the second pass re-prepares every
        # chunk and waits for its slot), more than the contention it avoids (docs/BENCHMARKS.md).
        self.one_writer_at_a_time = bool(one_writer_at_a_time)
        if chunk_bytes is None:
            # On a GPU, fewer and larger chunks: the copy engine and the quantization kernels want
            # large pieces, and each chunk costs a few Python calls and a stream synchronization.
            default = DEFAULT_CHUNK_BYTES * 32 if self.device.type == "cuda" else DEFAULT_CHUNK_BYTES
            chunk_bytes = min(default, self.staging_limit // 2)
        self.chunk_bytes = int(chunk_bytes)
        if self.chunk_bytes < MIN_CHUNK_BYTES or self.chunk_bytes > self.staging_limit:
            raise WeightSyncError(
                f"group {group!r}: source rank {rank}: staging watermark {self.staging_limit} bytes and "
                f"chunk {self.chunk_bytes} bytes: a chunk must be at least {MIN_CHUNK_BYTES} bytes and "
                f"fit the watermark")
        self._staging = Staging(self.engine, self._control, self.rank, self.device, self.staging_limit,
                                self._locals, self._outbox_region, self.log)
        self._dests: dict[int, DestinationLink] = {}
        # Delta pushes: the reference of what this source last pushed, and the inboxes of destinations
        # that take deltas (those get a header per version from every source, delta or not).
        self._delta = DeltaSender(self.engine, self._locals, self.device, self.rank, bool(delta))
        self._overflow_told: set[int] = set()  # destinations told their inbox was too small (logged once)
        self._last_version = -1  # the last version this source pushed (versions must increase)
        self._watcher: Any = None
        self._epoch_fallbacks = 0  # pushes that asked the coordinator for the epoch (watcher unhealthy)
        self._join({})
        self._watcher = self._control.start_watcher(self)

    def _engine_info(self) -> EngineInfo:
        # A GPU source's writes go over the cuda lane, where a 2-D copy reads strided rows at full speed:
        # no packing into staging for it (weightsync/plan/writes.py, ``pack_strided``).
        base = super()._engine_info()
        return EngineInfo(base.nics, base.stripe_threshold, base.max_piece, self.chunk_bytes,
                          self.device.type != "cuda")

    def _apply_part(self, part: SourcePart) -> None:
        program = self._held.hold(source_program(part, list(self._regions), self.rank))
        self._part = part
        self._relay = part.relay
        gatherers = {r: PeerLink(g, self._peer(g.address)) for r, g in part.gatherers.items()}
        providers = {r: PeerLink(p, self._peer(p.address)) for r, p in part.providers.items()}
        self._gatherers, self._providers = gatherers, providers
        self._staging.load(part, program, gatherers, providers, self._timeout)
        # Per destination: its peer and descriptors (the shadow comes with each push's grant).
        self._dests = {}
        for rank, t in part.destinations.items():
            peer = self._peer(t.address)
            self._dests[rank] = DestinationLink(t, peer, program.batches[rank],
                                                ordered=keeps_posting_order(peer))
        self._direct_srcs = [self._regions[k] for k in program.src_keys]
        self._rounds: list[Round] = program.rounds
        self._delta.load(part, self._rounds, program.src_keys, self._held.tails, self._dests,
                         {r: b.dkeys for r, b in program.batches.items()}, part.plan.num_sources)
        staged = int((part.writes["staged"] == 1).sum())
        self.log.info("source %d: plan epoch %d, %d writes (%d staged in %d chunks), %d bytes to "
                      "destinations %s", self.rank, self.epoch, len(part.writes), staged,
                      len(part.chunks), part.bytes, sorted(self._dests))

    def _plan_epoch(self, timeout: float) -> int:
        """The coordinator's plan epoch as this push must see it.

        From the epoch watcher, without a round trip. Like the round trip it replaces, it may lag a
        re-plan: a re-plan could always land just after the coordinator answered; now the lag is the
        long-poll's delivery (a one-way Ray reply, well under a push). Membership changes wait for the
        watchers to hear them before they return (Coordinator._await_watchers), so a push that starts
        after a join or report returned sees the new plan. A report this source made itself is awaited
        (its answer is the epoch after it); with the watcher unhealthy the coordinator is asked."""
        epoch = self._control.reported_epoch(timeout)
        heard = self._watcher.epoch() if self._watcher is not None else None
        if heard is None:
            self._epoch_fallbacks += 1
            heard = self._control.current_epoch(timeout)
        return max(epoch, heard)

    def close(self) -> None:
        """Stops the epoch watcher and closes the engine. A push in flight is cancelled (it fails, and no
        destination takes its version), unless it has already released its last writes: then it gets up
        to CLOSE_WAIT_S to finish."""
        with self._push_lock:
            self._closing = True
            h = self._last_push
        if h is not None and not h.done() and not h.cancel("the source was closed"):
            h.join(CLOSE_WAIT_S)
        if self._watcher is not None:
            self._watcher.stop()
        super().close()  # a cancelled push's waits end here (the engine fails them)
        if h is not None and not h.join(CLOSE_WAIT_S):
            self.log.warning("source %d: push of version %d still running %.0f s after close", self.rank,
                             h.version, CLOSE_WAIT_S)
        if self._push_worker is not None:
            self._push_worker.stop(1.0)  # ends at once unless the push above is still running

    # -- pushes in flight --------------------------------------------------------------------------
    def wait_pushed(self, timeout: float | None = None) -> PushStats | None:
        """Waits for this source's push (the one in flight, or the last one if nobody waited for it yet)
        and returns its ``PushStats`` or raises its error, as ``PushHandle.wait``; None if there is none.
        Call it before ``optimizer.step()``: a push reads the tensors until it ends."""
        h = self._last_push
        if h is None or (h.done() and h._observed):
            return None
        return h.wait(timeout)

    def guard(self, optimizer: Any, timeout: float | None = None) -> Any:
        """Makes every ``optimizer.step()`` wait for this source's push first (a step pre-hook calling
        ``wait_pushed``; the push's error, if any, is raised from the step). Returns the hook's handle
        (``.remove()`` undoes it)."""
        def before_step(_optimizer: Any, _args: Any, _kwargs: Any) -> None:
            self.wait_pushed(timeout)

        return optimizer.register_step_pre_hook(before_step)

    # -- the push ----------------------------------------------------------------------------------
    def push(self, version: int, timeout: float = 60.0) -> PushStats:
        """Writes the current contents of this source's tensors to every destination as ``version``.

        Called by every source rank (like a collective). Returns once every destination this source
        writes to has confirmed the complete version, or reports the ones that failed (see the module
        doc)."""
        return self._start(version, timeout, background=False).wait()

    def push_async(self, version: int, timeout: float = 60.0) -> PushHandle:
        """Starts ``push(version, timeout)`` in a thread of its own and returns its ``PushHandle`` at once.

        The tensors must not change until the push has ended (``handle.wait()``, ``wait_pushed()`` or
        ``guard(optimizer)`` before the next ``optimizer.step()``); a push that sees them change fails
        and no destination takes its version. Refused (``WeightSyncError``, nothing written) while
        another push of this source is in flight."""
        return self._start(version, timeout, background=True)

    def _start(self, version: int, timeout: float, background: bool) -> PushHandle:
        if not 0 <= version < 1 << 62:
            raise WeightSyncError(f"version {version} must be a non-negative integer")
        with self._push_lock:
            if self._closing:
                raise WeightSyncError(f"group {self.group!r}: source {self.rank} is closed")
            prev = self._last_push
            if prev is not None and not prev.done():
                raise WeightSyncError(
                    f"group {self.group!r}: source {self.rank}: version {version} refused, the push of "
                    f"version {prev.version} is still in flight (one push per source at a time: wait for "
                    "it with handle.wait() or src.wait_pushed() first; nothing was written)")
            if version <= self._last_version:
                raise WeightSyncError(f"group {self.group!r}: source {self.rank}: version {version} is not "
                                      f"newer than version {self._last_version} it pushed before; versions "
                                      "must increase (nothing was written)")
            self._last_version = version
            h = PushHandle(self, version, timeout, background)
            if background and self.device.type == "cuda":
                import torch

                # What the caller queued before this call (the optimizer step) must be done before the
                # engine reads the tensors: the push thread waits for this event, the caller does not.
                h._ready = torch.cuda.Event()
                h._ready.record(torch.cuda.current_stream(self.device))
            self._last_push = h
            if background and self._push_worker is None:
                self._push_worker = PushWorker(f"weightsync-{self.group}-push{self.rank}", self)
        h.start(self._push_worker)
        return h

    def _run_push(self, h: PushHandle) -> PushStats:
        """The push of ``h``, in its thread: on a GPU with the device and the push's own stream current,
        once the caller's last kernels are done."""
        if self.device.type != "cuda":
            return self._push_body(h)
        import torch

        with torch.cuda.device(self.device):
            if h.background:
                h._ready.synchronize()
            else:
                # The engine reads the tensors outside torch's streams: the caller's last update must be
                # done.
                torch.cuda.current_stream(self.device).synchronize()
            with torch.cuda.stream(self._push_stream):
                return self._push_body(h)

    def _push_body(self, h: PushHandle) -> PushStats:
        """The plan epoch made current, then the push itself (weightsync.runtime.push.Push)."""
        t0 = time.perf_counter()
        deadline = time.monotonic() + h.timeout
        # ">": the watcher may not have heard yet an epoch this source already fetched by itself.
        if self._plan_epoch(h.timeout) > self.epoch:
            self._fetch_part(max(deadline - time.monotonic(), 0.1))
        phases = {"plan": time.perf_counter() - t0}
        if self._part.plan_destinations == 0:
            # Every destination was dropped (reported failed) and none has joined again: a push that
            # returned stats would read as "version delivered" while it reached nobody.
            raise WeightSyncError(f"group {self.group!r}: push of version {h.version} from source "
                                  f"{self.rank} reaches no destination: plan epoch {self.epoch} has none "
                                  "(every one was dropped as failed and none has joined again); nothing was "
                                  "written")
        return Push(self, h, t0, deadline, phases).run()


def push(src: Source, version: int, timeout: float = 60.0) -> PushStats:
    """Writes the current contents of ``src``'s tensors to every destination as ``version``
    (``src.push``). Called by every source rank (like a collective)."""
    return src.push(version, timeout)


def push_async(src: Source, version: int, timeout: float = 60.0) -> PushHandle:
    """Starts the push of ``version`` and returns its ``PushHandle`` at once (``src.push_async``):
    ``handle.wait()`` gives the ``PushStats`` of ``push``. Every source rank calls it, like ``push``; the
    tensors must not change until the push has ended (``src.guard(optimizer)`` enforces it)."""
    return src.push_async(version, timeout)
