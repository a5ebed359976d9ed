"""``TransferEngine``, registered ``Region``s, ``Peer``s, ``Transfer``s, ``ImmCounter``s, ``Forward``s.

The C++ engine (cpp/) does the work on its own threads; this module gives it the contract's shape:
addresses and descriptors are opaque msgpack bytes (safe to send through Ray), every wait has a timeout,
and every failure is a ``weightsync`` error that names the peer, region or tensor.

How many immediates a write delivers (``Transfer.imm_count``): a write of ``n`` bytes with an immediate
is posted as pieces, and every piece delivers the immediate once to the destination's counter:

* ``n == 0``: one piece (a zero-length write that only signals);
* ``n <= stripe_threshold``: one piece;
* otherwise the write is striped over the engine's NICs: pieces of ``min(max_piece, ceil(n / nics)
  rounded up to 4 KiB)`` bytes, ``ceil(n / piece)`` of them.

A 2-D write (``rows > 1``: ``rows`` rows of ``n`` bytes, ``src_pitch``/``dst_pitch`` bytes apart, 0 meaning
``n``) delivers exactly one immediate, on every lane and whatever its size: its rows travel without one
(over the fabric as separate RMA writes spread over the NICs, each completing only once placed at the
target, FI_DELIVERY_COMPLETE; on the cuda lane as ``cuMemcpy2DAsync`` copies), and a zero-length write
carrying the immediate follows once all of them completed. So ``imm_count(n, rows=r)`` is 1 for ``r > 1``.

The cuda lane cuts a 1-D write into copies of ``cuda_piece`` bytes of its own, but delivers the count
above (all of it once the write's last copy is done), so the count never depends on the lane.

Into a *landing* region (GPU memory its engine's NICs cannot register, see ``TransferEngine``) the
count is the same: each piece above travels as tagged messages of at most the region's slot size, all
of a write on one NIC; a piece cut into several messages (and a 2-D write) announces its immediate with
one more, empty message after them, counted only once every byte before it is in GPU memory.

The count depends only on ``n``, ``rows`` and the sending engine's configuration (never on which NICs
are up), so the planner can compute expected counts ahead of time: ``weightsync.engine.imm_counts``
(vectorised; ``nics=len(engine.nics)``, ``engine.stripe_threshold``, ``engine.max_piece``) or
``TransferEngine.imm_count``. Both are the engine's own rule (cpp/core/pieces.hpp), not a copy of it.
A piece is never copied while it may still land: when its NIC's path fails, a piece in flight there
either completes there (it landed, counted once) or comes back as an error once the engine has aborted
its connection (tcp;ofi_rxm: a reset, so the kernel drops what it still held instead of sending it
later), and only then is it re-posted whole on another NIC; one whose outcome stays unknown fails its
write instead of being retried. A slow NIC whose connection still gets acknowledgements is not failed.
So a retried piece's first attempt does not land after the write completed. And each piece's immediate
is counted exactly once, whatever is retried: over the fabric NICs a piece's bytes are written without
it, complete only once placed, and are followed by an *announce*, a small tagged message that carries the
immediate and names the piece (the writer engine's 128-bit uid, its peer handle, a piece number kept
across retries). The receiver counts a name once and drops a repeat (``stats()``: ``imm_duplicates``), so
a piece whose acknowledgement was lost with a link after it landed, and which is therefore sent again on
another NIC, still counts once, and only after its bytes are in place. (Providers without tagged messages
or delivery completion carry the immediate on the write itself, without this guarantee. The wire format
is described in cpp/core/announce.hpp.)
"""

from __future__ import annotations

import logging
import operator
import os
import threading
from collections.abc import Sequence
from typing import Any

import numpy as np

from weightsync import _ext
from weightsync.engine.arguments import buffer_info, column, immediate, u64, used_entries
from weightsync.engine.descriptors import Address, Descriptor
from weightsync.engine.topology import NicChoice, engine_nics, given_nics
from weightsync.errors import TimeoutError, TransportError  # noqa: A004

log = logging.getLogger("weightsync.engine")

def _drain_log() -> None:
    """Forwards what the C++ engine queued for the log (worker-thread conditions such as a dropped
    landing message) to the ``weightsync.engine`` logger. Called at every call into the engine that
    may wait, so records reach the log from a Python thread, never from a worker."""
    for level, message in _ext.drain_log():
        log.log(level, "%s", message)


def _default_nics(provider: str, nics: Sequence[str] | None, gpu: int | None) -> NicChoice:
    """The engine's NICs and why: ``nics``, else ``$WEIGHTSYNC_NICS`` (comma-separated domain names),
    else those of the provider's NICs nearest CUDA device ``gpu`` (same PCIe switch, else NUMA node,
    else all), or nearest the calling thread's CPUs for a CPU-memory engine (``gpu=None``); the rules
    are weightsync.engine.topology's."""
    given = given_nics(nics)
    if given is not None:
        return given
    if provider.startswith("tcp"):
        # TCP has one "NIC" per network interface. Loopback is the safe default for one host (it has
        # no PCI device, so the choice keeps it); pass nics=["eth0"] (or set WEIGHTSYNC_NICS) for
        # engines on different hosts.
        return engine_nics(["lo"], provider, gpu)
    return engine_nics([domain for _prov, domain, _fabric in _ext.discover(provider)], provider, gpu)


class Region:
    """Memory registered on every NIC of an engine. ``descriptor`` lets a peer write into it."""

    def __init__(self, engine: TransferEngine, native: _ext.Region, buffer: Any, label: str) -> None:
        self._engine = engine
        self._native = native
        self.buffer = buffer  # keeps the memory alive as long as the region is
        self.label = label
        self.descriptor: bytes = Descriptor(
            engine.uid, native.id, native.len, native.kind, list(zip(native.bases, native.keys, strict=True)),
            native.on_fabric, native.cuda_blob, native.landing, native.landing_slot_bytes,
        ).pack()
        """What a peer passes to ``write`` to write into this region (opaque msgpack bytes)."""

    @property
    def nbytes(self) -> int:
        """Size of the registered memory in bytes."""
        return self._native.len

    @property
    def id(self) -> int:
        """The region's number within its engine."""
        return self._native.id

    @property
    def valid(self) -> bool:
        """False once deregistered."""
        return self._native.valid

    @property
    def on_fabric(self) -> bool:
        """Whether the engine's NICs registered the memory (False: GPU memory without FI_HMEM, reached by
        fabric peers through the landing ring and sent from through staging)."""
        return self._native.on_fabric

    @property
    def fabric_error(self) -> str:
        """Why the NICs did not register it (empty when they did)."""
        return self._native.fabric_error

    @property
    def landing(self) -> int:
        """The region's landing index (>= 0: fabric peers write it with tagged messages), or -1."""
        return self._native.landing

    @property
    def landing_slot_bytes(self) -> int:
        """Largest message a landing region takes (0 for other regions)."""
        return self._native.landing_slot_bytes

    @property
    def cuda_blob(self) -> bytes:
        """The cuda lane's export of the memory (IPC handle or VMM blob; empty: not exported)."""
        return bytes(self._native.cuda_blob)

    def __repr__(self) -> str:
        return f"Region({self.label}, id={self.id}, {self.nbytes} bytes)"


class Peer:
    """A remote engine this engine can write to (``TransferEngine.connect``)."""

    def __init__(self, native: _ext.Peer) -> None:
        self._native = native
        self._imported: dict[bytes, _ext.RemoteRegion] = {}
        self._lock = threading.Lock()

    @property
    def uid(self) -> str:
        """The remote engine's identity (hex)."""
        return self._native.uid

    @property
    def label(self) -> str:
        """Printable name of the peer and its addresses, as error messages give it."""
        return self._native.label

    @property
    def lane(self) -> str:
        """The lane this engine writes into the peer with: "cuda" (copy engines, same host) or "fabric"."""
        return "cuda" if self._native.cuda else "fabric"

    @property
    def transport(self) -> str:
        """Same as ``lane`` (the older name, kept for compatibility)."""
        return self.lane

    @property
    def failed_paths(self) -> list[bool]:
        """Per local NIC: whether writes to this peer through it have failed (and moved to other NICs)."""
        return list(self._native.failed_paths)

    @property
    def last_error(self) -> str:
        """Why the last of this peer's paths failed ("" if none has)."""
        return str(self._native.last_error)

    def __repr__(self) -> str:
        return f"Peer({self.label})"


class Transfer:
    """A write (or a batch of writes) in flight.

    ``wait`` returns once the engine has finished with every piece locally: the source memory may be
    reused. It does not mean the bytes have landed (a NIC may still hold some in flight); only the
    destination's counter (``imm_count`` immediates) says that.
    """

    def __init__(self, native: _ext.Transfer, keep_alive: Sequence[Region]) -> None:
        self._native = native
        # The engine itself keeps the sources' memory alive while pieces read from it (register's owner);
        # this only spares the regions' Python objects until the caller has seen the write succeed.
        self._keep_alive = keep_alive

    @property
    def imm_count(self) -> int:
        """Immediates this write delivers to the destination's counter (see the module docstring)."""
        return self._native.imm_count

    @property
    def nbytes(self) -> int:
        """Bytes the write moves (all rows of a 2-D write)."""
        return self._native.bytes

    @property
    def done(self) -> bool:
        """Whether every piece completed locally or one failed (``wait`` would not block)."""
        return self._native.done

    def wait(self, timeout: float = 60.0) -> None:
        """Blocks until every piece completed locally; raises TransportError if one failed for good and
        TimeoutError after ``timeout`` seconds."""
        done = self._native.wait(float(timeout))
        _drain_log()
        if not done:
            raise TimeoutError(
                f"{self._native.what}: not complete after {timeout} s ({self._native.pending} pieces pending)"
            )
        if self._native.failed:
            raise TransportError(self._native.error)
        self._keep_alive = ()


class Forward:
    """A write the engine posts by itself once enough immediates have arrived (``TransferEngine.forward``).

    ``transfer`` is that write's future: it completes once the forwarded write completed locally, and
    fails if the trigger is cancelled, the engine closes first, or the write cannot be posted when due
    (for example its source region was deregistered meanwhile).
    """

    def __init__(self, engine: TransferEngine, trigger_id: int, transfer: Transfer) -> None:
        self._engine = engine
        self.id = trigger_id
        self.transfer = transfer

    @property
    def fired(self) -> bool:
        """No longer waiting for immediates: posted, failed or cancelled."""
        return not self._engine._native.forward_pending(self.id)

    def cancel(self) -> bool:
        """Cancels the trigger if it has not fired yet; True if it was still pending."""
        return self._engine._native.cancel_forwards(self.id, False, 0) == 1

    def __repr__(self) -> str:
        return f"Forward({self.id}, {self.transfer._native.what})"


class ImmCounter:
    """Arrivals of one immediate value at this engine. Credits: early arrivals are kept, ``wait`` consumes."""

    def __init__(self, engine: TransferEngine, imm: int) -> None:
        self._engine = engine
        self.imm = imm

    @property
    def value(self) -> int:
        """Credits held now (arrived and not yet consumed)."""
        return self._engine._native.counter_value(self.imm)

    @property
    def total(self) -> int:
        """Immediates ever received with this value."""
        return self._engine._native.counter_total(self.imm)

    def wait(self, n: int, timeout: float = 60.0) -> None:
        """Consumes ``n`` credits, blocking until that many are held; TimeoutError after ``timeout``
        seconds (nothing consumed then), TransportError if the engine closes meanwhile."""
        n = u64(n, "n", f"counter {self.imm}: cannot wait for {n} immediates")
        ok = self._engine._native.counter_wait(self.imm, n, float(timeout))
        if not ok:
            _drain_log()
            if self._engine.closed:
                raise TransportError(f"engine closed while waiting for {n} immediates {self.imm}")
            raise TimeoutError(
                f"counter {self.imm}: {self.value} of {n} immediates arrived within {timeout} s"
            )

    def reset(self) -> int:
        """Drops the credits held (for an abandoned version) and returns how many there were."""
        return self._engine._native.counter_reset(self.imm)


class TransferEngine:
    """One per process (per GPU): registers memory and writes one-sided into peers' memory.

    ``transport``: "fabric" (libfabric NICs only), "cuda" (also a copy-engine lane for GPU peers on this
    host; an error where CUDA is unusable) or "auto" (the cuda lane where CUDA and a GPU are available).
    A peer is written through the cuda lane when both engines have one and share a host; otherwise, and
    for every immediate, through the fabric NICs.
    ``nics``: libfabric domain names to use (every one gets a worker thread); ``None`` picks
    ``$WEIGHTSYNC_NICS`` (comma-separated) if set, else the provider's NICs nearest this engine's GPU
    (its cuda lane's, or ``cuda_device``'s for a fabric-only engine; the calling thread's NUMA node
    without one), or loopback for TCP; ``nic_choice`` says which and why.
    ``provider``: e.g. "efa", "verbs;ofi_rxm", "tcp;ofi_rxm"; ``None``
    picks the first of those available (or ``$WEIGHTSYNC_PROVIDER``). ``cuda_device``: the process-local
    ordinal of this engine's GPU (default: torch's current device). ``cuda_piece``: bytes per copy on the
    cuda lane (0, the default: one copy per write, since each extra copy costs the copy engines a launch);
    ``cuda_streams``: streams the copies are spread over (1, the default: copies run in the order they
    are posted, which keeps the plan's schedule); ``cuda_batch_bytes``: 1-D copies smaller than this
    that are posted together go to the driver as one batched copy (``cuMemcpyBatchAsync``, CUDA >= 12.8)
    of at most this many bytes, completing together (0: a call and an event per copy);
    ``cuda_spin_us``: how long the idle cuda worker polls before sleeping.
    ``staging_slots``: GPU memory the NICs cannot register (no FI_HMEM) is sent to fabric peers through
    this many page-locked host slots of ``max_piece`` bytes, the device-to-host copy of one piece
    overlapping the network write of the one before.
    ``landing_slots``, ``landing_slot_bytes``: GPU memory the NICs cannot register is still a destination
    for fabric peers (a *landing* region): each NIC keeps a ring of ``landing_slots`` page-locked host
    buffers of ``landing_slot_bytes`` (0: ``max_piece``) posted as tagged receives; a writer sends its
    bytes as tagged messages of at most that size, and this engine copies each into GPU memory on its
    cuda lane, counting a message's immediate only once its copy (and every copy before it on that NIC)
    is done. The immediates a write delivers are the same as into any other region (``imm_count``).
    ``cuda_peers``: False keeps the cuda lane
    for staging and landing copies only: peers on this host are written over the fabric NICs, and this
    engine's address offers no cuda lane to them either (two GPU processes of one host then talk over
    the NICs, e.g. TCP).
    ``auth_key``: the engine key that fabric peers must prove when they connect (provider "tcp", the
    default on TCP: docs/SECURITY.md); a group's participants derive it from the group secret
    (``weightsync.control.engine_key``) and set it themselves. ``None``: peers without a key are accepted
    (a standalone engine); ``set_auth_key`` sets it later.

    Every default here is the C++ ``EngineConfig``'s (``weightsync._ext.EngineConfig()``): ``None``
    means "the engine's default". Test-only switches are set through ``TransferEngine._for_tests``.
    """

    def __init__(
        self,
        transport: str = "auto",
        nics: Sequence[str] | None = None,
        *,
        provider: str | None = None,
        stripe_threshold: int | None = None,
        max_piece: int | None = None,
        window_bytes: int | None = None,
        window_ops: int | None = None,
        stall_timeout: float | None = None,
        cuda_device: int | None = None,
        cuda_piece: int | None = None,
        cuda_streams: int | None = None,
        cuda_batch_bytes: int | None = None,
        cuda_spin_us: float | None = None,
        staging_slots: int | None = None,
        landing_slots: int | None = None,
        landing_slot_bytes: int | None = None,
        cuda_peers: bool | None = None,
        auth_key: bytes | None = None,
        _test_hooks: _ext.TestHooks | None = None,
    ) -> None:
        if transport not in ("auto", "fabric", "cuda"):
            raise TransportError(f"unknown transport {transport!r} (have: auto, fabric, cuda)")
        if cuda_batch_bytes is not None and cuda_batch_bytes < 0:
            raise TransportError(f"cuda_batch_bytes must be >= 0, not {cuda_batch_bytes}")
        config = _ext.EngineConfig()
        config.transport = "fabric"  # the C++ engine's lane policy: NIC lanes, plus the cuda lane below
        config.provider = provider or os.environ.get("WEIGHTSYNC_PROVIDER") or _ext.pick_provider()
        config.cuda_device = _cuda_lane(transport, cuda_device)
        # NICs are chosen near the cuda lane's GPU, or near the GPU named for a fabric-only engine.
        near = cuda_device if cuda_device is not None else (config.cuda_device if config.cuda_device >= 0
                                                            else None)
        self._nic_choice = _default_nics(config.provider, nics, near)
        config.nics = list(self._nic_choice.nics)
        given = {
            "stripe_threshold": stripe_threshold, "max_piece": max_piece, "window_bytes": window_bytes,
            "window_ops": window_ops, "stall_timeout_s": stall_timeout, "cuda_piece": cuda_piece,
            "cuda_streams": cuda_streams, "cuda_batch_bytes": cuda_batch_bytes, "cuda_spin_us": cuda_spin_us,
            "staging_slots": staging_slots, "landing_slots": landing_slots,
            "landing_slot_bytes": landing_slot_bytes, "cuda_peers": cuda_peers,
        }
        for field, value in given.items():
            if value is not None:
                setattr(config, field, type(getattr(config, field))(value))
        if auth_key is not None:
            config.auth_key = bytes(auth_key).hex()
        self._native = _ext.Engine.create(config, _test_hooks)
        # write_batch's last descriptor table: (the table, its entries, their imports)
        self._last_table: tuple[Sequence[Any], tuple[Any, ...], list[_ext.RemoteRegion]] | None = None
        _drain_log()
        self.transport = "fabric" if config.cuda_device < 0 else "fabric+cuda"
        """The lanes this engine opened: "fabric" or "fabric+cuda"."""
        self.address: bytes = Address(
            self.uid, self.provider, list(self._native.nic_addresses),
            # Without cuda_peers, peers on this host do not see the cuda lane: they write over the NICs.
            self._native.cuda_address if config.cuda_peers else b"",
            list(self._native.doorbell_bases), list(self._native.doorbell_keys),
        ).pack()
        """What a peer passes to ``connect`` (opaque msgpack bytes)."""
        log.info("engine %s on %s NICs %s: %s", self.uid[:8], self.provider, ",".join(self.nics),
                 self._nic_choice.reason)

    @classmethod
    def _for_tests(cls, *args: Any, stage_host_sources: bool = False, land_host_regions: bool = False,
                   lose_imm_acks: int = 0, cq_data_immediates: bool = False, no_path_abort: bool = False,
                   **kwargs: Any) -> TransferEngine:
        """An engine with the test-only switches of the C++ ``TestHooks`` (never for production):
        ``stage_host_sources`` keeps host sources off the NICs and stages them like GPU memory without
        FI_HMEM (copied with memcpy); ``land_host_regions`` makes host regions landing regions (the ring
        is plain memory, copied out with memcpy). Both run those GPU paths on machines without a GPU.
        ``lose_imm_acks``: the first that many writes carrying an immediate that land are reported to
        this engine as failed on their NIC (an acknowledgement lost with a link), so they are retried on
        another NIC. ``cq_data_immediates``: this engine's writes carry their immediates as remote CQ data
        of the write, without announces (no de-duplication; for benchmarks of what announces cost).
        ``no_path_abort``: a NIC path that fails keeps its connection (as where a lane finds no socket to
        abort), so its writes stay unresolved until the drain time runs out. Other arguments are
        ``TransferEngine``'s."""
        hooks = _ext.TestHooks()
        hooks.stage_host_sources = bool(stage_host_sources)
        hooks.land_host_regions = bool(land_host_regions)
        hooks.lose_imm_acks = int(lose_imm_acks)
        hooks.cq_data_immediates = bool(cq_data_immediates)
        hooks.no_path_abort = bool(no_path_abort)
        return cls(*args, _test_hooks=hooks, **kwargs)

    # --- identity -----------------------------------------------------------------------------------
    @property
    def uid(self) -> str:
        """This engine's identity (32 hex digits)."""
        return self._native.uid

    @property
    def provider(self) -> str:
        """The libfabric provider of its NIC lanes, e.g. "tcp;ofi_rxm"."""
        return self._native.provider

    @property
    def nics(self) -> list[str]:
        """Names of its NIC lanes (libfabric domains), in NIC order."""
        return list(self._native.nic_names)

    @property
    def nic_choice(self) -> NicChoice:
        """Why these NICs: ``reason`` in words, ``locality`` ("switch", "numa", "all" or "given" by
        ``nics=``/``$WEIGHTSYNC_NICS``), the GPU's PCI address and the candidates (``as_dict()``)."""
        return self._nic_choice

    @property
    def lanes(self) -> list[tuple[str, _ext.LaneCaps]]:
        """Per lane (NIC lanes first, then the cuda lane if any): its type and what it can do."""
        return list(self._native.lanes)

    @property
    def config(self) -> _ext.EngineConfig:
        """The configuration in force (a copy): the one given, with the provider and NICs chosen and
        ``max_piece``/``stripe_threshold``/``landing_slot_bytes`` clamped to what the lanes accept."""
        return self._native.config

    @property
    def cuda_peers(self) -> bool:
        """Whether peers on this host may be written through the cuda lane (``cuda_peers``)."""
        return self._native.config.cuda_peers

    @property
    def two_d_mode(self) -> str:
        """How the NICs keep a 2-D write's immediate behind its rows: "delivery" (rows complete at
        delivery), "ordered" (all on one NIC, placed in order) or "" (2-D writes with an immediate are
        refused over the NICs)."""
        return self._native.two_d_mode

    @property
    def closed(self) -> bool:
        """Whether ``close`` was called (every later call fails with a TransportError)."""
        return self._native.closed

    @property
    def stripe_threshold(self) -> int:
        """Writes larger than this many bytes are striped over the NICs (after clamping to ``max_piece``)."""
        return self._native.stripe_threshold

    @property
    def max_piece(self) -> int:
        """Largest piece a write is cut into (after clamping to what every NIC accepts)."""
        return self._native.max_piece

    def set_auth_key(self, key: bytes) -> None:
        """Sets the engine key peers must prove from now on (connections already made stay): an engine
        made before its group was known gets the group's key here (``auth_key``)."""
        self._native.set_auth_key(bytes(key).hex())

    # --- memory ---------------------------------------------------------------------------------------
    def register(self, buffer: Any, name: str | None = None) -> Region:
        """Registers a tensor/array/buffer on every NIC. The engine keeps a reference to ``buffer`` for as
        long as the region or any write reading from it lives (queued, or still held by a NIC), so
        dropping a transfer, the region and the buffer while writes are in flight never frees memory a
        NIC still reads."""
        info = buffer_info(buffer, name)
        native = self._native.register(info.ptr, info.nbytes, info.kind, info.device, buffer)
        _drain_log()
        return Region(self, native, buffer, info.label)

    def deregister(self, region: Region) -> None:
        """New writes from the region are refused; writes in flight finish first. The buffer stays
        referenced by the engine until the NIC has released every write in flight from it."""
        self._native.deregister(region._native)
        _drain_log()

    # --- peers ----------------------------------------------------------------------------------------
    def connect(self, address: bytes) -> Peer:
        """Connects to the engine whose ``address`` is given (through every NIC lane, and the cuda lane
        when both engines have one on one host); TransportError if the address is corrupted or the
        providers differ. Connecting to one's own address is allowed (loopback)."""
        a = Address.unpack(address)
        return Peer(self._native.connect(a.uid, a.provider, a.nic_addresses, a.cuda_address, a.doorbell_bases,
                                         a.doorbell_keys))

    def _import(self, peer: Peer, descriptor: bytes) -> _ext.RemoteRegion:
        with peer._lock:
            remote = peer._imported.get(descriptor)
        if remote is not None:
            return remote
        d = Descriptor.unpack(descriptor)
        region_id = d.region_id
        if d.engine_uid != peer.uid:
            raise TransportError(
                f"descriptor of region {region_id} belongs to engine {d.engine_uid[:8]}, not to {peer.label}"
            )
        if not d.on_fabric and d.landing < 0 and not (peer._native.cuda and d.cuda_blob):
            raise TransportError(
                f"region {region_id} of {peer.label} is GPU memory its NICs could not register, and this "
                "engine cannot reach it through CUDA IPC (another host, or no cuda lane here)"
            )
        remote = self._native.import_region(
            peer._native, region_id, d.nbytes, [b for b, _ in d.nics], [k for _, k in d.nics], d.cuda_blob,
            d.landing, d.slot_bytes,
        )
        with peer._lock:
            peer._imported[descriptor] = remote
        return remote

    def _import_table(self, table: Sequence[tuple[Peer, bytes]]) -> list[_ext.RemoteRegion]:
        """``_import`` of every (peer, descriptor) of a write_batch table. A source passes one table per
        destination to every round and staged chunk of a push (hundreds of descriptors, a lock and a
        lookup each): the same table object holding the same entries as last time reuses that call's
        imports."""
        last = self._last_table
        if (last is not None and last[0] is table and len(last[1]) == len(table)
                and all(map(operator.is_, last[1], table))):
            return last[2]
        remotes = [self._import(peer, desc) for peer, desc in table]
        self._last_table = (table, tuple(table), remotes)
        return remotes

    # --- writes ---------------------------------------------------------------------------------------
    def imm_count(self, nbytes: int, imm: bool = True, rows: int = 1) -> int:
        """Immediates a write of ``nbytes`` (per row) from this engine delivers (see the module docstring)."""
        return self._native.imm_count(int(nbytes), imm, int(rows))

    def write(
        self,
        src: Region,
        src_off: int,
        peer: Peer,
        dst_descriptor: bytes,
        dst_off: int,
        nbytes: int,
        imm: int | None = None,
        rows: int = 1,
        src_pitch: int = 0,
        dst_pitch: int = 0,
    ) -> Transfer:
        """Writes ``nbytes`` from ``src[src_off:]`` into the peer's region at ``dst_off``, one-sided.

        With ``rows > 1`` it writes a 2-D block: ``rows`` rows of ``nbytes`` bytes, row ``r`` read at
        ``src_off + r * src_pitch`` and written at ``dst_off + r * dst_pitch`` (a pitch of 0 means
        ``nbytes``), delivering one immediate in all.
        """
        if not isinstance(src, Region):
            raise TransportError(
                f"write source must be a Region registered with this engine, got {type(src).__name__}"
            )
        where = f"write to {peer.label}"
        src_off, dst_off, nbytes, rows, src_pitch, dst_pitch = (
            u64(v, name, where)
            for v, name in ((src_off, "source offset"), (dst_off, "destination offset"), (nbytes, "size"),
                            (rows, "row count"), (src_pitch, "source pitch"), (dst_pitch, "target pitch"))
        )
        remote = self._import(peer, dst_descriptor)
        native = self._native.write(src._native, src_off, remote, dst_off, nbytes, immediate(imm), rows,
                                    src_pitch, dst_pitch)
        return Transfer(native, (src,))

    def write_batch(
        self,
        srcs: Sequence[Region],
        peer_descriptors: Sequence[tuple[Peer, bytes]],
        src_index: np.ndarray,
        src_off: np.ndarray,
        dst_index: np.ndarray,
        dst_off: np.ndarray,
        nbytes: np.ndarray,
        imm: np.ndarray | int | None = None,
        rows: np.ndarray | None = None,
        src_pitch: np.ndarray | None = None,
        dst_pitch: np.ndarray | None = None,
    ) -> Transfer:
        """Submits many writes in one call: columns index into ``srcs`` and ``peer_descriptors``.

        ``rows``/``src_pitch``/``dst_pitch`` (optional columns) make writes 2-D as in ``write``;
        ``nbytes`` is then the bytes per row.
        """
        remotes = self._import_table(peer_descriptors)
        cols = [
            column(src_index, np.uint32, "source index"),
            column(src_off, np.uint64, "source offset"),
            column(dst_index, np.uint32, "destination index"),
            column(dst_off, np.uint64, "destination offset"),
            column(nbytes, np.uint64, "size"),
        ]
        # Only the table entries the batch uses go to the engine: the binding converts (and the engine
        # pins) every entry of both tables per call, and a plan round of a source holding Qwen3-30B-A3B's
        # 18,867 tensors uses about a fifteenth of them (3.3 ms of conversion per round on the CPU VM).
        srcs, cols[0] = used_entries(srcs, cols[0])
        remotes, cols[2] = used_entries(remotes, cols[2])
        imm_col = None
        if imm is not None:
            imm_col = (
                np.full(len(cols[0]), immediate(int(imm)), dtype=np.uint32)
                if np.isscalar(imm)
                else column(imm, np.uint32, "immediate")
            )
        geometry = [
            None if c is None else column(c, np.uint64, name)
            for c, name in ((rows, "row count"), (src_pitch, "source pitch"), (dst_pitch, "target pitch"))
        ]
        native = self._native.write_batch([s._native for s in srcs], remotes, *cols, imm_col, *geometry)
        return Transfer(native, tuple(srcs))

    # --- triggered writes (relays) ----------------------------------------------------------------------
    def forward(
        self,
        on_imm: int,
        count: int,
        src: Region,
        src_off: int,
        peer: Peer,
        dst_descriptor: bytes,
        dst_off: int,
        nbytes: int,
        imm: int | None = None,
        rows: int = 1,
        src_pitch: int = 0,
        dst_pitch: int = 0,
    ) -> Forward:
        """Posts ``write(src, src_off, peer, dst_descriptor, dst_off, nbytes, imm, rows, ...)`` once, as soon
        as ``count`` immediates ``on_imm`` have arrived at this engine, from the engine's own thread.

        ``count`` is compared with the counter's *total* (every immediate ever received with that value,
        whether consumed by a ``wait`` or not), so local waiters never delay or steal a trigger; a
        trigger already due fires at once. For a count relative to now pass
        ``counter(on_imm).total + n``. The write is validated now (bad input raises here) and again
        when it fires. Cancel with ``Forward.cancel`` or ``cancel_forwards``.
        """
        if not isinstance(src, Region):
            raise TransportError(
                f"forward source must be a Region registered with this engine, got {type(src).__name__}"
            )
        where = f"forward to {peer.label}"
        src_off, dst_off, nbytes, rows, src_pitch, dst_pitch, count = (
            u64(v, name, where)
            for v, name in ((src_off, "source offset"), (dst_off, "destination offset"), (nbytes, "size"),
                            (rows, "row count"), (src_pitch, "source pitch"), (dst_pitch, "target pitch"),
                            (count, "count"))
        )
        remote = self._import(peer, dst_descriptor)
        trigger_id, native = self._native.forward(
            immediate(on_imm), count, src._native, src_off, remote, dst_off, nbytes, immediate(imm), rows,
            src_pitch, dst_pitch,
        )
        return Forward(self, trigger_id, Transfer(native, (src,)))

    def cancel_forwards(self, on_imm: int | None = None) -> int:
        """Cancels the pending triggers on immediate ``on_imm`` (all if None); returns how many."""
        if on_imm is None:
            return self._native.cancel_forwards(0, False, 0)
        return self._native.cancel_forwards(0, True, immediate(on_imm))

    @property
    def pending_forwards(self) -> int:
        """Triggers registered with ``forward`` that have not fired yet."""
        return self._native.pending_forwards

    # --- counters and state ---------------------------------------------------------------------------
    def counter(self, imm: int) -> ImmCounter:
        """The counter of immediate ``imm`` (a 32-bit value) at this engine: credits of arrived writes."""
        return ImmCounter(self, immediate(imm))

    def stats(self) -> list[dict[str, Any]]:
        """Per NIC: bytes and writes completed, immediates received (and ``imm_duplicates``: announces of
        pieces counted already, dropped), errors, rerouted pieces, and messages
        landed in landing regions (``landed``, ``landed_bytes``) or dropped (``landing_dropped``: the
        region was deregistered, or the message did not fit it)."""
        _drain_log()
        return list(self._native.stats())

    def close(self) -> None:
        """Stops the lane workers and releases every registration; writes still in flight and waits on
        counters fail with a TransportError. Idempotent."""
        self._native.close()
        _drain_log()

    def __enter__(self) -> TransferEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"TransferEngine({self.uid[:8]}, {self.provider}, nics={self.nics})"


def _cuda_lane(transport: str, cuda_device: int | None) -> int:
    """The device ordinal for the engine's cuda lane, or -1 for none."""
    if transport == "fabric":
        return -1
    why = _ext.cuda_unavailable_reason()
    if not why and cuda_device is None:
        try:
            import torch

            if torch.cuda.is_available():
                cuda_device = torch.cuda.current_device()
            else:
                why = "torch sees no CUDA device"
        except ImportError:
            cuda_device = 0
    if why:
        if transport == "cuda":
            raise TransportError(f"transport 'cuda' unavailable: {why}")
        return -1
    return int(cuda_device)


__all__ = ["Forward", "ImmCounter", "Peer", "Region", "Transfer", "TransferEngine"]

