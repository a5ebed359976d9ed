"""The data plane as Python sees it: ``TransferEngine``, registered ``Region``s, ``Peer``s, ``Transfer``s.

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
are up), so the planner can compute expected counts ahead of time with ``TransferEngine.imm_count``.
A piece whose NIC fails is re-posted whole on another NIC and still delivers exactly one immediate,
unless the failed NIC had already delivered it (a link that dies after the data landed but before the
acknowledgement): then the destination may count it twice, which is why pushes use a fresh immediate
per version.
"""

from __future__ import annotations

import logging
import os
import threading
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import msgpack
import numpy as np

from weightsync import _ext
from weightsync.errors import TimeoutError, TransportError  # noqa: A004

log = logging.getLogger("weightsync.engine")

_DESCRIPTOR_VERSION = 2  # 2: landing index and slot size
_ADDRESS_VERSION = 1
_KIND_HOST = 0
_KIND_CUDA = 1


def _default_nics(provider: str) -> list[str]:
    env = os.environ.get("WEIGHTSYNC_NICS")
    if env:
        return [n for n in env.split(",") if n]
    if provider.startswith("tcp"):
        # TCP has one "NIC" per network interface. Loopback is the safe default for one host; pass
        # nics=["eth0"] (or set WEIGHTSYNC_NICS) for engines on different hosts.
        return ["lo"]
    return [domain for _prov, domain, _fabric in _ext.discover(provider)]


def _crc(fields: list[Any]) -> int:
    return zlib.crc32(msgpack.packb(fields, use_bin_type=True))


@dataclass(frozen=True)
class _BufferInfo:
    ptr: int
    nbytes: int
    kind: int
    device: int
    label: str


def _buffer_info(buffer: Any, name: str | None) -> _BufferInfo:
    """Pointer and size of a torch tensor, numpy array or writable buffer."""
    label = name or type(buffer).__name__
    try:
        import torch
    except ImportError:  # pragma: no cover - torch is a dependency; keep numpy usable without it
        torch = None
    if torch is not None and isinstance(buffer, torch.Tensor):
        if not buffer.is_contiguous():
            raise TransportError(f"cannot register tensor {label}: it is not contiguous (call .contiguous())")
        nbytes = buffer.numel() * buffer.element_size()
        if buffer.is_cuda:
            return _BufferInfo(buffer.data_ptr(), nbytes, _KIND_CUDA, buffer.device.index or 0, label)
        return _BufferInfo(buffer.data_ptr(), nbytes, _KIND_HOST, -1, label)
    if isinstance(buffer, np.ndarray):
        if not buffer.flags.c_contiguous:
            raise TransportError(f"cannot register array {label}: it is not C-contiguous")
        return _BufferInfo(buffer.ctypes.data, buffer.nbytes, _KIND_HOST, -1, label)
    try:
        view = memoryview(buffer)
    except TypeError:
        raise TransportError(
            f"cannot register {label}: expected a torch tensor, numpy array or writable buffer"
        ) from None
    if view.readonly:
        raise TransportError(f"cannot register {label}: the buffer is read-only")
    arr = np.frombuffer(view, dtype=np.uint8)
    return _BufferInfo(arr.ctypes.data, arr.nbytes, _KIND_HOST, -1, label)


class Region:
    """Memory registered on every NIC of an engine. ``descriptor`` lets a peer write into it."""

    def __init__(self, engine: TransferEngine, native: _ext.Region, buffer: Any, label: str) -> None:
        self._engine = engine
        self._native = native
        self.buffer = buffer  # keeps the memory alive as long as the region is
        self.label = label
        fields = [
            _DESCRIPTOR_VERSION,
            engine.uid,
            native.id,
            native.len,
            native.kind,
            [[b, k] for b, k in zip(native.bases, native.keys, strict=True)],
            native.on_fabric,
            native.cuda_blob,
            native.landing,
            native.landing_slot_bytes,
        ]
        self.descriptor: bytes = msgpack.packb([*fields, _crc(fields)], use_bin_type=True)

    @property
    def nbytes(self) -> int:
        return self._native.len

    @property
    def id(self) -> int:
        return self._native.id

    @property
    def valid(self) -> bool:
        return self._native.valid

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
        return self._native.uid

    @property
    def label(self) -> str:
        return self._native.label

    @property
    def transport(self) -> str:
        """"cuda" when this engine writes into the peer with the copy engines, else "fabric"."""
        return "cuda" if self._native.cuda else "fabric"

    @property
    def failed_paths(self) -> list[bool]:
        """Per local NIC: whether writes to this peer through it have failed (and moved to other NICs)."""
        return list(self._native.failed_paths)

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
        self._keep_alive = keep_alive  # source memory must outlive the pieces still being posted

    @property
    def imm_count(self) -> int:
        """Immediates this write delivers to the destination's counter (see the module docstring)."""
        return self._native.imm_count

    @property
    def nbytes(self) -> int:
        return self._native.bytes

    @property
    def done(self) -> bool:
        return self._native.done

    def wait(self, timeout: float = 60.0) -> None:
        if not self._native.wait(float(timeout)):
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
        if n < 0:
            raise ValueError(f"cannot wait for {n} immediates")
        if not self._engine._native.counter_wait(self.imm, n, float(timeout)):
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
    ``nics``: libfabric domain names to use (every one gets a worker thread); ``None`` picks all of the
    provider's, or loopback for TCP. ``provider``: e.g. "efa", "verbs;ofi_rxm", "tcp;ofi_rxm"; ``None``
    picks the first of those available (or ``$WEIGHTSYNC_PROVIDER``). ``cuda_device``: the process-local
    ordinal of this engine's GPU (default: torch's current device). ``cuda_piece``: bytes per copy on the
    cuda lane (0, the default: one copy per write, which measured best: see docs/BENCHMARKS.md);
    ``cuda_streams``: streams the copies are spread over (1, the default: copies run in the order they
    are posted, which keeps the plan's schedule); ``cuda_batch_bytes``: 1-D copies smaller than this
    that are posted together go to the driver as one batched copy (``cuMemcpyBatchAsync``, CUDA >= 12.8)
    of at most this many bytes, completing together (0: a call and an event per copy);
    ``cuda_spin_us``: how long the idle cuda worker polls before sleeping.
    ``staging_slots``: GPU memory the NICs cannot register (no FI_HMEM) is sent to fabric peers through
    this many page-locked host slots of ``max_piece`` bytes, the device-to-host copy of one piece
    overlapping the network write of the one before. ``stage_host_sources`` (tests only): host sources
    take the same path (copied with memcpy), to exercise it without a GPU.
    ``landing_slots``, ``landing_slot_bytes``: GPU memory the NICs cannot register is still a destination
    for fabric peers (a *landing* region): each NIC keeps a ring of ``landing_slots`` page-locked host
    buffers of ``landing_slot_bytes`` (0: ``max_piece``) posted as tagged receives; a writer sends its
    bytes as tagged messages of at most that size, and this engine copies each into GPU memory on its
    cuda lane, counting a message's immediate only once its copy (and every copy before it on that NIC)
    is done. The immediates a write delivers are the same as into any other region (``imm_count``).
    ``land_host_regions`` (tests only): host regions are landing regions too (the ring is plain memory,
    copied out with memcpy), to run the protocol without a GPU. ``cuda_peers``: False keeps the cuda lane
    for staging and landing copies only: peers on this host are written over the fabric NICs, and this
    engine's address offers no cuda lane to them either (two GPU processes of one host then talk over
    the NICs, e.g. TCP).
    """

    def __init__(
        self,
        transport: str = "auto",
        nics: Sequence[str] | None = None,
        *,
        provider: str | None = None,
        stripe_threshold: int = 1 << 20,
        max_piece: int = 16 << 20,
        window_bytes: int = 64 << 20,
        window_ops: int = 256,
        stall_timeout: float = 5.0,
        cuda_device: int | None = None,
        cuda_piece: int = 0,
        cuda_streams: int = 1,
        cuda_batch_bytes: int = 64 << 20,
        cuda_spin_us: float = 50.0,
        staging_slots: int = 4,
        stage_host_sources: bool = False,
        landing_slots: int = 8,
        landing_slot_bytes: int = 0,
        land_host_regions: bool = False,
        cuda_peers: bool = True,
    ) -> None:
        if transport not in ("auto", "fabric", "cuda"):
            raise TransportError(f"unknown transport {transport!r} (have: auto, fabric, cuda)")
        if cuda_batch_bytes < 0:
            raise TransportError(f"cuda_batch_bytes must be >= 0, not {cuda_batch_bytes}")
        lane = _cuda_lane(transport, cuda_device)
        provider = provider or os.environ.get("WEIGHTSYNC_PROVIDER") or _ext.pick_provider()
        nic_list = list(nics) if nics is not None else _default_nics(provider)
        self._native = _ext.Engine.create(
            "fabric",
            provider,
            nic_list,
            int(stripe_threshold),
            int(max_piece),
            int(window_bytes),
            int(window_ops),
            float(stall_timeout),
            lane,
            int(cuda_piece),
            int(cuda_streams),
            float(cuda_spin_us),
            int(staging_slots),
            bool(stage_host_sources),
            int(landing_slots),
            int(landing_slot_bytes),
            bool(land_host_regions),
            bool(cuda_peers),
            int(cuda_batch_bytes),
        )
        self.transport = "fabric" if lane < 0 else "fabric+cuda"
        fields = [
            _ADDRESS_VERSION,
            self.uid,
            self.provider,
            list(self._native.nic_addresses),
            # Without cuda_peers, peers on this host do not see the cuda lane: they write over the NICs.
            self._native.cuda_address if cuda_peers else b"",
            list(self._native.doorbell_bases),
            list(self._native.doorbell_keys),
        ]
        self.address: bytes = msgpack.packb([*fields, _crc(fields)], use_bin_type=True)
        log.debug("engine %s on %s NICs %s", self.uid[:8], self.provider, self.nics)

    # --- identity -----------------------------------------------------------------------------------
    @property
    def uid(self) -> str:
        return self._native.uid

    @property
    def provider(self) -> str:
        return self._native.provider

    @property
    def nics(self) -> list[str]:
        return list(self._native.nic_names)

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

    # --- memory ---------------------------------------------------------------------------------------
    def register(self, buffer: Any, name: str | None = None) -> Region:
        """Registers a tensor/array/buffer on every NIC; the region keeps it alive."""
        info = _buffer_info(buffer, name)
        native = self._native.register(info.ptr, info.nbytes, info.kind, info.device)
        return Region(self, native, buffer, info.label)

    def deregister(self, region: Region) -> None:
        """New writes from the region are refused; writes in flight finish first."""
        self._native.deregister(region._native)

    # --- peers ----------------------------------------------------------------------------------------
    def connect(self, address: bytes) -> Peer:
        fields = _unpack_checked(address, "engine address", 7)
        version, uid, provider, nic_addresses, cuda_address, bell_bases, bell_keys = fields
        if version != _ADDRESS_VERSION:
            raise TransportError(f"engine address of version {version}, expected {_ADDRESS_VERSION}")
        return Peer(self._native.connect(uid, provider, nic_addresses, cuda_address, bell_bases, bell_keys))

    def _import(self, peer: Peer, descriptor: bytes) -> _ext.RemoteRegion:
        with peer._lock:
            remote = peer._imported.get(descriptor)
        if remote is not None:
            return remote
        fields = _unpack_checked(descriptor, "region descriptor", 10)
        version, engine_uid, region_id, nbytes, _kind, nics, on_fabric, cuda_blob, landing, slot_bytes = (
            fields
        )
        if version != _DESCRIPTOR_VERSION:
            raise TransportError(f"region descriptor of version {version}, expected {_DESCRIPTOR_VERSION}")
        if engine_uid != peer.uid:
            raise TransportError(
                f"descriptor of region {region_id} belongs to engine {engine_uid[:8]}, not to {peer.label}"
            )
        if not on_fabric and landing < 0 and not (peer._native.cuda and cuda_blob):
            raise TransportError(
                f"region {region_id} of {peer.label} is GPU memory its NICs could not register, and this "
                "engine cannot reach it through CUDA IPC (another host, or no cuda lane here)"
            )
        remote = self._native.import_region(
            peer._native, region_id, nbytes, [int(b) for b, _ in nics], [int(k) for _, k in nics], cuda_blob,
            int(landing), int(slot_bytes),
        )
        with peer._lock:
            peer._imported[descriptor] = remote
        return remote

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
        if min(src_off, dst_off, nbytes, rows, src_pitch, dst_pitch) < 0:
            raise TransportError(f"negative offset, size, row count or pitch in write to {peer.label}")
        remote = self._import(peer, dst_descriptor)
        native = self._native.write(src._native, src_off, remote, dst_off, nbytes, _imm(imm), rows, src_pitch,
                                    dst_pitch)
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
        remotes = [self._import(peer, desc) for peer, desc in peer_descriptors]
        cols = [
            np.ascontiguousarray(src_index, dtype=np.uint32),
            np.ascontiguousarray(src_off, dtype=np.uint64),
            np.ascontiguousarray(dst_index, dtype=np.uint32),
            np.ascontiguousarray(dst_off, dtype=np.uint64),
            np.ascontiguousarray(nbytes, dtype=np.uint64),
        ]
        imm_col = None
        if imm is not None:
            imm_col = (
                np.full(len(cols[0]), _imm(int(imm)), dtype=np.uint32)
                if np.isscalar(imm)
                else np.ascontiguousarray(imm, dtype=np.uint32)
            )
        geometry = [None if c is None else np.ascontiguousarray(c, dtype=np.uint64)
                    for c in (rows, src_pitch, dst_pitch)]
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
        if min(src_off, dst_off, nbytes, rows, src_pitch, dst_pitch, count) < 0:
            raise TransportError(f"negative offset, size, count or pitch in forward to {peer.label}")
        remote = self._import(peer, dst_descriptor)
        trigger_id, native = self._native.forward(
            _imm(on_imm), count, src._native, src_off, remote, dst_off, nbytes, _imm(imm), rows, src_pitch,
            dst_pitch,
        )
        return Forward(self, trigger_id, Transfer(native, (src,)))

    def cancel_forwards(self, on_imm: int | None = None) -> int:
        """Cancels the pending triggers on immediate ``on_imm`` (all if None); returns how many."""
        if on_imm is None:
            return self._native.cancel_forwards(0, False, 0)
        return self._native.cancel_forwards(0, True, _imm(on_imm))

    @property
    def pending_forwards(self) -> int:
        return self._native.pending_forwards

    # --- counters and state ---------------------------------------------------------------------------
    def counter(self, imm: int) -> ImmCounter:
        return ImmCounter(self, _imm(imm))

    def stats(self) -> list[dict[str, Any]]:
        """Per NIC: bytes and writes completed, immediates received, errors, rerouted pieces, and messages
        landed in landing regions (``landed``, ``landed_bytes``) or dropped (``landing_dropped``: the
        region was deregistered, or the message did not fit it)."""
        return list(self._native.stats())

    def close(self) -> None:
        """Stops the NIC workers; writes still in flight fail with a TransportError."""
        self._native.close()

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


def _imm(imm: int | None) -> int | None:
    if imm is None:
        return None
    if not 0 <= int(imm) < 1 << 32:
        raise TransportError(f"immediate {imm} does not fit in 32 bits")
    return int(imm)


def _unpack_checked(blob: bytes, what: str, nfields: int) -> list[Any]:
    """Decodes an address or descriptor and checks its CRC, so corruption is reported, not written."""
    try:
        fields = msgpack.unpackb(blob, raw=False, strict_map_key=False)
    except Exception as exc:  # msgpack raises several unrelated types for garbage
        raise TransportError(f"corrupted {what}: {exc}") from None
    if not isinstance(fields, list) or len(fields) != nfields + 1:
        raise TransportError(f"corrupted {what}: unexpected structure")
    *body, crc = fields
    if _crc(body) != crc:
        raise TransportError(f"corrupted {what}: checksum mismatch")
    return body


__all__ = ["Forward", "ImmCounter", "Peer", "Region", "Transfer", "TransferEngine"]

