"""The engine room's seams, without a GPU: lanes say what they can do, the configuration has its
defaults in one place (the C++ struct), test-only switches stay out of it, descriptors are serialized in
one place, and the engine's worker-thread conditions reach Python's logging."""

from __future__ import annotations

import dataclasses
import inspect
import logging
import time

import msgpack
import numpy as np
import pytest

import weightsync as ws
from weightsync import _ext
from weightsync.engine import Address, Descriptor, TransferEngine
from weightsync.engine.descriptors import ADDRESS_VERSION, DESCRIPTOR_VERSION, crc

KiB = 1 << 10


def test_lane_types_and_fabric_capabilities() -> None:
    assert _ext.lane_types() == ["fabric", "cuda"]
    with TransferEngine("fabric", ["lo", "lo"]) as eng:
        lanes = eng.lanes
        assert [name for name, _ in lanes] == ["fabric", "fabric"]
        for _, caps in lanes:
            assert caps.is_nic and caps.writes_host and caps.rma_keys and caps.own_imm
            assert not caps.maps_remote and not caps.local_copies and not caps.unlimited_window
            assert caps.tagged  # tcp;ofi_rxm sends tagged messages (landing regions rely on it)
            # Announces on a connection of their own per path: the tcp lane's; rxm's share the data's.
            assert caps.control_queue == (eng.provider == "tcp")
        # The 2-D mode follows from the NICs' capabilities.
        caps = lanes[0][1]
        expected = "delivery" if caps.delivery_complete else "ordered" if caps.orders_writes else ""
        assert eng.two_d_mode == expected


def test_config_defaults_live_in_the_cpp_struct() -> None:
    """TransferEngine's keyword defaults are the C++ EngineConfig's (None = the struct's value)."""
    defaults = _ext.EngineConfig()
    assert defaults.cuda_piece == 0 and defaults.cuda_streams == 1  # the drifted values, settled
    params = inspect.signature(TransferEngine.__init__).parameters
    tunables = ["stripe_threshold", "max_piece", "window_bytes", "window_ops", "cuda_piece", "cuda_streams",
                "cuda_batch_bytes", "cuda_spin_us", "staging_slots", "landing_slots", "landing_slot_bytes",
                "cuda_peers"]
    for name in tunables:
        assert params[name].default is None, name
    with TransferEngine("fabric", ["lo"]) as eng:
        cfg = eng.config
        for name in [*tunables, "stall_timeout_s"]:
            if name in ("landing_slot_bytes", "max_piece", "stripe_threshold"):
                continue  # clamped by the engine, checked below
            assert getattr(cfg, name) == getattr(defaults, name), name
        assert cfg.max_piece == min(defaults.max_piece, cfg.max_piece)
        assert eng.max_piece == cfg.max_piece and eng.stripe_threshold == cfg.stripe_threshold
        assert cfg.landing_slot_bytes == eng.max_piece  # 0 means max_piece
        assert cfg.nics == ["lo"] and cfg.provider == eng.provider
    with TransferEngine("fabric", ["lo"], stripe_threshold=4 * KiB, max_piece=64 * KiB,
                        cuda_peers=False) as eng:
        assert (eng.stripe_threshold, eng.max_piece, eng.cuda_peers) == (4 * KiB, 64 * KiB, False)


def test_test_only_switches_are_not_engine_options() -> None:
    with pytest.raises(TypeError):
        TransferEngine(land_host_regions=True)  # type: ignore[call-arg]
    with pytest.raises(AttributeError):
        _ext.EngineConfig().stage_host_sources  # noqa: B018
    with TransferEngine._for_tests("fabric", ["lo"], land_host_regions=True) as eng:
        region = eng.register(np.zeros(64, dtype=np.uint8))
        assert not region.on_fabric and region.landing >= 0 and "land_host_regions" in region.fabric_error
    with TransferEngine("fabric", ["lo"]) as eng:
        region = eng.register(np.zeros(64, dtype=np.uint8))
        assert region.on_fabric and region.landing == -1 and region.cuda_blob == b""


def test_descriptors_round_trip_and_refuse_corruption() -> None:
    with TransferEngine("fabric", ["lo", "lo"]) as eng:
        region = eng.register(np.zeros(100, dtype=np.uint8))
        d = Descriptor.unpack(region.descriptor)
        assert (d.engine_uid, d.region_id, d.nbytes, d.landing) == (eng.uid, region.id, 100, -1)
        assert len(d.nics) == 2 and d.on_fabric
        assert d.pack() == region.descriptor
        a = Address.unpack(eng.address)
        assert a.uid == eng.uid and len(a.nic_addresses) == 2 and a.pack() == eng.address
        # A stale version is refused with its number, even with a valid checksum.
        fields = [DESCRIPTOR_VERSION + 1, *dataclasses.astuple(d)]
        fields[5] = [list(x) for x in fields[5]]
        stale = msgpack.packb([*fields, crc(fields)], use_bin_type=True)
        with pytest.raises(ws.TransportError, match=f"version {DESCRIPTOR_VERSION + 1}"):
            Descriptor.unpack(stale)
        with pytest.raises(ws.TransportError, match="checksum"):
            Descriptor.unpack(region.descriptor[:-1] + bytes([region.descriptor[-1] ^ 1]))
        with pytest.raises(ws.TransportError, match="corrupted engine address"):
            Address.unpack(b"\x00garbage")
        assert ADDRESS_VERSION == 1


def test_peer_lane_and_region_accessors() -> None:
    with TransferEngine("fabric", ["lo"]) as eng:
        peer = eng.connect(eng.address)
        assert peer.lane == "fabric" and peer.transport == peer.lane
        region = eng.register(np.zeros(10, dtype=np.uint8))
        assert region.nbytes == 10 and region.valid and region.landing_slot_bytes == 0
        eng.deregister(region)
        assert not region.valid


def test_engine_log_reaches_python_logging(caplog: pytest.LogCaptureFixture) -> None:
    """A message for a landing region that does not exist is dropped on the lander's worker thread; the
    record reaches the 'weightsync.engine' logger at the next call into an engine, not stderr."""
    with TransferEngine("fabric", ["lo"]) as writer, \
            TransferEngine._for_tests("fabric", ["lo"], land_host_regions=True, landing_slots=2) as lander:
        dst = lander.register(np.zeros(4096, dtype=np.uint8))
        forged = dataclasses.replace(Descriptor.unpack(dst.descriptor), landing=16000).pack()
        src = writer.register(np.ones(4096, dtype=np.uint8))
        peer = writer.connect(lander.address)
        with caplog.at_level(logging.WARNING, logger="weightsync.engine"):
            writer.write(src, 0, peer, forged, 0, 100, imm=3).wait(10)
            deadline = time.time() + 10
            while time.time() < deadline and sum(s["landing_dropped"] for s in lander.stats()) == 0:
                time.sleep(0.01)
            lander.stats()  # drains the queue into the log
        records = [r for r in caplog.records
                   if r.name == "weightsync.engine" and "dropped a message" in r.message]
        assert records and records[0].levelno == logging.WARNING
        assert "no such landing region" in records[0].message
