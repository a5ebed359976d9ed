"""Joining a group from a process that Ray did not start (as vLLM's multiprocessing workers are): it
connects to the group's cluster by explicit address and namespace, never starts a Ray of its own, and
an address nobody answers on fails fast. Needs Ray only (runs in both environments)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap

import pytest
import ray

import weightsync as ws
from tests import ROOT

PLAIN = textwrap.dedent("""
    import json, sys, time
    import ray
    from weightsync.control.rendezvous import connect
    from weightsync.errors import WeightSyncError
    t0 = time.monotonic()
    try:
        connect(*sys.argv[1:3] if sys.argv[1] else (None, None), timeout=10)
        error = None
    except WeightSyncError as exc:
        error = str(exc)
    print(json.dumps({"error": error, "ray": ray.is_initialized(), "s": time.monotonic() - t0}))
""")


def _run_plain(*args: str, env: dict[str, str] | None = None) -> dict:
    import json

    env = {**os.environ, "PYTHONPATH": ROOT, **(env or {})}
    for key in ("WEIGHTSYNC_RAY_ADDRESS", "WEIGHTSYNC_RAY_NAMESPACE", "RAY_ADDRESS"):
        env.pop(key, None)
    out = subprocess.run([sys.executable, "-c", PLAIN, *(args or ("", ""))], capture_output=True, text=True,
                         timeout=120, env=env, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_without_an_address_a_plain_process_starts_no_ray() -> None:
    got = _run_plain()
    assert got["ray"] is False
    assert "no Ray address" in got["error"] and "WEIGHTSYNC_RAY_ADDRESS" in got["error"]


def test_an_address_nobody_answers_on_fails_fast() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again below: nothing listens there
    got = _run_plain(f"127.0.0.1:{port}", "ns")
    assert got["ray"] is False
    assert f"127.0.0.1:{port}" in got["error"] and "does not start" in got["error"]
    assert got["s"] < 10


JOIN = textwrap.dedent("""
    import sys, torch
    import weightsync as ws
    from weightsync.control.rendezvous import connect
    connect(sys.argv[1], sys.argv[2], timeout=30)
    w = torch.zeros(64, 32)
    dst = ws.Destination(sys.argv[3], rank=0, tensors={"w": w}, mode="inplace", timeout=60)
    dst.wait(0, timeout=60)
    want = torch.arange(64 * 32, dtype=torch.float32).reshape(64, 32)
    print("EQUAL" if torch.equal(w, want) else "DIFFERENT")
    dst.close()
""")


class Pusher:
    def __init__(self, group: str) -> None:
        import torch

        self.w = torch.arange(64 * 32, dtype=torch.float32).reshape(64, 32)
        self.src = ws.Source(group, rank=0, tensors={"w": self.w}, timeout=60)

    def push(self, version: int) -> list:
        return list(ws.push(self.src, version, timeout=60).failed_destinations)


def test_a_plain_process_joins_by_address_and_namespace_and_receives(ray_cluster) -> None:
    name = "rendezvous-plain"
    group = ws.Group.create(name, num_sources=1, num_destinations=1)
    address = ray.get_runtime_context().gcs_address
    namespace = ray.get_runtime_context().namespace
    env = {**os.environ, "PYTHONPATH": ROOT, "WEIGHTSYNC_SECRET": group.secret}
    proc = subprocess.Popen([sys.executable, "-c", JOIN, address, namespace, name], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT)
    pusher = None
    try:
        pusher = ray.remote(num_cpus=0)(Pusher).remote(name)
        ray.get(pusher.__ray_ready__.remote(), timeout=120)
        assert ray.get(pusher.push.remote(0), timeout=120) == []
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err[-3000:]
        assert out.strip().splitlines()[-1] == "EQUAL"
    finally:
        if proc.poll() is None:
            proc.kill()
        if pusher is not None:
            ray.kill(pusher)
        group.shutdown()


def test_a_namespace_other_than_the_connected_one_is_refused(ray_cluster) -> None:
    from weightsync.control.rendezvous import connect

    here = ray.get_runtime_context().namespace
    assert connect(None, here) == here
    with pytest.raises(ws.WeightSyncError, match="namespace"):
        connect(None, here + "-other")
