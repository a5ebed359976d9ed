"""What vLLM does to the weights after loading (``process_weights_after_loading``, run by vLLM's model
loader in every engine right after ``load_weights``): a model processed so is updated in place only where
its kernels read the parameters the loaders fill; what vLLM derives from them is re-run after each update
(MLA's ``W_UK_T``/``W_UV``), and what it converts is refused naming the parameter. Every byte is compared
with vLLM's own loading plus processing of the same state dict. Runs in .venv-vllm."""

from __future__ import annotations

import importlib.util
from typing import Any

import pytest

if importlib.util.find_spec("vllm") is None:
    pytest.skip("vLLM is not installed here: tests/vllm run in .venv-vllm (bash scripts/setup_vllm.sh)",
                allow_module_level=True)

import torch

from tests.vllm import models
from tests.vllm.test_layouts import fill_through_planner, raw
from weightsync.errors import LayoutError
from weightsync.integrations.vllm.layouts import checkpoint_of, post_load_conversions

# DeepSeek-V3's MLA without MoE layers: vLLM's CPU MoE kernels (absent from a vLLM wheel built for CUDA)
# would stop the processing of the experts, not of the attention under test.
DEEPSEEK_V3_DENSE = dict(models.DEEPSEEK_V3, first_k_dense_replace=models.DEEPSEEK_V3["num_hidden_layers"])


def processed(config: dict[str, Any], seed: int) -> tuple[Any, Any]:
    """A model as a vLLM engine holds it after start-up: loaded by vLLM from the state dict of ``seed``,
    then processed by vLLM's model loader (``process_weights_after_loading``)."""
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader.utils import process_weights_after_loading

    model, vllm_config = models.build(config)
    with set_current_vllm_config(vllm_config):
        model.load_weights(iter(models.hf_state_dict(config, seed).items()))
        process_weights_after_loading(model, vllm_config.model_config, torch.device("cpu"))
    return model, vllm_config


def backend(model: Any, vllm_config: Any) -> Any:
    """The weightsync engine vLLM's factory makes for this worker."""
    from vllm.config import WeightTransferConfig
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    from weightsync.integrations.vllm import register

    register()
    return WeightTransferEngineFactory.create_engine(WeightTransferConfig(backend="weightsync"), vllm_config,
                                                     torch.device("cpu"), model)


@pytest.mark.parametrize("config", [models.LLAMA, DEEPSEEK_V3_DENSE], ids=["llama", "deepseek-v3-mla"])
def test_a_processed_model_is_updated_bit_identically_or_refused(config: dict[str, Any]) -> None:
    ref, _ = processed(config, seed=0)
    target, target_config = processed(config, seed=5)  # an engine started from other weights
    engine = backend(target, target_config)
    sd = models.hf_state_dict(config, seed=0)
    checkpoint = checkpoint_of(sd)
    converted = post_load_conversions(target)
    try:
        layout = engine.derive(checkpoint)
    except LayoutError as err:
        # A platform whose kernels read converted weights (vLLM's CPU GEMM with oneDNN or sgl prepacks
        # linear weights): refused, naming parameters post_load_conversions names.
        assert converted, str(err)
        assert any(repr(name) in str(err) for name in converted), str(err)
        return
    assert not set(converted) & set(layout.pieces)
    fill_through_planner(target, layout, sd)  # poisons every parameter first, W_UK_T/W_UV included
    want, got = dict(ref.named_parameters()), dict(target.named_parameters())
    assert want.keys() == got.keys()
    derived = [k for k in want if raw(want[k]) != raw(got[k])]
    if config is DEEPSEEK_V3_DENSE:
        # MLA's kernel tensors are made from kv_b_proj after loading: the backend re-runs that
        layers = range(config["num_hidden_layers"])
        assert [r.inputs for r in engine.refreshes] == [
            (f"model.layers.{i}.self_attn.kv_b_proj.weight",) for i in layers]
        # Before the re-run only those can differ (where vLLM made them as views of kv_b_proj's weight,
        # as on CPU, they already follow the writes; where it copies them, only the re-run updates them)
        assert set(derived) <= {f"model.layers.{i}.self_attn.mla_attn.mla_attn.{w}"
                                for i in layers for w in ("W_UV", "W_UK_T")}
    else:
        assert derived == [] and engine.refreshes == []
    engine.after_update()
    assert [k for k in want if raw(want[k]) != raw(got[k])] == []


def test_mla_with_a_packing_backend_is_refused_naming_kv_b_proj() -> None:
    """Where MLA's backend packs W_UK/W_UV itself after loading (AMX on CPU, AITER on ROCm), the derivation
    cannot be re-run as is: kv_b_proj's weight is refused."""
    model, vllm_config = models.build(DEEPSEEK_V3_DENSE)
    for module in model.modules():
        if type(module).__name__ == "MLAAttention":
            # The flag vLLM sets when it picks its AMX MLA backend (uses_amx_bmm), which this CPU lacks.
            module.is_amx_bmm_enabled = True
    with pytest.raises(LayoutError) as err:
        backend(model, vllm_config).derive(checkpoint_of(models.hf_state_dict(DEEPSEEK_V3_DENSE)))
    assert "'model.layers.0.self_attn.kv_b_proj.weight'" in str(err.value)
    assert "MLAAttention" in str(err.value)


def test_a_real_engine_is_updated_in_place_or_refused() -> None:
    """vLLM's LLM(...) on CPU with the weightsync backend (tests/vllm/llm_engine.py, its own process):
    either the backend refuses naming a parameter vLLM converted after loading (its CPU GEMM prepacks
    linear weights where oneDNN or sgl kernels exist), or a push leaves every parameter bit-identical to
    the engine's own loading and greedy generation unchanged. Skips with vLLM's error where vLLM's engine
    does not start (a vLLM wheel built for CUDA has no CPU kernels)."""
    import json
    import os
    import subprocess
    import sys

    from tests import ROOT

    proc = subprocess.run([sys.executable, "-m", "tests.vllm.llm_engine"], capture_output=True, text=True,
                          timeout=900, cwd=ROOT, env={**os.environ, "PYTHONPATH": ROOT})
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    if "unavailable" in got:
        pytest.skip(f"vLLM's engine does not start on this machine: {got['unavailable']}")
    if "refused" in got:
        assert any(repr(name) in got["refused"] for name in got["converted"]), got
        return
    assert got["differ"] == [], got
    assert got["after"] == got["before"], got


def test_fused_experts_on_a_prepacking_moe_backend_are_refused_naming_w13() -> None:
    """vLLM's CPU fused-MoE backend (like FlashInfer's and AITER's on GPUs) prepacks or shuffles w13/w2
    after loading: the backend refuses the experts instead of writing checkpoint bytes the kernels would
    not read. (On CUDA's Triton backend the experts are read as loaded and pass this check.)"""
    from vllm.config import set_current_vllm_config

    model, vllm_config = models.build(models.QWEN3_MOE)
    with set_current_vllm_config(vllm_config):
        experts = next(m for m in model.modules() if type(m).__name__ == "RoutedExperts")
    backend_name = experts.quant_method.unquantized_backend.name
    if backend_name in ("TRITON", "BATCHED_TRITON"):
        pytest.skip(f"vLLM picked its {backend_name} fused-MoE backend here, which reads w13/w2 as loaded")
    with pytest.raises(LayoutError) as err:
        backend(model, vllm_config).derive(checkpoint_of(models.hf_state_dict(models.QWEN3_MOE)))
    assert "'model.layers.0.mlp.experts.routed_experts.w13_weight'" in str(err.value), str(err.value)
    assert f"{backend_name} fused-MoE backend" in str(err.value)
