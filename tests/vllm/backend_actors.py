"""Ray actors for the backend test: a vLLM worker (the model vLLM builds on CPU, with the weight-transfer
engine vLLM's factory makes for backend "weightsync") and FSDP-style trainer ranks that push through the
trainer side of the backend."""

from __future__ import annotations

from functools import cached_property
from typing import Any

from tests.vllm import models


class VllmWorker:
    """What vLLM's GPU worker does around its weight-transfer engine, on CPU: the engine from the factory,
    init / start / update / finish inside the worker's VllmConfig, as gpu_worker.py runs them."""

    def __init__(self, config: dict[str, Any]) -> None:
        import torch
        from vllm.config import WeightTransferConfig
        from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

        from weightsync.integrations.vllm import register

        register()
        self.config = config
        self.model, self.vllm_config = models.build(config)
        for p in self.model.parameters():  # every byte compared later must have been pushed
            p.data.fill_(float("nan"))
        self.engine = WeightTransferEngineFactory.create_engine(
            WeightTransferConfig(backend="weightsync"), self.vllm_config, torch.device("cpu"), self.model)

    def _in_config(self, method: str, *args: Any) -> Any:
        from vllm.config import set_current_vllm_config

        with set_current_vllm_config(self.vllm_config):
            return getattr(self.engine, method)(*args)

    # the VLLMWeightSyncClient surface, as the worker exposes it
    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self._in_config("init_transfer_engine", self.engine.parse_init_info(init_info))

    def start_weight_update(self) -> None:
        self._in_config("start_weight_update")

    def update_weights(self, update_info: dict[str, Any]) -> None:
        self._in_config("update_weights", update_info)

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self._in_config("finish_weight_update")

    def differs_from_vllm_loading(self, seed: int) -> list[str]:
        """Parameters whose bytes differ from those vLLM's own load_weights gives for the state dict of
        ``seed`` (loaded into a second instance, in its own VllmConfig)."""
        import torch
        from vllm.config import set_current_vllm_config

        ref, ref_config = models.build(self.config)
        with set_current_vllm_config(ref_config):
            ref.load_weights(iter(models.hf_state_dict(self.config, seed).items()))

        def raw(t: Any) -> bytes:
            return t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()

        want, got = dict(ref.named_parameters()), dict(self.model.named_parameters())
        assert want.keys() == got.keys()
        return [k for k in want if raw(want[k]) != raw(got[k])]

    def last_verification(self) -> Any:
        return self.engine.last_verification

    def sleep_and_wake(self, level: int) -> None:
        """What vLLM's sleep mode does to the weights where it frees their memory (GPU workers with the
        CuMem allocator), emulated: vLLM's CPU worker ignores sleep (cpu_worker.py: "sleep mode is not
        supported on CPU"). Every parameter gets new storage (``param.data = ...``, as a reload or
        expert rebalancing that swaps tensors does too); level 1 keeps the values (offloaded, restored),
        level 2 discards them (NaN until the next update). The old storage is kept here, filled with a
        sentinel, to check that no update writes into it."""
        import torch

        self.freed = getattr(self, "freed", [])
        with torch.no_grad():
            for p in self.model.parameters():
                old = p.data
                new = torch.empty_like(old)
                if level == 1:
                    new.copy_(old)
                else:
                    new.view(torch.uint8).fill_(0x7F)
                p.data = new
                old.view(torch.uint8).fill_(0x5A)
                self.freed.append(old)

    def freed_memory_untouched(self) -> bool:
        import torch

        return all(bool((t.view(torch.uint8) == 0x5A).all()) for t in self.freed)

    def reregistrations(self) -> int:
        return int(self.engine.reregistrations)

    def update_after_a_move(self, version: int) -> str:
        """Moves the parameters as sleep mode does, then receives ``version`` without a new start: the
        backend's error (the bytes were aimed at the memory registered before the move)."""
        from weightsync.errors import WeightSyncError

        self.sleep_and_wake(1)
        try:
            self._in_config("update_weights", {"version": version, "timeout": 5.0})
        except WeightSyncError as exc:
            return str(exc)
        return ""

    def verify_with_swapped_heads(self, checksums: dict[str, int]) -> str:
        """Swaps two rows of layer 0's k_proj part of qkv_proj (what a wrong head mapping does) and
        returns the verification's error."""
        from weightsync.errors import WeightSyncError

        qkv = dict(self.model.named_parameters())["model.layers.0.self_attn.qkv_proj.weight"].data
        q_rows = self.config["num_attention_heads"] * self.config["head_dim"]
        qkv[[q_rows, q_rows + 1]] = qkv[[q_rows + 1, q_rows]]
        try:
            self.engine.verify(checksums)
        except WeightSyncError as exc:
            return str(exc)
        finally:
            qkv[[q_rows, q_rows + 1]] = qkv[[q_rows + 1, q_rows]]
        return ""


class ActorClient:
    """VLLMWeightSyncClient over a VllmWorker actor (what an RL framework's client to vLLM does)."""

    def __init__(self, worker: Any) -> None:
        self.worker = worker

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        import ray

        ray.get(self.worker.init_weight_transfer_engine.remote(init_info))

    def start_weight_update(self) -> None:
        import ray

        ray.get(self.worker.start_weight_update.remote())

    def update_weights(self, update_info: Any) -> None:
        import ray

        ray.get(self.worker.update_weights.remote(update_info))

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        import ray

        ray.get(self.worker.finish_weight_update.remote(weight_version))


def _halves_source(config: dict[str, Any], rank: int, seed: int) -> Any:
    from vllm.distributed.weight_transfer.base import ParamMeta, Shard, WeightSource

    class Halves(WeightSource):
        """FSDP2's layout without FSDP: rank r of 2 owns rows [r*ceil(n/2), ...) of every tensor."""

        def __init__(self) -> None:
            self.full = models.hf_state_dict(config, seed)
            self.local = {}
            for k, v in self.full.items():
                size = -(-v.shape[0] // 2)
                self.local[k] = v[rank * size:(rank + 1) * size].clone()

        @cached_property
        def metadata(self) -> list[ParamMeta]:
            return [ParamMeta(k, v.dtype, tuple(v.shape), owners=(0, 1), placements=(Shard(0),))
                    for k, v in self.full.items()]

        def iter_local(self) -> Any:
            yield from self.local.items()

        def load(self, seed: int) -> None:
            """A training step: new values in place."""
            for k, v in models.hf_state_dict(config, seed).items():
                size = -(-v.shape[0] // 2)
                self.local[k].copy_(v[rank * size:(rank + 1) * size])

    return Halves()


class Trainer:
    """A trainer rank of 2 running the backend's trainer side."""

    def __init__(self, config: dict[str, Any], rank: int, seed: int, port: int) -> None:
        import torch.distributed as dist

        self.rank = rank
        self.source = _halves_source(config, rank, seed)
        self.engine: Any = None
        # The trainer's process group (FSDP has one): verification adds the ranks' checksums over it.
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)

    def init(self, group: str, worker: Any) -> None:
        from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

        from weightsync.integrations.vllm import register
        from weightsync.integrations.vllm.engine import WeightsyncTrainerInitInfo

        register()
        info = WeightsyncTrainerInitInfo(group=group, rank=self.rank, timeout=120.0, verify=True)
        self.engine = WeightTransferTrainerFactory.trainer_init(info, client=ActorClient(worker),
                                                                source=self.source)

    def step(self, seed: int, version: int) -> dict[str, Any]:
        self.source.load(seed)
        stats = self.engine.send_weights(version)
        return {"failed": list(stats.failed_destinations), "bytes": stats.bytes}

    def checksums(self) -> dict[str, int]:
        return self.engine.checksums()
