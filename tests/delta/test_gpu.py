"""Delta pushes into GPU destinations (issue 18): a trainer actor on one GPU pushes every change case of
tests/delta/test_push.py into a TP rank (inplace) and a staged full replica on the other GPU, over the
cuda lane (CUDA IPC: the two sides must be separate processes). On a host of one GPU the two actors share
it (half a GPU each, still two processes). On a GPU destination an early span's
scatter is only queued while the next span's entries are read on a stream of their own; the version's
last apply waits for every scatter, so a reader never sees a version before all of it is in place.
After every push every destination byte must equal what a dense push gives (bitwise)."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
import torch

import weightsync as ws
from tests.delta.test_push import CASES, bits, initial, named, step, view

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")]
GPUS_EACH = 1 if torch.cuda.device_count() >= 2 else 0.5  # the trainer's and the rollout's

LAYOUTS = ["tp0", "replica"]
MODES = ["inplace", "staged"]


class DeltaTrainer:
    """One source holding the whole model on its GPU, updated in place before each push."""

    def __init__(self, group: str, min_part_bytes: int) -> None:
        import weightsync.delta.codec as delta_module

        # Every span filled: a kilobyte model would otherwise fill one span, and the early spans'
        # queued scatters would go untested (the source cuts the spans).
        delta_module.MIN_SPAN_BYTES = min_part_bytes
        self.full = initial()
        self.local = {k: v.clone().cuda() for k, v in self.full.items()}
        self.src = ws.Source(group, rank=0, tensors=dict(self.local), timeout=60, delta=True)

    def push(self, version: int, case: str | None, seed: int) -> dict[str, Any]:
        if case is not None:
            self.full = step(self.full, case, seed)
            for k, t in self.local.items():
                t.copy_(self.full[k])
        stats = ws.push(self.src, version, timeout=30)
        return {"delta": stats.delta_destinations, "failed": stats.failed_destinations,
                "full": {k: v.clone() for k, v in self.full.items()}}

    def close(self) -> None:
        self.src.close()


class DeltaRollout:
    """The destinations on this actor's GPU; the staged one read by a generation loop that applies each
    version as it completes and checks it whole against that version's model."""

    def __init__(self, group: str) -> None:
        self.history: dict[int, dict[str, torch.Tensor]] = {}
        self.local: list[dict[str, torch.Tensor]] = []
        self.dsts: list[ws.Destination] = []
        full = initial()
        futs = []
        # Together: each one's join waits for the group's plan, which needs every destination.
        with ThreadPoolExecutor(len(LAYOUTS)) as ex:
            for j, (layout, mode) in enumerate(zip(LAYOUTS, MODES, strict=True)):
                poison = {k: torch.full_like(v, float("nan")).cuda() for k, v in view(layout, full).items()}
                self.local.append(poison)
                futs.append(ex.submit(ws.Destination, group, j, named(layout, poison), mode, timeout=60,
                                      push_timeout=20, delta_bytes=1 << 20))
            self.dsts = [f.result(timeout=120) for f in futs]
        self.mixed: list[str] = []
        self.reads: set[int] = set()
        self._stop = threading.Event()
        self._reader: threading.Thread | None = None

    def expect(self, version: int, full: dict[str, torch.Tensor]) -> None:
        self.history[version] = full

    def start_reader(self) -> None:
        j = MODES.index("staged")

        def loop() -> None:
            while not self._stop.is_set():
                v = self.dsts[j].apply()
                if v < 0 or v not in self.history:
                    time.sleep(0.001)
                    continue
                for k, t in view(LAYOUTS[j], self.history[v]).items():
                    if not torch.equal(bits(self.local[j][k].cpu()), bits(t)):
                        self.mixed.append(f"destination {j} {k} differs from version {v}")
                self.reads.add(v)

        self._reader = threading.Thread(target=loop, daemon=True)
        self._reader.start()

    def check(self, version: int) -> list[str]:
        """Every destination at ``version``, byte for byte; what differs."""
        wrong = []
        for j, d in enumerate(self.dsts):
            assert d.wait(version, timeout=30) == version
            if MODES[j] == "staged":
                deadline = time.monotonic() + 30
                while d.live_version < version and time.monotonic() < deadline:
                    if self._reader is None:
                        d.apply()
                    time.sleep(0.002)
            for k, t in view(LAYOUTS[j], self.history[version]).items():
                if not torch.equal(bits(self.local[j][k].cpu()), bits(t)):
                    wrong.append(f"destination {j} ({LAYOUTS[j]}, {MODES[j]}) {k} at version {version}")
        return wrong

    def stop(self) -> tuple[list[str], list[int]]:
        self._stop.set()
        if self._reader is not None:
            self._reader.join(timeout=10)
        return self.mixed, sorted(self.reads)

    def close(self) -> None:
        for d in self.dsts:
            d.close()


def test_every_case_into_gpu_destinations_with_a_reader(ray_cluster) -> None:
    ray = ray_cluster
    group = ws.Group.create("delta-gpu-dst", num_sources=1, num_destinations=len(LAYOUTS))
    trainer = ray.remote(num_cpus=0, num_gpus=GPUS_EACH)(DeltaTrainer).remote("delta-gpu-dst", 1)
    rollout = ray.remote(num_cpus=0, num_gpus=GPUS_EACH)(DeltaRollout).remote("delta-gpu-dst")
    try:
        ray.get(rollout.__ray_ready__.remote(), timeout=120)
        r = ray.get(trainer.push.remote(0, None, 0), timeout=90)
        ray.get(rollout.expect.remote(0, r["full"]), timeout=30)
        assert ray.get(rollout.check.remote(0), timeout=60) == []
        ray.get(rollout.start_reader.remote(), timeout=30)
        for v, case in enumerate(CASES, start=1):
            # the expected model first (the reader checks each version it applies against it)
            want = step(r["full"], case, v)
            ray.get(rollout.expect.remote(v, want), timeout=30)
            r = ray.get(trainer.push.remote(v, case, v), timeout=90)
            assert r["failed"] == [] and r["delta"] == [0, 1], (case, r["delta"])
            assert ray.get(rollout.check.remote(v), timeout=60) == [], case
        time.sleep(0.2)
        mixed, reads = ray.get(rollout.stop.remote(), timeout=30)
        assert mixed == []
        assert reads, "the reader applied no version"
    finally:
        for a in (trainer, rollout):
            try:
                ray.get(a.close.remote(), timeout=30)
            except Exception:  # an actor that failed: killed below all the same
                pass
            ray.kill(a)
        group.shutdown()
