"""Relay for fan-out on CPU with Ray over TCP loopback: sources write into the head of a chain of full
replicas, each replica's engine forwards every chunk to the next one as soon as it has landed."""

from __future__ import annotations

import os
import time

import numpy as np
import pytest
import ray
import torch

import weightsync as ws
from tests.runtime.group_actors import ReplicaRollout, ReplicaTrainer, replica_tensors
from tests.support.peer import pid_alive
from weightsync.plan.lower import split_writes
from weightsync.plan.writes import K_DATA, K_GATHER, WRITE_DTYPE

SMALL_CHUNK = 64 << 10  # "emb" (512 KiB) is forwarded in 8 chunks


def _start(name: str, sources: int, replicas: int, mode: str, **kw) -> tuple[ws.Group, list, list]:
    group = ws.Group.create(name, num_sources=sources, num_destinations=replicas, **kw)
    rollouts = [ray.remote(num_cpus=0)(ReplicaRollout).remote(name, j, mode) for j in range(replicas)]
    trainers = [ray.remote(num_cpus=0)(ReplicaTrainer).remote(name, i, sources) for i in range(sources)]
    ray.get([a.__ray_ready__.remote() for a in trainers + rollouts], timeout=120)
    return group, trainers, rollouts


def _stop(group: ws.Group, actors: list) -> None:
    for a in actors:
        ray.kill(a)
    group.shutdown()


def _check(rollouts: list, version: int) -> None:
    assert ray.get([r.wait.remote(version) for r in rollouts], timeout=60) == [version] * len(rollouts)
    want = replica_tensors(version)
    for j, (live, got) in enumerate(ray.get([r.snapshot.remote() for r in rollouts], timeout=60)):
        assert live == version, f"replica {j}: live version {live}, expected {version}"
        for k in want:
            assert torch.equal(got[k], want[k]), f"replica {j}: {k} differs at version {version}"


@pytest.mark.parametrize("mode", ["inplace", "staged"])
@pytest.mark.parametrize(("sources", "replicas"), [(1, 3), (2, 4)])
def test_relay_chain_bit_identical(ray_cluster, sources: int, replicas: int, mode: str) -> None:
    name = f"relay-{sources}x{replicas}-{mode}"
    group, trainers, rollouts = _start(name, sources, replicas, mode, relay_chunk_bytes=SMALL_CHUNK)
    try:
        model_bytes = sum(t.numel() * 4 for t in replica_tensors(0).values())
        for version in range(10):
            ray.get([r.poison.remote() for r in rollouts], timeout=30)
            stats = ray.get([t.push.remote(version) for t in trainers], timeout=120)
            for s in stats:
                assert s["failed_destinations"] == [], s
                assert s["destinations"] == list(range(replicas))
                assert s["relayed"] == list(range(1, replicas))  # only the head is written by sources
            assert sum(s["bytes"] for s in stats) == model_bytes  # the model leaves the sources once
            _check(rollouts, version)
        status = group.status()
        assert status["relay"] and status["chain"] == list(range(replicas)), status
    finally:
        _stop(group, trainers + rollouts)


def test_relay_back_to_back_staged_never_mixed(ray_cluster) -> None:
    """Pushes one after the other with no pause; readers apply and check at every safe point."""
    group, trainers, rollouts = _start("relay-b2b", 1, 3, "staged")
    try:
        ray.get([r.start_reader.remote() for r in rollouts])
        for version in range(15):
            stats = ray.get([t.push.remote(version) for t in trainers], timeout=120)
            assert all(s["failed_destinations"] == [] for s in stats), stats
        readers = ray.get([r.stop_reader.remote() for r in rollouts], timeout=30)
        for rd in readers:
            assert rd["mixed"] == [], rd
            assert rd["reads"] > 0
        _check(rollouts, 14)
        assert group.status()["relay"]
    finally:
        _stop(group, trainers + rollouts)


def test_relay_off_and_auto_direct(ray_cluster) -> None:
    """relay=False pushes to every replica directly; auto stays direct when sources >= destinations."""
    group, trainers, rollouts = _start("relay-off", 1, 3, "inplace", relay=False)
    try:
        for version in range(2):
            stats = ray.get([t.push.remote(version) for t in trainers], timeout=120)
            assert stats[0]["relayed"] == [] and stats[0]["failed_destinations"] == []
            _check(rollouts, version)
        assert not group.status()["relay"]
    finally:
        _stop(group, trainers + rollouts)
    group, trainers, rollouts = _start("relay-auto-direct", 2, 2, "inplace")
    try:
        stats = ray.get([t.push.remote(0) for t in trainers], timeout=120)
        assert all(s["relayed"] == [] for s in stats)
        _check(rollouts, 0)
        assert not group.status()["relay"]
    finally:
        _stop(group, trainers + rollouts)


def test_relay_dead_member_is_dropped_and_the_rest_of_the_chain_completes(ray_cluster) -> None:
    """A replica in the middle of the chain dies during a push: the source names it, the coordinator
    re-plans without it, and the next push reaches every member of the new plan whole."""
    group, trainers, rollouts = _start("relay-dead", 1, 3, "inplace")
    try:
        ray.get(trainers[0].push.remote(0), timeout=60)
        _check(rollouts, 0)
        pid = ray.get(rollouts[1].__ray_call__.remote(lambda _self: os.getpid()), timeout=30)
        ray.kill(rollouts[1])
        deadline = time.monotonic() + 30
        while pid_alive(pid):  # the process gone (not only marked dead) before the push starts
            assert time.monotonic() < deadline, f"replica 1 (pid {pid}) still runs"
            time.sleep(0.05)
        stats = ray.get(trainers[0].push.remote(1, 12.0), timeout=60)  # > the engine stall timeout (5 s)
        assert 1 in stats["failed_destinations"] and 0 not in stats["failed_destinations"], stats
        deadline = time.monotonic() + 30
        while 1 in group.status()["chain"] or "destination 1" not in group.status()["dead"]:
            assert time.monotonic() < deadline, group.status()
            time.sleep(0.1)
        # The chain is re-planned without replica 1. A member behind it may be dropped too when the
        # source's writes to it timed out behind the dead one's; it is alive, so it is re-admitted: the
        # group settles on replicas 0 and 2, and both get version 2 whole.
        deadline = time.monotonic() + 30
        while sorted(group.status()["destinations"]) != [0, 2]:
            assert time.monotonic() < deadline, group.status()
            time.sleep(0.1)
        stats = ray.get(trainers[0].push.remote(2), timeout=60)
        assert stats["failed_destinations"] == [] and sorted(stats["destinations"]) == [0, 2], stats
        _check([rollouts[0], rollouts[2]], 2)
    finally:
        _stop(group, trainers + rollouts)


def test_split_writes_covers_the_same_bytes() -> None:
    """Relay chunks: 1-D writes cut by bytes, 2-D writes by whole rows, gathers left alone."""
    w = np.zeros(4, WRITE_DTYPE)
    w["rows"] = [1, 1, 10, 1]
    w["kind"] = [K_DATA, K_DATA, K_DATA, K_GATHER]
    w["nbytes"] = [1000, 100, 10 * 64, 5000]
    w["src_offset"] = [7, 3000, 5000, 0]
    w["dst_offset"] = [11, 4000, 9000, 0]
    w["src_pitch"] = [0, 0, 64, 0]
    w["dst_pitch"] = [0, 0, 256, 0]
    out = split_writes(w, 300)
    assert list(out["nbytes"]) == [300, 300, 300, 100, 100, 256, 256, 128, 5000]
    assert list(out["src_offset"][:4]) == [7, 307, 607, 907]
    assert list(out["dst_offset"][:4]) == [11, 311, 611, 911]
    assert list(out["rows"][5:8]) == [4, 4, 2]
    assert list(out["src_offset"][5:8]) == [5000, 5000 + 4 * 64, 5000 + 8 * 64]
    assert list(out["dst_offset"][5:8]) == [9000, 9000 + 4 * 256, 9000 + 8 * 256]
    assert out["kind"][-1] == K_GATHER and out["nbytes"][-1] == 5000
