"""What the SGLang backend refuses, naming the parameter or checkpoint tensor, before anything joins a
group: models SGLang builds on CPU, their layouts read by the worker side's own code. And the custom
loader never raises into SGLang's scheduler. Runs in .venv-sglang (scripts/setup_sglang.sh)."""

from __future__ import annotations

import importlib.util
from typing import Any

import pytest

if importlib.util.find_spec("sglang") is None:
    pytest.skip("SGLang is not installed here: tests/sglang run in .venv-sglang (bash "
                "scripts/setup_sglang.sh; scripts/test.sh runs them there)", allow_module_level=True)

import torch

from tests.sglang import models
from weightsync.errors import LayoutError
from weightsync.integrations.sglang import load_weights
from weightsync.integrations.sglang.worker import SglangDestination, destination_of

# Block-quantized FP8 (DeepSeek-V3's checkpoint format), which SGLang's Fp8LinearMethod loads on CPU.
FP8_LLAMA = dict(models.LLAMA, hidden_size=128, intermediate_size=128, quantization_config={
    "quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [32, 32], "fmt": "e4m3"})


def _checkpoint(sd: dict[str, Any]) -> list[list[Any]]:
    return [[k, list(v.shape), str(v.dtype).removeprefix("torch.")] for k, v in sd.items()]


def test_a_quantized_model_is_refused_naming_the_parameter() -> None:
    models.setup(FP8_LLAMA)
    model = models.build()
    assert model.model.layers[0].self_attn.qkv_proj.weight.dtype == torch.float8_e4m3fn
    with pytest.raises(LayoutError, match=r"parameter 'model\.layers\.0\.[a-z_.]+\.weight'.*Fp8LinearMethod"):
        SglangDestination(model).init({"checkpoint": _checkpoint(models.hf_state_dict(FP8_LLAMA))})


def test_a_checkpoint_tensor_of_another_shape_is_refused_naming_it() -> None:
    models.setup(models.LLAMA)
    sd = models.hf_state_dict(models.LLAMA)
    sd["model.layers.1.self_attn.k_proj.weight"] = sd["model.layers.1.self_attn.k_proj.weight"][:-4]
    with pytest.raises(LayoutError, match=r"model\.layers\.1\.self_attn\.k_proj\.weight"):
        SglangDestination(models.build()).init({"checkpoint": _checkpoint(sd)})


def test_the_loader_never_raises_into_sglang() -> None:
    """Weights handed to weightsync's loader (not a command), or a command whose outcome cannot be
    reported (no Ray here), are logged; the model is untouched and SGLang's scheduler keeps running."""
    models.setup(models.LLAMA)
    model = models.build()
    before = models.raw(model.model.norm.weight)
    sd = models.hf_state_dict(models.LLAMA)
    load_weights(model, [("model.norm.weight", sd["model.norm.weight"])])
    load_weights(model, [("weightsync.finish", torch.frombuffer(bytearray(b'{"reply_to": "x"}'),
                                                                 dtype=torch.uint8))])
    assert models.raw(model.model.norm.weight) == before
    assert destination_of(model) is not None and destination_of(model).destination is None
