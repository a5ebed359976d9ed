"""The trainer side for SGLang: a ``weightsync.Source`` per trainer rank over the model's tensors (FSDP2
DTensors as ``module.state_dict()`` gives them, or full tensors), and, on the sender rank, the SGLang
side driven through SGLang's own ``update_weights_from_tensor``.

``engine``: anything with SGLang's ``update_weights_from_tensor(named_tensors, load_format=...)`` whose
call returns once every TP worker ran the custom loader: ``sglang.Engine``, or a client of SGLang's HTTP
server. The SGLang server must list ``LOAD_FORMAT`` in its ``--custom-weight-loader``.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from typing import Any

from weightsync.control.rendezvous import connect
from weightsync.errors import WeightSyncError
from weightsync.integrations.sglang import LOAD_FORMAT, protocol
from weightsync.integrations.vllm.verify import MASK64, box_checksum, to_signed
from weightsync.plan.layout import dtensor_box
from weightsync.runtime.describe import Sharded, _is_dtensor
from weightsync.runtime.source import PushStats, Source


def _counted_box(t: Any) -> tuple[Any, tuple[int, ...], tuple[int, ...], bool]:
    """(local tensor, global shape, offsets, whether this rank counts it in checksums) of a DTensor's
    local shard (of replicas, the one at mesh coordinate 0 of the replicated axes), a ``Sharded`` box, or
    a full tensor (counted by rank 0)."""
    if isinstance(t, Sharded):
        return t.local_tensor, tuple(t.global_shape), tuple(t.offsets), True
    if _is_dtensor(t):
        from torch.distributed.tensor import Shard

        coord = t.device_mesh.get_coordinate()
        offsets, _ = dtensor_box(tuple(t.shape), tuple(t.device_mesh.shape), coord, t.placements)
        first = all(c == 0 for c, p in zip(coord, t.placements, strict=True) if not isinstance(p, Shard))
        return t.to_local(), tuple(int(x) for x in t.shape), tuple(offsets), first
    import torch.distributed as dist

    rank0 = not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0
    return t, tuple(int(x) for x in t.shape), (0,) * t.dim(), rank0


class SglangTrainer:
    """One trainer rank's side of a weightsync group whose destinations are SGLang TP workers.

    Every trainer rank makes one (like a collective) with its ``tensors`` (checkpoint names: the Hugging
    Face names SGLang's ``load_weights`` takes), and calls :meth:`push` each step. The sender rank (with
    ``engine``) also sends the SGLang side its commands: ``num_workers`` is the number of SGLang TP
    workers in the group (ranks ``worker_rank_offset`` on). The group must exist
    (``weightsync.Group.create(group, num_sources=trainer ranks, num_destinations=SGLang workers)``).

    ``verify``: after each push the trainer ranks' per-tensor checksums (summed over the ranks with
    torch.distributed) go to the workers, which compare them with what landed; a mismatch raises naming
    the tensors. The tensors must stay as they are until ``push`` returns."""

    def __init__(self, group: str, rank: int, tensors: Mapping[str, Any], engine: Any = None, *,
                 num_workers: int = 1, worker_rank_offset: int = 0, ray_address: str | None = None,
                 ray_namespace: str | None = None, worker_ray_address: str | None = None,
                 worker_ray_namespace: str | None = None, secret: str | None = None, timeout: float = 120.0,
                 push_timeout: float = 60.0, verify: bool = False) -> None:
        self.group, self.rank, self.engine = group, rank, engine
        self.timeout, self.push_timeout, self.verify = timeout, push_timeout, verify
        self.version = -1
        self.last_stats: PushStats | None = None
        # each SGLang worker's outcome of the last update: {rank: {"version", "verification"}}
        self.last_update: dict[int, dict[str, Any]] = {}
        self.workers = list(range(worker_rank_offset, worker_rank_offset + num_workers))
        self._offset = worker_rank_offset
        self._boxes = {name: _counted_box(t) for name, t in tensors.items()}
        self._checkpoint = [[name, list(g), str(local.dtype).removeprefix("torch.")]
                            for name, (local, g, _, _) in self._boxes.items()]
        connect(ray_address, ray_namespace, timeout=timeout)
        if engine is not None:
            # The workers read their layouts first: a model they refuse fails here, naming the parameter,
            # before any rank waits for the group to form.
            self.command("init", {"checkpoint": self._checkpoint, "ray_address": worker_ray_address,
                                  "ray_namespace": worker_ray_namespace, "timeout": timeout})
        failure: list[BaseException] = []
        helper: threading.Thread | None = None
        if engine is not None:
            args = {"group": group, "secret": secret, "timeout": timeout, "push_timeout": push_timeout}

            def join_workers() -> None:
                try:
                    self.command("join", args)
                except BaseException as exc:  # re-raised in the caller's thread below
                    failure.append(exc)

            # The workers' join returns once the plan exists, which needs this rank's join too.
            helper = threading.Thread(target=join_workers, name="weightsync-sglang-join", daemon=True)
            helper.start()
        try:
            self.src: Source | None = Source(group, rank, dict(tensors), timeout=timeout, secret=secret)
        except BaseException as exc:
            if helper is not None:
                helper.join(timeout)
            if failure:  # the workers' failure says why the group never formed
                raise WeightSyncError(f"the SGLang workers did not join group {group!r}: {failure[0]}") \
                    from failure[0]
            raise exc
        if helper is not None:
            helper.join(timeout)
            if failure:
                raise WeightSyncError(f"the SGLang workers failed to join group {group!r}: {failure[0]}") \
                    from failure[0]
            if helper.is_alive():
                raise WeightSyncError(f"the SGLang workers did not join group {group!r} within {timeout} s")

    def command(self, op: str, args: dict[str, Any]) -> dict[int, dict[str, Any]]:
        """Sends ``op`` to every SGLang worker through ``engine.update_weights_from_tensor`` and returns
        their outcomes; raises naming the workers that refused or did not answer."""
        if self.engine is None:
            raise WeightSyncError(f"trainer rank {self.rank} has no SGLang engine: the sender sends commands")
        named, reply_to = protocol.command(op, {**args, "rank_offset": self._offset})
        answer = self.engine.update_weights_from_tensor(named_tensors=named, load_format=LOAD_FORMAT)
        if isinstance(answer, tuple) and len(answer) >= 2 and answer[0] is False:
            raise WeightSyncError(f"SGLang refused weightsync command {op!r}: {answer[1]}")
        wait = self.timeout if op in ("init", "join") else self.push_timeout
        outcomes = protocol.collect(reply_to, self.workers, wait)
        protocol.raise_failures(op, outcomes)
        return outcomes

    def checksums(self) -> dict[str, int]:
        """Per tensor, the checksum of the whole tensor as the trainer ranks hold it (a collective over
        torch.distributed's default group when one of several ranks is set up)."""
        import torch
        import torch.distributed as dist

        names = list(self._boxes)
        mine = [box_checksum(local, g, o) if counts else 0 for local, g, o, counts in self._boxes.values()]
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            total = torch.tensor([to_signed(x) for x in mine], dtype=torch.int64)
            dist.all_reduce(total)  # integer sums wrap modulo 2**64, like the checksums
            mine = [int(x) & MASK64 for x in total.tolist()]
        return dict(zip(names, mine, strict=True))

    def push(self, version: int | None = None) -> PushStats:
        """Pushes the tensors' current contents as ``version`` (default: one more than the last); on the
        sender, then waits until every SGLang worker holds it whole (and verified). Every rank calls it;
        generation should be paused around it (SGLang's ``pause_generation``/``continue_generation``)."""
        if self.src is None:
            raise WeightSyncError("this trainer side was closed")
        version = self.version + 1 if version is None else int(version)
        stats = self.src.push(version, self.push_timeout)
        self.version = version
        self.last_stats = stats
        checksums = self.checksums() if self.verify else None
        if self.engine is not None:
            update = self.command("update", {"version": version, "timeout": self.push_timeout,
                                             "checksums": checksums})
            self.last_update = {r: o["result"] for r, o in update.items()}
            self.command("finish", {})
        return stats

    def close(self) -> None:
        """Leaves the group (the sender first tells the SGLang workers to leave it too)."""
        if self.src is None:
            return
        try:
            if self.engine is not None:
                self.command("close", {})
        finally:
            self.src.close()
            self.src = None


__all__ = ["SglangTrainer"]
