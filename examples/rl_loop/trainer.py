"""Trainer ranks: Ray actors that hold the policy sharded with FSDP2 and push it with weightsync.

Every rank holds a dim-0 shard of every parameter (FSDP2 ``fully_shard`` over a 1-D mesh: gloo on CPU,
NCCL on CUDA) and trains on its share of each batch (data parallel; FSDP2 reduce-scatters the gradients).
The parameters FSDP2 exposes are DTensors with ``Shard(0)`` placements, and those are what the
``ws.Source`` is given: the optimizer updates the shards in place, so after every step a push sends the
current bytes of exactly the memory the optimizer wrote, with no gather and no copy (on CPU).

The push does not stop the trainer: ``push`` starts it (``ws.push_async``) right after a batch's last
optimizer step and returns; it moves its bytes while the next batch's forward and backward run, and the
trainer waits for it (``handle.wait()``) only before the next ``optimizer.step()``. That wait is what
``step`` reports as ``wait_s``. ``src.guard(optimizer)`` makes every step wait for a push in flight too,
so a step can never change the weights under a push (which would fail it: weightsync checks).

On CUDA the shards are registered on the GPU (the engine's cuda lane writes with the copy engines); an
engine without that lane makes the source fall back to host mirrors of the shards, copied every step.
"""

from __future__ import annotations

import math
import time
from typing import Any

import torch

import weightsync as ws

from .model import ModelConfig, Policy, action_logprobs
from .ppo import clipped_loss, group_advantages
from .task import DigitSumTask


class Trainer:
    def __init__(self, group: str, rank: int, world: int, port: int, cfg: ModelConfig, task: DigitSumTask,
                 seed: int, lr: float, clip: float, epochs: int, group_size: int, device: str,
                 delta: bool = False) -> None:
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        torch.set_num_threads(1)
        self.rank, self.world, self.cfg, self.task = rank, world, cfg, task
        self.clip, self.epochs, self.group_size = clip, epochs, group_size
        self.device = torch.device("cuda" if device == "cuda" else "cpu")
        if self.device.type == "cuda":
            torch.cuda.set_device(0)  # Ray shows each actor only its own GPU
        dist.init_process_group("nccl" if device == "cuda" else "gloo", init_method=f"tcp://127.0.0.1:{port}",
                                rank=rank, world_size=world)
        mesh = init_device_mesh(self.device.type, (world,))
        torch.manual_seed(seed)  # every rank builds the same initial model, then keeps its shard
        self.policy = Policy(cfg).to(self.device)
        for layer in self.policy.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(self.policy, mesh=mesh)
        self.optimizer = torch.optim.Adam(self.policy.parameters(), lr=lr)
        self.params: dict[str, Any] = dict(self.policy.named_parameters())
        self.mirrors: dict[str, torch.Tensor] = {}
        try:
            # the DTensor shards, where they live; delta: each push sends only what changed since the last
            self.src = ws.Source(group, rank=rank, tensors=self.params, delta=delta)
        except ws.TransportError:
            if self.device.type == "cpu":
                raise
            # A GPU the engine cannot register (no cuda lane): push from host mirrors of the shards.
            self.mirrors = {k: p.to_local().detach().to("cpu").pin_memory() for k, p in self.params.items()}
            tensors = {k: ws.Sharded(self.mirrors[k], tuple(p.shape), _shard_offsets(p, rank, world))
                       for k, p in self.params.items()}
            self.src = ws.Source(group, rank=rank, tensors=tensors, delta=delta)
        self.sync_memory = "host mirror" if self.mirrors else self.device.type
        self.src.guard(self.optimizer)  # a safety net: every optimizer.step() waits for the push in flight
        self.handle: ws.PushHandle | None = None  # the push started at the end of the last step

    def _refresh_mirrors(self) -> None:
        for key, mirror in self.mirrors.items():
            mirror.copy_(self.params[key].to_local().detach())

    def _result(self, stats: ws.PushStats) -> dict[str, Any]:
        if stats.failed_destinations:
            raise RuntimeError(f"trainer {self.rank}: push {stats.version} failed for "
                               f"{stats.failed_destinations}")
        return {"version": stats.version, "seconds": stats.seconds, "bytes": stats.bytes, "gbps": stats.gbps,
                "writes": stats.writes, "wire_bytes": stats.wire_bytes, "changed": stats.changed_fraction}

    def _wait_push(self) -> tuple[dict[str, Any] | None, float]:
        """Waits for the push in flight (if any): its result and how long the trainer waited for it."""
        if self.handle is None:
            return None, 0.0
        t0 = time.perf_counter()
        stats = self.handle.wait(timeout=60.0)
        waited = time.perf_counter() - t0
        self.handle = None
        return self._result(stats), waited

    def _reference(self) -> dict[str, torch.Tensor] | None:
        """Full tensors gathered over the trainers' own process group (not through weightsync): what
        every rollout must hold. Collective: every rank calls it, rank 0 returns it."""
        full = {k: p.full_tensor().detach().cpu() for k, p in self.params.items()}
        return full if self.rank == 0 else None

    def initial(self) -> dict[str, Any]:
        """Pushes version 0 (the initial weights, blocking: ``ws.push``) so the rollouts can start."""
        self._refresh_mirrors()
        stats = ws.push(self.src, version=0, timeout=60.0)
        return {"push": self._result(stats), "reference": self._reference(), "sync_memory": self.sync_memory}

    def step(self, version: int, batch: dict[str, torch.Tensor]) -> dict[str, Any]:
        """One PPO step (``version``) on this rank's share of ``batch``. The previous version's push runs
        meanwhile; the trainer waits for it only before the first ``optimizer.step()``. Returns that
        push's result (``push``) and the trainer's wait (``wait_s``); ``push`` starts the next one."""
        t0 = time.perf_counter()
        groups = batch["rewards"].numel() // self.group_size
        mine = torch.arange(groups).view(-1, 1)[self.rank::self.world]  # whole groups per rank
        rows = (mine * self.group_size + torch.arange(self.group_size)).reshape(-1)
        tokens = batch["tokens"][rows].to(self.device)
        behaviour = batch["logprobs"][rows].to(self.device)
        advantages = group_advantages(batch["rewards"][rows], self.group_size).to(self.device)
        normalizer = float(batch["logprobs"].numel())  # global token count: ranks' gradients add up
        info: dict[str, float] = {}
        push, waited = None, 0.0
        for _ in range(self.epochs):
            logprobs = action_logprobs(self.policy(tokens), tokens, self.task.prompt_len)
            loss, info = clipped_loss(logprobs, behaviour, advantages, self.clip, normalizer)
            self.optimizer.zero_grad(set_to_none=True)
            loss.backward()
            if self.handle is not None:  # the weights are about to change: the push must be done
                push, waited = self._wait_push()
            self.optimizer.step()
        train_s = time.perf_counter() - t0
        return {"train_s": train_s, "push": push, "wait_s": waited, **info}

    def push(self, version: int) -> dict[str, Any]:
        """Starts the push of ``version`` (the weights after the last step) and returns at once, with the
        full tensors the rollouts must hold (gathered while the push runs: reading does not change them)."""
        self._refresh_mirrors()  # host mirrors (no cuda lane): a copy of the shards the push then reads
        t0 = time.perf_counter()
        self.handle = ws.push_async(self.src, version=version, timeout=60.0)
        return {"start_s": time.perf_counter() - t0, "reference": self._reference()}

    def finish(self) -> dict[str, Any]:
        """Waits for the last push; returns its result and the wait."""
        push, waited = self._wait_push()
        return {"push": push, "wait_s": waited}

    def close(self) -> None:
        import torch.distributed as dist

        self.src.close()
        dist.destroy_process_group()


def _shard_offsets(param: Any, rank: int, world: int) -> tuple[int, ...]:
    """Offsets of this rank's ``Shard(0)`` box: torch.chunk sizes, ceil(rows / world) per rank."""
    rows = math.ceil(param.shape[0] / world)
    return (min(rank * rows, param.shape[0]),) + (0,) * (param.dim() - 1)
