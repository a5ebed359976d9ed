"""Model layouts: parameter counts equal the configs' ``_expected`` figures, trainer and vLLM layouts tile
every tensor as they should, and a moderate-scale plan from them is valid."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from weightsync.plan import plan
from weightsync.plan.layout import DTYPES
from weightsync.sim.models import CONFIGS, checkpoint, counts, inference_layouts, load_config, trainer_layouts

MODELS = CONFIGS
CONFIGS = sorted(MODELS.glob("*.json"))


@pytest.mark.parametrize("path", CONFIGS, ids=[p.stem for p in CONFIGS])
def test_counts_equal_expected(path: Path) -> None:
    cfg = load_config(path)
    exp = cfg["_expected"]
    got = counts(cfg)
    want = exp.get("weight_elements", exp.get("weight_elements_without_mtp"))
    assert got["weight_elements"] == want
    if "fp8_scale_elements" in exp:
        assert got["fp8_scale_elements"] == exp["fp8_scale_elements"]
    if "tensors" in exp:
        assert got["tensors"] == exp["tensors"]
    if "fp8_checkpoint_gib_approx" in exp:
        assert got["fp8_bytes"] / 2**30 == pytest.approx(exp["fp8_checkpoint_gib_approx"], abs=0.01)


def _coverage(layouts: list, names: list[str]) -> np.ndarray:
    """Elements of each tensor covered by the regions of the given (distinct) layouts."""
    cov = np.zeros(len(names), np.int64)
    for lay in layouts:
        np.add.at(cov, lay.tensor, np.prod(lay.shape, axis=1))
    return cov


@pytest.mark.parametrize("kind", ["hsdp:8", "fsdp", "tp:4,hsdp:8"])
def test_trainer_layouts_tile_every_tensor(kind: str) -> None:
    cfg = load_config(MODELS / "llama-3.1-70b.json")
    lays = trainer_layouts(cfg, 16, kind)
    assert len(lays) == 16
    group = 16 if kind == "fsdp" else 8
    distinct = lays[:group]
    assert len({id(x) for x in distinct}) == group
    if kind != "fsdp":
        assert lays[8] is lays[0]  # nodes replicate
    ck = checkpoint(cfg)
    shp, _ = ck.arrays()
    want = np.prod(shp, axis=1)
    if kind.startswith("tp:4"):  # tensors without a TP split are replicated over the 4 TP ranks
        split = np.isin(np.array(ck.role), ["col", "kv", "row", "vocab"])
        want = np.where(split, want, 4 * want)
    assert np.array_equal(_coverage(distinct, ck.names), want)


def test_vllm_layout_of_llama() -> None:
    cfg = load_config(MODELS / "llama-3.1-70b.json")
    lays = inference_layouts(cfg, 16, 8, "bf16")
    assert lays[8] is lays[0]
    r0 = lays[0]
    keys = dict(zip(r0.keys, r0.key_nbytes.tolist(), strict=True))
    # qkv_proj per TP rank: 64/8 q heads + 1 k + 1 v head of 128, times hidden 8192, bf16
    assert keys["model.layers.0.self_attn.qkv_proj.weight"] == (8 + 1 + 1) * 128 * 8192 * 2
    assert keys["model.layers.0.mlp.gate_up_proj.weight"] == 2 * (28672 // 8) * 8192 * 2
    assert keys["model.layers.0.mlp.down_proj.weight"] == 8192 * (28672 // 8) * 2
    assert keys["model.embed_tokens.weight"] == (128256 // 8) * 8192 * 2
    # every non-replicated tensor is covered exactly once by one replica's 8 ranks
    ck = checkpoint(cfg)
    shp, _ = ck.arrays()
    cov = _coverage(lays[:8], r0.table.names)[: len(ck.names)]
    full = np.prod(shp, axis=1)
    rep = np.array([r == "rep" for r in ck.role])
    assert np.array_equal(cov[~rep], full[~rep])
    assert np.array_equal(cov[rep], 8 * full[rep])


def test_vllm_layout_of_kimi_experts_and_scales() -> None:
    cfg = load_config(MODELS / "kimi-k2.json")
    lays = inference_layouts(cfg, 16, 16, "fp8")
    names = lays[0].table.names
    idx = {n: i for i, n in enumerate(names)}
    e_gate = [idx[f"model.layers.5.mlp.experts.{e}.gate_proj.weight"] for e in range(384)]
    owner = []
    for e, t in enumerate(e_gate):
        holders = [r for r in range(16) if np.any(lays[r].tensor == t)]
        assert len(holders) == 1, e
        owner.append(holders[0])
    assert owner == [e // 24 for e in range(384)]  # whole experts, 24 per EP rank
    keys = dict(zip(lays[3].keys, lays[3].key_nbytes.tolist(), strict=True))
    assert keys["model.layers.5.mlp.experts.routed_experts.w13_weight"] == 24 * 2 * 2048 * 7168
    assert keys["model.layers.5.mlp.experts.routed_experts.w13_weight_scale_inv"] == 24 * 2 * 16 * 56 * 4
    assert keys["model.layers.5.self_attn.fused_qkv_a_proj.weight"] == (1536 + 576) * 7168
    # the router's score-correction bias is float32 in the checkpoints and in vLLM, on both sides
    assert keys["model.layers.5.mlp.gate.e_score_correction_bias"] == 384 * 4
    bias = idx["model.layers.5.mlp.gate.e_score_correction_bias"]
    assert DTYPES[int(lays[3].table.dtype[bias])] == "float32"
    held = trainer_layouts(cfg, 8, "fsdp")[0].table
    assert DTYPES[int(held.dtype[held.index()[names[bias]]])] == "float32"
    assert keys["model.layers.5.self_attn.fused_qkv_a_proj.weight_scale_inv"] == (12 + 5) * 56 * 4
    # one replica holds the FP8 checkpoint plus copies of what TP replicates
    total = sum(lay.nbytes() for lay in lays)
    assert total >= counts(cfg)["fp8_bytes"]


def test_plan_llama_70b_moderate_scale() -> None:
    """16 trainer GPUs (HSDP 2 x 8) to 2 replicas of TP 8 in FP8: valid, every byte once."""
    cfg = load_config(MODELS / "llama-3.1-70b.json")
    src = trainer_layouts(cfg, 16, "hsdp:8")
    dst = inference_layouts(cfg, 16, 8, "fp8")
    p = plan(src, dst, source_hosts=[r // 8 for r in range(16)],
             destination_hosts=[10 + r // 8 for r in range(16)], fp8_block=(128, 128))
    replica = sum(lay.nbytes() for lay in dst[:8])
    assert p.nbytes == 2 * replica
    assert np.all(p.bytes_per_destination() == p.needed_bytes)
    b = p.bytes_per_source()
    assert b.max() / b.mean() < 1.05


def test_tiny_config_roundtrip(tmp_path: Path) -> None:
    cfg = {"architectures": ["Qwen3MoeForCausalLM"], "hidden_size": 256, "num_hidden_layers": 2,
           "moe_intermediate_size": 128, "num_experts": 8, "num_experts_per_tok": 2, "num_attention_heads": 4,
           "num_key_value_heads": 2, "head_dim": 64, "vocab_size": 1000, "tie_word_embeddings": False}
    path = tmp_path / "tiny.json"
    path.write_text(json.dumps(cfg))
    c = load_config(path)
    src = trainer_layouts(c, 8, "fsdp")
    dst = inference_layouts(c, 8, 4, "bf16")
    p = plan(src, dst)
    assert p.nbytes == sum(lay.nbytes() for lay in dst)


def test_a_config_is_found_by_its_name_or_path_and_a_missing_one_named() -> None:
    assert load_config("kimi-k2") == load_config(MODELS / "kimi-k2.json")
    assert load_config("kimi-k2")["_name"] == "kimi-k2"
    with pytest.raises(FileNotFoundError, match="kimi-k2"):  # the error lists the names there are
        load_config("kimi-k3")
