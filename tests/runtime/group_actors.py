"""Ray actors for the control-plane tests: trainer ranks (sources) and rollout ranks (destinations).

The model: logical tensors q, k, v, gate, up, down and norm. Sources hold dim-0 shards (as
``ws.Sharded`` or as DTensor on a gloo mesh) and a replicated norm; destinations hold vLLM-style fused
``qkv_proj``/``gate_up_proj`` pieces per TP rank, a column shard of ``down``, or full replicas.
Every version's values come from a seed, so the test builds its reference independently.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from typing import Any

import torch

import weightsync as ws

# The destinations of tests/runtime/test_group*.py: (layout, TP rank).
DESTS = [("tp", 0), ("tp", 1), ("replica", 0)]


def free_port() -> int:
    """A TCP port free on this host (the trainers' gloo rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


SHAPES = {"q": (16, 8), "k": (8, 8), "v": (8, 8), "gate": (12, 8), "up": (12, 8), "down": (8, 12),
          "norm": (8,)}


def full_tensors(version: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + version)
    return {name: torch.randn(shape, generator=g) for name, shape in SHAPES.items()}


def destination_view(layout: str, tp_rank: int, full: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """What a destination of this layout must hold, built straight from the full tensors."""
    if layout == "replica":
        return {k: v.clone() for k, v in full.items()}
    r = tp_rank
    q, k, v = full["q"][r * 8:(r + 1) * 8], full["k"][r * 4:(r + 1) * 4], full["v"][r * 4:(r + 1) * 4]
    gate, up = full["gate"][r * 6:(r + 1) * 6], full["up"][r * 6:(r + 1) * 6]
    return {"qkv_proj": torch.cat([q, k, v]), "gate_up_proj": torch.cat([gate, up]),
            "down": full["down"][:, r * 6:(r + 1) * 6].contiguous(), "norm": full["norm"].clone()}


class Trainer:
    def __init__(self, group: str, rank: int, world: int, port: int, use_dtensor: bool) -> None:
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import Shard, distribute_tensor

        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
        mesh = init_device_mesh("cpu", (world,))
        self.rank, self.world = rank, world
        full = full_tensors(0)
        tensors: dict[str, Any] = {}
        self.locals: dict[str, torch.Tensor] = {}
        for name, t in full.items():
            if name == "norm":
                tensors[name] = self.locals[name] = t.clone()  # replicated on every trainer
            elif use_dtensor and name in ("q", "gate", "down"):
                dt = distribute_tensor(t, mesh, [Shard(0)])
                tensors[name] = dt
                self.locals[name] = dt.to_local()
            else:
                rows = t.shape[0] // world
                local = t[rank * rows:(rank + 1) * rows].clone()
                tensors[name] = ws.Sharded(local, t.shape, (rank * rows, 0))
                self.locals[name] = local
        self.src = ws.Source(group, rank=rank, tensors=tensors)

    def push(self, version: int, timeout: float = 30.0) -> dict[str, Any]:
        # Update in place (as an optimizer step would), then push.
        full = full_tensors(version)
        for name, local in self.locals.items():
            if name == "norm":
                local.copy_(full[name])
            else:
                rows = full[name].shape[0] // self.world
                local.copy_(full[name][self.rank * rows:(self.rank + 1) * rows])
        stats = ws.push(self.src, version=version, timeout=timeout)
        return stats.__dict__


class _Reader:
    """A staged rollout's generation loop in a thread: at each safe point apply the newest version, then
    check every tensor against what that version must hold (``_want``); reads of a mixed version are
    recorded."""

    def __init__(self) -> None:
        self.mixed: list[str] = []
        self.reads = 0
        self._stop = threading.Event()
        self._reader: threading.Thread | None = None

    def _want(self, version: int) -> dict[str, torch.Tensor]:
        raise NotImplementedError

    def start_reader(self) -> None:
        def loop() -> None:
            while not self._stop.is_set():
                version = self.dst.apply()  # type: ignore[attr-defined]
                if version < 0:
                    continue
                want = self._want(version)
                for k, t in self.tensors.items():  # type: ignore[attr-defined]
                    if not torch.equal(t, want[k]):
                        self.mixed.append(f"{k} differs from version {version}")
                self.reads += 1

        self._reader = threading.Thread(target=loop, daemon=True)
        self._reader.start()

    def stop_reader(self) -> dict[str, Any]:
        self._stop.set()
        if self._reader is not None:
            self._reader.join(10)
        return {"reads": self.reads, "mixed": self.mixed[:5]}


class Rollout(_Reader):
    def __init__(self, group: str, rank: int, layout: str, tp_rank: int, mode: str) -> None:
        self.layout, self.tp_rank = layout, tp_rank
        poison = {k: torch.full_like(v, float("nan")) for k, v in destination_view(layout, tp_rank,
                                                                                     full_tensors(0)).items()}
        self.tensors = poison
        if layout == "replica":
            named: dict[str, Any] = dict(poison)
        else:
            r = tp_rank
            named = {
                "qkv_proj": ws.Fused(poison["qkv_proj"], 0, [
                    ("q", (r * 8, 0), (8, 8)), ("k", (r * 4, 0), (4, 8)), ("v", (r * 4, 0), (4, 8))]),
                "gate_up_proj": ws.Fused(poison["gate_up_proj"], 0, [("gate", (r * 6, 0), (6, 8)),
                                                                    ("up", (r * 6, 0), (6, 8))]),
                "down": ws.Sharded(poison["down"], (8, 12), (0, r * 6)),
                "norm": poison["norm"],
            }
        self.dst = ws.Destination(group, rank=rank, tensors=named, mode=mode)
        _Reader.__init__(self)

    def wait(self, version: int, timeout: float = 30.0) -> int:
        return self.dst.wait(version, timeout)

    def snapshot(self, apply: bool = True, version: int = -1, timeout: float = 30.0
                 ) -> tuple[int, dict[str, torch.Tensor]]:
        """The live tensors. ``apply=False`` while the reader runs: it is the one generation loop that
        applies (a second caller of ``apply`` would change the tensors under the reader's reads), so wait
        for it to have made ``version`` live instead."""
        if apply:
            self.dst.apply()
        deadline = time.monotonic() + timeout
        while self.dst.live_version < version and time.monotonic() < deadline:
            time.sleep(0.005)
        return self.dst.live_version, {k: v.clone() for k, v in self.tensors.items()}

    def _want(self, version: int) -> dict[str, torch.Tensor]:
        return destination_view(self.layout, self.tp_rank, full_tensors(version))

    def version(self) -> int:
        return self.dst.version

    def stop_granting(self) -> int:
        """From now on announces still land here (the engine takes their bytes and their immediates) but
        are never answered: no grant goes out, so the sources write nothing more to this destination. What
        each announce said is kept for ``announced``. Returns this process's pid."""
        seen: set[tuple[int, int]] = set()
        self._announces_seen = seen
        mailbox = self.dst._mailbox

        def answer_nothing() -> None:
            # Called by the destination's thread once an announce's immediate is in (its bytes before it).
            seen.update((r, int(mailbox["version"][r])) for r in self.dst._sources)

        self.dst._answer = answer_nothing
        return os.getpid()

    def announced(self, version: int) -> bool:
        """Whether every source of this destination's plan has announced ``version`` here (its immediate
        counted), after ``stop_granting``."""
        seen = getattr(self, "_announces_seen", set())
        return all((r, version) in seen for r in self.dst._sources)


# -- full replicas (relay tests) ----------------------------------------------------------------------
# Sizes chosen so that relay chunks are cut (with a small relay_chunk_bytes), and "col" is held by
# column shards when there are two sources, which makes its writes into a replica 2-D (strided).
REPLICA_SHAPES = {"emb": (256, 512), "w": (64, 96), "col": (32, 64), "norm": (96,)}


def replica_tensors(version: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(5000 + version)
    return {name: torch.randn(shape, generator=g) for name, shape in REPLICA_SHAPES.items()}


def _replica_box(name: str, rank: int, world: int) -> tuple[tuple[slice, ...], tuple[int, ...]]:
    """The slice of ``name`` source ``rank`` holds, and its offsets: "col" by columns, the rest by rows."""
    shape = REPLICA_SHAPES[name]
    if len(shape) == 1:
        return (slice(None),), (0,)
    if name == "col":
        n = shape[1] // world
        return (slice(None), slice(rank * n, (rank + 1) * n)), (0, rank * n)
    n = shape[0] // world
    return (slice(rank * n, (rank + 1) * n), slice(None)), (rank * n, 0)


class ReplicaTrainer:
    def __init__(self, group: str, rank: int, world: int) -> None:
        self.rank, self.world = rank, world
        full = replica_tensors(0)
        self.locals: dict[str, torch.Tensor] = {}
        tensors: dict[str, Any] = {}
        for name, t in full.items():
            sl, offs = _replica_box(name, rank, world)
            local = self.locals[name] = t[sl].clone()
            tensors[name] = local if len(t.shape) == 1 else ws.Sharded(local, t.shape, offs)
        self.src = ws.Source(group, rank=rank, tensors=tensors, timeout=60)

    def push(self, version: int, timeout: float = 30.0) -> dict[str, Any]:
        full = replica_tensors(version)
        for name, local in self.locals.items():
            local.copy_(full[name][_replica_box(name, self.rank, self.world)[0]])
        return ws.push(self.src, version=version, timeout=timeout).__dict__


class ReplicaRollout(_Reader):
    def __init__(self, group: str, rank: int, mode: str) -> None:
        self.tensors = {k: torch.full_like(v, float("nan")) for k, v in replica_tensors(0).items()}
        self.dst = ws.Destination(group, rank=rank, tensors=dict(self.tensors), mode=mode, timeout=60,
                                  push_timeout=30)
        _Reader.__init__(self)

    def poison(self) -> None:
        """NaN into the live tensors (between pushes): every byte must be written again."""
        for t in self.tensors.values():
            t.fill_(float("nan"))

    def wait(self, version: int, timeout: float = 30.0) -> int:
        return self.dst.wait(version, timeout)

    def snapshot(self) -> tuple[int, dict[str, torch.Tensor]]:
        self.dst.apply()
        return self.dst.live_version, {k: v.clone() for k, v in self.tensors.items()}

    def _want(self, version: int) -> dict[str, torch.Tensor]:
        return replica_tensors(version)
