"""A small causal transformer policy, in the trainer's layout and in the rollouts' fused layout.

The trainer holds the model as ``torch.nn`` modules with separate ``q_proj``/``k_proj``/``v_proj`` and
``gate_proj``/``up_proj`` (the layout training frameworks and HF checkpoints use). The rollouts hold
what inference engines such as vLLM hold: ``qkv_proj = [q; k; v]`` and ``gate_up_proj = [gate; up]``
concatenated along the output dimension, and run the forward pass from those fused tensors
(:func:`fused_forward`). Both sides compute the same function, so a rollout's behaviour log-probs are
the trainer's log-probs of the version it generated with.

Attention is grouped-query (fewer k/v heads than q heads), so q, k and v have different sizes and
the fused tensor is not three equal slices: the destinations' layout is genuinely different.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .task import NUM_DIGIT_TOKENS


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    seq_len: int
    dim: int = 64
    layers: int = 2
    heads: int = 4
    kv_heads: int = 2
    hidden: int = 128

    @property
    def head_dim(self) -> int:
        return self.dim // self.heads


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
    """Causal grouped-query attention on ``[batch, seq, features]`` projections."""
    b, s, _ = q.shape
    q = q.view(b, s, cfg.heads, cfg.head_dim).transpose(1, 2)
    k = k.view(b, s, cfg.kv_heads, cfg.head_dim).transpose(1, 2)
    v = v.view(b, s, cfg.kv_heads, cfg.head_dim).transpose(1, 2)
    group = cfg.heads // cfg.kv_heads
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    return out.transpose(1, 2).reshape(b, s, cfg.dim)


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.attn_norm = nn.Parameter(torch.ones(cfg.dim))
        self.q_proj = nn.Linear(cfg.dim, cfg.heads * cfg.head_dim, bias=False)
        self.k_proj = nn.Linear(cfg.dim, cfg.kv_heads * cfg.head_dim, bias=False)
        self.v_proj = nn.Linear(cfg.dim, cfg.kv_heads * cfg.head_dim, bias=False)
        self.o_proj = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.mlp_norm = nn.Parameter(torch.ones(cfg.dim))
        self.gate_proj = nn.Linear(cfg.dim, cfg.hidden, bias=False)
        self.up_proj = nn.Linear(cfg.dim, cfg.hidden, bias=False)
        self.down_proj = nn.Linear(cfg.hidden, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = rms_norm(x, self.attn_norm)
        x = x + self.o_proj(attention(self.q_proj(h), self.k_proj(h), self.v_proj(h), self.cfg))
        h = rms_norm(x, self.mlp_norm)
        return x + self.down_proj(F.silu(self.gate_proj(h)) * self.up_proj(h))


class Policy(nn.Module):
    """Token ids ``[batch, seq]`` -> logits over the 10 digits ``[batch, seq, 10]``."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok_emb = nn.Parameter(torch.randn(cfg.vocab_size, cfg.dim) * 0.5)
        self.pos_emb = nn.Parameter(torch.randn(cfg.seq_len, cfg.dim) * 0.5)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.final_norm = nn.Parameter(torch.ones(cfg.dim))
        # Zero output head: the first version picks digits uniformly, i.e. starts exactly at chance.
        self.lm_head = nn.Parameter(torch.zeros(NUM_DIGIT_TOKENS, cfg.dim))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.tok_emb[tokens] + self.pos_emb[: tokens.shape[1]]
        for layer in self.layers:
            x = layer(x)
        return rms_norm(x, self.final_norm) @ self.lm_head.T


# ------------------------------------------------------------------------------------------------
# The rollouts' fused layout


def fused_parts(cfg: ModelConfig, layer: int) -> dict[str, list[tuple[str, int]]]:
    """Fused key -> [(trainer parameter name, rows)] in concatenation order (dim 0)."""
    p = f"layers.{layer}."
    q_rows, kv_rows = cfg.heads * cfg.head_dim, cfg.kv_heads * cfg.head_dim
    qkv = [(p + "q_proj.weight", q_rows), (p + "k_proj.weight", kv_rows), (p + "v_proj.weight", kv_rows)]
    gate_up = [(p + "gate_proj.weight", cfg.hidden), (p + "up_proj.weight", cfg.hidden)]
    return {p + "qkv_proj.weight": qkv, p + "gate_up_proj.weight": gate_up}


def fuse(cfg: ModelConfig, params: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The rollouts' tensors built from full trainer-layout tensors (also the reference to check against)."""
    fused_from: set[str] = set()
    out: dict[str, torch.Tensor] = {}
    for layer in range(cfg.layers):
        for key, parts in fused_parts(cfg, layer).items():
            out[key] = torch.cat([params[name] for name, _ in parts], dim=0)
            fused_from.update(name for name, _ in parts)
    for name, t in params.items():
        if name not in fused_from:
            out[name] = t.clone()
    return out


def fused_forward(cfg: ModelConfig, w: dict[str, torch.Tensor], tokens: torch.Tensor) -> torch.Tensor:
    """:meth:`Policy.forward` computed from the fused tensors, the way the rollout engine runs it."""
    x = w["tok_emb"][tokens] + w["pos_emb"][: tokens.shape[1]]
    q_rows, kv_rows = cfg.heads * cfg.head_dim, cfg.kv_heads * cfg.head_dim
    for i in range(cfg.layers):
        p = f"layers.{i}."
        h = rms_norm(x, w[p + "attn_norm"])
        q, k, v = (h @ w[p + "qkv_proj.weight"].T).split([q_rows, kv_rows, kv_rows], dim=-1)
        x = x + attention(q, k, v, cfg) @ w[p + "o_proj.weight"].T
        h = rms_norm(x, w[p + "mlp_norm"])
        gate, up = (h @ w[p + "gate_up_proj.weight"].T).split([cfg.hidden, cfg.hidden], dim=-1)
        x = x + (F.silu(gate) * up) @ w[p + "down_proj.weight"].T
    return rms_norm(x, w["final_norm"]) @ w["lm_head"].T


def action_logprobs(logits: torch.Tensor, tokens: torch.Tensor, prompt_len: int) -> torch.Tensor:
    """Log-probs ``[batch, answer_len]`` of the answer tokens of full sequences ``tokens``.

    The logits at position t predict token t + 1, so the answer (positions ``prompt_len..``) is scored
    by positions ``prompt_len - 1 .. seq - 2``.
    """
    logp = torch.log_softmax(logits[:, prompt_len - 1:-1].float(), dim=-1)
    return logp.gather(-1, tokens[:, prompt_len:].unsqueeze(-1)).squeeze(-1)


@torch.no_grad()
def generate(cfg: ModelConfig, w: dict[str, torch.Tensor], prompts: torch.Tensor, answer_len: int,
             generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Samples ``answer_len`` digits after each prompt; returns (full sequences, their log-probs)."""
    tokens = prompts
    for _ in range(answer_len):
        # The sequences are a handful of tokens: recomputing the prefix is cheaper than a KV cache here.
        logits = fused_forward(cfg, w, tokens)[:, -1].float()
        nxt = torch.multinomial(torch.softmax(logits, dim=-1).cpu(), 1, generator=generator).to(tokens.device)
        tokens = torch.cat([tokens, nxt], dim=1)
    logprobs = action_logprobs(fused_forward(cfg, w, tokens), tokens, prompts.shape[1])
    return tokens, logprobs
