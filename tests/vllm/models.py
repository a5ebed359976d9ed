"""Tiny models that vLLM builds on CPU, and Hugging Face state dicts of random values for them.

vLLM must be told to run on its CPU platform before it is imported (VLLM_TARGET_DEVICE=cpu); every
model is built inside its own VllmConfig context (vLLM registers layer names per config, so a second
instance in the same context would clash), and vLLM's distributed state is set up once per process
(world of one gloo rank)."""

from __future__ import annotations

import json
import os
import socket
import tempfile
from typing import Any

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

# Small, but with every layout feature: GQA (4 query heads, 2 KV heads), fused qkv/gate_up, untied
# lm_head, and a vocabulary that is not a multiple of vLLM's padding (64), so the embedding has padding.
LLAMA = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
    "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
    "head_dim": 16, "vocab_size": 200, "max_position_embeddings": 128, "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "hidden_act": "silu",
}
QWEN3 = {
    "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 64,
    "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
    "head_dim": 16, "vocab_size": 200, "max_position_embeddings": 128, "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0, "tie_word_embeddings": True, "torch_dtype": "bfloat16", "hidden_act": "silu",
    "attention_bias": False,
}
# Qwen3-MoE: every layer sparse, 4 routed experts (fused into w13/w2 by FusedMoE), top-2 routing.
QWEN3_MOE = {
    "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": 64,
    "intermediate_size": 96, "moe_intermediate_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 200, "max_position_embeddings": 128,
    "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "hidden_act": "silu", "num_experts": 4, "num_experts_per_tok": 2, "norm_topk_prob": True,
    "decoder_sparse_step": 1, "mlp_only_layers": [], "attention_bias": False,
}
# DeepSeek-V3: MLA (low-rank q and kv projections, fused_qkv_a_proj in vLLM), a dense first layer, then
# MoE layers with a shared expert, sigmoid routing and its float32 e_score_correction_bias.
DEEPSEEK_V3 = {
    "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "hidden_size": 64,
    "intermediate_size": 96, "moe_intermediate_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 4, "vocab_size": 200, "max_position_embeddings": 128, "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0, "tie_word_embeddings": False, "torch_dtype": "bfloat16", "hidden_act": "silu",
    "q_lora_rank": 32, "kv_lora_rank": 32, "qk_nope_head_dim": 16, "qk_rope_head_dim": 16, "v_head_dim": 16,
    "n_routed_experts": 4, "n_shared_experts": 1, "num_experts_per_tok": 2, "first_k_dense_replace": 1,
    "moe_layer_freq": 1, "n_group": 1, "topk_group": 1, "routed_scaling_factor": 1.0, "norm_topk_prob": True,
    "scoring_func": "sigmoid", "topk_method": "noaux_tc", "rope_scaling": None, "attention_bias": False,
}

# Gemma 4 (text): a sliding and a full attention layer, q/k norms, four norms per layer, tied embeddings,
# and the per-layer ``layer_scalar`` that vLLM's loader copies into a persistent buffer, not a parameter.
GEMMA4 = {
    "architectures": ["Gemma4ForCausalLM"], "model_type": "gemma4_text", "hidden_size": 64,
    "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
    "head_dim": 16, "global_head_dim": 16, "vocab_size": 200, "max_position_embeddings": 128,
    "rms_norm_eps": 1e-6, "tie_word_embeddings": True, "torch_dtype": "bfloat16",
    "hidden_activation": "gelu_pytorch_tanh", "hidden_size_per_layer_input": 0,
    "vocab_size_per_layer_input": 200, "sliding_window": 32,
    "layer_types": ["sliding_attention", "full_attention"],
}

_distributed = False


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_distributed(tp: int = 1, rank: int = 0, port: int | None = None) -> None:
    """vLLM's process groups for a world of ``tp`` gloo ranks (tensor parallel, PP 1), once per process;
    every rank calls it with the same ``port``."""
    global _distributed
    if _distributed:
        return
    from vllm.distributed import init_distributed_environment, initialize_model_parallel

    init_distributed_environment(world_size=tp, rank=rank, local_rank=rank, backend="gloo",
                                 distributed_init_method=f"tcp://127.0.0.1:{port or _free_port()}")
    initialize_model_parallel(tp, 1)
    _distributed = True


def build(config: dict[str, Any], dtype: str = "bfloat16", tp: int = 1, rank: int = 0,
          port: int | None = None, ep: bool = False, device: str = "cpu") -> tuple[Any, Any]:
    """``(model, vllm_config)``: the model vLLM builds for ``config`` on CPU (this process's ``rank`` of
    ``tp``, whose ranks meet at ``port``; with ``ep`` the MoE layers' experts are split over the ranks
    instead of each expert's matrices), its parameters not yet loaded. Use the model inside
    ``set_current_vllm_config(vllm_config)``. ``device="meta"``: parameters without storage (real
    model shapes at no memory; their layouts can be derived, nothing loaded)."""
    import torch
    from vllm.config import (
        DeviceConfig,
        LoadConfig,
        ModelConfig,
        ParallelConfig,
        VllmConfig,
        set_current_vllm_config,
    )
    from vllm.model_executor.model_loader.utils import initialize_model
    from vllm.utils.torch_utils import set_default_torch_dtype

    folder = tempfile.mkdtemp(prefix="ws-vllm-model-")
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(config, f)
    model_config = ModelConfig(model=folder, tokenizer=folder, skip_tokenizer_init=True, dtype=dtype,
                               max_model_len=64, enforce_eager=True)
    vllm_config = VllmConfig(model_config=model_config, device_config=DeviceConfig("cpu"),
                             load_config=LoadConfig(load_format="dummy"),
                             parallel_config=ParallelConfig(tensor_parallel_size=tp,
                                                            enable_expert_parallel=ep))
    # Under a config without a model, vLLM's process groups include the expert-parallel one (it leaves
    # that out under a dense model's config), so that dense and MoE models can be built in one process.
    with set_current_vllm_config(VllmConfig(device_config=DeviceConfig("cpu"),
                                            parallel_config=ParallelConfig(tensor_parallel_size=tp))):
        init_distributed(tp, rank, port)
    with set_current_vllm_config(vllm_config), set_default_torch_dtype(model_config.dtype), \
            torch.device(device):
        model = initialize_model(vllm_config=vllm_config)
    return model, vllm_config


def hf_state_dict(config: dict[str, Any], seed: int = 0) -> dict[str, Any]:
    """A Hugging Face state dict of random (never zero) bf16 values for ``config``, with the standard
    Hugging Face names of these decoder-only families (written out here, not asked of vLLM, whose
    loaders are what is under test)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    h, inter, v = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    nq, nkv = config["num_attention_heads"], config.get("num_key_value_heads", 0)
    hd = config.get("head_dim") or h // nq

    def rnd(*shape: int) -> Any:
        # uniform in [0.5, 1.5) with a random sign: never zero, full use of bf16's mantissa
        x = torch.rand(*shape, generator=g) + 0.5
        sign = torch.randint(0, 2, shape, generator=g) * 2 - 1
        return (x * sign).to(torch.bfloat16)

    sd = {"model.embed_tokens.weight": rnd(v, h), "model.norm.weight": rnd(h)}
    if not config["tie_word_embeddings"]:
        sd["lm_head.weight"] = rnd(v, h)
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        if config["model_type"] == "deepseek_v3":
            sd |= _deepseek_layer(config, i, rnd)
            continue
        sd |= {p + "self_attn.q_proj.weight": rnd(nq * hd, h),
               p + "self_attn.k_proj.weight": rnd(nkv * hd, h),
               p + "self_attn.v_proj.weight": rnd(nkv * hd, h),
               p + "self_attn.o_proj.weight": rnd(h, nq * hd),
               p + "input_layernorm.weight": rnd(h), p + "post_attention_layernorm.weight": rnd(h)}
        if "num_experts" in config:  # Qwen3-MoE: a router and per-expert gate/up/down projections
            moe = config["moe_intermediate_size"]
            sd[p + "mlp.gate.weight"] = rnd(config["num_experts"], h)
            for e in range(config["num_experts"]):
                q = f"{p}mlp.experts.{e}."
                sd |= {q + "gate_proj.weight": rnd(moe, h), q + "up_proj.weight": rnd(moe, h),
                       q + "down_proj.weight": rnd(h, moe)}
        else:
            sd |= {p + "mlp.gate_proj.weight": rnd(inter, h), p + "mlp.up_proj.weight": rnd(inter, h),
                   p + "mlp.down_proj.weight": rnd(h, inter)}
        if config["model_type"] in ("qwen3", "qwen3_moe", "gemma4_text"):
            sd |= {p + "self_attn.q_norm.weight": rnd(hd), p + "self_attn.k_norm.weight": rnd(hd)}
        if config["model_type"] == "gemma4_text":
            sd |= {p + "pre_feedforward_layernorm.weight": rnd(h),
                   p + "post_feedforward_layernorm.weight": rnd(h), p + "layer_scalar": rnd(1)}
    return sd


def _deepseek_layer(config: dict[str, Any], i: int, rnd: Any) -> dict[str, Any]:
    """One DeepSeek-V3 decoder layer's Hugging Face tensors: MLA, then a dense MLP (the first
    ``first_k_dense_replace`` layers) or routed experts, a shared expert and the router with its float32
    score-correction bias."""
    h, nh = config["hidden_size"], config["num_attention_heads"]
    ql, kvl = config["q_lora_rank"], config["kv_lora_rank"]
    nope, rope, v = config["qk_nope_head_dim"], config["qk_rope_head_dim"], config["v_head_dim"]
    p = f"model.layers.{i}."
    a = p + "self_attn."
    sd = {a + "q_a_proj.weight": rnd(ql, h), a + "q_a_layernorm.weight": rnd(ql),
          a + "q_b_proj.weight": rnd(nh * (nope + rope), ql),
          a + "kv_a_proj_with_mqa.weight": rnd(kvl + rope, h),
          a + "kv_a_layernorm.weight": rnd(kvl), a + "kv_b_proj.weight": rnd(nh * (nope + v), kvl),
          a + "o_proj.weight": rnd(h, nh * v),
          p + "input_layernorm.weight": rnd(h), p + "post_attention_layernorm.weight": rnd(h)}

    def mlp(prefix: str, inter: int) -> dict[str, Any]:
        return {prefix + "gate_proj.weight": rnd(inter, h), prefix + "up_proj.weight": rnd(inter, h),
                prefix + "down_proj.weight": rnd(h, inter)}

    if i < config["first_k_dense_replace"]:
        return sd | mlp(p + "mlp.", config["intermediate_size"])
    moe, n = config["moe_intermediate_size"], config["n_routed_experts"]
    sd |= {p + "mlp.gate.weight": rnd(n, h), p + "mlp.gate.e_score_correction_bias": rnd(n).float()}
    sd |= mlp(p + "mlp.shared_experts.", moe * config["n_shared_experts"])
    for e in range(n):
        sd |= mlp(f"{p}mlp.experts.{e}.", moe)
    return sd
