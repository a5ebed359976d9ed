"""Another Ray job of the same cluster goes after a group: it reads what Ray lets any client read, calls
every coordinator method with guessed secrets from its own namespace and from the group's, and tries to
join and push through the public API. Nothing it does is applied, the group keeps working for its
members, and the refusals are counted and logged (issue 16, control plane).

The cluster is a real one of its own (``ray start --head`` on a free port, its own temp dir), so that
the attacker is a second driver of a second job, as on a shared cluster; the test stops only the
processes that cluster started. Ray's token authentication is off in it: it keeps out whoever lacks the
cluster's token, and the attacker here is a job that has it, like every job of a shared cluster.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import ray
import torch

import weightsync as ws
from tests import ROOT

GROUP = "guarded"
VICTIM_NS = "victim"
N = 1024


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _pids_of(marker: str) -> set[int]:
    """Processes whose command line names ``marker`` (our cluster's temp dir), and their descendants."""
    parents: dict[int, int] = {}
    roots: set[int] = set()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes()
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:  # gone meanwhile
            continue
        parents[int(entry)] = int(stat.rsplit(")", 1)[1].split()[1])
        if marker.encode() in cmdline:
            roots.add(int(entry))
    found = set(roots)
    grew = True
    while grew:
        grew = False
        for pid, ppid in parents.items():
            if ppid in found and pid not in found:
                found.add(pid)
                grew = True
    return found


def _stop(marker: str) -> None:
    for sig, wait in ((signal.SIGTERM, 5.0), (signal.SIGKILL, 2.0)):
        pids = _pids_of(marker)
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + wait
        while _pids_of(marker) and time.monotonic() < deadline:
            time.sleep(0.2)


def _all_cmdlines() -> bytes:
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                out.append(Path(f"/proc/{entry}/cmdline").read_bytes())
            except OSError:  # gone meanwhile
                pass
    return b"\n".join(out)


@pytest.fixture(scope="module")
def cluster() -> Iterator[dict[str, Any]]:
    """A Ray cluster of its own; the victim's driver is this process."""
    tmp = tempfile.mkdtemp(prefix="wssec", dir="/tmp")  # short: Ray's socket paths must fit
    port = _free_port()
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "WEIGHTSYNC_SECRET")}
    env.update(RAY_AUTH_MODE="disabled",
               PYTHONPATH=os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p))
    ray_bin = str(Path(sys.executable).parent / "ray")
    saved = os.environ.get("WEIGHTSYNC_SECRET")
    try:
        started = subprocess.run([ray_bin, "start", "--head", f"--port={port}", "--num-cpus=4",
                                  "--include-dashboard=false", "--disable-usage-stats", f"--temp-dir={tmp}",
                                  f"--dashboard-port={_free_port()}",
                                  f"--dashboard-agent-listen-port={_free_port()}",
                                  f"--metrics-export-port={_free_port()}"],
                                 env=env, capture_output=True, text=True, timeout=120)
        if started.returncode != 0:
            raise RuntimeError(f"ray start failed: {started.stderr[-2000:]}")
        os.environ.pop("WEIGHTSYNC_SECRET", None)  # the victim's default: a fresh secret, handed on by hand
        ray.init(address=f"127.0.0.1:{port}", namespace=VICTIM_NS, log_to_driver=False)
        yield {"address": f"127.0.0.1:{port}", "env": env, "tmp": tmp}
    finally:
        ray.shutdown()
        _stop(tmp)
        if saved is not None:
            os.environ["WEIGHTSYNC_SECRET"] = saved


class Trainer:
    def __init__(self, group: str, secret: str) -> None:
        self.w = torch.zeros(N)
        self.src = ws.Source(group, 0, {"w": self.w}, timeout=60, secret=secret)

    def push(self, version: int) -> list[int]:
        self.w.fill_(float(version))
        return ws.push(self.src, version=version, timeout=30).failed_destinations


class Rollout:
    def __init__(self, group: str, secret: str) -> None:
        self.w = torch.zeros(N)
        self.dst = ws.Destination(group, 0, {"w": self.w}, mode="inplace", timeout=60, secret=secret)

    def state(self, version: int) -> tuple[int, list[float]]:
        if version >= 0:
            self.dst.wait(version, timeout=30)
        return self.dst.version, sorted(set(self.w.tolist()))


def _wait_logged(tmp: str, needle: str, timeout: float) -> list[str]:
    """Lines of the cluster's log files that contain ``needle`` (waits for the log to be flushed)."""
    deadline = time.monotonic() + timeout
    while True:
        lines = [line for p in Path(tmp).rglob("*") if p.is_file() and p.suffix in (".out", ".err", ".log")
                 for line in p.read_text(errors="replace").splitlines() if needle in line]
        if lines or time.monotonic() > deadline:
            return lines
        time.sleep(0.5)


def test_another_ray_job_can_neither_read_the_secret_nor_join_query_or_push(cluster: dict[str, Any],
                                                                              tmp_path: Path) -> None:
    group = ws.Group.create(GROUP, num_sources=1, num_destinations=1)
    secret = group.secret
    assert secret not in repr(group)
    # The members are handed the secret as an argument, not through Ray's KV or the job's runtime_env.
    trainer = ray.remote(num_cpus=0)(Trainer).remote(GROUP, secret)
    rollout = ray.remote(num_cpus=0)(Rollout).remote(GROUP, secret)
    try:
        ray.get([trainer.__ray_ready__.remote(), rollout.__ray_ready__.remote()], timeout=120)
        assert ray.get(trainer.push.remote(1), timeout=60) == []
        assert ray.get(rollout.state.remote(1), timeout=60) == (1, [1.0])
        before = group.status()

        dump = tmp_path / "read.txt"
        out = subprocess.run([sys.executable, "-m", "tests.security._attacker", cluster["address"], VICTIM_NS,
                              GROUP, str(dump)], env=cluster["env"], cwd=ROOT, capture_output=True,
                             text=True, timeout=180)
        assert out.returncode == 0, out.stderr[-3000:]
        got = json.loads(out.stdout.strip().splitlines()[-1])

        # It read the KV of several namespaces and the job and actor tables: no secret there.
        read = dump.read_text()
        assert "jobs:" in read and "actors:" in read
        assert secret not in read
        assert "weightsync/" not in read  # no key of ours at all (the old store of the secret)
        # Every coordinator call with every guess was refused for the secret, whatever the method.
        for method, answers in got["calls"].items():
            for answer in answers:
                assert answer.startswith("WeightSyncError") and "refused: wrong secret" in answer, \
                    (method, answer)
                assert secret not in answer
        # Through the public API: no secret known -> a clear error; a guess -> the join is refused.
        assert "does not know the group's secret" in got["source_without_secret"]
        assert "WEIGHTSYNC_SECRET" in got["source_without_secret"]
        assert "join refused: wrong secret" in got["source_with_guess"], got["source_with_guess"]
        assert "at least 16 characters" in got["source_short_secret"]

        # Nothing was applied: the destination still holds version 1, bit for bit.
        assert ray.get(rollout.state.remote(-1), timeout=30) == (1, [1.0])
        after = group.status()
        for key in ("epoch", "sources", "destinations", "dead", "watchers"):
            assert after[key] == before[key], key
        # The refusals were counted per method: 4 guesses each, one more join from the public API.
        rejected = after["rejected"]
        for method in got["calls"]:
            assert rejected.get(method, 0) >= len(got["calls"][method]), (method, rejected)
        assert rejected["join"] >= len(got["calls"]["join"]) + 1
        # ... and logged with the method and who the caller claimed to be, never with the secret.
        logged = _wait_logged(cluster["tmp"], "report_dead refused: wrong secret", 10.0)
        assert any("caller says 'destination 1'" in line for line in logged), logged

        # The group keeps working for its members.
        assert ray.get(trainer.push.remote(2), timeout=60) == []
        assert ray.get(rollout.state.remote(2), timeout=60) == (2, [2.0])
    finally:
        for a in (trainer, rollout):
            ray.kill(a)
        group.shutdown()

    # The secret is in no log file of the cluster and on no command line of this machine.
    assert not _wait_logged(cluster["tmp"], secret, 0.0)
    assert secret.encode() not in _all_cmdlines()


@pytest.mark.timeout(120)
def test_the_default_secret_is_this_process_own(cluster: dict[str, Any]) -> None:
    """With no secret handed in and none in the environment, Group.create makes a fresh one that only
    this process knows: an actor of the same job that was not handed it cannot join, and says how."""
    group = ws.Group.create("unshared", num_sources=1, num_destinations=1)
    try:
        assert len(group.secret) == 32
        rollout = ray.remote(num_cpus=0, max_restarts=0)(Rollout).remote("unshared", None)
        with pytest.raises(ray.exceptions.RayActorError) as err:
            ray.get(rollout.__ray_ready__.remote(), timeout=60)
        assert "does not know the group's secret" in str(err.value)
        assert group.status()["destinations"] == []
    finally:
        group.shutdown()


def test_code_another_job_runs_inside_the_coordinator_gets_no_credential(cluster: dict[str, Any],
                                                                         tmp_path: Path) -> None:
    """A second job runs its own code in the coordinator (``__ray_call__``), keeps what the members
    present for 12 s (every watcher calls at least every 10 s) and tries to join as source 0 with each
    thing it kept: it learns neither the secret nor the engine key, and no version of its lands."""
    from weightsync.control.engine_key import engine_key

    group = ws.Group.create("robbed", num_sources=1, num_destinations=1)
    secret = group.secret
    trainer = ray.remote(num_cpus=0)(Trainer).remote("robbed", secret)
    rollout = ray.remote(num_cpus=0)(Rollout).remote("robbed", secret)
    try:
        ray.get([trainer.__ray_ready__.remote(), rollout.__ray_ready__.remote()], timeout=120)
        assert ray.get(trainer.push.remote(1), timeout=60) == []
        assert ray.get(rollout.state.remote(1), timeout=60) == (1, [1.0])

        dump = tmp_path / "loot.json"
        out = subprocess.run([sys.executable, "-m", "tests.security._ray_call_thief", cluster["address"],
                              VICTIM_NS, "robbed", str(dump)], env=cluster["env"], cwd=ROOT,
                             capture_output=True, text=True, timeout=240)
        assert out.returncode == 0, out.stderr[-3000:]
        got = json.loads(out.stdout.strip().splitlines()[-1])
        # Its code did run inside the coordinator and saw the members' calls ...
        assert got["installed"].startswith("accepted"), got["installed"]
        loot = json.loads(dump.read_text())
        assert loot["presented"], "the members made no call while the thief listened"
        # ... but nothing it saw there is the secret or the engine key,
        seen = "\n".join(loot["presented"] + loot["attributes"])
        assert secret not in seen
        assert engine_key(secret, "robbed").hex() not in seen
        # and no join with anything it kept was admitted.
        assert got["joins"], got
        for answer in got["joins"]:
            assert not answer.startswith("accepted"), answer
        # With the coordinator's own key it was admitted as source 0 (taking the trainer's place: it can
        # stop pushes), but the destination's engine refused its engine: no write landed.
        assert got["key_joins"], got
        for answer in got["key_joins"]:
            assert answer.startswith("TimeoutError") and "engine key proof failed" in answer, answer
        # The rollout never took the thief's version; a trainer that joins again pushes as before.
        assert ray.get(rollout.state.remote(-1), timeout=30) == (1, [1.0])
        ray.kill(trainer)
        trainer = ray.remote(num_cpus=0)(Trainer).remote("robbed", secret)
        assert ray.get(trainer.push.remote(2), timeout=90) == []
        assert ray.get(rollout.state.remote(2), timeout=60) == (2, [2.0])
    finally:
        for a in (trainer, rollout):
            ray.kill(a)
        group.shutdown()
