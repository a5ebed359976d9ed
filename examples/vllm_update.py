"""A vLLM model takes its weights from FSDP2 trainer ranks through weightsync, step after step.

Two trainer ranks (Ray actors, a gloo process group) train a tiny Llama sharded with FSDP2's
``fully_shard`` and, after every optimizer step, push it with vLLM's weight-transfer API: the trainer
side is ``WeightTransferTrainerFactory.trainer_init`` with a ``ModuleSource`` over the sharded module, the
vLLM side the ``weightsync`` backend (``WeightTransferConfig(backend="weightsync")``) that reads its layout
off the model's own loaders. ``verify=True`` makes every vLLM worker compare per-tensor checksums of what
landed with the trainers'; at the end the model is compared byte for byte with what vLLM's own
``load_weights`` makes of the trainers' full state dict. Prints progress and a JSON summary.

    .venv-vllm/bin/python -m examples.vllm_update          # vLLM's CPU platform, about a minute
    .venv-vllm/bin/python -m examples.vllm_update --llm    # vllm.LLM on a GPU (2 trainer GPUs' worth
                                                           # of work runs on CPU; the vLLM side on GPU)

On CPU, vLLM's full engine (``vllm.LLM``) does not start from the PyPI wheel (its CPU kernels are not in
it), so the vLLM side here is what vLLM's worker does around its weight-transfer engine: the model built
by vLLM for its CPU platform, the engine made by vLLM's ``WeightTransferEngineFactory``, and the RL
methods ``vllm.LLM`` has (``init_weight_transfer_engine``, ``start_weight_update``, ``update_weights``,
``finish_weight_update``), driven by vLLM's ``RayVLLMWeightSyncClient`` exactly as it drives an ``LLM``
actor. Everything weightsync does is the same code on both.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import tempfile
import time
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# A Hugging Face Llama config: GQA, fused qkv/gate_up in vLLM, untied lm_head and a vocabulary vLLM pads.
CONFIG: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
    "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
    "head_dim": 16, "vocab_size": 200, "max_position_embeddings": 128, "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0, "tie_word_embeddings": False, "torch_dtype": "bfloat16", "hidden_act": "silu",
}


def model_folder(config: dict[str, Any]) -> str:
    """A model folder with only ``config.json``: vLLM builds the model from it (weights: ``dummy``, the
    first push brings the real ones)."""
    folder = tempfile.mkdtemp(prefix="vllm-update-")
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(config, f)
    return folder


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _build_on_cpu(folder: str) -> tuple[Any, Any]:
    """``(model, vllm_config)``: the model vLLM builds on its CPU platform for ``folder``, unloaded."""
    import torch
    from vllm.config import (
        DeviceConfig,
        LoadConfig,
        ModelConfig,
        ParallelConfig,
        VllmConfig,
        set_current_vllm_config,
    )
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    from vllm.distributed.parallel_state import model_parallel_is_initialized
    from vllm.model_executor.model_loader.utils import initialize_model
    from vllm.utils.torch_utils import set_default_torch_dtype

    model_config = ModelConfig(model=folder, tokenizer=folder, skip_tokenizer_init=True, dtype="bfloat16",
                               max_model_len=64, enforce_eager=True)
    vllm_config = VllmConfig(model_config=model_config, device_config=DeviceConfig("cpu"),
                             load_config=LoadConfig(load_format="dummy"), parallel_config=ParallelConfig())
    with set_current_vllm_config(vllm_config):
        if not model_parallel_is_initialized():
            init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                         distributed_init_method=f"tcp://127.0.0.1:{_free_port()}")
            initialize_model_parallel(1, 1)
    with set_current_vllm_config(vllm_config), set_default_torch_dtype(model_config.dtype), \
            torch.device("cpu"):
        model = initialize_model(vllm_config=vllm_config)
    return model, vllm_config


class CpuVllm:
    """The vLLM side on vLLM's CPU platform: the worker's model and its weight-transfer engine (backend
    ``weightsync``, found through vLLM's general plugins), behind ``vllm.LLM``'s RL methods."""

    def __init__(self, folder: str) -> None:
        os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
        import torch
        from vllm.config import WeightTransferConfig
        from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory
        from vllm.plugins import load_general_plugins

        load_general_plugins()  # what vLLM's workers do at start: registers the weightsync backend
        self.folder = folder
        self.model, self.vllm_config = _build_on_cpu(folder)
        self.engine = WeightTransferEngineFactory.create_engine(
            WeightTransferConfig(backend="weightsync"), self.vllm_config, torch.device("cpu"), self.model)

    def _call(self, method: str, *args: Any) -> Any:
        from vllm.config import set_current_vllm_config

        with set_current_vllm_config(self.vllm_config):
            return getattr(self.engine, method)(*args)

    # vllm.LLM's RL methods (vllm/entrypoints/rl/offline.py), as RayVLLMWeightSyncClient calls them
    def init_weight_transfer_engine(self, request: Any) -> None:
        info = request["init_info"] if isinstance(request, dict) else request.init_info
        self._call("init_transfer_engine", self.engine.parse_init_info(info))

    def start_weight_update(self) -> None:
        self._call("start_weight_update")

    def update_weights(self, request: Any) -> None:
        info = request["update_info"] if isinstance(request, dict) else request.update_info
        self._call("update_weights", info)

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self._call("finish_weight_update")

    def update_weight_version(self, new_version: str) -> None:
        pass

    def checked_by_verification(self) -> Any:
        """What the last update's verification compared (``{"version", "checked", "skipped"}``)."""
        return self.engine.last_verification

    def differs_from_vllm_loading(self, state_dict: dict[str, Any]) -> list[str]:
        """The parameters whose bytes differ from what vLLM's own ``load_weights`` makes of
        ``state_dict`` (the trainers' full weights) in a second instance of the model."""
        import torch
        from vllm.config import set_current_vllm_config

        ref, ref_config = _build_on_cpu(self.folder)
        with set_current_vllm_config(ref_config):
            ref.load_weights(iter(state_dict.items()))

        def raw(t: Any) -> bytes:
            return t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()

        want, got = dict(ref.named_parameters()), dict(self.model.named_parameters())
        return sorted(k for k in want if k not in got or raw(want[k]) != raw(got[k]))


class TrainerRank:
    """One of ``world`` FSDP2 trainer ranks of a Hugging Face Llama (CPU, gloo)."""

    def __init__(self, rank: int, world: int, port: int, config: dict[str, Any], device: str) -> None:
        import torch
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        from transformers import LlamaConfig, LlamaForCausalLM

        self.rank = rank
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
        fields = {k: v for k, v in config.items() if k not in ("architectures", "model_type", "torch_dtype")}
        torch.manual_seed(0)  # every rank starts from the same weights, as loading a checkpoint would
        model = LlamaForCausalLM(LlamaConfig(**fields)).to(torch.bfloat16)
        mesh = init_device_mesh(device, (world,))
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        self.model = model
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        self.vocab = int(config["vocab_size"])
        self.trainer: Any = None

    def connect(self, group: str, vllm: Any, secret: str, worker_ray_address: str | None,
                worker_ray_namespace: str | None) -> None:
        """The trainer side of the ``weightsync`` backend; rank 0 also initializes the vLLM side (its
        layout, its join) through the client."""
        from vllm.distributed.weight_transfer.base import ModuleSource
        from vllm.distributed.weight_transfer.clients import RayVLLMWeightSyncClient
        from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

        from weightsync.integrations.vllm import register
        from weightsync.integrations.vllm.engine import WeightsyncTrainerInitInfo

        register()  # the trainer's process loads no vLLM plugins: the backend is registered here
        info = WeightsyncTrainerInitInfo(group=group, rank=self.rank, secret=secret, verify=True,
                                         worker_ray_address=worker_ray_address,
                                         worker_ray_namespace=worker_ray_namespace)
        self.trainer = WeightTransferTrainerFactory.trainer_init(
            info, client=RayVLLMWeightSyncClient(vllm), source=ModuleSource(self.model))

    def step(self, step: int) -> dict[str, Any]:
        """One optimizer step on a random batch, then the push of the new weights as version ``step``
        (every rank; rank 0 drives vLLM's start, update and finish around it)."""
        import torch

        g = torch.Generator().manual_seed(1000)  # one batch, the same on every rank: the loss falls
        ids = torch.randint(0, self.vocab, (4, 16), generator=g)
        loss = self.model(input_ids=ids, labels=ids).loss
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad()
        stats = self.trainer.send_weights(step)
        return {"loss": float(loss), "bytes": int(stats.bytes),
                "failed": [str(f) for f in stats.failed_destinations]}

    def full_state_dict(self) -> dict[str, Any]:
        """Every parameter gathered whole (a collective: every rank calls it)."""
        return {name: p.full_tensor().detach().clone() for name, p in self.model.named_parameters()}

    def close(self) -> None:
        import torch.distributed as dist

        if self.trainer is not None:
            self.trainer.shutdown()
        dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--llm", action="store_true",
                        help="the vLLM side as vllm.LLM on one GPU (its worker processes join through "
                        "Ray's address)")
    args = parser.parse_args()

    import ray

    import weightsync as ws

    t0 = time.perf_counter()
    secret = ws.new_secret()
    # A Ray instance of our own, its workers importing this checkout.
    ray.init(address="local", num_cpus=3, num_gpus=1 if args.llm else 0, include_dashboard=False,
             log_to_driver=False, logging_level="ERROR",
             runtime_env={"env_vars": {"PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1",
                                       **({} if args.llm else {"VLLM_TARGET_DEVICE": "cpu"})}})
    group_name = f"vllm-update-{os.getpid()}"
    group = ws.Group.create(group_name, num_sources=2, num_destinations=1, secret=secret)
    folder = model_folder(CONFIG)
    actors: list[Any] = []
    try:
        if args.llm:
            from vllm import LLM
            from vllm.config import WeightTransferConfig

            vllm = ray.remote(num_cpus=1, num_gpus=1)(LLM).remote(
                model=folder, skip_tokenizer_init=True, load_format="dummy", enforce_eager=True,
                max_model_len=64, weight_transfer_config=WeightTransferConfig(backend="weightsync"))
            # vLLM's worker processes are not Ray's: they join the group through Ray's address.
            context = ray.get_runtime_context()
            worker_address, worker_namespace = context.gcs_address, context.namespace
        else:
            vllm = ray.remote(num_cpus=1)(CpuVllm).remote(folder)
            worker_address = worker_namespace = None
        actors.append(vllm)
        port = _free_port()
        trainers = [ray.remote(num_cpus=1)(TrainerRank).remote(r, 2, port, CONFIG, "cpu") for r in range(2)]
        actors += trainers
        ray.get([t.connect.remote(group_name, vllm, secret, worker_address, worker_namespace)
                 for t in trainers], timeout=600)
        print(f"joined: 2 FSDP2 trainer ranks, 1 vLLM worker ({time.perf_counter() - t0:.0f} s)", flush=True)
        losses = []
        for step in range(1, args.steps + 1):
            out = ray.get([t.step.remote(step) for t in trainers], timeout=600)
            if any(o["failed"] for o in out):
                raise SystemExit(f"step {step}: destinations failed: {out}")
            losses.append(out[0]["loss"])
            print(f"step {step}: loss {out[0]['loss']:.3f}, pushed {sum(o['bytes'] for o in out)} bytes, "
                  "verified", flush=True)
        summary: dict[str, Any] = {"steps": args.steps, "losses": losses}
        if not args.llm:
            state = ray.get([t.full_state_dict.remote() for t in trainers], timeout=600)[0]
            summary["differ"] = ray.get(vllm.differs_from_vllm_loading.remote(state), timeout=600)
            summary["verification"] = ray.get(vllm.checked_by_verification.remote())
            summary["tensors"] = len(state)
        ray.get([t.close.remote() for t in trainers], timeout=120)
        summary["seconds"] = round(time.perf_counter() - t0, 1)
        print(json.dumps(summary), flush=True)
        if summary.get("differ"):
            raise SystemExit(f"vLLM's parameters differ from the trainers' weights: {summary['differ']}")
    finally:
        for a in actors:
            ray.kill(a)
        group.shutdown()
        ray.shutdown()


if __name__ == "__main__":
    main()
