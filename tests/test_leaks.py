"""The leak check every test runs under (tests/conftest.py) can fail: each kind of thing a test can leave
behind is reported, and one that goes within the grace time is not. And the CPU tests' Ray actors start
no CUDA on a GPU host (tests/conftest.py)."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
import threading
from typing import Any

import numpy as np

from tests.support import leaks
from weightsync.engine import TransferEngine


def test_a_child_left_running_is_reported_and_one_that_exits_is_not() -> None:
    before = leaks.Snapshot()
    stays = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    goes = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(0.5)"])
    try:
        left = leaks.leaked(before, grace_s=3.0)
        assert len(left) == 1 and left[0].startswith(f"child process {stays.pid} "), left
    finally:
        stays.kill()
        stays.wait()
        goes.wait()
    assert leaks.leaked(before, grace_s=3.0) == []


def test_a_thread_left_running_is_reported() -> None:
    before = leaks.Snapshot()
    release = threading.Event()
    thread = threading.Thread(target=release.wait, name="left-waiting", daemon=True)
    thread.start()
    try:
        assert leaks.leaked(before, grace_s=0.5) == ["thread 'left-waiting'"]
    finally:
        release.set()
        thread.join()
    assert leaks.leaked(before, grace_s=3.0) == []


def test_an_engine_left_open_is_reported_and_one_only_garbage_holds_is_not() -> None:
    before = leaks.Snapshot()
    kept = TransferEngine(transport="fabric", stall_timeout=2.0)
    try:
        kept.register(np.zeros(64, dtype=np.uint8))
        left = leaks.leaked(before, grace_s=0.5)
        assert len(left) == 1 and left[0].startswith(f"open engine {kept!r}"), left
    finally:
        kept.close()
    assert leaks.leaked(before, grace_s=0.5) == []

    # An engine in a reference cycle, unreachable: garbage collection closes it, the check collects.
    cycle: list[Any] = [TransferEngine(transport="fabric", stall_timeout=2.0)]
    cycle.append(cycle)
    del cycle
    assert leaks.leaked(before, grace_s=3.0) == []


def test_an_actor_left_alive_and_a_ray_left_initialised_are_reported(ray_cluster: Any) -> None:
    ray = ray_cluster
    before = leaks.Snapshot()

    @ray.remote(num_cpus=0)
    class Left:
        def ready(self) -> bool:
            return True

    actor = Left.remote()
    ray.get(actor.ready.remote(), timeout=60)
    try:
        left = leaks.leaked(before, grace_s=0.5)
        assert len(left) == 1 and left[0].startswith("Ray actor Left"), left
    finally:
        ray.kill(actor)
    assert leaks.leaked(before, grace_s=10.0) == []
    # A test that found no Ray and leaves one initialised (the module's Ray stands in for it here).
    assert leaks.leaked(dataclasses.replace(before, ray=False), grace_s=0.5) == [
        "Ray still initialised (ray.init without ray.shutdown)"]


def test_an_actor_that_asked_for_no_gpu_sees_none_and_opens_no_cuda_lane(ray_cluster: Any) -> None:
    ray = ray_cluster

    @ray.remote(num_cpus=0)
    def what_a_cpu_actor_sees() -> tuple[str | None, str]:
        import os

        from weightsync.engine import TransferEngine

        with TransferEngine(stall_timeout=2.0) as engine:  # transport "auto", as a participant's
            return os.environ.get("CUDA_VISIBLE_DEVICES"), engine.transport

    assert ray.get(what_a_cpu_actor_sees.remote(), timeout=120) == ("", "fabric")
