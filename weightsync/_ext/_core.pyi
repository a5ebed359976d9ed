"""weightsync transfer engine (C++ core)"""

from collections.abc import Sequence
from typing import Annotated, Final

import numpy
from numpy.typing import NDArray

def pick_provider() -> str: ...
def drain_log() -> list[tuple[int, str]]:
    """
    Takes the engine's queued log records, oldest first, as (level, message) with Python's level
    numbers (weightsync.engine forwards them to the logger 'weightsync.engine'). Also releases the
    buffers the engine's threads let go of since the last call.
    """

def lane_types() -> list[str]:
    """
    Names of the lane types an engine can open, in the order it opens them.
    """

def cuda_unavailable_reason() -> str: ...
def cuda_device_count() -> int: ...
def host_identity() -> str: ...
def imm_counts(
    nbytes: Annotated[NDArray[numpy.int64], dict(shape=(None,), order="C", device="cpu", writable=False)],
    rows: Annotated[NDArray[numpy.int64], dict(shape=(None,), order="C", device="cpu", writable=False)],
    nics: int,
    stripe_threshold: int,
    max_piece: int,
) -> Annotated[NDArray[numpy.int64], dict(shape=(None,))]:
    """
    Immediates each write delivers from an engine with `nics` fabric NICs and this stripe_threshold and
    max_piece (an engine's values: TransferEngine.stripe_threshold, .max_piece). Every write carries an
    immediate; rows > 1 makes it a 2-D write of rows x nbytes, which delivers exactly one. The engine's
    own rule (cpp PieceRule), evaluated for each element.
    """

def delta_compare(
    word: int,
    ref: int,
    ref_words: int,
    addrs: Annotated[NDArray[numpy.uint64], dict(shape=(None,), order="C", device="cpu", writable=False)],
    words: Annotated[NDArray[numpy.int64], dict(shape=(None,), order="C", device="cpu", writable=False)],
    out_idx: int,
    out_val: int,
    cap: int,
    threads: int = 1,
    scratch: int = 0,
    scratch_bytes: int = 0,
) -> int:
    """
    The changed words of a word space (its keys at `addrs`, `words` each, end to end in the reference at
    `ref`), compared bitwise as `word`-byte integers: their sorted positions (int64) to `out_idx` and
    values to `out_val`, each put into the reference; the first `cap` only (the rest is neither written
    nor put into the reference: a second run finds exactly it; entries past the count may be
    overwritten). Returns how many changed in all. Up to `threads` threads, without the GIL; all but the
    first collect their changes in `scratch` (8 + 2 * word bytes a change) while it has room, then in
    memory of their own. ValueError names a bad argument.
    """

def delta_encode_idx16(
    word: int,
    idx: int,
    vals: int,
    nidx: int,
    runs: Annotated[NDArray[numpy.int64], dict(shape=(None, None), order="C", device="cpu", writable=False)],
    low: int,
    out_vals: int,
    k: int,
    counts: int,
    nblocks: int,
) -> None:
    """
    ENC_IDX16 entries from runs of the compare's output (`nidx` sorted int64 positions at `idx`, values
    at `vals`): `runs` rows (lo, shift, out, count) make changed words lo .. lo + count entries out ..
    out + count of a stream of `k` entries and `nblocks` blocks: the position plus shift's low 16 bits
    to `low`, the value to `out_vals`, its block counted into the int32 `counts` (added to). Without the
    GIL; ValueError names a bad argument.
    """

def delta_scatter_idx16(
    word: int,
    n: int,
    k: int,
    counts: int,
    low: int,
    vals: int,
    runs: Annotated[NDArray[numpy.int64], dict(shape=(None, None), order="C", device="cpu", writable=False)],
    threads: int = 1,
) -> None:
    """
    Scatters an ENC_IDX16 stream of `n` words of which `k` changed (its int32 block counts, 16-bit
    indices and values at these addresses) into its contiguous runs' keys: `runs` rows (key address,
    key words, shift, first and last+1 entry, first and last+1 stream position); entry j of a run goes
    to word `position + shift` of its key. Every entry is checked against its run and key (ValueError).
    Up to `threads` threads, without the GIL.
    """

def discover(provider: str = "") -> list[tuple[str, str, str]]: ...

class ImmRing:
    @staticmethod
    def create() -> ImmRing: ...
    @staticmethod
    def open(pid: int, fd: int) -> ImmRing: ...
    @property
    def fd(self) -> int: ...
    def push(self, imm: int) -> bool: ...
    def pop(self) -> int | None: ...
    def sleep(self, timeout_us: int) -> None: ...
    def wake(self) -> None: ...
    def set_live(self, region_id: int, live: bool) -> bool: ...
    def is_live(self, region_id: int) -> bool: ...

    live_slots: Final[int] = ...
    """(arg: object, /) -> int"""

class Region:
    @property
    def id(self) -> int: ...
    @property
    def ptr(self) -> int: ...
    @property
    def len(self) -> int: ...
    @property
    def kind(self) -> int: ...
    @property
    def device(self) -> int: ...
    @property
    def valid(self) -> bool: ...
    @property
    def keys(self) -> list[int]: ...
    @property
    def bases(self) -> list[int]: ...
    @property
    def on_fabric(self) -> bool: ...
    @property
    def landing(self) -> int: ...
    @property
    def landing_slot_bytes(self) -> int: ...
    @property
    def fabric_error(self) -> str: ...
    @property
    def cuda_blob(self) -> bytes: ...

class Peer:
    @property
    def id(self) -> int: ...
    @property
    def uid(self) -> str: ...
    @property
    def label(self) -> str: ...
    @property
    def remote_nics(self) -> int: ...
    @property
    def cuda(self) -> bool: ...
    @property
    def failed_paths(self) -> list[bool]: ...
    @property
    def last_error(self) -> str: ...

class RemoteRegion:
    @property
    def id(self) -> int: ...
    @property
    def len(self) -> int: ...
    @property
    def peer(self) -> Peer: ...
    @property
    def by_copy(self) -> bool: ...
    @property
    def landing(self) -> int: ...

class Transfer:
    def wait(self, timeout: float) -> bool:
        """True once every piece landed or one failed for good; False on timeout."""

    @property
    def done(self) -> bool: ...
    @property
    def failed(self) -> bool: ...
    @property
    def error(self) -> str: ...
    @property
    def pending(self) -> int: ...
    @property
    def imm_count(self) -> int: ...
    @property
    def bytes(self) -> int: ...
    @property
    def what(self) -> str: ...

class LaneCaps:
    """What a lane can do (cpp/core/lane.hpp documents each field)."""

    @property
    def is_nic(self) -> bool: ...
    @property
    def writes_host(self) -> bool: ...
    @property
    def writes_cuda(self) -> bool: ...
    @property
    def rma_keys(self) -> bool: ...
    @property
    def maps_remote(self) -> bool: ...
    @property
    def two_d(self) -> bool: ...
    @property
    def own_imm(self) -> bool: ...
    @property
    def batching(self) -> bool: ...
    @property
    def tagged(self) -> bool: ...
    @property
    def orders_sends(self) -> bool: ...
    @property
    def delivery_complete(self) -> bool: ...
    @property
    def orders_writes(self) -> bool: ...
    @property
    def local_copies(self) -> bool: ...
    @property
    def unlimited_window(self) -> bool: ...
    @property
    def control_queue(self) -> bool: ...

class EngineConfig:
    """
    Everything an engine is opened with (cpp/core/engine.hpp documents each field).
    """

    def __init__(self) -> None: ...
    @property
    def transport(self) -> str: ...
    @transport.setter
    def transport(self, arg: str, /) -> None: ...
    @property
    def provider(self) -> str: ...
    @provider.setter
    def provider(self, arg: str, /) -> None: ...
    @property
    def nics(self) -> list[str]: ...
    @nics.setter
    def nics(self, arg: Sequence[str], /) -> None: ...
    @property
    def stripe_threshold(self) -> int: ...
    @stripe_threshold.setter
    def stripe_threshold(self, arg: int, /) -> None: ...
    @property
    def max_piece(self) -> int: ...
    @max_piece.setter
    def max_piece(self, arg: int, /) -> None: ...
    @property
    def window_bytes(self) -> int: ...
    @window_bytes.setter
    def window_bytes(self, arg: int, /) -> None: ...
    @property
    def window_ops(self) -> int: ...
    @window_ops.setter
    def window_ops(self, arg: int, /) -> None: ...
    @property
    def stall_timeout_s(self) -> float: ...
    @stall_timeout_s.setter
    def stall_timeout_s(self, arg: float, /) -> None: ...
    @property
    def cuda_device(self) -> int: ...
    @cuda_device.setter
    def cuda_device(self, arg: int, /) -> None: ...
    @property
    def cuda_piece(self) -> int: ...
    @cuda_piece.setter
    def cuda_piece(self, arg: int, /) -> None: ...
    @property
    def cuda_streams(self) -> int: ...
    @cuda_streams.setter
    def cuda_streams(self, arg: int, /) -> None: ...
    @property
    def cuda_batch_bytes(self) -> int: ...
    @cuda_batch_bytes.setter
    def cuda_batch_bytes(self, arg: int, /) -> None: ...
    @property
    def cuda_spin_us(self) -> float: ...
    @cuda_spin_us.setter
    def cuda_spin_us(self, arg: float, /) -> None: ...
    @property
    def staging_slots(self) -> int: ...
    @staging_slots.setter
    def staging_slots(self, arg: int, /) -> None: ...
    @property
    def landing_slots(self) -> int: ...
    @landing_slots.setter
    def landing_slots(self, arg: int, /) -> None: ...
    @property
    def landing_slot_bytes(self) -> int: ...
    @landing_slot_bytes.setter
    def landing_slot_bytes(self, arg: int, /) -> None: ...
    @property
    def cuda_peers(self) -> bool: ...
    @cuda_peers.setter
    def cuda_peers(self, arg: bool, /) -> None: ...
    @property
    def auth_key(self) -> str: ...
    @auth_key.setter
    def auth_key(self, arg: str, /) -> None: ...

class TestHooks:
    """
    Test-only switches (cpp/core/engine.hpp); set through TransferEngine._for_tests.
    """

    def __init__(self) -> None: ...
    @property
    def stage_host_sources(self) -> bool: ...
    @stage_host_sources.setter
    def stage_host_sources(self, arg: bool, /) -> None: ...
    @property
    def land_host_regions(self) -> bool: ...
    @land_host_regions.setter
    def land_host_regions(self, arg: bool, /) -> None: ...
    @property
    def lose_imm_acks(self) -> int: ...
    @lose_imm_acks.setter
    def lose_imm_acks(self, arg: int, /) -> None: ...
    @property
    def cq_data_immediates(self) -> bool: ...
    @cq_data_immediates.setter
    def cq_data_immediates(self, arg: bool, /) -> None: ...
    @property
    def no_path_abort(self) -> bool: ...
    @no_path_abort.setter
    def no_path_abort(self, arg: bool, /) -> None: ...

class Engine:
    @staticmethod
    def create(config: EngineConfig, hooks: TestHooks | None = None) -> Engine: ...
    @property
    def config(self) -> EngineConfig:
        """
        The configuration in force (a copy): the lanes' choices and clamps applied.
        """

    @property
    def lanes(self) -> list[tuple[str, LaneCaps]]:
        """
        Per lane (NIC lanes first): its type name and what it can do (LaneCaps).
        """

    @property
    def uid(self) -> str: ...
    @property
    def provider(self) -> str: ...
    @property
    def transport(self) -> str: ...
    @property
    def nic_names(self) -> list[str]: ...
    @property
    def nic_addresses(self) -> list[bytes]: ...
    @property
    def cuda_address(self) -> bytes: ...
    @property
    def cuda_name(self) -> str: ...
    @property
    def doorbell_bases(self) -> list[int]: ...
    @property
    def doorbell_keys(self) -> list[int]: ...
    @property
    def stripe_threshold(self) -> int: ...
    @property
    def max_piece(self) -> int: ...
    @property
    def two_d_mode(self) -> str: ...
    @property
    def closed(self) -> bool: ...
    def register(self, ptr: int, nbytes: int, kind: int, device: int, owner: object | None = None) -> Region:
        """
        Registers memory; `owner` (the object the memory belongs to) is referenced until the region is
        deregistered or dropped and no write reading from it is left in the engine or a NIC.
        """

    def deregister(self, region: Region) -> None: ...
    def connect(
        self,
        uid: str,
        provider: str,
        addresses: Sequence[bytes],
        cuda_address: bytes,
        doorbell_base: Sequence[int],
        doorbell_key: Sequence[int],
    ) -> Peer: ...
    def import_region(
        self,
        peer: Peer,
        region_id: int,
        nbytes: int,
        base: Sequence[int],
        key: Sequence[int],
        cuda_blob: bytes,
        landing: int = -1,
        slot_bytes: int = 0,
    ) -> RemoteRegion: ...
    def imm_count(self, nbytes: int, has_imm: bool = True, rows: int = 1) -> int: ...
    def write(
        self,
        src: Region,
        src_off: int,
        dst: RemoteRegion,
        dst_off: int,
        nbytes: int,
        imm: int | None,
        rows: int = 1,
        src_pitch: int = 0,
        dst_pitch: int = 0,
    ) -> Transfer: ...
    def write_batch(
        self,
        srcs: Sequence[Region],
        dsts: Sequence[RemoteRegion],
        src_idx: Annotated[
            NDArray[numpy.uint32], dict(shape=(None,), order="C", device="cpu", writable=False)
        ],
        src_off: Annotated[
            NDArray[numpy.uint64], dict(shape=(None,), order="C", device="cpu", writable=False)
        ],
        dst_idx: Annotated[
            NDArray[numpy.uint32], dict(shape=(None,), order="C", device="cpu", writable=False)
        ],
        dst_off: Annotated[
            NDArray[numpy.uint64], dict(shape=(None,), order="C", device="cpu", writable=False)
        ],
        nbytes: Annotated[
            NDArray[numpy.uint64], dict(shape=(None,), order="C", device="cpu", writable=False)
        ],
        imm: Annotated[NDArray[numpy.uint32], dict(shape=(None,), order="C", device="cpu", writable=False)]
        | None,
        rows: Annotated[NDArray[numpy.uint64], dict(shape=(None,), order="C", device="cpu", writable=False)]
        | None = None,
        src_pitch: Annotated[
            NDArray[numpy.uint64], dict(shape=(None,), order="C", device="cpu", writable=False)
        ]
        | None = None,
        dst_pitch: Annotated[
            NDArray[numpy.uint64], dict(shape=(None,), order="C", device="cpu", writable=False)
        ]
        | None = None,
    ) -> Transfer: ...
    def forward(
        self,
        on_imm: int,
        count: int,
        src: Region,
        src_off: int,
        dst: RemoteRegion,
        dst_off: int,
        nbytes: int,
        imm: int | None,
        rows: int = 1,
        src_pitch: int = 0,
        dst_pitch: int = 0,
    ) -> tuple[int, Transfer]: ...
    def cancel_forwards(self, trigger_id: int, by_imm: bool, imm: int) -> int: ...
    @property
    def pending_forwards(self) -> int: ...
    def forward_pending(self, trigger_id: int) -> bool: ...
    def counter_wait(self, imm: int, n: int, timeout: float) -> bool: ...
    def counter_value(self, imm: int) -> int: ...
    def counter_total(self, imm: int) -> int: ...
    def counter_reset(self, imm: int) -> int: ...
    def set_auth_key(self, key_hex: str) -> None: ...
    def stats(self) -> list: ...
    def close(self) -> None: ...
