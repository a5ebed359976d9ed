"""Typed plan parts: lowering a group's plan into one part per participant, and each part's msgpack
round trip (what the coordinator sends is what the participant reads)."""

from __future__ import annotations

import dataclasses

import msgpack
import numpy as np
import pytest

from weightsync.errors import PlanError, WeightSyncError
from weightsync.plan.lower import GroupOptions, lower_group, source_program
from weightsync.plan.parts import (
    DESTINATION,
    SOURCE,
    DestinationPart,
    EngineInfo,
    Member,
    PlanFailure,
    SourcePart,
    unpack_part,
)
from weightsync.plan.writes import K_DATA
from weightsync.runtime.describe import Sharded, describe_tensors
from weightsync.wire import imm_counts, relay_imm

ENGINE = EngineInfo(nics=2, stripe_threshold=1 << 20, max_piece=1 << 20, chunk_bytes=64 << 10)


def _members(dest_layouts: list[dict], sources: int = 2) -> tuple[list[Member], list[Member]]:
    g = np.arange(512 * 1024, dtype=np.float32).reshape(512, 1024)  # 2 MiB: striped over both NICs
    cast = np.ones((64, 64), np.float32)
    rows = 512 // sources
    srcs = [Member(SOURCE, i, describe_tensors({
        "w": Sharded(g[i * rows:(i + 1) * rows], g.shape, (i * rows, 0)), "c": cast}).to_msgpack(),
        b"src%d" % i, "h0", ENGINE, {}, b"mbox-s%d" % i) for i in range(sources)]
    dsts = [Member(DESTINATION, j, describe_tensors(d).to_msgpack(), b"dst%d" % j, "h1", ENGINE,
                   {k: [b"d%d-%s-0" % (j, k.encode()), b"d%d-%s-1" % (j, k.encode())] for k in d},
                   b"mbox-d%d" % j) for j, d in enumerate(dest_layouts)]
    return srcs, dsts


def _full() -> dict:
    return {"w": np.zeros((512, 1024), np.float32), "c": np.zeros((64, 64), np.float32)}


def _same(a: object, b: object) -> None:
    """Field by field: arrays by value, nested dataclasses recursively."""
    assert type(a) is type(b)
    for f in dataclasses.fields(a):  # type: ignore[arg-type]
        x, y = getattr(a, f.name), getattr(b, f.name)
        if isinstance(x, np.ndarray):
            assert x.dtype == y.dtype and np.array_equal(x, y), f.name
        elif dataclasses.is_dataclass(x):
            _same(x, y)
        elif isinstance(x, dict):
            assert x.keys() == y.keys() and list(x) == list(y), f.name
            for k in x:
                if dataclasses.is_dataclass(x[k]):
                    _same(x[k], y[k])
                else:
                    assert x[k] == y[k], (f.name, k)
        else:
            assert x == y, f.name


@pytest.mark.parametrize("relay", [False, True])
def test_parts_round_trip_through_msgpack(relay: bool) -> None:
    srcs, dsts = _members([_full(), _full(), _full()])
    lowered = lower_group(srcs, dsts, 7, GroupOptions(relay=relay, relay_chunk_bytes=256 << 10))
    assert lowered.chain == ([0, 1, 2] if relay else [])
    assert set(lowered.parts) == {(SOURCE, 0), (SOURCE, 1), (DESTINATION, 0), (DESTINATION, 1),
                                  (DESTINATION, 2)}
    for part in lowered.parts.values():
        back = unpack_part(part.to_msgpack())
        _same(part, back)
        assert back.epoch == 7
        if isinstance(part, SourcePart):
            assert isinstance(back, SourcePart)
            assert back.plan == part.plan
            with pytest.raises(dataclasses.FrozenInstanceError):
                back.epoch = 8  # type: ignore[misc]
    failure = PlanFailure(3, "PlanError", "no source holds w")
    back = unpack_part(failure.to_msgpack())
    assert back == failure
    assert isinstance(back.error("group 'g'"), PlanError)


def test_a_part_of_another_format_is_refused() -> None:
    srcs, dsts = _members([_full()])
    part = lower_group(srcs, dsts, 1, GroupOptions()).parts[(DESTINATION, 0)]
    d = msgpack.unpackb(part.to_msgpack(), raw=False, strict_map_key=False)
    with pytest.raises(WeightSyncError, match="format"):
        unpack_part(msgpack.packb({**d, "format": 99}, use_bin_type=True))
    old = {k: v for k, v in d.items() if k not in ("format", "role")}  # the untyped dicts of format 1
    with pytest.raises(WeightSyncError, match="format 1"):
        unpack_part(msgpack.packb(old, use_bin_type=True))


def test_expected_immediates_are_what_the_sources_writes_deliver() -> None:
    """Each destination expects the engine's immediates of exactly the data writes aimed at it."""
    srcs, dsts = _members([_full(), _full()])
    parts = lower_group(srcs, dsts, 1, GroupOptions(relay=False)).parts
    got = {j: 0 for j in range(2)}
    for i in range(2):
        sp = parts[(SOURCE, i)]
        assert isinstance(sp, SourcePart)
        w = sp.writes[sp.writes["kind"] == K_DATA]
        n = imm_counts(w["nbytes"], w["rows"], ENGINE.nics, ENGINE.stripe_threshold, ENGINE.max_piece)
        for t in sp.destinations.values():
            got[t.rank] += int(n[w["dst_rank"] == t.slot].sum())
    for j in range(2):
        dp = parts[(DESTINATION, j)]
        assert isinstance(dp, DestinationPart) and dp.relay is None
        assert dp.expected == got[j] > 0
        assert set(dp.sources) == {0, 1}


def test_relay_parts_chain_the_destinations() -> None:
    srcs, dsts = _members([_full(), _full(), _full()])
    parts = lower_group(srcs, dsts, 5, GroupOptions(relay=True, relay_chunk_bytes=256 << 10)).parts
    relays = [parts[(DESTINATION, j)].relay for j in range(3)]  # type: ignore[union-attr]
    assert [r.position for r in relays] == [0, 1, 2]
    assert [None if r.successor is None else r.successor.rank for r in relays] == [1, 2, None]
    imms = relays[0].imm.tolist()
    assert imms == [relay_imm(5, c) for c in range(len(imms))]  # one immediate per chunk, in order
    assert all(np.array_equal(r.imm, relays[0].imm) for r in relays)
    assert (relays[0].row_bytes * relays[0].rows).max() <= 256 << 10
    for i in range(2):  # every source announces to the whole chain
        sp = parts[(SOURCE, i)]
        assert isinstance(sp, SourcePart) and sp.relay == [0, 1, 2]
        assert [(t.rank, t.successor) for t in sp.destinations.values()] == [(0, 1), (1, 2), (2, -1)]


def test_source_program_cuts_rounds_and_chunks() -> None:
    # the left half of w's columns: strided rows in the sources, packed into staging chunks
    half = {"w": Sharded(np.zeros((512, 512), np.float32), (512, 1024), (0, 0)),
            "c": np.zeros((64, 64), np.float32)}
    srcs, dsts = _members([_full(), half])
    parts = lower_group(srcs, dsts, 1, GroupOptions(relay=False)).parts
    sp = parts[(SOURCE, 0)]
    assert isinstance(sp, SourcePart)
    prog = source_program(sp, ["w", "c"], 0)
    assert prog.src_keys == [k for k in sp.keys if k in ("w", "c")]
    data = sp.writes[sp.writes["kind"] == K_DATA]
    assert sum(b.writes for b in prog.batches.values()) == len(data)
    direct = sum(len(r.nbytes) for r in prog.rounds)
    staged = sum(len(d[1]) for g in prog.chunk_groups for d in g[1])
    assert direct + staged == len(data)
    assert len(prog.chunk_groups) == len(sp.chunks) > 0 and staged > 0
    with pytest.raises(PlanError, match="does not hold"):
        source_program(sp, ["c"], 0)
