"""Sources learn the plan epoch from a watcher thread (a long-poll on the coordinator) instead of asking
for it on every push: the coordinator's long-poll and its wait for watchers (no Ray), then sources in
Ray actors (a push right after a re-plan, the fallback, close), then Ray shut down under a watcher."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import ray
import torch

import weightsync as ws
import weightsync.control.coordinator as coordinator
from tests import ROOT
from weightsync.control.admission import Proof, admission_key, prove
from weightsync.control.coordinator import DESTINATION, SOURCE, Coordinator
from weightsync.runtime.describe import describe_tensors


def _p(method: str) -> Proof:
    """A fresh proof of the secret "s" of group "unit" for one call of ``method``."""
    return prove(admission_key("s", "unit"), "unit", method)

# -- the coordinator alone -----------------------------------------------------------------------------
_LAYOUT = describe_tensors({"w": torch.zeros(4, 4)}).to_msgpack()
_ENGINE = {"nics": 1, "stripe_threshold": 1 << 20, "max_piece": 1 << 20}


def _join(c: Coordinator, role: str, rank: int) -> int:
    return c.join(_p("join"), role, rank, _LAYOUT, b"addr%d" % rank, "host", _ENGINE, {"w": [b"d", b"d"]},
                  b"mbox")


def _planned() -> Coordinator:
    c = Coordinator("unit", 1, 1, "s")
    _join(c, SOURCE, 0)
    _join(c, DESTINATION, 0)
    assert c.epoch == 1
    return c


class _FakeWatcher:
    """What weightsync.control.watcher.EpochWatcher does, in a thread, against a Coordinator object: call
    wait_epoch with the newest epoch heard; ``delay`` s pass between an answer and holding it."""

    def __init__(self, c: Coordinator, rank: int = 0, delay: float = 0.0) -> None:
        self.c, self.rank, self.delay = c, rank, delay
        self.heard = -1
        self.stop = False
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stop:
            epoch = self.c.wait_epoch(_p("wait_epoch"), self.rank, "tok", self.heard, 0.2)
            time.sleep(self.delay)
            self.heard = max(self.heard, epoch)

    def wait_heard(self, epoch: int, timeout: float = 1.0) -> None:
        deadline = time.monotonic() + timeout
        while self.heard < epoch:
            assert time.monotonic() < deadline, f"watcher heard {self.heard}, not {epoch}, within {timeout} s"
            time.sleep(0.005)

    def close(self) -> None:
        self.stop = True
        self.thread.join(2)


def test_wait_epoch_answers_at_once_on_a_replan_and_at_timeout() -> None:
    c = _planned()
    t = time.monotonic()
    assert c.wait_epoch(_p("wait_epoch"), 0, "tok", 0, 5.0) == 1  # already newer: at once
    assert time.monotonic() - t < 0.5
    t = time.monotonic()
    # nothing new: the current epoch at the timeout
    assert c.wait_epoch(_p("wait_epoch"), 0, "tok", 1, 0.3) == 1
    assert time.monotonic() - t >= 0.3
    with pytest.raises(ws.WeightSyncError, match="wrong secret"):
        c.wait_epoch("not the secret", 0, "tok", 1, 0.1)

    # A long-poll in flight is answered by the re-plan of a join, and of a report.
    got: list[tuple[int, float]] = []

    def poll(after: int) -> None:
        got.append((c.wait_epoch(_p("wait_epoch"), 0, "tok", after, 10.0), time.monotonic()))

    for after, change in ((1, lambda: _join(c, DESTINATION, 1)),
                          (2, lambda: c.report_dead(_p("report_dead"), "test", DESTINATION, [1], 2))):
        th = threading.Thread(target=poll, args=(after,))
        th.start()
        time.sleep(0.2)  # the poll is waiting
        t = time.monotonic()
        threading.Thread(target=change, daemon=True).start()
        th.join(2)
        epoch, when = got.pop()
        assert epoch == after + 1 == c.epoch
        assert when - t < 1.0


def test_membership_change_returns_once_every_watcher_heard_it() -> None:
    c = _planned()
    slow = _FakeWatcher(c, delay=0.3)  # takes 0.3 s to hold an answer
    try:
        slow.wait_heard(1)
        t = time.monotonic()
        _join(c, DESTINATION, 1)
        # Returned only once the watcher held the new epoch: a push started now would use the new plan.
        assert slow.heard == c.epoch == 2
        assert 0.3 <= time.monotonic() - t < coordinator.WATCHER_ACK_TIMEOUT
        assert c.status(_p("status"))["watchers"] == {0: 2}
        t = time.monotonic()
        assert c.report_dead(_p("report_dead"), "test", DESTINATION, [1], 2) == 3
        assert slow.heard == 3
        assert 0.3 <= time.monotonic() - t < coordinator.WATCHER_ACK_TIMEOUT
    finally:
        slow.close()


def test_silent_closed_or_replaced_watchers_are_not_waited_for(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(coordinator, "WATCHER_ACK_TIMEOUT", 0.4)
    c = _planned()
    # Registered by one long-poll, then silent (its process hangs): waited for at most the timeout, once.
    c.wait_epoch(_p("wait_epoch"), 0, "tok", 1, 0.0)
    t = time.monotonic()
    _join(c, DESTINATION, 1)
    assert 0.4 <= time.monotonic() - t < 1.5
    assert c.status(_p("status"))["watchers"] == {}
    t = time.monotonic()
    c.report_dead(_p("report_dead"), "test", DESTINATION, [1], c.epoch)
    assert time.monotonic() - t < 0.2

    # Closed: unwatch with its own token forgets it (another token does not).
    c.wait_epoch(_p("wait_epoch"), 0, "tok", c.epoch, 0.0)
    c.unwatch(_p("unwatch"), 0, "another")
    assert c.status(_p("status"))["watchers"] == {0: c.epoch}
    c.unwatch(_p("unwatch"), 0, "tok")
    assert c.status(_p("status"))["watchers"] == {}
    t = time.monotonic()
    _join(c, DESTINATION, 2)
    assert time.monotonic() - t < 0.2

    # A source rank joining again is a new process: its old watcher is not waited for.
    c.wait_epoch(_p("wait_epoch"), 0, "tok", c.epoch, 0.0)
    t = time.monotonic()
    _join(c, SOURCE, 0)
    assert time.monotonic() - t < 0.2
    assert c.status(_p("status"))["watchers"] == {}


# -- sources in Ray actors -------------------------------------------------------------------------------
@ray.remote(num_cpus=0, max_restarts=0)
class _Receiver:
    def __init__(self, group: str, rank: int) -> None:
        self.w = torch.full((16, 16), float("nan"))
        self.dst = ws.Destination(group, rank=rank, tensors={"w": self.w}, mode="inplace", timeout=60,
                                  push_timeout=20)

    def has(self, version: int, timeout: float = 20.0) -> bool:
        self.dst.wait(version, timeout)
        return bool(torch.equal(self.w, torch.full((16, 16), float(version))))


@ray.remote(num_cpus=0, max_restarts=0)
class _Pusher:
    def __init__(self, group: str) -> None:
        self.w = torch.zeros(16, 16)
        self.src = ws.Source(group, rank=0, tensors={"w": self.w}, timeout=60)

    def push(self, version: int, timeout: float = 20.0) -> dict:
        self.w.fill_(float(version))
        return ws.push(self.src, version=version, timeout=timeout).__dict__

    def watcher(self) -> dict:
        w = self.src._watcher
        return {"epoch": w.epoch(), "alive": w.alive, "fallbacks": self.src._epoch_fallbacks,
                "threads": sorted(t.name for t in threading.enumerate() if t.name.endswith("-epoch"))}

    def stop_watcher(self) -> None:
        self.src._watcher.stop()  # as if the watcher had died

    def close(self) -> None:
        self.src.close()


def _heard(pusher: ray.actor.ActorHandle, epoch: int, timeout: float) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        w = ray.get(pusher.watcher.remote())
        if w["epoch"] == epoch or time.monotonic() > deadline:
            return w
        time.sleep(0.02)


def test_pushes_follow_replans_through_the_watcher_or_the_fallback(ray_cluster) -> None:
    name = "watcher-replans"
    group = ws.Group.create(name, num_sources=1, num_destinations=1)
    receivers = [_Receiver.remote(name, 0)]
    pusher = _Pusher.remote(name)
    try:
        ray.get([pusher.__ray_ready__.remote(), receivers[0].__ray_ready__.remote()], timeout=120)
        epoch = group.status()["epoch"]
        w = _heard(pusher, epoch, 5.0)
        assert w["epoch"] == epoch and w["alive"], w
        for v in range(3):
            s = ray.get(pusher.push.remote(v), timeout=60)
            assert s["destinations"] == [0] and s["failed_destinations"] == [], s
        assert ray.get(receivers[0].has.remote(2))
        # With the watcher healthy, no push asked the coordinator for the epoch.
        assert ray.get(pusher.watcher.remote())["fallbacks"] == 0

        # A new destination joins: the watcher's epoch follows within a second (the join waits for it),
        # and a push started right after uses the new plan without asking the coordinator.
        receivers.append(_Receiver.remote(name, 1))
        ray.get(receivers[1].__ray_ready__.remote(), timeout=120)
        epoch = group.status()["epoch"]
        w = _heard(pusher, epoch, 1.0)
        assert w["epoch"] == epoch, (w, epoch)
        s = ray.get(pusher.push.remote(3), timeout=60)
        assert (s["epoch"], s["destinations"], s["failed_destinations"]) == (epoch, [0, 1], []), s
        assert ray.get([r.has.remote(3) for r in receivers]) == [True, True]
        assert ray.get(pusher.watcher.remote())["fallbacks"] == 0

        # Without a watcher (it died), a push asks the coordinator: a new destination is still written.
        ray.get(pusher.stop_watcher.remote())
        assert ray.get(pusher.watcher.remote())["epoch"] is None
        receivers.append(_Receiver.remote(name, 2))
        ray.get(receivers[2].__ray_ready__.remote(), timeout=120)
        s = ray.get(pusher.push.remote(4), timeout=60)
        assert (s["destinations"], s["failed_destinations"]) == ([0, 1, 2], []), s
        assert s["epoch"] == group.status()["epoch"] > epoch
        assert ray.get([r.has.remote(4) for r in receivers]) == [True] * 3
        assert ray.get(pusher.watcher.remote())["fallbacks"] == 1
    finally:
        for a in [pusher, *receivers]:
            ray.kill(a)
        group.shutdown()


def test_close_stops_the_watcher(ray_cluster) -> None:
    name = "watcher-close"
    group = ws.Group.create(name, num_sources=1, num_destinations=1)
    receiver, pusher = _Receiver.remote(name, 0), _Pusher.remote(name)
    try:
        ray.get([pusher.__ray_ready__.remote(), receiver.__ray_ready__.remote()], timeout=120)
        w = _heard(pusher, group.status()["epoch"], 5.0)
        assert w["alive"] and len(w["threads"]) == 1, w
        deadline = time.monotonic() + 5
        while group.status()["watchers"] != {0: w["epoch"]}:
            assert time.monotonic() < deadline, group.status()
            time.sleep(0.02)
        t = time.monotonic()
        ray.get(pusher.close.remote(), timeout=30)
        assert time.monotonic() - t < 2.0  # the thread is woken, not waited out (its poll is 10 s)
        w = ray.get(pusher.watcher.remote())
        assert not w["alive"] and w["threads"] == [] and w["epoch"] is None, w
        deadline = time.monotonic() + 5
        while group.status()["watchers"]:  # the coordinator was told (no membership change waits for it)
            assert time.monotonic() < deadline, group.status()
            time.sleep(0.02)
    finally:
        ray.kill(pusher)
        ray.kill(receiver)
        group.shutdown()


# -- Ray shut down under a running watcher -----------------------------------------------------------------
_SHUTDOWN_SCRIPT = textwrap.dedent("""
    import time
    import ray, torch
    import weightsync as ws
    from weightsync.control.group import new_secret

    ray.init(address="local", num_cpus=1, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"WEIGHTSYNC_SECRET": new_secret()}})
    group = ws.Group.create("shutdown", 1, 1)  # held: the coordinator lives as long as its handle

    @ray.remote(num_cpus=0)
    class Receiver:
        def __init__(self):
            self.dst = ws.Destination("shutdown", 0, {"w": torch.zeros(8, 8)}, mode="inplace")

    r = Receiver.remote()
    src = ws.Source("shutdown", 0, {"w": torch.randn(8, 8)})
    ray.get(r.__ray_ready__.remote())
    ws.push(src, 0)
    deadline = time.monotonic() + 10
    while src._watcher.epoch() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    print("heard", src._watcher.epoch(), flush=True)
    ray.shutdown()  # the watcher is waiting for its long-poll's answer
    deadline = time.monotonic() + 5
    while src._watcher.alive and time.monotonic() < deadline:
        time.sleep(0.01)
    print("stopped", not src._watcher.alive, "ray", ray.is_initialized(), flush=True)
""")


def test_ray_shutdown_under_a_running_watcher() -> None:
    """The watcher stops without calling Ray again: a call after shutdown ends the process (seen with a
    watcher that waited inside ray.wait), and one through the auto-init hooks would start a new Ray."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p)}
    out = subprocess.run([sys.executable, "-c", _SHUTDOWN_SCRIPT], env=env, capture_output=True, text=True,
                         timeout=240, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "heard 1" in out.stdout, out.stdout + out.stderr[-3000:]
    assert "stopped True ray False" in out.stdout, out.stdout + out.stderr[-3000:]
