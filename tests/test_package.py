"""What a packager and a user expect of the package itself: its version, its type marker, the public
names of the contract, and the wire records' layout."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np

import weightsync as ws
from weightsync import wire

ROOT = Path(__file__).resolve().parents[1]


def test_version_is_the_projects() -> None:
    want = re.search(r'^version\s*=\s*"([^"]+)"', (ROOT / "pyproject.toml").read_text(), re.M)
    assert want is not None and ws.__version__ == want.group(1)


def test_typed_marker_ships() -> None:
    assert (ROOT / "weightsync" / "py.typed").is_file()


def test_public_names() -> None:
    for name in ("Group", "Source", "push", "PushStats", "Destination", "Sharded", "Fused", "TransferEngine",
                 "WeightSyncError", "LayoutError", "PlanError", "TransportError", "TimeoutError", "plan",
                 "describe_tensors"):
        assert getattr(ws, name) is not None, name
    assert issubclass(ws.TimeoutError, TimeoutError)


def test_announce_and_ack_records_share_one_slot_size_and_name_their_fields() -> None:
    assert wire.ANNOUNCE_RECORD.names == ("epoch", "version", "buffer")
    assert wire.ACK_RECORD.names == ("version", "next_buffer", "reserved")
    assert wire.ANNOUNCE_RECORD.itemsize == wire.ACK_RECORD.itemsize == wire.SLOT_BYTES == 24
    slot = np.full(1, wire.EMPTY, wire.ACK_RECORD)
    slot[0] = (7, 1, 0)
    assert (int(slot["version"][0]), int(slot["next_buffer"][0])) == (7, 1)


def test_immediate_tags_never_collide() -> None:
    kinds = [wire.data_imm(127, (1 << 24) - 1), wire.gather_imm(31, 5), wire.relay_imm(31, 5),
             wire.gathered_imm(31, 5)]
    assert [k >> 29 for k in kinds] == [0b011, 0b100, 0b101, 0b110]
    assert wire.ANNOUNCE not in kinds and wire.ACK not in kinds


def test_the_delta_kernels_source_ships_beside_its_module() -> None:
    """The CUDA kernels are read from kernels.cu, which includes block.h (the ENC_IDX16 block the C++ host
    kernels and the codec take too): both lie inside the package, so a wheel and an editable install carry
    them (wheel.packages copies a package's data files)."""
    from weightsync.delta import cuda, units

    delta = ROOT / "weightsync" / "delta"
    assert cuda.SOURCE == (delta / "kernels.cu").read_text()
    assert '#include "block.h"' in cuda.SOURCE
    assert "#define WS_DELTA_BLOCK_BITS 16" in (delta / "block.h").read_text()
    assert units.BLOCK == 1 << 16
