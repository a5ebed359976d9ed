"""Layouts derived from vLLM's own loaders carry a push bit for bit: a tiny model vLLM builds on CPU is
loaded once by vLLM (the reference) and once through weightsync's planner from two FSDP-style halves of
the same Hugging Face state dict, using only the layout read off the live model. Runs in .venv-vllm."""

from __future__ import annotations

import importlib.util
from typing import Any

import pytest

if importlib.util.find_spec("vllm") is None:
    pytest.skip("vLLM is not installed here: tests/vllm run in .venv-vllm (bash scripts/setup_vllm.sh; "
                "scripts/test.sh runs them there)", allow_module_level=True)

import torch

from tests.support.plan_executor import execute
from tests.vllm import models
from weightsync.integrations.vllm.layouts import checkpoint_of, derive_layout
from weightsync.plan import plan
from weightsync.runtime.describe import Sharded, describe_tensors


def fsdp_halves(sd: dict[str, Any]) -> list[dict[str, Sharded]]:
    """Rank r of 2 holds rows [r*ceil(n/2), ...) of every tensor, as FSDP2's Shard(0) places them."""
    ranks = []
    for r in range(2):
        held = {}
        for k, v in sd.items():
            n = v.shape[0]
            lo, hi = min(n, r * ((n + 1) // 2)), min(n, (r + 1) * ((n + 1) // 2))
            held[k] = Sharded(v[lo:hi].clone(), tuple(v.shape), (lo,) + (0,) * (v.dim() - 1))
        ranks.append(held)
    return ranks


def raw(t: Any) -> bytes:
    return t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def loaded_pair(config: dict[str, Any]) -> tuple[Any, Any, Any, dict[str, Any]]:
    """(reference model loaded by vLLM, target model, target's vllm_config, the state dict)."""
    from vllm.config import set_current_vllm_config

    ref, ref_config = models.build(config)
    sd = models.hf_state_dict(config)
    with set_current_vllm_config(ref_config):
        ref.load_weights(iter(sd.items()))
    target, target_config = models.build(config)
    return ref, target, target_config, sd


def fill_through_planner(target: Any, layout: Any, sd: dict[str, Any]) -> None:
    """Poisons ``target`` (so every byte compared afterwards was written here), applies the layout's fills,
    and writes the state dict's FSDP halves into it through the planner along the derived layout."""
    with torch.no_grad():
        for p in target.parameters():
            p.data.fill_(float("nan"))
    layout.apply_fills(target)
    dst = layout.tensors(target)
    halves = fsdp_halves(sd)
    p = plan([describe_tensors(h) for h in halves], [describe_tensors(dst)], allow_cast=True)
    execute(p, [{k: s.local_tensor for k, s in h.items()} for h in halves],
            [{k: v.local_tensor for k, v in dst.items()}])


@pytest.mark.parametrize("config", [models.LLAMA, models.QWEN3, models.QWEN3_MOE, models.DEEPSEEK_V3],
                         ids=["llama", "qwen3", "qwen3-moe", "deepseek-v3"])
def test_derived_layout_fills_the_model_bit_identically(config: dict[str, Any]) -> None:
    from vllm.config import set_current_vllm_config

    ref, target, target_config, sd = loaded_pair(config)
    with set_current_vllm_config(target_config):
        layout = derive_layout(target, checkpoint_of(sd))
    assert layout.unloaded == []
    # Tied embeddings: vLLM's loader skips lm_head.weight, so the layout never asks for it.
    assert layout.unused == []
    fill_through_planner(target, layout, sd)
    want, got = dict(ref.named_parameters()), dict(target.named_parameters())
    assert want.keys() == got.keys()
    differ = [k for k in want if raw(want[k]) != raw(got[k])]
    assert differ == []


def test_fused_and_padded_parameters_are_described_as_vllm_lays_them_out() -> None:
    from vllm.config import set_current_vllm_config

    model, config = models.build(models.LLAMA)
    cfg = models.LLAMA
    hd, nq, nkv = cfg["head_dim"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    h, inter, vocab = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    sd = models.hf_state_dict(models.LLAMA)
    with set_current_vllm_config(config):
        layout = derive_layout(model, checkpoint_of(sd))
    params = dict(model.named_parameters())
    qkv = "model.layers.1.self_attn.qkv_proj.weight"
    # vLLM's parameter subclass (ModelWeightParameter) is described through its data
    assert type(params[qkv]).__name__ == "ModelWeightParameter"
    assert [(n.rsplit(".", 2)[-2], at) for n, _, _, _, at in layout.pieces[qkv]] == \
        [("q_proj", (0, 0)), ("k_proj", (nq * hd, 0)), ("v_proj", ((nq + nkv) * hd, 0))]
    gate_up = "model.layers.0.mlp.gate_up_proj.weight"
    assert [(n.rsplit(".", 2)[-2], at) for n, _, _, _, at in layout.pieces[gate_up]] == \
        [("gate_proj", (0, 0)), ("up_proj", (inter, 0))]
    # The vocabulary-parallel embedding pads its rows to a multiple of 64; the loader zeroes the padding
    padded = params["model.embed_tokens.weight"].shape[0]
    assert padded > vocab and padded % 64 == 0
    assert layout.pieces["model.embed_tokens.weight"] == [
        ("model.embed_tokens.weight", (vocab, h), (0, 0), (vocab, h), (0, 0))]
    assert [(f.at, f.shape, f.value) for f in layout.fills["model.embed_tokens.weight"]] == [
        ((vocab, 0), (padded - vocab, h), 0.0)]


def test_tied_lm_head_is_reported_unused() -> None:
    from vllm.config import set_current_vllm_config

    model, config = models.build(models.QWEN3)
    sd = models.hf_state_dict(models.QWEN3)
    sd["lm_head.weight"] = sd["model.embed_tokens.weight"].clone()  # a checkpoint that saves it anyway
    with set_current_vllm_config(config):
        layout = derive_layout(model, checkpoint_of(sd))
    assert layout.unused == ["lm_head.weight"]
    assert "model.layers.0.self_attn.q_norm.weight" in layout.pieces


def run_ranks(config_name: str, ep: bool = False) -> list[dict[str, Any]]:
    """Runs tests.vllm.tp_rank for both ranks of vLLM at TP 2 (two gloo ranks, two processes) and returns
    their JSON results."""
    import json
    import os
    import subprocess
    import sys

    from tests import ROOT
    from tests.runtime.group_actors import free_port

    port = free_port()
    env = {**os.environ, "PYTHONPATH": ROOT}
    args = [config_name] + (["ep"] if ep else [])
    procs = [subprocess.Popen([sys.executable, "-m", "tests.vllm.tp_rank", str(r), "2", str(port), *args],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT)
             for r in range(2)]
    results = []
    for proc in procs:
        out, err = proc.communicate(timeout=600)
        assert proc.returncode == 0, err[-3000:]
        results.append(json.loads(out.strip().splitlines()[-1]))
    return results


def test_tensor_parallel_ranks_are_filled_bit_identically() -> None:
    """vLLM at TP 2: each rank's layout (column shards of qkv/gate_up with its heads, row shards of
    o_proj/down_proj, its part of the padded vocabulary) fills it bit-identically."""
    results = run_ranks("LLAMA")
    cfg = models.LLAMA
    h, inter, hd = cfg["hidden_size"], cfg["intermediate_size"], cfg["head_dim"]
    for rank, got in enumerate(results):
        assert got["differ"] == [] and got["unloaded"] == [], (rank, got["differ"], got["unloaded"])
        pieces = got["pieces"]
        # row-parallel: this rank's half of the input dimension
        assert pieces["model.layers.0.mlp.down_proj.weight"] == [
            ["model.layers.0.mlp.down_proj.weight", [0, rank * inter // 2], [h, inter // 2], [0, 0]]]
        # QKV: 2 of the 4 query heads, 1 of the 2 KV heads
        assert [p[1:] for p in pieces["model.layers.1.self_attn.qkv_proj.weight"]] == [
            [[rank * 2 * hd, 0], [2 * hd, h], [0, 0]], [[rank * hd, 0], [hd, h], [2 * hd, 0]],
            [[rank * hd, 0], [hd, h], [3 * hd, 0]]]
        # vocabulary-parallel: 256 padded rows, 128 per rank; rank 1 holds the 72 real rows left
        assert pieces["model.embed_tokens.weight"][0][1:] == [[rank * 128, 0], [128 - 56 * rank, h], [0, 0]]


EXPERTS = "model.layers.{}.mlp.experts.{}.{}_proj.weight"
W13, W2 = "model.layers.{}.mlp.experts.routed_experts.w13_weight", \
    "model.layers.{}.mlp.experts.routed_experts.w2_weight"


def test_fused_experts_at_tensor_parallel_2_are_filled_bit_identically() -> None:
    """Qwen3-MoE at TP 2 (FusedMoE's expert weight loader): every rank holds all experts, each rank the
    half of every expert's gate/up rows (w13: [gate half; up half]) and of down's columns (w2)."""
    cfg = models.QWEN3_MOE
    moe, h, n = cfg["moe_intermediate_size"], cfg["hidden_size"], cfg["num_experts"]
    half = moe // 2
    for rank, got in enumerate(run_ranks("QWEN3_MOE")):
        assert got["differ"] == [] and got["unloaded"] == [] and got["unused"] == [], (rank, got)
        assert got["shapes"][W13.format(1)] == [n, moe, h] and got["shapes"][W2.format(1)] == [n, h, half]
        assert got["pieces"][W13.format(1)] == [
            [EXPERTS.format(1, e, which), [rank * half, 0], [half, h], [e, k * half, 0]]
            for e in range(n) for k, which in enumerate(("gate", "up"))]
        assert got["pieces"][W2.format(1)] == [
            [EXPERTS.format(1, e, "down"), [0, rank * half], [h, half], [e, 0, 0]] for e in range(n)]


def test_expert_parallel_ranks_hold_their_experts_whole_bit_identically() -> None:
    """Qwen3-MoE with expert parallelism over the 2 ranks (vLLM's CPU platform allows it): rank r holds
    experts 2r and 2r+1 whole; the other rank's experts are reported unused."""
    cfg = models.QWEN3_MOE
    moe, h, n = cfg["moe_intermediate_size"], cfg["hidden_size"], cfg["num_experts"]
    for rank, got in enumerate(run_ranks("QWEN3_MOE", ep=True)):
        assert got["differ"] == [] and got["unloaded"] == [], (rank, got["differ"], got["unloaded"])
        mine = [2 * rank, 2 * rank + 1]
        assert got["shapes"][W13.format(0)] == [2, 2 * moe, h] and got["shapes"][W2.format(0)] == [2, h, moe]
        assert got["pieces"][W13.format(0)] == [
            [EXPERTS.format(0, e, which), [0, 0], [moe, h], [e - mine[0], k * moe, 0]]
            for e in mine for k, which in enumerate(("gate", "up"))]
        assert got["pieces"][W2.format(0)] == [
            [EXPERTS.format(0, e, "down"), [0, 0], [h, moe], [e - mine[0], 0, 0]] for e in mine]
        others = [e for e in range(n) if e not in mine]
        assert sorted(got["unused"]) == sorted(EXPERTS.format(i, e, w) for i in range(2) for e in others
                                               for w in ("gate", "up", "down"))


def test_deepseek_v3_at_tensor_parallel_2_is_filled_bit_identically() -> None:
    """DeepSeek-V3 (MLA's fused_qkv_a_proj and kv_b_proj, a dense layer, routed and shared experts, the
    float32 router bias) at TP 2: both ranks bit-identical to vLLM's own loading, every tensor used."""
    for rank, got in enumerate(run_ranks("DEEPSEEK_V3")):
        assert got["differ"] == [] and got["unloaded"] == [] and got["unused"] == [], (rank, got["differ"])
        # the replicated low-rank projection fuses q_a_proj and kv_a_proj_with_mqa whole on each rank
        fused = got["pieces"]["model.layers.0.self_attn.fused_qkv_a_proj.weight"]
        assert [p[0].rsplit(".", 2)[-2] for p in fused] == ["q_a_proj", "kv_a_proj_with_mqa"]


def test_checkpoint_tensor_loaded_into_a_buffer_is_placed_in_that_buffer() -> None:
    """Gemma 4's ``layer_scalar`` is a persistent buffer that vLLM's loader fills from the checkpoint: the
    layout places it there (not in ``unused``, where a push of it would be dropped), and a push through
    the planner leaves every parameter and that buffer bit-identical to vLLM's own loading."""
    from vllm.config import set_current_vllm_config

    ref, target, target_config, sd = loaded_pair(models.GEMMA4)
    scalars = [f"model.layers.{i}.layer_scalar" for i in range(models.GEMMA4["num_hidden_layers"])]
    with set_current_vllm_config(target_config):
        layout = derive_layout(target, checkpoint_of(sd))
    assert layout.unused == [] and layout.unloaded == []
    for name in scalars:
        assert layout.pieces[name] == [(name, (1,), (0,), (1,), (0,))]
    buffers = dict(target.named_buffers())
    with torch.no_grad():
        for name in scalars:
            buffers[name].fill_(float("nan"))  # so that the value compared below was pushed
    fill_through_planner(target, layout, sd)
    want, got = dict(ref.named_parameters()), dict(target.named_parameters())
    assert [k for k in want if raw(want[k]) != raw(got[k])] == []
    want_buffers = dict(ref.named_buffers())
    assert [k for k in scalars if raw(want_buffers[k]) != raw(buffers[k])] == []
    assert raw(buffers[scalars[0]]) == raw(sd[scalars[0]])
