"""FP8 block-quantized models as a vLLM engine holds them after start-up (loaded, then processed by
``process_weights_after_loading`` into the kernels' format): the backend lands the trainers' bytes in a
checkpoint-format copy of every quantized layer and, once a whole version has landed, re-runs the layer's
processing into its live kernel tensors, as vLLM's in-place reload does. Every byte is compared with
vLLM's own loading plus processing of the same FP8 checkpoint (made by vLLM's ``per_block_cast_to_fp8``)
in a second instance. Where vLLM cannot process the model on this machine, the backend refuses it at
init naming a parameter and vLLM's error, and the bit-identity case skips with that error. Runs in
.venv-vllm.

Three kernel set-ups, as vLLM's CPU platform allows them:

* ``cpu-amx``: vLLM's CPU FP8 GEMM (``CPUFp8BlockScaledMMKernel``, VNNI-prepacked weights), its AMX
  availability check answered yes where the CPU has no AMX (as tests/vllm/test_fp8_layouts.py does);
  its processing needs vLLM's compiled CPU ops (``torch.ops._C.convert_weight_packed``), which the PyPI
  wheel lacks;
* ``torch-block``: vLLM's generic block-FP8 kernel (``BlockWiseTorchFP8ScaledMMLinearKernel``, what CUDA
  and XPU fall back to) made the CPU platform's choice: its processing runs in torch on any platform
  (forward is never called here);
* FP8 experts (Qwen3-MoE): ``Fp8MoEMethod`` converts w13/w2 into its fused-MoE backend's format."""

from __future__ import annotations

import importlib.util
from typing import Any

import pytest

if importlib.util.find_spec("vllm") is None:
    pytest.skip("vLLM is not installed here: tests/vllm run in .venv-vllm (bash scripts/setup_vllm.sh)",
                allow_module_level=True)

import torch

from tests.vllm import models
from tests.vllm.test_fp8_layouts import BLOCK, FP8_CONFIG, vllm_fp8_state_dict
from tests.vllm.test_layouts import fsdp_halves, raw
from tests.vllm.test_post_load import backend
from weightsync.errors import LayoutError
from weightsync.integrations.vllm.layouts import checkpoint_of, fp8_checkpoint
from weightsync.plan import plan
from weightsync.runtime.describe import describe_tensors

# Qwen3 with FP8 block quantization (as Qwen3-*-FP8 checkpoints): head_dim 128 keeps q, k and v whole
# 128-row tiles (vLLM's fused qkv scale grid needs that); the MLP has two tiles of rows.
QWEN3_FP8 = dict(models.QWEN3, hidden_size=128, intermediate_size=256, head_dim=128, num_attention_heads=2,
                 num_key_value_heads=1, quantization_config=FP8_CONFIG)
QWEN3_MOE_FP8 = dict(models.QWEN3_MOE, hidden_size=128, intermediate_size=256, moe_intermediate_size=128,
                     head_dim=128, num_attention_heads=2, num_key_value_heads=1,
                     quantization_config=FP8_CONFIG)


@pytest.fixture(params=["cpu-amx", "torch-block"])
def kernel(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    from vllm.model_executor.kernels.linear.scaled_mm import cpu as cpu_kernels

    if request.param == "cpu-amx":
        if not torch.cpu._is_amx_tile_supported():
            monkeypatch.setattr(cpu_kernels.CPUFp8BlockScaledMMKernel, "is_supported",
                                classmethod(lambda cls, compute_capability=None: (True, None)))
    else:
        import vllm.model_executor.kernels.linear as linear_kernels
        from vllm.model_executor.kernels.linear.scaled_mm.pytorch import BlockWiseTorchFP8ScaledMMLinearKernel
        from vllm.platforms import PlatformEnum

        monkeypatch.setitem(linear_kernels._POSSIBLE_FP8_BLOCK_KERNELS, PlatformEnum.CPU,
                            [BlockWiseTorchFP8ScaledMMLinearKernel])
        monkeypatch.setattr(BlockWiseTorchFP8ScaledMMLinearKernel, "is_supported",
                            classmethod(lambda cls, compute_capability=None: (True, None)))
    return str(request.param)


def weights(config: dict[str, Any], seed: int) -> dict[str, Any]:
    """``models.hf_state_dict`` with every tensor scaled by a factor of its own (which depends on the
    seed), so that the FP8 block scales differ between seeds and tensors, not only the values."""
    g = torch.Generator().manual_seed(1000 + seed)
    return {k: (v.float() * torch.exp2(torch.rand((), generator=g) * 8 - 4)).to(v.dtype)
            for k, v in models.hf_state_dict(config, seed).items()}


def processed_fp8(config: dict[str, Any], seed: int) -> tuple[Any, Any, str | None]:
    """``(model, vllm_config, error)``: the model loaded by vLLM from the FP8 checkpoint of ``seed``'s
    weights, then processed by vLLM's model loader; ``error`` is vLLM's error where the processing fails
    on this machine (the model is then left loaded, unprocessed)."""
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader.utils import process_weights_after_loading

    model, vllm_config = models.build(config)
    sd = weights(config, seed)
    with set_current_vllm_config(vllm_config):
        fp8_names = {ct.name for ct in fp8_checkpoint(model, checkpoint_of(sd), BLOCK)
                     if ct.dtype.startswith("float8")}
        model.load_weights(iter(vllm_fp8_state_dict(sd, fp8_names).items()))
        try:
            process_weights_after_loading(model, vllm_config.model_config, torch.device("cpu"))
        except Exception as err:
            return model, vllm_config, f"{type(err).__name__}: {err}"
    return model, vllm_config, None


def push(target: Any, layout: Any, sd: dict[str, Any]) -> None:
    """Writes ``sd``'s FSDP halves through the planner, the senders quantizing to FP8 blocks, into the
    tensors the backend registers (the landing copies of the quantized layers), poisoned first."""
    from tests.runtime.test_transforms import run_in_process

    dst = layout.tensors(target)
    with torch.no_grad():
        for t in dst.values():
            t.local_tensor.view(torch.uint8).fill_(0x7F)  # NaN in bf16, float32 and e4m3
    layout.apply_fills(target)
    halves = fsdp_halves(sd)
    p = plan([describe_tensors(h) for h in halves], [describe_tensors(dst)], allow_cast=True, fp8_block=BLOCK)
    run_in_process(p, [{k: s.local_tensor for k, s in h.items()} for h in halves],
                   [{k: v.local_tensor for k, v in dst.items()}], 1 << 20)


def snapshot(model: Any) -> dict[str, bytes]:
    return {k: raw(v) for k, v in model.named_parameters()}


def refused_with_vllms_error(config: dict[str, Any], error: str, named: str) -> None:
    """vLLM cannot process ``config`` here: the backend refuses it at init, naming a parameter of a
    quantized layer (one ending in ``named``) and carrying vLLM's error."""
    model, vllm_config, _ = processed_fp8(config, seed=5)
    with pytest.raises(LayoutError) as err:
        backend(model, vllm_config).derive(checkpoint_of(weights(config, 0)))
    assert error.splitlines()[0][:80] in str(err.value), str(err.value)
    assert "re-running that processing here fails" in str(err.value)
    assert f"{named}'" in str(err.value).split(":")[0], str(err.value)
    pytest.skip(f"vLLM cannot process this FP8 model on this machine (the backend refuses it, naming "
                f"the parameter): {error.splitlines()[0][:300]}")


def test_an_fp8_model_is_reprocessed_after_each_update_bit_identically(kernel: str) -> None:
    ref, _, error = processed_fp8(QWEN3_FP8, seed=0)
    if error is not None:
        refused_with_vllms_error(QWEN3_FP8, error, "self_attn.qkv_proj.weight")
    target, target_config, _ = processed_fp8(QWEN3_FP8, seed=5)  # an engine started from other weights
    started = snapshot(target)
    engine = backend(target, target_config)
    sd = weights(QWEN3_FP8, seed=0)
    layout = engine.derive(checkpoint_of(sd))
    # every quantized linear is re-processed and lands in a checkpoint-format copy of its own
    quantized = sorted(n for n, m in target.named_modules()
                       if type(getattr(m, "quant_method", None)).__name__ == "Fp8LinearMethod")
    assert sorted(r.module for r in engine.reprocess) == quantized and len(quantized) == 8
    name = "model.layers.0.self_attn.qkv_proj.weight_scale_inv"
    assert layout.landing[name].data_ptr() != dict(target.named_parameters())[name].data_ptr()
    assert snapshot(target) == started  # deriving and the trial processing changed nothing live

    push(target, layout, sd)
    # while the version lands the quantized layers' kernels read the previous one, whole (the other
    # parameters take the bytes in place, as in any in-place update: generation is paused around it)
    kernel_tensors = [k for k in started if k.rpartition(".")[0] in quantized]
    assert len(kernel_tensors) == 16
    now, want = snapshot(target), snapshot(ref)
    assert [k for k in kernel_tensors if now[k] != started[k]] == []
    assert [k for k in kernel_tensors if now[k] == want[k]] == []  # seed 5's weights, not seed 0's
    engine.after_update()
    got = snapshot(target)
    assert want.keys() == got.keys()
    assert [k for k in want if want[k] != got[k]] == []
    assert dict(target.named_parameters())["model.layers.1.mlp.down_proj.weight"].dtype == torch.float8_e4m3fn

    # and again: back to the weights it started from (a re-run is the same processing as the first)
    push(target, layout, weights(QWEN3_FP8, seed=5))
    engine.after_update()
    assert snapshot(target) == started

    # a re-run that fails part way leaves the model marked torn (finish_weight_update raises) until a
    # later re-run completes
    from weightsync.errors import WeightSyncError

    failing = engine.reprocess[3]

    def broken() -> None:
        raise RuntimeError("kernel out of memory")

    object.__setattr__(failing, "run", broken)
    with pytest.raises(WeightSyncError, match="not a whole version") as err:
        engine.after_update()
    assert failing.module in str(err.value) and "kernel out of memory" in str(err.value)
    assert engine._torn is not None
    del failing.run
    engine.after_update()
    assert engine._torn is None and snapshot(target) == started


def test_fp8_experts_are_reprocessed_or_refused_with_vllms_error(kernel: str) -> None:
    if kernel != "torch-block":
        pytest.skip("one linear kernel is enough for the experts")
    ref, _, error = processed_fp8(QWEN3_MOE_FP8, seed=0)
    if error is not None:
        refused_with_vllms_error(QWEN3_MOE_FP8, error, "mlp.experts.routed_experts.w13_weight")
    target, target_config, _ = processed_fp8(QWEN3_MOE_FP8, seed=5)
    engine = backend(target, target_config)
    sd = weights(QWEN3_MOE_FP8, seed=0)
    layout = engine.derive(checkpoint_of(sd))
    assert any(r.module.endswith("mlp.experts.routed_experts") for r in engine.reprocess)
    push(target, layout, sd)
    engine.after_update()
    want, got = snapshot(ref), snapshot(target)
    assert [k for k in want if want[k] != got[k]] == []
