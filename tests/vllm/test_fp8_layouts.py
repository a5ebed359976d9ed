"""DeepSeek-V3-style FP8 block-quantized checkpoints (``weight_scale_inv``): a trainer holding bf16 weights
pushes them through the layout derived from vLLM's own loaders, the sender quantizes (weightsync's
runtime preparation, the sender code of a real push), and every parameter, FP8 values and float32 block
scales alike, is bit-identical to what vLLM's load_weights holds for the FP8 checkpoint that vLLM's own
``per_block_cast_to_fp8`` makes of the same weights. Runs in .venv-vllm.

vLLM's CPU platform has FP8 block GEMM kernels only for CPUs with AMX tiles; elsewhere the model is
built with that kernel's availability check answered yes (the kernel is chosen when the layers are
made and runs only in forward, which nothing here calls; loading and the loaders are vLLM's own)."""

from __future__ import annotations

import importlib.util
from typing import Any

import pytest

if importlib.util.find_spec("vllm") is None:
    pytest.skip("vLLM is not installed here: tests/vllm run in .venv-vllm (bash scripts/setup_vllm.sh)",
                allow_module_level=True)

import torch

from tests.vllm import models
from tests.vllm.test_layouts import fsdp_halves, raw
from weightsync.integrations.vllm.layouts import (
    SCALE_SUFFIX,
    checkpoint_of,
    derive_layout,
    fp8_checkpoint,
    post_load_conversions,
)
from weightsync.plan import plan
from weightsync.runtime.describe import describe_tensors

BLOCK = (128, 128)
# DeepSeek-V3's quantization_config, and dimensions that make whole and partial 128 x 128 tiles
# (kv_a_proj_with_mqa: 160 rows; o_proj: 64 columns) without FusedMoE's refined scale grid.
FP8_CONFIG = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
              "weight_block_size": list(BLOCK)}
DEEPSEEK_V3_FP8 = dict(models.DEEPSEEK_V3, hidden_size=128, intermediate_size=256,
                       moe_intermediate_size=128, num_attention_heads=2, num_key_value_heads=2,
                       q_lora_rank=128, kv_lora_rank=128, qk_nope_head_dim=32, qk_rope_head_dim=32,
                       v_head_dim=32, quantization_config=FP8_CONFIG)


@pytest.fixture
def fp8_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    if not torch.cpu._is_amx_tile_supported():
        from vllm.model_executor.kernels.linear.scaled_mm import cpu as cpu_kernels

        monkeypatch.setattr(cpu_kernels.CPUFp8BlockScaledMMKernel, "is_supported",
                            classmethod(lambda cls, compute_capability=None: (True, None)))


def vllm_fp8_state_dict(sd: dict[str, Any], fp8_names: set[str]) -> dict[str, Any]:
    """The FP8 checkpoint of ``sd`` as vLLM's own block quantizer makes it: the named tensors become
    FP8 values and float32 ``_scale_inv`` tile scales."""
    from vllm.utils.deep_gemm import per_block_cast_to_fp8

    out: dict[str, Any] = {}
    for name, t in sd.items():
        if name not in fp8_names:
            out[name] = t
            continue
        if t.dim() == 2:
            q, s = per_block_cast_to_fp8(t, list(BLOCK))
        else:
            q, s = (torch.stack(x) for x in zip(*(per_block_cast_to_fp8(e, list(BLOCK)) for e in t),
                                                strict=True))
        out[name], out[name + SCALE_SUFFIX] = q, s
    return out


def test_fp8_checkpoint_lands_bit_identically_to_vllm_loading_it(fp8_kernels: None) -> None:
    from vllm.config import set_current_vllm_config

    from tests.runtime.test_transforms import run_in_process

    sd = models.hf_state_dict(DEEPSEEK_V3_FP8)
    target, target_config = models.build(DEEPSEEK_V3_FP8)
    with set_current_vllm_config(target_config):
        checkpoint = fp8_checkpoint(target, checkpoint_of(sd), BLOCK)
        layout = derive_layout(target, checkpoint)
    fp8_names = {ct.name for ct in checkpoint if ct.dtype.startswith("float8")}
    # every projection is quantized; embeddings, norms, the router, its bias and lm_head are not
    assert "model.layers.1.self_attn.kv_b_proj.weight" in fp8_names
    assert "model.layers.1.mlp.experts.3.down_proj.weight" in fp8_names
    assert not {"model.embed_tokens.weight", "lm_head.weight", "model.layers.1.mlp.gate.weight",
                "model.layers.1.mlp.gate.e_score_correction_bias"} & fp8_names
    assert layout.unused == [] and layout.unloaded == []
    # kv_a_proj_with_mqa's 160 rows are two tiles, at tile row 1 of the fused scales after q_a_proj's
    assert layout.pieces["model.layers.1.self_attn.fused_qkv_a_proj.weight_scale_inv"] == [
        ("model.layers.1.self_attn.q_a_proj.weight_scale_inv", (1, 1), (0, 0), (1, 1), (0, 0)),
        ("model.layers.1.self_attn.kv_a_proj_with_mqa.weight_scale_inv", (2, 1), (0, 0), (2, 1), (1, 0))]

    ref, ref_config = models.build(DEEPSEEK_V3_FP8)
    with set_current_vllm_config(ref_config):
        ref.load_weights(iter(vllm_fp8_state_dict(sd, fp8_names).items()))

    with torch.no_grad():
        for p in target.parameters():  # poison: NaN for floats, 0x7F bytes (NaN in e4m3) for FP8
            p.data.view(torch.uint8).fill_(0x7F)
    layout.apply_fills(target)
    dst = layout.tensors(target)
    halves = fsdp_halves(sd)
    p = plan([describe_tensors(h) for h in halves], [describe_tensors(dst)], allow_cast=True,
             fp8_block=BLOCK)
    run_in_process(p, [{k: s.local_tensor for k, s in h.items()} for h in halves],
                   [{k: v.local_tensor for k, v in dst.items()}], 1 << 20)
    want, got = dict(ref.named_parameters()), dict(target.named_parameters())
    assert want.keys() == got.keys()
    assert [k for k in want if raw(want[k]) != raw(got[k])] == []
    assert got["model.layers.1.self_attn.o_proj.weight"].dtype == torch.float8_e4m3fn


def test_fp8_layers_are_named_as_converted_after_loading(fp8_kernels: None) -> None:
    """vLLM's FP8 methods rewrite weights and scales into the kernels' format after loading (on this
    platform, VNNI prepacking for AMX): the parameters are named, with the method."""
    model, _ = models.build(DEEPSEEK_V3_FP8)
    conversions = post_load_conversions(model)
    assert "Fp8LinearMethod" in conversions["model.layers.0.self_attn.fused_qkv_a_proj.weight"]
    assert "Fp8LinearMethod" in conversions["model.layers.1.mlp.shared_experts.down_proj.weight_scale_inv"]
    assert "Fp8MoEMethod" in conversions["model.layers.1.mlp.experts.routed_experts.w13_weight"]
    assert "model.layers.1.mlp.gate.weight" not in conversions


def test_the_backend_refuses_an_fp8_model_it_cannot_reprocess_naming_the_parameter(fp8_kernels: None) -> None:
    """The worker side derives the FP8 layout and tries the re-processing it would run after every update
    (tests/vllm/test_fp8_reprocess.py), before joining anything: where vLLM's CPU FP8 kernel cannot
    process its weights (the PyPI wheel has no compiled CPU ops), it refuses naming the parameter."""
    from tests.vllm.test_post_load import backend
    from weightsync.errors import LayoutError

    if hasattr(torch.ops._C, "convert_weight_packed"):
        pytest.skip("this vLLM has its compiled CPU ops: the FP8 kernel's processing can be re-run here")
    model, vllm_config = models.build(DEEPSEEK_V3_FP8)
    with pytest.raises(LayoutError) as err:
        backend(model, vllm_config).derive(checkpoint_of(models.hf_state_dict(DEEPSEEK_V3_FP8)))
    assert "'model.layers.0.self_attn.fused_qkv_a_proj.weight'" in str(err.value)
    assert "Fp8LinearMethod" in str(err.value)
    assert "convert_weight_packed" in str(err.value)  # vLLM's own error, passed on
