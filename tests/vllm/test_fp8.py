"""The sender's FP8 block quantization gives the bytes of vLLM's own block quantizer
(``per_block_cast_to_fp8`` in vllm/utils/deep_gemm.py), with and without UE8M0 scales. Runs in
.venv-vllm, on CPU (vLLM's function as vLLM runs it: compiled by torch.compile)."""

from __future__ import annotations

import importlib.util

import pytest

if importlib.util.find_spec("vllm") is None:
    pytest.skip("vLLM is not installed here: tests/vllm run in .venv-vllm (bash scripts/setup_vllm.sh; "
                "scripts/test.sh runs them there)", allow_module_level=True)

import torch

from tests.vllm import models  # noqa: F401  (selects vLLM's CPU platform before vLLM is imported)
from weightsync.runtime.transforms import quantize_fp8_blocks


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(
        a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def weights(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    # Magnitudes over many binades (so scales fall everywhere between powers of two), one all-zero tile
    # and one tile of tiny values (amax under the 1e-4 floor).
    x = torch.randn(shape, generator=g) * torch.exp2(torch.randint(-12, 12, shape, generator=g).float())
    x[..., :128, :128] = 0.0
    if shape[-2] > 128 and shape[-1] > 128:
        x[..., 128:256, 128:256] *= 1e-9
    return x.to(dtype)


@pytest.mark.parametrize("ue8m0", [False, True], ids=["float-scales", "ue8m0"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_quantizer_gives_vllms_bytes(dtype: torch.dtype, ue8m0: bool) -> None:
    from vllm.utils.deep_gemm import per_block_cast_to_fp8

    for seed, shape in enumerate([(256, 384), (333, 300), (129, 257), (1, 5)]):
        x = weights(shape, dtype, seed)
        want_q, want_s = per_block_cast_to_fp8(x, [128, 128], use_ue8m0=ue8m0)
        got_q, got_s = quantize_fp8_blocks(x, (128, 128), ue8m0=ue8m0)
        assert same_bits(got_s, want_s), (shape, (got_s != want_s).sum())
        assert same_bits(got_q, want_q), (shape, (got_q.view(torch.uint8) != want_q.view(torch.uint8)).sum())


def test_stacked_experts_are_quantized_slice_by_slice_as_vllm_would() -> None:
    from vllm.utils.deep_gemm import per_block_cast_to_fp8

    x = weights((3, 200, 260), torch.bfloat16, 7)
    got_q, got_s = quantize_fp8_blocks(x)
    for e in range(3):
        want_q, want_s = per_block_cast_to_fp8(x[e], [128, 128])
        assert same_bits(got_q[e], want_q) and same_bits(got_s[e], want_s), e
