"""Ray actors for the SGLang backend's tests: SGLang TP workers (the model SGLang builds on CPU, updated
through SGLang's own ``WeightUpdater.update_weights_from_tensor``, the code a server's TP worker runs for
that request) and trainer ranks holding the checkpoint as FSDP2 DTensors (gloo)."""

from __future__ import annotations

from typing import Any

from tests.sglang import models


class SglangWorker:
    """One SGLang TP worker: its model (parameters NaN until a push lands: every byte compared later was
    written by weightsync) and SGLang's weight updater around it, with weightsync's custom loader listed
    as the server's ``--custom-weight-loader`` lists it."""

    def __init__(self, config: dict[str, Any], tp: int, rank: int, port: int, ep: int = 1) -> None:
        import torch
        from sglang.srt.configs.model_config import ModelConfig
        from sglang.srt.model_executor.model_runner_components.weight_updater import WeightUpdater

        from weightsync.integrations.sglang import LOAD_FORMAT

        self.config = config
        self.swap_before_update: str | None = None
        server_args = models.setup(config, tp=tp, rank=rank, port=port, ep=ep)
        self.model = models.build()
        with torch.no_grad():
            for p in self.model.parameters():
                p.data.fill_(float("nan"))

        def unused(*args: Any, **kwargs: Any) -> None:
            raise AssertionError("not part of update_weights_from_tensor")

        self.updater = WeightUpdater(tp_rank=rank, device="cpu", gpu_id=0,
                                     model_config=ModelConfig.from_server_args(server_args),
                                     custom_weight_loaders=[LOAD_FORMAT], get_model=lambda: self.model,
                                     update_model_fields=unused, recapture_cuda_graph=unused,
                                     get_model_runner=unused)

    def update_weights_from_tensor(self, named_tensors: list[tuple[str, Any]],
                                   load_format: str | None = None) -> tuple[bool, str]:
        if self.swap_before_update is not None and named_tensors[0][0] == "weightsync.update":
            self.swap_rows(self.swap_before_update)
            self.swap_before_update = None
        return self.updater.update_weights_from_tensor(named_tensors=named_tensors, load_format=load_format)

    def differs_from_sglang_loading(self, seed: int) -> list[str]:
        """Parameters whose bytes differ from what SGLang's own load_weights makes of the state dict of
        ``seed`` (in a second instance built here)."""
        return models.differing(models.loaded_by_sglang(self.config, seed), self.model)

    def swap_rows_after_next_update(self, name: str) -> None:
        """Once the next push has landed (before the worker checks it), swaps the first two rows of
        parameter ``name``: what a layout putting bytes in the wrong place leaves."""
        self.swap_before_update = name

    def shapes(self) -> dict[str, list[int]]:
        return {k: list(v.shape) for k, v in self.model.named_parameters()}

    def replace_memory(self, name: str) -> None:
        """Gives parameter ``name`` new storage, as a quantization method's repacking or a memory release
        and resume may."""
        p = dict(self.model.named_parameters())[name]
        p.data = p.data.clone()

    def swap_rows(self, name: str) -> None:
        import torch

        p = dict(self.model.named_parameters())[name].data
        with torch.no_grad():
            first = p[0].clone()
            p[0] = p[1]
            p[1] = first


class FanOut:
    """What ``sglang.Engine.update_weights_from_tensor`` does for the trainer: the same command to every
    TP worker, returning once all ran it."""

    def __init__(self, workers: list[Any]) -> None:
        self.workers = workers

    def update_weights_from_tensor(self, named_tensors: list[tuple[str, Any]],
                                   load_format: str | None = None) -> tuple[bool, str]:
        import ray

        answers = ray.get([w.update_weights_from_tensor.remote(named_tensors, load_format)
                           for w in self.workers], timeout=600)
        bad = [a for a in answers if not a[0]]
        return bad[0] if bad else (True, "Success")


class Trainer:
    """A trainer rank of ``world`` (gloo) holding the checkpoint as DTensors sharded on dim 0 (FSDP2's
    placement); rank 0 drives the SGLang workers."""

    def __init__(self, config: dict[str, Any], rank: int, world: int, port: int) -> None:
        import torch.distributed as dist

        self.config, self.rank = config, rank
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
        self.tensors = self._distribute(models.hf_state_dict(config, 0))
        self.trainer: Any = None

    def _distribute(self, sd: dict[str, Any]) -> dict[str, Any]:
        """Each rank's Shard(0) piece of every tensor, cut locally (every rank holds the same state dict):
        no collective, so one rank alone may call it."""
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import Shard, distribute_tensor

        if not hasattr(self, "mesh"):
            self.mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        return {k: distribute_tensor(v, self.mesh, [Shard(0)], src_data_rank=None) for k, v in sd.items()}

    def init(self, group: str, workers: list[Any], verify: bool = True) -> None:
        from weightsync.integrations.sglang.trainer import SglangTrainer

        engine = FanOut(workers) if self.rank == 0 else None
        self.trainer = SglangTrainer(group, self.rank, self.tensors, engine, num_workers=len(workers),
                                     verify=verify, timeout=300, push_timeout=120)

    def init_expecting_refusal(self, group: str, workers: list[Any], truncated: str) -> str:
        """The sender's init with ``truncated`` two rows short of the model's shape."""
        from weightsync.integrations.sglang.trainer import SglangTrainer

        short = models.hf_state_dict(self.config)[truncated][:-2]
        self.tensors[truncated] = self._distribute({truncated: short})[truncated]
        try:
            SglangTrainer(group, self.rank, self.tensors, FanOut(workers), num_workers=len(workers),
                          timeout=60)
        except Exception as err:
            return str(err)
        return ""

    def step(self, seed: int, version: int) -> dict[str, Any]:
        """Takes the state dict of ``seed`` into the registered shards and pushes it as ``version``."""
        import torch

        new = self._distribute(models.hf_state_dict(self.config, seed))
        with torch.no_grad():
            for k, t in self.tensors.items():
                t.to_local().copy_(new[k].to_local())
        self.trainer.push(version)
        return self.trainer.last_update if self.rank == 0 else {}

    def push_expecting_refusal(self, version: int) -> str:
        try:
            self.trainer.push(version)
        except Exception as err:
            return str(err)
        return ""

    def close(self) -> None:
        if self.trainer is not None:
            self.trainer.close()
