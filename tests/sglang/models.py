"""Tiny models that SGLang builds on CPU (the configs and Hugging Face state dicts of tests.vllm.models).

SGLang 0.5.23 from PyPI runs its model classes and loaders on a CPU-only machine with no settings: it
falls back to its generic platform and never imports ``sgl_kernel``. Two things stand in for a server:

* ``vllm._custom_ops.rotary_embedding``, which ``RotaryEmbedding.__init__`` imports on that platform and
  only stores (it is called in ``forward``, which these tests never run): a module whose function raises
  if it is ever called;
* SGLang's process groups, set up as its layer tests do: a gloo world of ``tp`` ranks, the runtime
  context published from ``ServerArgs``, ``initialize_model_parallel(backend="gloo")``; for TP > 1
  ``SGLANG_NCCL_SO_PATH`` names a library that does not exist, so that SGLang leaves pynccl off as it does
  on a CPU-only torch.

Models are built as ``DefaultModelLoader.load_model`` builds them (``ModelConfig.from_server_args``, the
expert-location metadata ``ModelRunner`` installs for every model, ``_initialize_model`` in bf16 on CPU),
their parameters not loaded.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import tempfile
import types
from typing import Any

from tests.vllm.models import LLAMA, QWEN3, QWEN3_MOE, hf_state_dict

__all__ = ["LLAMA", "QWEN3", "QWEN3_MOE", "build", "hf_state_dict", "setup"]

_state: dict[str, Any] = {}


def _rope_kernel_stand_in() -> None:
    try:
        import vllm._custom_ops
        return
    except ImportError:
        pass

    def rotary_embedding(*args: Any, **kwargs: Any) -> None:
        raise RuntimeError("vllm._custom_ops.rotary_embedding stands in for a kernel these tests never run")

    vllm = types.ModuleType("vllm")
    vllm.__path__ = []  # type: ignore[attr-defined]
    ops = types.ModuleType("vllm._custom_ops")
    ops.rotary_embedding = rotary_embedding  # type: ignore[attr-defined]
    vllm._custom_ops = ops  # type: ignore[attr-defined]
    sys.modules.setdefault("vllm", vllm)
    sys.modules.setdefault("vllm._custom_ops", ops)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def setup(config: dict[str, Any], tp: int = 1, rank: int = 0, port: int | None = None, ep: int = 1) -> Any:
    """SGLang's process groups for ``config`` at ``rank`` of ``tp`` gloo ranks (meeting at ``port``), with
    ``ep`` expert-parallel ranks; returns the ``ServerArgs``. Rebuilds the model-parallel groups when
    called again in the same process (another model), the world group once per process."""
    os.environ.setdefault("SGLANG_NCCL_SO_PATH", "libnccl-absent-on-cpu.so")
    _rope_kernel_stand_in()
    import torch

    torch.set_num_threads(1)
    from sglang.srt.distributed import parallel_state
    from sglang.srt.distributed.parallel_state import (
        destroy_model_parallel,
        init_distributed_environment,
        initialize_model_parallel,
        model_parallel_is_initialized,
    )
    from sglang.srt.runtime_context import SpawnRanks, get_parallel, publish, reset_context
    from sglang.srt.server_args import ServerArgs

    folder = tempfile.mkdtemp(prefix="ws-sglang-model-")
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(config, f)
    if not torch.distributed.is_initialized():
        init_distributed_environment(world_size=tp, rank=rank, local_rank=rank, backend="gloo",
                                     distributed_init_method=f"tcp://127.0.0.1:{port or free_port()}")
    if model_parallel_is_initialized():
        destroy_model_parallel()
    reset_context()
    server_args = ServerArgs(model_path=folder, tp_size=tp, ep_size=ep, pp_size=1, dtype="bfloat16",
                             device="cpu", skip_tokenizer_init=True)
    publish(server_args, role="test", ranks=SpawnRanks(world_rank=rank))
    get_parallel().override_permanently(world_group=parallel_state._WORLD)
    initialize_model_parallel(backend="gloo")  # widths from the published ServerArgs
    _state["server_args"] = server_args
    return server_args


def build(server_args: Any = None) -> Any:
    """The model SGLang builds for the ``server_args`` of the last :func:`setup`, parameters unloaded."""
    import torch
    from sglang.srt.configs.load_config import LoadConfig
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.eplb.expert_location import (
        compute_initial_expert_location_metadata,
        set_global_expert_location_metadata,
    )
    from sglang.srt.model_loader.loader import _get_quantization_config, _initialize_model
    from sglang.srt.model_loader.utils import set_default_torch_dtype
    from sglang.srt.runtime_context import get_parallel

    server_args = server_args or _state["server_args"]
    model_config = ModelConfig.from_server_args(server_args)
    metadata = compute_initial_expert_location_metadata(model_config=model_config,
                                                        moe_ep_rank=get_parallel().moe_ep_rank)
    set_global_expert_location_metadata(metadata, allow_overwrite=True)
    load_config = LoadConfig()
    with set_default_torch_dtype(model_config.dtype), torch.device("cpu"):
        return _initialize_model(model_config, load_config,
                                 quant_config=_get_quantization_config(model_config, load_config))


def loaded_by_sglang(config: dict[str, Any], seed: int) -> Any:
    """A second instance of the current setup's model, loaded by SGLang's own ``load_weights``."""
    model = build()
    model.load_weights(iter(hf_state_dict(config, seed).items()))
    return model


def raw(t: Any) -> bytes:
    import torch

    return t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def differing(want: Any, got: Any) -> list[str]:
    """Parameters whose bytes differ between two instances of a model."""
    w, g = dict(want.named_parameters()), dict(got.named_parameters())
    assert w.keys() == g.keys()
    return [k for k in w if raw(w[k]) != raw(g[k])]
