"""Trainer ranks: Ray actors that hold the policy sharded with FSDP2 and push it with weightsync.

Every rank holds a dim-0 shard of every parameter (FSDP2 ``fully_shard`` over a 1-D mesh: gloo on CPU,
NCCL on CUDA) and trains on its share of each batch (data parallel; FSDP2 reduce-scatters the gradients).
The parameters FSDP2 exposes are DTensors with ``Shard(0)`` placements, and those are what the
``ws.Source`` is given: the optimizer updates the shards in place, so after every step ``ws.push`` sends
the current bytes of exactly the memory the optimizer wrote, with no gather and no copy (on CPU).

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
                 seed: int, lr: float, clip: float, epochs: int, group_size: int, device: str) -> None:
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
            self.src = ws.Source(group, rank=rank, tensors=self.params)  # the DTensor shards, where they live
        except ws.TransportError:
            if self.device.type == "cpu":
                raise
            # A GPU the engine cannot register (no cuda lane): push from host mirrors of the shards.
            self.mirrors = {k: p.to_local().detach().to("cpu").pin_memory() for k, p in self.params.items()}
            tensors = {k: ws.Sharded(self.mirrors[k], tuple(p.shape), _shard_offsets(p, rank, world))
                       for k, p in self.params.items()}
            self.src = ws.Source(group, rank=rank, tensors=tensors)
        self.sync_memory = "host mirror" if self.mirrors else self.device.type

    def _push(self, version: int) -> dict[str, Any]:
        for key, mirror in self.mirrors.items():
            mirror.copy_(self.params[key].to_local().detach())
        if self.device.type == "cuda":
            torch.cuda.synchronize()  # the copy engines read the shards: the optimizer must be done
        stats = ws.push(self.src, version=version, timeout=60.0)
        if stats.failed_destinations:
            raise RuntimeError(f"trainer {self.rank}: push {version} failed for {stats.failed_destinations}")
        return {"seconds": stats.seconds, "bytes": stats.bytes, "gbps": stats.gbps, "writes": stats.writes}

    def _reference(self) -> dict[str, torch.Tensor] | None:
        """Full tensors gathered over the trainers' own process group (not through weightsync): what
        every rollout must hold. Collective: every rank calls it, rank 0 returns it."""
        full = {k: p.full_tensor().detach().cpu() for k, p in self.params.items()}
        return full if self.rank == 0 else None

    def initial(self) -> dict[str, Any]:
        """Pushes version 0 (the initial weights) so the rollouts can start generating."""
        return {"push": self._push(0), "reference": self._reference(), "sync_memory": self.sync_memory}

    def step(self, version: int, batch: dict[str, torch.Tensor]) -> dict[str, Any]:
        """One PPO step on this rank's share of ``batch``, then push the result as ``version``."""
        t0 = time.perf_counter()
        groups = batch["rewards"].numel() // self.group_size
        mine = torch.arange(groups).view(-1, 1)[self.rank::self.world]  # whole groups per rank
        rows = (mine * self.group_size + torch.arange(self.group_size)).reshape(-1)
        tokens = batch["tokens"][rows].to(self.device)
        behaviour = batch["logprobs"][rows].to(self.device)
        advantages = group_advantages(batch["rewards"][rows], self.group_size).to(self.device)
        normalizer = float(batch["logprobs"].numel())  # global token count: ranks' gradients add up
        info: dict[str, float] = {}
        for _ in range(self.epochs):
            logprobs = action_logprobs(self.policy(tokens), tokens, self.task.prompt_len)
            loss, info = clipped_loss(logprobs, behaviour, advantages, self.clip, normalizer)
            self.optimizer.zero_grad(set_to_none=True)
            loss.backward()
            self.optimizer.step()
        train_s = time.perf_counter() - t0
        push = self._push(version)
        return {"train_s": train_s, "push": push, "reference": self._reference(), **info}

    def close(self) -> None:
        import torch.distributed as dist

        self.src.close()
        dist.destroy_process_group()


def _shard_offsets(param: Any, rank: int, world: int) -> tuple[int, ...]:
    """Offsets of this rank's ``Shard(0)`` box: torch.chunk sizes, ceil(rows / world) per rank."""
    rows = math.ceil(param.shape[0] / world)
    return (min(rank * rows, param.shape[0]),) + (0,) * (param.dim() - 1)
