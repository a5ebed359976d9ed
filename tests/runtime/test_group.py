"""Control plane on CPU with Ray: two trainer ranks push to three rollout ranks of different layouts."""

from __future__ import annotations

import pytest
import ray
import torch

import weightsync as ws
from tests.runtime.group_actors import DESTS, Rollout, Trainer, destination_view, free_port, full_tensors


def _start(name: str, mode: str) -> tuple[ws.Group, list, list]:
    group = ws.Group.create(name, num_sources=2, num_destinations=3)
    trainer_cls = ray.remote(num_cpus=0)(Trainer)
    rollout_cls = ray.remote(num_cpus=0)(Rollout)
    port = free_port()
    rollouts = [rollout_cls.remote(name, j, layout, tp, mode) for j, (layout, tp) in enumerate(DESTS)]
    trainers = [trainer_cls.remote(name, i, 2, port, use_dtensor=(i >= 0)) for i in range(2)]
    ray.get([t.__ray_ready__.remote() for t in trainers + rollouts], timeout=120)
    return group, trainers, rollouts


@pytest.mark.parametrize("mode", ["inplace", "staged"])
def test_twenty_pushes_bit_identical(ray_cluster, mode: str) -> None:
    group, trainers, rollouts = _start(f"t20-{mode}", mode)
    try:
        if mode == "staged":
            ray.get([r.start_reader.remote() for r in rollouts])
        for version in range(20):  # from 0: a fresh mailbox slot must not pass for an ack of version 0
            stats = ray.get([t.push.remote(version) for t in trainers], timeout=120)
            assert all(s["failed_destinations"] == [] for s in stats)
            assert ray.get([r.wait.remote(version) for r in rollouts]) == [version] * 3
            full = full_tensors(version)
            for (layout, tp), r in zip(DESTS, rollouts, strict=True):
                # staged: the reader thread is the generation loop that applies; inplace: nothing to apply
                live_version, got = ray.get(r.snapshot.remote(apply=mode != "staged", version=version))
                assert live_version == version
                want = destination_view(layout, tp, full)
                assert got.keys() == want.keys()
                for k in want:
                    assert torch.equal(got[k], want[k]), f"{layout}{tp} {k} differs at version {version}"
        if mode == "staged":
            readers = ray.get([r.stop_reader.remote() for r in rollouts])
            for rd in readers:
                assert rd["mixed"] == [], rd
                assert rd["reads"] > 0
    finally:
        for a in trainers + rollouts:
            ray.kill(a)
        group.shutdown()


BAD_LAYOUTS = {
    # case: (what the destination holds, words the error must contain)
    "unknown name": ({"wq": torch.zeros(4, 4)}, ["'wq'", "did you mean 'w'"]),
    "shape": ({"w": torch.zeros(4, 5)}, ["'w'", "shape"]),
    "dtype": ({"w": torch.zeros(4, 4, dtype=torch.float64)}, ["'w'", "dtype"]),
    "uncovered": ({"w": torch.zeros(4, 4), "b": torch.zeros(3)}, ["'b'"]),
}


@pytest.mark.parametrize("case", sorted(BAD_LAYOUTS))
def test_bad_layout_is_refused_everywhere(ray_cluster, case: str) -> None:
    name = f"bad-layout-{case.replace(' ', '-')}"
    dst_tensors, words = BAD_LAYOUTS[case]
    group = ws.Group.create(name, num_sources=1, num_destinations=1)

    @ray.remote(num_cpus=0)
    class Holder:
        def __init__(self, role: str, tensors: dict) -> None:
            self.error = None
            try:
                if role == "source":
                    ws.Source(name, rank=0, tensors=tensors, timeout=30)
                else:
                    ws.Destination(name, rank=0, tensors=tensors, timeout=30)
            except ws.WeightSyncError as exc:
                self.error = f"{type(exc).__name__}: {exc}"

        def get(self):
            return self.error

    try:
        src = Holder.remote("source", {"w": torch.randn(4, 4)})
        dst = Holder.remote("destination", dst_tensors)
        errors = ray.get([src.get.remote(), dst.get.remote()], timeout=90)
        for e in errors:  # the same error in the participant that caused it and in the other
            assert e is not None and e.split(":")[0] in ("LayoutError", "PlanError"), e
            for w in words:
                assert w in e, (w, e)
    finally:
        group.shutdown()
