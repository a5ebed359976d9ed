"""Group-level faults of issue 15: each test asserts what a user who trusts these weights expects.
What holds each: the grant protocol (announce -> grant -> data -> ack) for cases 1, 6, 9; version-scoped
relay immediates and relay grants for case 8; the superseded-version check for case 2; weightsync errors
for case 11.

CPU only: Ray actors (tests/faults/_group_procs.py) push and receive over the engine's default transport.
Each version's tensors are random (never zero) and every row names its version, so a mixed version is
seen row by row and every check is bitwise. Races are made deterministic by construction: a process is
stopped (SIGSTOP) or killed at a chosen point, or a destination's Python thread is kept off the GIL.
"""

from __future__ import annotations

import os
import secrets
import signal
import time
from pathlib import Path
from typing import Any

import pytest
import ray
import torch

import weightsync as ws
from tests.faults._group_procs import Rollout, Trainer, differs, row_versions, version_tensors
from tests.support.peer import pid_alive

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def ray_cluster():
    path = os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH", "")) if p)
    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": path, "WEIGHTSYNC_SECRET": secrets.token_hex(16)}})
    yield
    ray.shutdown()


_trainer = ray.remote(num_cpus=0, max_restarts=0)(Trainer)
_rollout = ray.remote(num_cpus=0, max_restarts=0)(Rollout)


class _Run:
    """A group with its actors; ``close()`` resumes stopped processes and kills every actor."""

    def __init__(self, name: str, sources: int, dests: list[tuple[str, float]], **group_kw: Any) -> None:
        self.name = name
        self.group = ws.Group.create(name, num_sources=sources, num_destinations=len(dests), **group_kw)
        self.rollouts = [_rollout.remote(name, j, mode, pt) for j, (mode, pt) in enumerate(dests)]
        self.trainers = [_trainer.remote(name, i, sources) for i in range(sources)]
        self.stopped: list[int] = []
        ray.get([a.__ray_ready__.remote() for a in self.trainers + self.rollouts], timeout=120)

    def push(self, version: int, timeout: float, salt: int = 0, only: list[int] | None = None) -> list[dict]:
        ts = self.trainers if only is None else [self.trainers[i] for i in only]
        return ray.get([t.push.remote(version, timeout, salt) for t in ts], timeout=timeout + 60)

    def check(self, j: int, version: int) -> None:
        live, got = ray.get(self.rollouts[j].snapshot.remote(), timeout=30)
        assert live == version, f"destination {j}: live version {live}, expected {version}"
        assert not differs(got, version), f"destination {j} at version {version}: {differs(got, version)}"

    def stop(self, pid: int) -> None:
        os.kill(pid, signal.SIGSTOP)
        self.stopped.append(pid)

    def resume(self, pid: int) -> None:
        os.kill(pid, signal.SIGCONT)
        self.stopped.remove(pid)

    def close(self) -> None:
        for pid in list(self.stopped):
            self.resume(pid)
        for a in self.trainers + self.rollouts:
            ray.kill(a)
        self.group.shutdown()


def _ok(results: list[dict]) -> bool:
    return all(r["ok"] and not r["failed"] for r in results)


def _kill_and_wait(actor: Any) -> None:
    """Kills an actor and waits until its process is gone (not only marked dead)."""
    pid = ray.get(actor.pid.remote(), timeout=30)
    ray.kill(actor)
    deadline = time.monotonic() + 30
    while pid_alive(pid):
        assert time.monotonic() < deadline, f"process {pid} still runs"
        time.sleep(0.05)


# ------------------------------------------------------------------------------------------------
# case 1


@pytest.mark.timeout(120)
def test_replacement_source_writes_the_shadow_the_destination_receives_into(ray_cluster) -> None:
    """Two sources, one staged destination. After an odd number of pushes the sources write shadow 1
    next; source 1 is killed and replaced (a new process, which knows no shadow). The next push must give
    the destination one whole version: whatever ``apply()`` makes live is bitwise that version, and the
    group goes on with whole versions."""
    run = _Run("fault-shadow", 2, [("staged", 10.0)])
    try:
        for version in (1, 2, 3):  # shadows 0, 1, 0: both sources now write shadow 1 next
            assert _ok(run.push(version, 10.0))
            run.check(0, version)
        _kill_and_wait(run.trainers[1])
        run.trainers[1] = _trainer.remote(run.name, 1, 2)  # joins: a new plan epoch
        ray.get(run.trainers[1].__ray_ready__.remote(), timeout=120)

        results = run.push(4, 10.0)
        live, got = ray.get(run.rollouts[0].snapshot.remote(), timeout=30)
        # Never torn: the live tensors are bitwise the version apply() says they are.
        assert not differs(got, live), f"apply() made version {live} live holding {differs(got, live)}"
        if _ok(results):
            assert live == 4, f"every source reported version 4 confirmed, the destination shows {live}"
        # And the group is whole again on the next push.
        assert _ok(run.push(5, 10.0))
        run.check(0, 5)
    finally:
        run.close()


# ------------------------------------------------------------------------------------------------
# case 2


@pytest.mark.timeout(120)
def test_destination_abandons_a_dead_version_when_a_new_plan_arrives(ray_cluster) -> None:
    """Two sources, one inplace destination with a long ``push_timeout`` (60 s). Source 1 dies; source 0
    pushes version 2 alone, which cannot complete (and times out on source 0, as it should). A replacement
    source 1 joins (new plan epoch) and both push version 3 with a 6 s timeout: the destination must drop
    the dead version 2 as soon as version 3 of the new epoch is announced, and confirm version 3 within
    the push's timeout."""
    run = _Run("fault-dead-version", 2, [("inplace", 60.0)])
    try:
        assert _ok(run.push(1, 10.0))
        run.check(0, 1)
        _kill_and_wait(run.trainers[1])
        (dead,) = run.push(2, 3.0, only=[0])
        assert not dead["ok"] and dead["type"] == "TimeoutError", dead
        run.trainers[1] = _trainer.remote(run.name, 1, 2)
        ray.get(run.trainers[1].__ray_ready__.remote(), timeout=120)

        results = run.push(3, 6.0)
        assert _ok(results), f"version 3 of the new plan not confirmed within 6 s: {results}"
        run.check(0, 3)
    finally:
        run.close()


# ------------------------------------------------------------------------------------------------
# case 6


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("version", "salt"), [(3, 0), (5, 1)], ids=["backwards", "repeated"])
def test_version_not_newer_is_refused_before_any_byte_moves(ray_cluster, version: int, salt: int) -> None:
    """One source, one inplace destination at version 5. Pushing version 3 (or version 5 again, with other
    data) must be refused at once with a weightsync error that names both versions, and the destination
    must keep version 5's bytes."""
    run = _Run(f"fault-version-{version}", 1, [("inplace", 10.0)])
    try:
        assert _ok(run.push(5, 10.0))
        run.check(0, 5)
        (result,) = run.push(version, 8.0, salt=salt)
        time.sleep(0.5)  # bytes that were written have landed by now
        run.check(0, 5)  # the weights are version 5's, bit for bit
        assert not result["ok"] and result["weightsync_error"], result
        assert "5" in result["error"] and str(version) in result["error"], result
        assert result["seconds"] < 4.0, f"refused only after {result['seconds']:.1f} s: {result}"
        # The group goes on with a newer version.
        assert _ok(run.push(6, 10.0))
        run.check(0, 6)
    finally:
        run.close()


# ------------------------------------------------------------------------------------------------
# case 8


@pytest.mark.timeout(120)
def test_late_relay_pieces_never_complete_a_later_version(ray_cluster) -> None:
    """One source, a relay chain of two staged destinations: head H (push_timeout 20 s), tail T
    (push_timeout 1.5 s). H is stopped (SIGSTOP) during version 2: the source's writes wait in H's socket,
    nobody confirms (the push raises, nobody is reported: no re-plan), and T abandons version 2. H is
    resumed, completes version 2 and forwards it to T: late pieces. H is stopped again and version 3
    pushed: with H stopped nothing of version 3 can reach T, so T must not report version 3, and what
    ``apply()`` makes live on T must be bitwise the version it names."""
    run = _Run("fault-relay-late", 1, [("staged", 20.0), ("staged", 1.5)], relay=True)
    try:
        assert _ok(run.push(1, 10.0))
        assert run.group.status()["chain"] == [0, 1]
        run.check(0, 1)
        run.check(1, 1)
        head = ray.get(run.rollouts[0].pid.remote(), timeout=30)

        run.stop(head)
        (v2,) = run.push(2, 3.0)
        assert not v2["ok"], v2  # nobody can confirm (today: TimeoutError, nobody reported, no re-plan)
        time.sleep(1.5)  # T abandoned version 2 (1.5 s after its announce, 4.5 s ago)
        run.resume(head)
        ray.get(run.rollouts[0].wait.remote(2, 10.0), timeout=30)  # H completes version 2 and forwards it
        time.sleep(0.5)  # H's forwards of version 2 land on T
        if ray.get(run.rollouts[1].version.remote(), timeout=30) == 2:
            pytest.fail("setup: T completed version 2 instead of abandoning it (its thread was late)")
        epoch = run.group.status()["epoch"]

        run.stop(head)
        pending = run.trainers[0].push.remote(3, 3.0)
        reached = ray.get(run.rollouts[1].wait.remote(3, 3.0), timeout=30)
        live, got = ray.get(run.rollouts[1].snapshot.remote(), timeout=30)
        assert reached != 3, (f"the tail reports version 3 while the head, its only way in, is stopped "
                              f"(plan epoch {epoch}); apply() gave version {live}: {differs(got, live)}")
        assert not differs(got, live), f"apply() made version {live} live holding {differs(got, live)}"
        run.resume(head)
        ray.get(pending, timeout=60)
    finally:
        run.close()


# ------------------------------------------------------------------------------------------------
# case 9


@pytest.mark.timeout(90)
def test_updating_is_raised_before_any_byte_of_the_next_version_lands(ray_cluster, tmp_path: Path) -> None:
    """One source, one inplace destination at version 1. The destination's Python threads are kept off
    the GIL for up to 8 s (its engine keeps running) while version 2 is pushed: the window a slow or
    descheduled receiving thread opens, made wide on purpose. Whenever bytes of version 2 are visible in
    the live tensors, a reader must see ``updating`` (or version 2 complete); ``updating == False`` with
    ``version == 1`` promises the tensors are version 1's."""
    run = _Run("fault-updating", 1, [("inplace", 10.0)])
    try:
        assert _ok(run.push(1, 10.0))
        run.check(0, 1)
        marker = tmp_path / "holding"
        probe = run.rollouts[0].probe_landing.remote(1, 8.0, str(marker))
        deadline = time.monotonic() + 30
        while not marker.exists():  # from now on the destination's Python threads are off the GIL
            assert time.monotonic() < deadline, "the probe did not start"
            time.sleep(0.01)
        pending = run.trainers[0].push.remote(2, 20.0)
        seen = ray.get(probe, timeout=60)
        assert seen["changed"] or not differs(seen["tensors"], 1), seen  # nothing else wrote them
        if seen["changed"]:
            mixed = {k: sorted(set(row_versions(t))) for k, t in seen["tensors"].items()}
            consistent = seen["version"] == 2 and not differs(seen["tensors"], 2)
            assert seen["updating"] or consistent, (
                f"bytes of version 2 landed while updating=False and version={seen['version']}: "
                f"rows claim versions {mixed}")
        assert _ok([ray.get(pending, timeout=60)])
        run.check(0, 2)
    finally:
        run.close()


# ------------------------------------------------------------------------------------------------
# a destination dropped while it was stopped is re-admitted when it resumes


def _members(run: _Run, want: list[int], timeout: float) -> list[int]:
    """The coordinator's destination ranks once they are ``want`` (or whatever they are at the timeout)."""
    deadline = time.monotonic() + timeout
    while True:
        got = run.group.status()["destinations"]
        if got == want or time.monotonic() > deadline:
            return got
        time.sleep(0.05)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode", ["inplace", "staged"])
def test_destination_stopped_past_the_push_timeout_is_readmitted(ray_cluster, mode: str) -> None:
    """Two sources, two destinations. Destination 0 is stopped (SIGSTOP) for longer than the push
    timeout: the push succeeds on destination 1, reports destination 0 failed and the coordinator drops
    it. While it is behind it must keep its old version, whole (never a version it did not fully
    receive). Once it resumes (SIGCONT) it must notice that it was dropped, join again under its rank,
    and hold the next version bit for bit: the first push after its rejoin reaches both destinations."""
    run = _Run(f"fault-readmit-{mode}", 2, [(mode, 3.0), ("staged", 3.0)], relay=False)
    try:
        assert _ok(run.push(1, 10.0))
        run.check(0, 1)
        run.check(1, 1)
        stopped = ray.get(run.rollouts[0].pid.remote(), timeout=30)

        run.stop(stopped)
        results = run.push(2, 2.5)
        assert all(r["ok"] and r["failed"] == [0] for r in results), results
        assert _members(run, [1], 10.0) == [1], "the stopped destination was not dropped from the plan"
        assert _ok(run.push(3, 2.5))  # the group goes on without it
        run.check(1, 3)
        time.sleep(1.0)  # past its own push_timeout too: whatever it was landing is abandoned on resume
        run.resume(stopped)

        # It notices that it was dropped and joins again (a new plan epoch with both destinations).
        assert _members(run, [0, 1], 15.0) == [0, 1], (
            f"destination 0 was not re-admitted after it resumed: {run.group.status()}")
        # While behind, it still holds version 1 bit for bit (never 2 or 3, which it did not receive).
        run.check(0, 1)
        # The next push or two bring it up to date: the first push after its rejoin may still find the
        # sources' engine paths to it failed from the stall (then it is dropped and joins again once more).
        history = []
        for version in (4, 5):
            _members(run, [0, 1], 15.0)
            results = run.push(version, 10.0)
            history.append((version, results))
            assert all(r["ok"] and set(r["failed"]) <= {0} for r in results), history
            run.check(1, version)
            if _ok(results):
                break
        assert _ok(results), f"destination 0 not written within two pushes after it resumed: {history}"
        run.check(0, version)
        assert _ok(run.push(6, 10.0))  # and it stays in
        run.check(0, 6)
        run.check(1, 6)
    finally:
        run.close()


@pytest.mark.timeout(120)
def test_destinations_stopped_while_nobody_acks_are_kept(ray_cluster) -> None:
    """Every destination is stopped (SIGSTOP) through a push: nobody acks, so the sources probe the silent
    destinations with one more write each. A stopped destination's probe is not delivered, but it does not
    fail either: no destination is reported (a stopped destination is not a dead one), the push raises
    weightsync's TimeoutError, the plan keeps both, and once they resume a push reaches them again."""
    run = _Run("fault-all-stopped", 2, [("staged", 3.0), ("staged", 3.0)], relay=False)
    try:
        assert _ok(run.push(1, 10.0))
        pids = ray.get([r.pid.remote() for r in run.rollouts], timeout=30)
        for pid in pids:
            run.stop(pid)
        results = run.push(2, 2.5)
        assert all(not r["ok"] and r["type"] == "TimeoutError" and "probe" not in r["error"]
                   for r in results), results
        time.sleep(1.0)  # a report, had there been one, has re-planned by now
        assert run.group.status()["destinations"] == [0, 1]
        for pid in pids:
            run.resume(pid)
        time.sleep(1.0)  # past their own push_timeout: what they were landing is abandoned
        results = run.push(3, 10.0)
        assert _ok(results), results
        run.check(0, 3)
        run.check(1, 3)
    finally:
        run.close()


@pytest.mark.timeout(120)
def test_a_dropped_destination_whose_rank_was_taken_over_stops(ray_cluster) -> None:
    """Destination 0 is stopped past the push timeout and dropped; a replacement joins under rank 0
    before it resumes. The old process must not take the rank back: it stops receiving and its ``wait``
    raises a weightsync error naming the rank, while the replacement gets the next versions."""
    run = _Run("fault-superseded", 2, [("inplace", 3.0), ("staged", 3.0)], relay=False)
    old = run.rollouts[0]
    try:
        assert _ok(run.push(1, 10.0))
        stopped = ray.get(old.pid.remote(), timeout=30)
        run.stop(stopped)
        results = run.push(2, 2.5)
        assert all(r["ok"] and r["failed"] == [0] for r in results), results
        assert _members(run, [1], 10.0) == [1]
        run.rollouts[0] = _rollout.remote(run.name, 0, "inplace", 3.0)
        ray.get(run.rollouts[0].__ray_ready__.remote(), timeout=120)
        assert _members(run, [0, 1], 10.0) == [0, 1]
        epoch = run.group.status()["epoch"]
        run.resume(stopped)

        with pytest.raises(ws.WeightSyncError, match="destination rank 0 was taken over"):
            ray.get(old.wait.remote(3, 15.0), timeout=60)
        assert run.group.status()["epoch"] == epoch  # it did not join again (no re-plan)
        assert _ok(run.push(3, 10.0))
        run.check(0, 3)
        run.check(1, 3)
    finally:
        ray.kill(old)
        run.close()


# ------------------------------------------------------------------------------------------------
# case 11 (the group part)


def _destination_for_missing_group() -> None:
    ws.Destination("fault-no-such-group", rank=0, tensors={"w": torch.ones(4)}, mode="inplace")


def _source_for_missing_group() -> None:
    ws.Source("fault-no-such-group", rank=0, tensors={"w": torch.ones(4)})


@pytest.mark.timeout(60)
@pytest.mark.parametrize("join", [_source_for_missing_group, _destination_for_missing_group],
                         ids=["source", "destination"])
def test_unknown_group_is_a_weightsync_error_naming_it(ray_cluster, join: Any) -> None:
    """A source or destination of a group nobody created (a typo, or the group was shut down) must get a
    ``ws.WeightSyncError`` that names the group, not an error of Ray's internals."""
    with pytest.raises(ws.WeightSyncError, match="fault-no-such-group"):
        join()


def test_version_tensors_detect_a_mix() -> None:
    """The check the tests above rely on: a tensor with rows of two versions is seen, row by row."""
    a, b = version_tensors(3), version_tensors(4)
    mixed = {k: torch.cat([a[k][: len(a[k]) // 2], b[k][len(b[k]) // 2:]]) for k in a}
    assert differs(a, 3) == []
    assert len(differs(mixed, 3)) == len(a) and len(differs(mixed, 4)) == len(a)
    assert sorted(set(row_versions(mixed["w"]))) == [3.0, 4.0]
    assert not torch.equal(version_tensors(5)["w"], version_tensors(5, salt=1)["w"])
    assert all((t != 0).all() for t in a.values())
