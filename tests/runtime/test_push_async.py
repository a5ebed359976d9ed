"""Non-blocking pushes (``ws.push_async``) on CPU with Ray over TCP loopback.

Overlap is made deterministic by stopping a destination's process (SIGSTOP): while it is stopped it can
neither grant nor count a version, so a push that has returned to its caller cannot have completed; it
completes once the process continues. Every version is random (``randn``, never zeros; destinations start
as NaN) and checked bit for bit on every destination.
"""

from __future__ import annotations

import os
import signal
import threading
import time
import zlib
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import ray
import torch

import weightsync as ws

SHAPES = {"emb": (96, 64), "w": (64, 48), "col": (32, 40), "norm": (48,)}


def values(name: str, version: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(zlib.crc32(name.encode()) * 1000 + version)
    return torch.randn(SHAPES[name], generator=g)


def _rows(name: str, rank: int, world: int) -> slice:
    if len(SHAPES[name]) == 1:
        return slice(None)  # replicated on every trainer
    n = SHAPES[name][0] // world
    return slice(rank * n, (rank + 1) * n)


class AsyncTrainer:
    """A trainer rank holding dim-0 shards (1-D tensors replicated) as Parameters, with an SGD optimizer
    whose steps wait for the push in flight (``src.guard``)."""

    def __init__(self, group: str, rank: int, world: int) -> None:
        self.rank, self.world = rank, world
        self.params: dict[str, torch.nn.Parameter] = {}
        tensors: dict[str, Any] = {}
        for name, shape in SHAPES.items():
            p = torch.nn.Parameter(values(name, 0)[_rows(name, rank, world)].clone())
            self.params[name] = p
            offsets = (_rows(name, rank, world).start, 0)
            tensors[name] = p if len(shape) == 1 else ws.Sharded(p, shape, offsets)
        self.src = ws.Source(group, rank=rank, tensors=tensors, timeout=60)
        self.optimizer = torch.optim.SGD(list(self.params.values()), lr=0.5)
        self.src.guard(self.optimizer)
        self.handle: Any = None

    def set_version(self, version: int) -> None:
        with torch.no_grad():
            for name, p in self.params.items():
                p.copy_(values(name, version)[_rows(name, self.rank, self.world)])

    def push_async(self, version: int, timeout: float = 30.0) -> float:
        t0 = time.perf_counter()
        self.handle = ws.push_async(self.src, version, timeout=timeout)
        return time.perf_counter() - t0

    def push(self, version: int, timeout: float = 30.0) -> dict[str, Any]:
        return ws.push(self.src, version, timeout=timeout).__dict__

    def done(self) -> bool:
        return self.handle.done()

    def push_threads(self) -> list[int]:
        """The live threads named as this source's push thread, as ids of their Thread objects (kept
        referenced here, so an id is never reused by another thread)."""
        prefix = f"weightsync-{self.src.group}-push{self.rank}"
        found = [t for t in threading.enumerate() if t.name.startswith(prefix)]
        self._threads = [*getattr(self, "_threads", []), *found]
        return [id(t) for t in found]

    def wait(self, timeout: float | None = None) -> dict[str, Any]:
        return self.handle.wait(timeout).__dict__

    def change_weights(self) -> None:
        """An in-place update that does not wait for the push (what the guard prevents)."""
        with torch.no_grad():
            self.params["w"].mul_(2.0)

    def step(self) -> float:
        """One optimizer step (the guard waits for the push first); returns the seconds it took."""
        for p in self.params.values():
            p.grad = torch.ones_like(p)
        t0 = time.perf_counter()
        self.optimizer.step()
        return time.perf_counter() - t0

    def shards(self) -> dict[str, torch.Tensor]:
        return {k: p.detach().clone() for k, p in self.params.items()}

    def close(self) -> float:
        t0 = time.perf_counter()
        self.src.close()
        return time.perf_counter() - t0


class AsyncRollout:
    """A full replica (NaN until the first version), ``inplace`` or ``staged``, of ``dtype``."""

    def __init__(self, group: str, rank: int, mode: str, dtype: torch.dtype = torch.float32) -> None:
        self.tensors = {k: torch.full(s, float("nan"), dtype=dtype) for k, s in SHAPES.items()}
        self.dst = ws.Destination(group, rank=rank, tensors=dict(self.tensors), mode=mode, timeout=60,
                                  push_timeout=30)

    def pid(self) -> int:
        return os.getpid()

    def version(self) -> int:
        return self.dst.version

    def wait(self, version: int, timeout: float = 30.0) -> int:
        return self.dst.wait(version, timeout)

    def torn(self) -> bool:
        return self.dst.updating or self.dst.dirty

    def snapshot(self) -> tuple[int, dict[str, torch.Tensor]]:
        self.dst.apply()
        return self.dst.live_version, {k: v.clone() for k, v in self.tensors.items()}


class Team:
    def __init__(self, name: str, trainers: int, modes: list[str], dtype: torch.dtype = torch.float32,
                 **group_options: Any) -> None:
        self.group = ws.Group.create(name, num_sources=trainers, num_destinations=len(modes), **group_options)
        self.rollouts = [ray.remote(num_cpus=0)(AsyncRollout).remote(name, j, m, dtype)
                         for j, m in enumerate(modes)]
        self.trainers = [ray.remote(num_cpus=0)(AsyncTrainer).remote(name, i, trainers)
                         for i in range(trainers)]
        ray.get([a.__ray_ready__.remote() for a in self.trainers + self.rollouts], timeout=120)
        self.pids = ray.get([r.pid.remote() for r in self.rollouts], timeout=30)
        self.dtype = dtype

    def set_version(self, version: int) -> None:
        ray.get([t.set_version.remote(version) for t in self.trainers], timeout=30)

    def push_async(self, version: int, timeout: float = 30.0) -> list[float]:
        return ray.get([t.push_async.remote(version, timeout) for t in self.trainers], timeout=30)

    def wait(self) -> list[dict[str, Any]]:
        return ray.get([t.wait.remote() for t in self.trainers], timeout=90)

    @contextmanager
    def stopped(self, j: int) -> Iterator[None]:
        """Rollout ``j``'s process stopped (it cannot grant, count or ack) for the block."""
        os.kill(self.pids[j], signal.SIGSTOP)
        try:
            yield
        finally:
            try:
                os.kill(self.pids[j], signal.SIGCONT)
            except ProcessLookupError:  # killed meanwhile
                pass

    def check(self, version: int, rollouts: list[int] | None = None,
              want: dict[str, torch.Tensor] | None = None) -> None:
        """Every rollout (or those named) holds ``version`` (``want``, else its random values) bit for bit."""
        which = range(len(self.rollouts)) if rollouts is None else rollouts
        refs = [self.rollouts[j] for j in which]
        assert ray.get([r.wait.remote(version) for r in refs], timeout=60) == [version] * len(refs)
        want = want or {k: values(k, version) for k in SHAPES}
        snaps = ray.get([r.snapshot.remote() for r in refs], timeout=60)
        for j, (live, got) in zip(which, snaps, strict=True):
            assert live == version, f"rollout {j}: live version {live}, expected {version}"
            for k, w in want.items():
                w = w.to(self.dtype)
                assert torch.equal(got[k].view(torch.uint8), w.view(torch.uint8)), \
                    f"rollout {j}: {k} differs at version {version}"

    def versions(self) -> list[int]:
        return ray.get([r.version.remote() for r in self.rollouts], timeout=30)

    def full(self) -> dict[str, torch.Tensor]:
        """The trainers' current tensors as full tensors (rows from each rank)."""
        shards = ray.get([t.shards.remote() for t in self.trainers], timeout=30)
        world = len(self.trainers)
        return {k: shards[0][k] if len(s) == 1 else torch.cat([shards[i][k] for i in range(world)])
                for k, s in SHAPES.items()}

    def stop(self) -> None:
        for a in self.trainers + self.rollouts:
            ray.kill(a)
        self.group.shutdown()


def _cause(info: pytest.ExceptionInfo) -> BaseException:
    return info.value.cause if isinstance(info.value, ray.exceptions.RayTaskError) else info.value


@pytest.fixture(scope="module")
def team(ray_cluster) -> Iterator[Team]:
    """2 trainers (row shards) -> a staged and an inplace full replica."""
    t = Team("push-async", 2, ["staged", "inplace"])
    try:
        yield t
    finally:
        t.stop()


def test_push_returns_before_destinations_have_the_version_and_lands_exactly(team: Team) -> None:
    threads = []
    for version in (1, 2, 3):
        team.set_version(version)
        with team.stopped(0):
            calls = team.push_async(version)
            # Rollout 0 cannot grant or count while stopped: no push can have completed.
            time.sleep(0.3)
            assert ray.get([t.done.remote() for t in team.trainers], timeout=30) == [False, False]
            # The trainers' actors are free meanwhile (forward/backward would run here).
            assert ray.get([t.shards.remote() for t in team.trainers], timeout=30)
            threads.append(ray.get([t.push_threads.remote() for t in team.trainers], timeout=30))
        assert max(calls) < 1.0, calls
        for s in team.wait():
            assert s["version"] == version and s["failed_destinations"] == [], s
        team.check(version)
    # Each source's pushes ran in one thread, started once (not a thread per push, whose start made
    # push_async wait for the GIL while the new thread ran the push's first Python).
    assert all(len(ids) == 1 for ids in threads[0]), threads
    assert threads == [threads[0]] * 3, threads


def test_second_push_while_one_is_in_flight_is_refused(team: Team) -> None:
    t0 = team.trainers[0]
    team.set_version(4)
    with team.stopped(0):
        team.push_async(4)
        for call in (t0.push_async.remote(5), t0.push.remote(5)):
            with pytest.raises(ray.exceptions.RayTaskError) as info:
                ray.get(call, timeout=30)
            err = _cause(info)
            assert type(err) is ws.WeightSyncError and "still in flight" in str(err), err
    assert all(s["failed_destinations"] == [] for s in team.wait())
    team.check(4)
    team.set_version(5)  # the refused version was not used up
    team.push_async(5)
    team.wait()
    team.check(5)


def test_tensors_changed_under_a_push_fail_it_and_no_destination_flips(team: Team) -> None:
    team.set_version(6)
    team.push_async(6)
    team.wait()
    team.set_version(7)
    with team.stopped(0):
        team.push_async(7, timeout=6.0)
        ray.get(team.trainers[0].change_weights.remote(), timeout=30)  # during the push: not allowed
    with pytest.raises(ray.exceptions.RayTaskError) as info:
        ray.get(team.trainers[0].wait.remote(), timeout=60)
    err = _cause(info)
    assert isinstance(err, ws.WeightSyncError) and "changed while the push read them" in str(err), err
    assert "'w'" in str(err)
    # Trainer 1 wrote all of its share, tails included; trainer 0 held its tails back: no destination
    # can complete version 7, and trainer 1 times out waiting for acks.
    with pytest.raises(ray.exceptions.RayTaskError) as info:
        ray.get(team.trainers[1].wait.remote(), timeout=60)
    assert isinstance(_cause(info), ws.TimeoutError), _cause(info)
    assert team.versions() == [6, 6]
    team.check(6, rollouts=[0])  # staged: version 7 went to the shadow, never made live
    # Inplace: bytes of version 7 may be in the live tensors, and the destination says so (it is still
    # landing 7 until a newer announce or its push timeout, then dirty until a complete version).
    assert ray.get(team.rollouts[1].torn.remote(), timeout=30) is True
    # The next version lands whole on both (they abandon 7 at its announce).
    team.set_version(8)
    team.push_async(8)
    assert all(s["failed_destinations"] == [] for s in team.wait())
    team.check(8)
    assert ray.get(team.rollouts[1].torn.remote(), timeout=30) is False


def test_guard_makes_the_optimizer_step_wait_for_the_push(team: Team) -> None:
    team.set_version(9)
    with team.stopped(0):
        team.push_async(9)
        steps = [t.step.remote() for t in team.trainers]
        time.sleep(0.5)
        ready, _ = ray.wait(steps, num_returns=len(steps), timeout=0)
        assert not ready  # both steps wait in the guard while the push cannot complete
    waited = ray.get(steps, timeout=60)
    assert min(waited) > 0.3, waited
    assert all(s["failed_destinations"] == [] for s in team.wait())  # the result is still there
    team.check(9)  # the weights from before the step, whole
    stepped = team.full()
    assert not torch.equal(stepped["w"], values("w", 9))
    team.push_async(10)
    team.wait()
    team.check(10, want=stepped)


def test_wait_timeout_then_killed_destination_then_no_destination(ray_cluster) -> None:
    # One source, two full replicas: a relay chain (the source writes the head, which forwards).
    t = Team("push-async-fail", 1, ["inplace", "staged"])
    try:
        tr = t.trainers[0]
        t.set_version(1)
        with t.stopped(1):
            t.push_async(1)
            with pytest.raises(ray.exceptions.RayTaskError) as info:
                ray.get(tr.wait.remote(0.2), timeout=30)  # the push goes on
            assert isinstance(_cause(info), ws.TimeoutError), _cause(info)
        assert t.wait()[0]["failed_destinations"] == []
        t.check(1)

        # A destination killed while the push waits for it: failed_destinations, the other one whole.
        # (SIGKILL while stopped: it never runs again. ray.kill, then SIGCONT, let it land the version
        # before it went.)
        t.set_version(2)
        os.kill(t.pids[1], signal.SIGSTOP)
        t.push_async(2, timeout=8.0)
        os.kill(t.pids[1], signal.SIGKILL)
        s = t.wait()[0]
        assert s["failed_destinations"] == [1], s
        t.check(2, rollouts=[0])

        # No destination answers within the timeout: ws.TimeoutError on wait(), nothing flips.
        t.set_version(3)
        start = time.monotonic()
        with t.stopped(0):
            t.push_async(3, timeout=2.0)
            with pytest.raises(ray.exceptions.RayTaskError) as info:
                ray.get(tr.wait.remote(), timeout=60)
        assert isinstance(_cause(info), ws.TimeoutError), _cause(info)
        assert time.monotonic() - start < 30
        t.set_version(4)
        t.push_async(4)
        assert t.wait()[0]["failed_destinations"] == []
        t.check(4, rollouts=[0])
    finally:
        t.stop()


def test_close_with_a_push_in_flight_cancels_it(ray_cluster) -> None:
    t = Team("push-async-close", 1, ["staged"])
    try:
        tr = t.trainers[0]
        t.set_version(1)
        t.push_async(1)
        t.wait()
        t.set_version(2)
        with t.stopped(0):
            t.push_async(2)
            assert len(ray.get(tr.push_threads.remote(), timeout=30)) == 1
            closed_in = ray.get(tr.close.remote(), timeout=60)
            assert closed_in < 5.0, closed_in
            assert ray.get(tr.push_threads.remote(), timeout=30) == []  # the push thread ended
            with pytest.raises(ray.exceptions.RayTaskError) as info:
                ray.get(tr.wait.remote(), timeout=30)
            err = _cause(info)
            assert type(err) is ws.WeightSyncError and "cancelled" in str(err), err
        with pytest.raises(ray.exceptions.RayTaskError) as info:
            ray.get(tr.push_async.remote(3), timeout=30)
        assert "closed" in str(_cause(info))
        time.sleep(0.5)
        assert t.versions() == [1]
        t.check(1)
    finally:
        t.stop()


def test_cast_destination_staged_writes_hold_their_tail(ray_cluster) -> None:
    """bf16 destinations of fp32 trainers: every write is staged (cast on the sender), so the held-back
    write is a staged one, copied out of its staging chunk."""
    t = Team("push-async-cast", 2, ["staged", "inplace"], dtype=torch.bfloat16, allow_cast=True)
    try:
        for version in (1, 2):
            t.set_version(version)
            with t.stopped(1):
                t.push_async(version)
                time.sleep(0.2)
                assert ray.get([tr.done.remote() for tr in t.trainers], timeout=30) == [False, False]
            assert all(s["failed_destinations"] == [] and s["chunks"] > 0 for s in t.wait())
            t.check(version)
        t.set_version(3)
        with t.stopped(1):
            t.push_async(3, timeout=6.0)
            ray.get(t.trainers[1].change_weights.remote(), timeout=30)
        with pytest.raises(ray.exceptions.RayTaskError) as info:
            ray.get(t.trainers[1].wait.remote(), timeout=60)
        assert "changed while the push read them" in str(_cause(info))
        # The other source's push completes no destination: it raises (no ack within its timeout) or, when
        # the destinations were reported failed first, returns them all as failed.
        try:
            other = ray.get(t.trainers[0].wait.remote(), timeout=60)
        except ray.exceptions.RayTaskError:
            pass
        else:
            assert sorted(other["failed_destinations"]) == [0, 1], other
        assert t.versions() == [2, 2]
        t.check(2, rollouts=[0])
        t.set_version(4)
        t.push_async(4)
        assert all(s["failed_destinations"] == [] for s in t.wait())
        t.check(4)
    finally:
        t.stop()


# -- what a push publishes when the tensors change under it, and what a dropped source leaves behind ----

BIG = 1 << 22  # words of the racing tensor: its in-place op (one thread, about 1 s) outlasts the push


def big_values(version: int) -> torch.Tensor:
    """Positive random words (the racing op, ``polygamma_(3)``, is finite on them)."""
    g = torch.Generator().manual_seed(7919 * version + 1)
    return torch.rand(BIG, generator=g) + 0.5


class RacingTrainer:
    """One source holding one large CPU tensor; ``race`` runs an in-place op on it from another thread
    while a non-blocking push reads it (what ``guard`` exists to prevent, here on purpose)."""

    def __init__(self, group: str) -> None:
        torch.set_num_threads(1)  # the racing op writes the tensor in one sweep, and takes its time
        self.w = big_values(0)
        self.src = ws.Source(group, rank=0, tensors={"w": self.w}, timeout=60)

    def set_version(self, version: int) -> None:
        self.w.copy_(big_values(version))

    def push(self, version: int) -> None:
        ws.push(self.src, version, timeout=30.0)

    def race(self, version: int, lead: float) -> dict[str, Any]:
        """Pushes ``version`` while another thread runs ``w.polygamma_(3)``: started ``lead`` seconds before
        ``push_async`` (negative: right after it). Returns whether the push succeeded, its error, and
        the tensor's bytes before and after the op."""
        before = self.w.clone()
        go = threading.Event()

        def writer() -> None:
            go.wait()
            with torch.no_grad():
                self.w.polygamma_(3)

        th = threading.Thread(target=writer)
        th.start()
        if lead >= 0:
            go.set()
            time.sleep(lead)
            h = ws.push_async(self.src, version, timeout=30.0)
        else:
            h = ws.push_async(self.src, version, timeout=30.0)
            go.set()
        th.join()
        try:
            h.wait()
            error = ""
        except ws.WeightSyncError as exc:
            error = str(exc)
        return {"ok": not error, "error": error, "before": before, "after": self.w.clone()}

    def change_unseen(self) -> None:
        """Changes the bytes without moving the tensor's version counter (``.data`` is another tensor
        object with a counter of its own): what the push's check sees of an in-place op that has not
        returned yet."""
        self.w.data.mul_(3.0)

    def push_async(self, version: int, timeout: float = 30.0) -> None:
        self.handle = ws.push_async(self.src, version, timeout=timeout)

    def wait(self) -> dict[str, Any]:
        return self.handle.wait().__dict__

    def tensor(self) -> torch.Tensor:
        return self.w.clone()


class RacingRollout:
    def __init__(self, group: str) -> None:
        self.w = torch.full((BIG,), float("nan"))
        self.dst = ws.Destination(group, rank=0, tensors={"w": self.w}, mode="staged", timeout=60,
                                  push_timeout=30)

    def pid(self) -> int:
        return os.getpid()

    def version(self) -> int:
        return self.dst.version

    def take(self, version: int) -> torch.Tensor:
        """Waits for ``version``, makes it live, returns its bytes."""
        assert self.dst.wait(version, timeout=30.0) == version
        self.dst.apply()
        assert self.dst.live_version == version
        return self.w.clone()


@pytest.fixture(scope="module")
def racing(ray_cluster) -> Iterator[tuple[Any, Any, int]]:
    name = "push-async-race"
    group = ws.Group.create(name, num_sources=1, num_destinations=1)
    rollout = ray.remote(num_cpus=0)(RacingRollout).remote(name)
    trainer = ray.remote(num_cpus=0)(RacingTrainer).remote(name)
    try:
        ray.get([trainer.__ray_ready__.remote(), rollout.__ray_ready__.remote()], timeout=120)
        yield trainer, rollout, ray.get(rollout.pid.remote(), timeout=30)
    finally:
        ray.kill(trainer)
        ray.kill(rollout)
        group.shutdown()


def _same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.view(torch.int32), b.view(torch.int32))


def test_an_in_place_op_racing_a_push_never_publishes_a_torn_version(racing: tuple[Any, Any, int]) -> None:
    """Issue 41, item 1: an in-place op on another thread overlapping a non-blocking push. On CPU torch
    moves the version counter only when the op returns, so the counters alone cannot see an op still
    writing at the push's check. Every push either fails (and the destination keeps what it had) or
    the destination makes live exactly the bytes from before the op or from after it.

    The destination is stopped for the first moments of each push (the push waits for its grant), so
    the op is still writing while the push is in flight however the machine schedules the writer: what
    the push's check must not miss. (A writer descheduled for a whole push writes nothing the push
    could see; push_handle's doc says what the push publishes then.)"""
    trainer, rollout, pid = racing
    version = 1
    ray.get(trainer.set_version.remote(version), timeout=30)
    ray.get(trainer.push.remote(version), timeout=60)
    assert _same_bytes(ray.get(rollout.take.remote(version), timeout=60), big_values(version))
    outcomes = []
    for lead in (0.0, 0.002, 0.01, 0.03, -1.0, 0.0, 0.005, -1.0):
        version += 1
        ray.get(trainer.set_version.remote(version), timeout=30)
        os.kill(pid, signal.SIGSTOP)
        try:
            call = trainer.race.remote(version, lead)
            time.sleep(0.3)
        finally:
            os.kill(pid, signal.SIGCONT)
        r = ray.get(call, timeout=120)
        if not r["ok"]:
            assert "changed while the push read them" in r["error"], r["error"]
            assert ray.get(rollout.version.remote(), timeout=30) < version
            outcomes.append("failed")
            continue
        got = ray.get(rollout.take.remote(version), timeout=60)
        from_before = int((got.view(torch.int32) == r["before"].view(torch.int32)).sum())
        from_after = int((got.view(torch.int32) == r["after"].view(torch.int32)).sum())
        outcomes.append("before" if from_before == BIG else "after" if from_after == BIG else
                        f"TORN ({from_before} words from before, {from_after} from after)")
    assert not [o for o in outcomes if o.startswith("TORN")], outcomes


def test_a_change_the_counters_do_not_show_fails_the_push(racing: tuple[Any, Any, int]) -> None:
    """The same situation made deterministic: the bytes change while the push waits for its grant (the
    destination is stopped), and the tensor's counter does not move (a write through ``.data``; an
    in-place op that has not returned yet looks the same to the counter). The push fails, the
    destination keeps its version, and the next push lands whole."""
    trainer, rollout, pid = racing
    ray.get(trainer.set_version.remote(100), timeout=30)
    ray.get(trainer.push.remote(100), timeout=60)
    assert _same_bytes(ray.get(rollout.take.remote(100), timeout=60), big_values(100))
    ray.get(trainer.set_version.remote(101), timeout=30)
    os.kill(pid, signal.SIGSTOP)
    try:
        ray.get(trainer.push_async.remote(101, 10.0), timeout=30)
        time.sleep(0.2)
        ray.get(trainer.change_unseen.remote(), timeout=30)
    finally:
        os.kill(pid, signal.SIGCONT)
    with pytest.raises(ray.exceptions.RayTaskError) as info:
        ray.get(trainer.wait.remote(), timeout=60)
    err = _cause(info)
    assert isinstance(err, ws.WeightSyncError) and "changed while the push read them" in str(err), err
    assert ray.get(rollout.version.remote(), timeout=30) == 100
    now = ray.get(trainer.tensor.remote(), timeout=30)
    ray.get(trainer.push.remote(102), timeout=60)
    assert _same_bytes(ray.get(rollout.take.remote(102), timeout=60), now)


class DroppedSource:
    """Creates a Source under rank 0 of a one-source group, pushes, and drops it without close()."""

    def __init__(self, group: str) -> None:
        self.group = group
        self.ref: Any = None

    def resources(self) -> tuple[int, int]:
        """This process's weightsync threads (the push and watcher threads) and open file descriptors
        (every engine holds some: its sockets and event descriptors). Ray's own thread pools grow and
        shrink on their own, so the process's native thread count is no measure."""
        return (sum(t.name.startswith("weightsync") for t in threading.enumerate()),
                len(os.listdir("/proc/self/fd")))

    def push_and_drop(self, version: int, how: str) -> None:
        """``how``: "push" (blocking), "async" (push_async, waited for) or "mid" (push_async, dropped
        with the push in flight, its handle too)."""
        import weakref

        src = ws.Source(self.group, rank=0, tensors={k: values(k, version) for k in SHAPES}, timeout=60)
        self.ref = weakref.ref(src)
        if how == "push":
            ws.push(src, version, timeout=30.0)
        else:
            h = ws.push_async(src, version, timeout=30.0)
            if how == "async":
                h.wait()
            del h
        del src

    def collected(self) -> bool:
        import gc

        gc.collect()
        return self.ref() is None


def test_a_source_dropped_after_a_non_blocking_push_is_collected(ray_cluster) -> None:
    """Issue 41, item 5: a Source dropped without close() after ``push_async`` (waited for, or still in
    flight) is collected like one dropped after ``push``, and leaves no thread or descriptor behind."""
    name = "push-async-drop"
    group = ws.Group.create(name, num_sources=1, num_destinations=1)
    rollout = ray.remote(num_cpus=0)(AsyncRollout).remote(name, 0, "staged")
    probe = ray.remote(num_cpus=0)(DroppedSource).remote(name)
    try:
        # The rollout's join waits for a source: the first one comes with the first cycle.
        version = 1
        first = probe.push_and_drop.remote(version, "push")
        ray.get([rollout.__ray_ready__.remote(), first], timeout=120)
        pid = ray.get(rollout.pid.remote(), timeout=30)

        def collected() -> bool:
            deadline = time.monotonic() + 30
            while not ray.get(probe.collected.remote(), timeout=30):
                if time.monotonic() > deadline:
                    return False
                time.sleep(0.2)
            return True

        assert collected()  # the first cycle also warmed up what stays (Ray's and torch's threads)
        base = ray.get(probe.resources.remote(), timeout=30)
        grown = {}
        for how in ("push", "async", "mid", "async", "mid"):
            version += 1
            if how == "mid":
                os.kill(pid, signal.SIGSTOP)  # the push cannot complete until the rollout continues
                try:
                    ray.get(probe.push_and_drop.remote(version, how), timeout=120)
                    time.sleep(0.3)
                finally:
                    os.kill(pid, signal.SIGCONT)
            else:
                ray.get(probe.push_and_drop.remote(version, how), timeout=120)
            assert collected(), f"the source dropped after {how!r} (version {version}) was not collected"
            ray.get(rollout.wait.remote(version), timeout=60)
            # The push thread ends once it runs again after the collection: a moment later.
            deadline = time.monotonic() + 10
            while True:
                threads, fds = ray.get(probe.resources.remote(), timeout=30)
                if (threads <= base[0] and fds <= base[1]) or time.monotonic() > deadline:
                    break
                time.sleep(0.1)
            grown[f"{how} {version}"] = (threads - base[0], fds - base[1])
        assert all(t <= 0 and f <= 0 for t, f in grown.values()), grown
    finally:
        ray.kill(probe)
        ray.kill(rollout)
        group.shutdown()
