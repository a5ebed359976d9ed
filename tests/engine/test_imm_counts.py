"""The one immediate-count rule: ``_core.imm_counts`` (what the planner expects) equals what an engine
really delivers, counted at the destination, across piece boundaries, 2-D writes and NIC counts."""

from __future__ import annotations

import time

import numpy as np
import pytest

from weightsync._ext import _core
from weightsync.engine import TransferEngine

KiB, MiB = 1 << 10, 1 << 20
THRESHOLD, PIECE = 64 * KiB, 256 * KiB  # small pieces: a few MiB already cut into many


def _sizes(nics: int) -> list[int]:
    """Sizes around every boundary of the rule: 0, the threshold, 4 KiB alignment, whole NIC rounds."""
    around = [1, 4095, 4096, THRESHOLD, PIECE, nics * PIECE, 2 * nics * PIECE, 3 * nics * PIECE + 4096]
    sizes = {0, 1, 4097, 3 * MiB + 5}
    for b in around:
        sizes.update((b - 1, b, b + 1))
    rng = np.random.default_rng(nics)
    sizes.update(int(s) for s in rng.integers(1, 4 * MiB, 12))
    return sorted(s for s in sizes if s >= 0)


def _check_delivered(writer: TransferEngine, dst_engine: TransferEngine, writes: list[tuple[int, ...]],
                     nics: int) -> None:
    """Writes (row bytes, rows[, pitch]), each with its own immediate, from `writer` into `dst_engine`;
    the count per immediate at the destination must be exactly imm_counts's."""
    nbytes = np.array([w[0] for w in writes], dtype=np.int64)
    rows = np.array([w[1] for w in writes], dtype=np.int64)
    pitch = np.array([w[2] if len(w) > 2 else 0 for w in writes], dtype=np.int64)
    expected = _core.imm_counts(nbytes, rows, nics, writer.stripe_threshold, writer.max_piece)
    assert expected.dtype == np.int64 and expected.shape == nbytes.shape
    extent = int(((rows - 1) * np.where(pitch > 0, pitch, nbytes) + nbytes).max())
    src = np.random.default_rng(0).integers(0, 256, extent, dtype=np.uint8)
    dst = np.zeros(extent, dtype=np.uint8)
    src_region, dst_region = writer.register(src), dst_engine.register(dst)
    peer = writer.connect(dst_engine.address)
    imm = np.arange(1000, 1000 + len(writes), dtype=np.uint32)
    zeros = np.zeros(len(writes))
    t = writer.write_batch([src_region], [(peer, dst_region.descriptor)], zeros, zeros, zeros, zeros, nbytes,
                           imm=imm, rows=rows, src_pitch=pitch, dst_pitch=pitch)
    assert t.imm_count == int(expected.sum())
    t.wait(timeout=60)
    for i, (n, r) in enumerate(zip(nbytes.tolist(), rows.tolist(), strict=True)):
        assert writer.imm_count(n, rows=r) == expected[i], (n, r)
        dst_engine.counter(int(imm[i])).wait(int(expected[i]), timeout=30)
    time.sleep(0.2)  # any surplus immediate would have arrived by now
    got = [dst_engine.counter(int(v)).total for v in imm]
    assert got == expected.tolist(), [(w, g, int(e)) for w, g, e in zip(writes, got, expected, strict=True)
                                      if g != e]
    assert np.array_equal(dst[: int(nbytes[-1] * rows[-1])], src[: int(nbytes[-1] * rows[-1])])


@pytest.mark.parametrize("nics", [1, 2, 3, 4])
def test_imm_counts_match_delivered_1d(nics: int) -> None:
    with TransferEngine("fabric", ["lo"] * nics, stripe_threshold=THRESHOLD, max_piece=PIECE,
                        stall_timeout=5.0) as eng:
        assert len(eng.nics) == nics
        _check_delivered(eng, eng, [(n, 1) for n in _sizes(nics)], nics)


@pytest.mark.parametrize("nics", [1, 3])
def test_imm_counts_match_delivered_2d(nics: int) -> None:
    """A 2-D write delivers one immediate whatever its size: rows back to back (one span, cut like a 1-D
    write), rows apart (each row its own write), and rows larger than a piece (then striped themselves)."""
    with TransferEngine("fabric", ["lo"] * nics, stripe_threshold=THRESHOLD, max_piece=PIECE) as eng:
        writes = [(0, 2), (1, 2), (4096, 3), (PIECE + 1, 2), (3 * PIECE, 4), (THRESHOLD, 7), (100, 1),
                  (100, 5, 4096), (PIECE + 7, 3, PIECE + 4096), (0, 3, 64), (THRESHOLD + 1, 1, 0)]
        _check_delivered(eng, eng, writes, nics)


def test_imm_counts_into_landing_regions() -> None:
    """Into a landing region (tagged messages of at most a slot, one announce per multi-message piece)
    the count is the same rule."""
    with TransferEngine("fabric", ["lo", "lo"], stripe_threshold=THRESHOLD, max_piece=PIECE) as writer, \
            TransferEngine._for_tests("fabric", ["lo"], land_host_regions=True, landing_slot_bytes=48 * KiB,
                           landing_slots=4) as lander:
        sizes = [0, 1, 48 * KiB, 48 * KiB + 1, THRESHOLD + 1, PIECE * 2 + 3, MiB + 4095]
        _check_delivered(writer, lander, [(n, 1) for n in sizes] + [(PIECE + 5, 3)], 2)


def test_imm_counts_default_config() -> None:
    """The defaults (1 MiB threshold, 16 MiB pieces): 80 MiB over 2 NICs is 6 pieces of 13.3 MiB, not 5."""
    with TransferEngine("fabric", ["lo", "lo"]) as eng:
        nbytes = np.array([80 * MiB], dtype=np.int64)
        assert _core.imm_counts(nbytes, np.ones(1, np.int64), 2, eng.stripe_threshold, eng.max_piece)[0] == 6
        _check_delivered(eng, eng, [(80 * MiB, 1), (MiB, 1), (MiB + 1, 1)], 2)


def test_imm_counts_rule_values() -> None:
    """Spot values of the rule itself, and refusals of impossible input."""
    def counts(nbytes: list[int], rows: list[int], nics: int, st: int = MiB, mp: int = 16 * MiB) -> list[int]:
        return _core.imm_counts(np.array(nbytes, np.int64), np.array(rows, np.int64), nics, st, mp).tolist()

    assert counts([0, 1, MiB, MiB + 1, 32 * MiB, 80 * MiB], [1] * 6, 1) == [1, 1, 1, 1, 2, 5]
    assert counts([MiB + 1, 80 * MiB, 80 * MiB], [1, 1, 2], 2) == [2, 6, 1]
    # 3 NICs, 12 KiB + 1: pieces of ceil(n / 3) rounded up to 4 KiB (8 KiB), so 2 of them, not 3.
    assert counts([3 * 4096 + 1], [1], 3, st=4096) == [2]
    assert counts([], [], 4) == []
    # A threshold above max_piece is clamped to it (as the engine does).
    assert counts([2 * MiB], [1], 1, st=64 * MiB, mp=MiB) == [2]
    with pytest.raises(ValueError):
        counts([1, 2], [1], 1)
    with pytest.raises(ValueError):
        counts([-1], [1], 1)
    with pytest.raises(ValueError):
        counts([1], [0], 1)
    with pytest.raises(ValueError):
        counts([1], [1], 0)
    with pytest.raises(ValueError):
        counts([1], [1], 1, mp=0)
