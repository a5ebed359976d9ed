"""Ray actors for the group-level fault tests (tests/faults/test_group_faults.py): a trainer rank that
pushes, a rollout rank that receives, on CPU over the engine's default transport.

Only the public API is used. Every version's tensors come from a seed of that version (random values in
[1, 2), never zero) with column 0 of every row set to ``version + 0.5``: a tensor that mixes versions is
seen row by row (:func:`row_versions`), and a check against :func:`version_tensors` is bitwise.
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any

import torch

import weightsync as ws

# Rows split evenly between up to 2 sources (each source's rows are its own writes), small enough that a
# read of a whole tensor holds the GIL (numpy and bytes copies of a few KiB do not release it).
SHAPES = {"w": (8, 16), "b": (4, 16)}


def version_tensors(version: int, salt: int = 0) -> dict[str, torch.Tensor]:
    """What every destination must hold at ``version`` (``salt``: other data under the same version)."""
    g = torch.Generator().manual_seed(100_000 + 1000 * salt + version)
    out = {}
    for name, shape in SHAPES.items():
        t = torch.rand(shape, generator=g) + 1.0
        t[:, 0] = version + 0.5
        out[name] = t
    return out


def row_versions(t: torch.Tensor) -> list[float]:
    """The version each row of a tensor claims (column 0 minus 0.5; NaN rows: never written)."""
    return [float(x) - 0.5 for x in t[:, 0].tolist()]


def differs(got: dict[str, torch.Tensor], version: int, salt: int = 0) -> list[str]:
    """Names of tensors not bitwise equal to ``version``'s, with the versions their rows claim."""
    want = version_tensors(version, salt)
    return [f"{k} is not bitwise version {version}'s (salt {salt}): its rows claim versions "
            f"{sorted(set(row_versions(got[k])))}" for k in want if not torch.equal(got[k], want[k])]


def _rows(rank: int, world: int, name: str) -> slice:
    n = SHAPES[name][0] // world
    return slice(rank * n, (rank + 1) * n)


class Trainer:
    """Source ``rank`` of ``world``: holds rows ``rank`` of every tensor (``ws.Sharded``)."""

    def __init__(self, group: str, rank: int, world: int) -> None:
        self.rank, self.world = rank, world
        full = version_tensors(0)
        self.locals = {k: t[_rows(rank, world, k)].clone() for k, t in full.items()}
        tensors = {k: ws.Sharded(self.locals[k], SHAPES[k], (_rows(rank, world, k).start, 0)) for k in SHAPES}
        self.src = ws.Source(group, rank=rank, tensors=tensors, timeout=60.0)

    def pid(self) -> int:
        return os.getpid()

    def push(self, version: int, timeout: float, salt: int = 0) -> dict[str, Any]:
        """Writes ``version``'s rows into the local tensors (an optimizer step), then pushes. Never raises:
        the outcome (stats or the exception's type and text) comes back as a dict."""
        full = version_tensors(version, salt)
        for k, local in self.locals.items():
            local.copy_(full[k][_rows(self.rank, self.world, k)])
        start = time.monotonic()
        try:
            stats = ws.push(self.src, version=version, timeout=timeout)
        except Exception as exc:  # the test judges the exception
            return {"ok": False, "seconds": time.monotonic() - start, "type": type(exc).__name__,
                    "weightsync_error": isinstance(exc, ws.WeightSyncError), "error": str(exc)}
        return {"ok": True, "seconds": time.monotonic() - start, "failed": list(stats.failed_destinations),
                "destinations": list(stats.destinations), "epoch": stats.epoch}


class Rollout:
    """Destination ``rank``: tensors start as NaN (never a version's value)."""

    def __init__(self, group: str, rank: int, mode: str, push_timeout: float) -> None:
        self.mode = mode
        self.tensors = {k: torch.full(s, float("nan")) for k, s in SHAPES.items()}
        self.dst = ws.Destination(group, rank=rank, tensors=dict(self.tensors), mode=mode, timeout=60.0,
                                  push_timeout=push_timeout)

    def pid(self) -> int:
        return os.getpid()

    def version(self) -> int:
        return self.dst.version

    def wait(self, version: int, timeout: float) -> int:
        """The version reached, or -2 if ``version`` was not reached within ``timeout``."""
        try:
            return self.dst.wait(version, timeout)
        except ws.TimeoutError:
            return -2

    def snapshot(self) -> tuple[int, dict[str, torch.Tensor]]:
        """Staged: apply() the newest complete version; inplace: the live tensors. (version, copies)."""
        version = self.dst.apply() if self.mode == "staged" else self.dst.version
        return version, {k: v.clone() for k, v in self.tensors.items()}

    def probe_landing(self, old_version: int, hold_s: float, marker: str) -> dict[str, Any]:
        """Keeps this process's GIL for up to ``hold_s`` seconds and watches the live tensors (inplace).

        The receiving thread of the destination is Python: while this method holds the GIL it cannot run,
        but the engine's own threads (C++) keep placing bytes and counting immediates. This is the window
        a slow or descheduled receiving thread opens, made as wide as we like: if a byte of a newer version
        shows in the live tensors while ``updating`` is False and ``version`` is still ``old_version``, a
        reader at a safe point reads a mixed model. ``marker`` (a file path) is created once the GIL is
        held for good: the test pushes only after it exists. Returns what was seen at the first change."""
        views = {k: t.numpy() for k, t in self.tensors.items()}  # share memory with the live tensors
        before = {k: v.tobytes() for k, v in views.items()}
        old_interval = sys.getswitchinterval()
        sys.setswitchinterval(hold_s + 30.0)  # another thread waiting for the GIL asks for it only after this
        try:
            # Let every thread go through the GIL once under the new interval (their waits use the
            # interval they started with), then hold it: from here on no Python thread of this process runs.
            time.sleep(0.5)
            with open(marker, "w") as f:  # the last call that may let another thread run
                f.write("holding")
            deadline = time.monotonic() + hold_s
            changed = False
            while time.monotonic() < deadline:
                if any(views[k].tobytes() != before[k] for k in views):
                    changed = True
                    break
            # Read the state the reader would read at this moment (uncontended locks keep the GIL).
            updating, version = self.dst.updating, self.dst.version
            got = {k: torch.from_numpy(v.copy()) for k, v in views.items()}
        finally:
            sys.setswitchinterval(old_interval)
        return {"changed": changed, "updating": updating, "version": version, "tensors": got,
                "old_version": old_version}
