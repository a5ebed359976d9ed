"""The layouts derived from vLLM's own loaders at the real shapes of the five models in weightsync/sim/configs
(meta tensors: no weights, no memory) against weightsync.sim.models.inference_layouts, the hand-written
layouts the benchmarks and planner tests use: every box (which checkpoint tensor, which part of it, where
in which vLLM parameter) must agree. vLLM at TP 1; each model cut to its first dense and first MoE layer
(every layer of a kind has the same shapes); then at TP 2 (two gloo ranks in two processes,
tests/vllm/real_shapes_rank.py), with and without expert parallelism. Runs in .venv-vllm."""

from __future__ import annotations

import importlib.util
import json
import math
from typing import Any

import pytest

if importlib.util.find_spec("vllm") is None:
    pytest.skip("vLLM is not installed here: tests/vllm run in .venv-vllm (bash scripts/setup_vllm.sh)",
                allow_module_level=True)

from tests import ROOT
from tests.vllm import models
from tests.vllm.test_fp8_layouts import fp8_kernels  # noqa: F401 (a fixture)
from weightsync.integrations.vllm.layouts import CheckpointTensor, derive_layout, fp8_checkpoint
from weightsync.sim import models as plan_models

SHARED = plan_models.CONFIGS  # as the planner's tests find them
NAMES = ["llama-3.1-70b", "llama-3.1-405b", "qwen3-235b-a22b", "deepseek-v3", "kimi-k2"]
# What vLLM needs beyond the shapes weightsync/sim/configs records (rope, norms, routing) comes from the tiny
# config of the same family.
BASE = {"LlamaForCausalLM": models.LLAMA, "Qwen3MoeForCausalLM": models.QWEN3_MOE,
        "DeepseekV3ForCausalLM": models.DEEPSEEK_V3}

# Box = (vLLM parameter, checkpoint tensor, offsets in it, box shape, byte offset in the parameter, row
# stride in elements, the parameter's dtype), 2-D (1-D tensors as one row), as
# weightsync.plan.layout.Layout holds them.
Box = tuple[str, str, tuple[int, int], tuple[int, int], int, int, str]


def real_config(name: str) -> dict[str, Any]:
    shape = {k: v for k, v in json.loads((SHARED / f"{name}.json").read_text()).items()
             if not k.startswith("_")}
    cfg = dict(BASE[shape["architectures"][0]], **shape)
    # the first dense layer and the first MoE layer (Qwen3-MoE's layers are all sparse)
    cfg["num_hidden_layers"] = cfg.get("first_k_dense_replace", 0) + 1
    if cfg["num_hidden_layers"] > 2:
        cfg["first_k_dense_replace"] = 1
        cfg["num_hidden_layers"] = 2
    return cfg


def derived_boxes(cfg: dict[str, Any], tp: int = 1, rank: int = 0, port: int | None = None,
                  ep: bool = False) -> tuple[set[Box], list[str]]:
    from vllm.config import set_current_vllm_config

    model, vllm_config = models.build(cfg, device="meta", tp=tp, rank=rank, port=port, ep=ep)
    ck = plan_models.checkpoint(cfg)
    checkpoint = [CheckpointTensor(n, tuple(s), "float32" if wide else "bfloat16")
                  for n, s, wide in zip(ck.names, ck.shapes, ck.float32, strict=True)]
    with set_current_vllm_config(vllm_config):
        if "quantization_config" in cfg:
            checkpoint = fp8_checkpoint(model, checkpoint, cfg["quantization_config"]["weight_block_size"])
        layout = derive_layout(model, checkpoint)
    params = dict(model.named_parameters())
    boxes: set[Box] = set()
    for pname, pieces in layout.pieces.items():
        p = params[pname]
        for name, _, offsets, shape, at in pieces:
            flat = sum(a * math.prod(p.shape[d + 1:]) for d, a in enumerate(at))
            lo, sh = (0,) * (2 - len(offsets)) + tuple(offsets), (1,) * (2 - len(shape)) + tuple(shape)
            boxes.add((pname, name, lo, sh, flat * p.element_size(), int(p.shape[-1]),
                       str(p.dtype).removeprefix("torch.")))
    return boxes, layout.unused


def planned_boxes(cfg: dict[str, Any], tp: int = 1, rank: int = 0, ep: bool = False) -> set[Box]:
    fp8 = "quantization_config" in cfg
    lay = plan_models.inference_layouts(cfg, tp, tp, dtype="fp8" if fp8 else "bf16", expert_parallel=ep)[rank]
    from weightsync.plan.layout import DTYPES

    return {(lay.keys[int(lay.key[i])], lay.table.names[int(lay.tensor[i])],
             tuple(int(x) for x in lay.offsets[i]), tuple(int(x) for x in lay.shape[i]),
             int(lay.byte_offset[i]), int(lay.strides[i][0]), DTYPES[int(lay.table.dtype[lay.tensor[i]])])
            for i in range(len(lay.tensor))}


@pytest.mark.parametrize("name", NAMES)
def test_derived_layouts_match_the_planner_models_at_real_shapes(name: str, fp8_kernels: None) -> None:  # noqa: F811
    cfg = real_config(name)
    derived, unused = derived_boxes(cfg)
    planned = planned_boxes(cfg)
    only_vllm = sorted(derived - planned)
    only_plan = sorted(planned - derived)
    assert (only_vllm[:6], only_plan[:6]) == ([], []), (len(only_vllm), len(only_plan))
    # vLLM recomputes the rotary inverse frequencies old DeepSeek checkpoints carry: never loaded
    assert all(n.endswith("rotary_emb.inv_freq") for n in unused), unused[:5]


# Two cases (each starts two vLLM processes): GQA heads and the padded vocabulary split over the ranks,
# and MLA, shared experts and FP8 scales with the experts split by expert parallelism.
@pytest.mark.parametrize("name, ep", [("llama-3.1-70b", False), ("deepseek-v3", True)],
                         ids=["llama-70b-tp2", "deepseek-v3-ep2"])
def test_derived_layouts_match_the_planner_models_at_tensor_parallel_2(name: str, ep: bool) -> None:
    """Each rank of vLLM at TP 2 (its heads, its column and row shards, its half of the padded vocabulary;
    with expert parallelism its half of the experts whole) against sim.models' layout of that rank."""
    import os
    import subprocess
    import sys

    from tests.runtime.group_actors import free_port

    port = free_port()
    env = {**os.environ, "PYTHONPATH": ROOT}
    procs = [subprocess.Popen([sys.executable, "-m", "tests.vllm.real_shapes_rank", str(r), "2", str(port),
                               name, "ep" if ep else "tp"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, env=env, cwd=ROOT) for r in range(2)]
    outs = []
    for proc in procs:
        out, err = proc.communicate(timeout=900)
        assert proc.returncode == 0, err[-3000:]
        outs.append(json.loads(out.strip().splitlines()[-1]))
    cfg = real_config(name)
    for rank, got in enumerate(outs):
        derived = {(k, n, tuple(lo), tuple(sh), at, st, dt) for k, n, lo, sh, at, st, dt in got["boxes"]}
        planned = planned_boxes(cfg, 2, rank, ep)
        assert len(derived) >= 10, got  # the layers' boxes are there to compare
        only_vllm, only_plan = sorted(derived - planned), sorted(planned - derived)
        assert (only_vllm[:6], only_plan[:6]) == ([], []), (rank, len(only_vllm), len(only_plan))
