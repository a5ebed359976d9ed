"""Layouts of real models, built from Hugging Face configs (``configs/*.json`` beside this module).

Trainer side: Hugging Face checkpoint names, every tensor sharded along dim 0 like FSDP2 does
(``torch.chunk`` sizes), over all trainer GPUs (``fsdp``), inside nodes of 8 and replicated across
nodes (``hsdp:8``), or Megatron-style tensor parallel inside FSDP (``tp:T``, a 2-D mesh).

Inference side: vLLM parameter names and vLLM's tensor-parallel layout: column-parallel (rows split)
and row-parallel (columns split) linears, ``qkv_proj`` and ``gate_up_proj`` fused per TP rank (MLA's
``fused_qkv_a_proj`` too), replicated norms and router, vocab-parallel embedding and head (vocabulary
padded to 64), experts whole on one rank with expert parallelism (FusedMoE's
``experts.routed_experts.w13_weight`` = per expert ``[gate; up]``), and FP8 block-quantized weights with
their ``weight_scale_inv`` block scales. Tensors that are float32 in the checkpoints and in vLLM
(DeepSeek's ``e_score_correction_bias``, buffers) are float32 on both sides whatever the weights' dtype.

Destination regions name the *logical* (Hugging Face) tensors they hold; the keys are the vLLM
parameter names the rollout registers. No torch needed: layouts are built as numpy columns, one
``Layout`` object per distinct layout, shared by every rank that has it (HSDP nodes, replicas).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from weightsync.errors import LayoutError
from weightsync.plan.layout import DTYPE_CODE, Layout, TensorTable

W = 2  # every tensor of these models has rank <= 2 (per-expert weights are separate tensors)
FP8 = "float8_e4m3fn"
SCALE = "_scale_inv"


# The Hugging Face configs (shapes) of the large models the simulator and the real-shape tests use.
CONFIGS = Path(__file__).resolve().parent / "configs"


def config_names() -> list[str]:
    """The names :func:`load_config` takes besides paths: the configs in :data:`CONFIGS`."""
    return sorted(p.stem for p in CONFIGS.glob("*.json"))


def load_config(path: str | Path) -> dict[str, Any]:
    """A model config: a JSON file's path, or the name of one in :data:`CONFIGS` (``kimi-k2``)."""
    file = Path(path)
    if not file.exists() and (CONFIGS / f"{path}.json").exists():
        file = CONFIGS / f"{path}.json"
    if not file.exists():
        raise FileNotFoundError(f"no model config {str(path)!r}: a JSON file's path, or one of "
                                f"{config_names()}")
    with open(file) as f:
        cfg = json.load(f)
    cfg.setdefault("_name", file.stem)
    return cfg


def family(cfg: Mapping[str, Any]) -> str:
    arch = (cfg.get("architectures") or [""])[0]
    if arch.startswith("Deepseek"):
        return "deepseek"
    if arch.startswith("Qwen3Moe"):
        return "qwen3moe"
    if arch.startswith(("Llama", "Qwen2", "Qwen3", "Mistral")):
        return "llama"
    raise LayoutError(f"no layout builder for architecture {arch!r}")


# ==================================================================================================
# Checkpoint listing


@dataclass
class Checkpoint:
    """Tensors of a Hugging Face checkpoint: names, shapes (left-padded to 2-D with 1), ranks, and
    which are FP8-quantizable linear weights (``quant``), non-weight buffers (``buffer``) or float32
    whatever the model's dtype (``float32``: buffers and DeepSeek's ``e_score_correction_bias``, float32
    in the checkpoints and in vLLM)."""

    names: list[str] = field(default_factory=list)
    shapes: list[tuple[int, ...]] = field(default_factory=list)
    quant: list[bool] = field(default_factory=list)
    buffer: list[bool] = field(default_factory=list)
    float32: list[bool] = field(default_factory=list)
    # tensor-parallel role on the inference side: "col", "row", "rep", "vocab", "expert"
    role: list[str] = field(default_factory=list)

    def add(self, name: str, shape: tuple[int, ...], role: str, quant: bool = False,
            buffer: bool = False, float32: bool = False) -> None:
        self.names.append(name)
        self.shapes.append(shape)
        self.quant.append(quant)
        self.buffer.append(buffer)
        self.float32.append(float32 or buffer)
        self.role.append(role)

    def arrays(self) -> tuple[np.ndarray, np.ndarray]:
        shp = np.ones((len(self.names), W), np.int64)
        nd = np.zeros(len(self.names), np.int8)
        for i, s in enumerate(self.shapes):
            shp[i, W - len(s):] = s
            nd[i] = len(s)
        return shp, nd


def _mla(cfg: Mapping[str, Any]) -> dict[str, int]:
    heads = cfg["num_attention_heads"]
    return {
        "q_a": cfg["q_lora_rank"], "heads": heads,
        "q_b": heads * (cfg["qk_nope_head_dim"] + cfg["qk_rope_head_dim"]),
        "kv_a": cfg["kv_lora_rank"] + cfg["qk_rope_head_dim"], "kv_lora": cfg["kv_lora_rank"],
        "kv_b": heads * (cfg["qk_nope_head_dim"] + cfg["v_head_dim"]), "o_in": heads * cfg["v_head_dim"],
    }


def checkpoint(cfg: Mapping[str, Any]) -> Checkpoint:
    """The tensors of the model's checkpoint, without FP8 scales (see :func:`counts`) and without
    multi-token-prediction layers (vLLM loads those only for speculative decoding)."""
    fam = family(cfg)
    H = cfg["hidden_size"]
    V = cfg["vocab_size"]
    L = cfg["num_hidden_layers"]
    ck = Checkpoint()
    ck.add("model.embed_tokens.weight", (V, H), "vocab")
    for i in range(L):
        p = f"model.layers.{i}."
        ck.add(p + "input_layernorm.weight", (H,), "rep")
        ck.add(p + "post_attention_layernorm.weight", (H,), "rep")
        if fam == "deepseek":
            m = _mla(cfg)
            a = p + "self_attn."
            ck.add(a + "q_a_proj.weight", (m["q_a"], H), "rep", quant=True)
            ck.add(a + "q_a_layernorm.weight", (m["q_a"],), "rep")
            ck.add(a + "q_b_proj.weight", (m["q_b"], m["q_a"]), "col", quant=True)
            ck.add(a + "kv_a_proj_with_mqa.weight", (m["kv_a"], H), "rep", quant=True)
            ck.add(a + "kv_a_layernorm.weight", (m["kv_lora"],), "rep")
            ck.add(a + "kv_b_proj.weight", (m["kv_b"], m["kv_lora"]), "col", quant=True)
            ck.add(a + "o_proj.weight", (H, m["o_in"]), "row", quant=True)
            # Old-style DeepSeek-architecture checkpoints also store the rotary inverse frequencies,
            # one buffer per layer; the trainer holds it, vLLM recomputes it (never transferred).
            ck.add(a + "rotary_emb.inv_freq", (cfg["qk_rope_head_dim"] // 2,), "rep", buffer=True)
            dense = i < cfg.get("first_k_dense_replace", 0)
        else:
            hd = cfg.get("head_dim") or H // cfg["num_attention_heads"]
            a = p + "self_attn."
            ck.add(a + "q_proj.weight", (cfg["num_attention_heads"] * hd, H), "col", quant=True)
            ck.add(a + "k_proj.weight", (cfg["num_key_value_heads"] * hd, H), "kv", quant=True)
            ck.add(a + "v_proj.weight", (cfg["num_key_value_heads"] * hd, H), "kv", quant=True)
            ck.add(a + "o_proj.weight", (H, cfg["num_attention_heads"] * hd), "row", quant=True)
            if fam == "qwen3moe":
                ck.add(a + "q_norm.weight", (hd,), "rep")
                ck.add(a + "k_norm.weight", (hd,), "rep")
            dense = fam == "llama" or i in cfg.get("mlp_only_layers", [])
        if dense:
            inter = cfg["intermediate_size"]
            ck.add(p + "mlp.gate_proj.weight", (inter, H), "col", quant=True)
            ck.add(p + "mlp.up_proj.weight", (inter, H), "col", quant=True)
            ck.add(p + "mlp.down_proj.weight", (H, inter), "row", quant=True)
            continue
        E = cfg.get("n_routed_experts") or cfg["num_experts"]
        inter = cfg["moe_intermediate_size"]
        ck.add(p + "mlp.gate.weight", (E, H), "rep")
        if fam == "deepseek":
            ck.add(p + "mlp.gate.e_score_correction_bias", (E,), "rep", float32=True)
        for e in range(E):
            x = f"{p}mlp.experts.{e}."
            ck.add(x + "gate_proj.weight", (inter, H), "expert", quant=True)
            ck.add(x + "up_proj.weight", (inter, H), "expert", quant=True)
            ck.add(x + "down_proj.weight", (H, inter), "expert", quant=True)
        if cfg.get("n_shared_experts"):
            si = inter * cfg["n_shared_experts"]
            ck.add(p + "mlp.shared_experts.gate_proj.weight", (si, H), "col", quant=True)
            ck.add(p + "mlp.shared_experts.up_proj.weight", (si, H), "col", quant=True)
            ck.add(p + "mlp.shared_experts.down_proj.weight", (H, si), "row", quant=True)
    ck.add("model.norm.weight", (H,), "rep")
    if not cfg.get("tie_word_embeddings"):
        ck.add("lm_head.weight", (V, H), "vocab")
    return ck


def counts(cfg: Mapping[str, Any], block: tuple[int, int] = (128, 128)) -> dict[str, int]:
    """Weight elements, FP8 block-scale elements and checkpoint tensor count (FP8 checkpoints carry
    one ``weight_scale_inv`` per quantized weight)."""
    ck = checkpoint(cfg)
    shp, _ = ck.arrays()
    q = np.array(ck.quant)
    buf = np.array(ck.buffer)
    weights = int(np.prod(shp[~buf], axis=1).sum())
    scales = int((-(-shp[q, 0] // block[0]) * -(-shp[q, 1] // block[1])).sum())
    fp8 = "quantization_config" in cfg
    el = np.prod(shp, axis=1)
    wide = np.array(ck.float32) & ~buf
    fp8_bytes = int(el[q].sum() + 2 * el[~q & ~buf & ~wide].sum() + 4 * el[wide].sum() + 4 * scales)
    return {"weight_elements": weights, "fp8_scale_elements": scales,
            "tensors": len(ck.names) + (int(q.sum()) if fp8 else 0), "fp8_bytes": fp8_bytes}


# ==================================================================================================
# Trainer layouts


def _chunk(size: np.ndarray, n: int, i: int | np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """torch.chunk / FSDP2 placement of shard i of n along a dimension of length size."""
    c = -(-size // n)
    lo = np.minimum(i * c, size)
    hi = np.minimum(lo + c, size)
    return lo, hi - lo


def trainer_layouts(cfg: Mapping[str, Any], trainers: int, layout: str = "hsdp:8",
                    dtype: str = "bfloat16") -> list[Layout]:
    """One layout per trainer rank (ranks with equal layouts share one object).

    ``fsdp``: every tensor dim-0 sharded over all ranks. ``hsdp:G``: sharded over the G GPUs of a node
    (ranks ``G*n .. G*n+G-1``), replicated across nodes. ``tp:T`` (with optional ``,hsdp:G``): a
    (fsdp, tp) mesh, linear weights split Megatron-style over the T ranks of a TP group (column-parallel
    rows, row-parallel columns; TP groups are consecutive ranks), then dim 0 over the FSDP ranks.
    """
    ck = checkpoint(cfg)
    shp, nd = ck.arrays()
    names = ck.names
    n = len(names)
    dt = np.full(n, DTYPE_CODE[dtype], np.int16)
    for i in np.nonzero(np.array(ck.float32))[0]:
        dt[i] = DTYPE_CODE["float32"]
    table = TensorTable(names, shp, nd, dt)
    itemsize = np.where(dt == DTYPE_CODE["float32"], 4, 2).astype(np.int64)
    tp = 1
    group = trainers
    for part in layout.split(","):
        kind, _, arg = part.partition(":")
        if kind == "fsdp":
            group = trainers
        elif kind == "hsdp":
            group = int(arg or 8)
        elif kind == "tp":
            tp = int(arg)
        else:
            raise LayoutError(f"unknown trainer layout {layout!r} (fsdp, hsdp:G, tp:T[,hsdp:G])")
    if trainers % group or group % tp:
        raise LayoutError(f"{trainers} trainers do not split into groups of {group} with TP {tp}")
    fsdp = group // tp
    dim0 = W - nd.astype(np.int64)  # first real dimension in the padded layout
    rows = np.arange(n)
    role = np.array(ck.role)
    tp_dim = np.where(np.isin(role, ["col", "kv", "vocab"]), dim0, np.where(role == "row", W - 1, -1))
    layouts: list[Layout] = []
    for g in range(group):
        f, t = divmod(g, tp)
        lo = np.zeros((n, W), np.int64)
        sh = shp.copy()
        if tp > 1:
            sel = tp_dim >= 0
            d = tp_dim[sel]
            a, s = _chunk(sh[sel, d], tp, t)
            lo[np.nonzero(sel)[0], d] = a
            sh[np.nonzero(sel)[0], d] = s
        a, s = _chunk(sh[rows, dim0], fsdp, f)
        lo[rows, dim0] += a
        sh[rows, dim0] = s
        strides = np.stack([sh[:, 1], np.ones(n, np.int64)], axis=1)
        nbytes = np.prod(sh, axis=1) * itemsize
        layouts.append(Layout(table, rows.astype(np.int32), lo, sh, strides, rows.astype(np.int32),
                              np.zeros(n, np.int64), names, nbytes))
    return [layouts[r % group] for r in range(trainers)]


# ==================================================================================================
# Inference (vLLM) layouts


class _Rows:
    """Accumulates destination regions of one TP rank as Python lists, then one Layout."""

    def __init__(self) -> None:
        self.t: list[int] = []
        self.lo: list[tuple[int, int]] = []
        self.sh: list[tuple[int, int]] = []
        self.st: list[tuple[int, int]] = []
        self.key: list[int] = []
        self.boff: list[int] = []
        self.keys: list[str] = []
        self.key_nbytes: list[int] = []

    def new_key(self, name: str, nbytes: int) -> int:
        self.keys.append(name)
        self.key_nbytes.append(nbytes)
        return len(self.keys) - 1

    def add(self, t: int, lo: tuple[int, int], sh: tuple[int, int], k: int, boff: int,
            row_stride: int) -> None:
        self.t.append(t)
        self.lo.append(lo)
        self.sh.append(sh)
        self.st.append((row_stride, 1))
        self.key.append(k)
        self.boff.append(boff)

    def layout(self, table: TensorTable) -> Layout:
        n = len(self.t)
        return Layout(table, np.array(self.t, np.int32), np.array(self.lo, np.int64).reshape(n, W),
                      np.array(self.sh, np.int64).reshape(n, W), np.array(self.st, np.int64).reshape(n, W),
                      np.array(self.key, np.int32), np.array(self.boff, np.int64), self.keys,
                      np.array(self.key_nbytes, np.int64))


def inference_layouts(cfg: Mapping[str, Any], gpus: int, replica_gpus: int, dtype: str = "fp8",
                      expert_parallel: bool = True, block: tuple[int, int] = (128, 128)) -> list[Layout]:
    """One layout per inference rank: ``gpus // replica_gpus`` replicas of TP ``replica_gpus`` (with
    expert parallelism over the same ranks, as ``vllm --enable-expert-parallel`` runs it)."""
    if gpus % replica_gpus:
        raise LayoutError(f"{gpus} inference GPUs are not a whole number of replicas of {replica_gpus}")
    K = replica_gpus
    fp8 = dtype == "fp8"
    ck = checkpoint(cfg)
    fam = family(cfg)
    shp, nd = ck.arrays()
    names = list(ck.names)
    quant = list(ck.quant)
    # Table of logical tensors as the destinations see them: FP8 weights, float32 scales, bf16 rest.
    dts = [DTYPE_CODE[FP8] if (fp8 and q) else DTYPE_CODE["bfloat16"] for q in quant]
    gsh = [tuple(int(x) for x in s) for s in shp]
    ndl = [int(x) for x in nd]
    scale_id: dict[int, int] = {}
    if fp8:
        for i, q in enumerate(quant):
            if q:
                scale_id[i] = len(names)
                names.append(ck.names[i] + SCALE)
                gsh.append((-(-gsh[i][0] // block[0]), -(-gsh[i][1] // block[1])))
                ndl.append(2)
                dts.append(DTYPE_CODE["float32"])
    for i, wide in enumerate(ck.float32):
        if wide:
            dts[i] = DTYPE_CODE["float32"]
    table = TensorTable(names, np.array(gsh, np.int64), np.array(ndl, np.int8), np.array(dts, np.int16))
    idx = table.index()
    isz = {DTYPE_CODE[FP8]: 1, DTYPE_CODE["bfloat16"]: 2, DTYPE_CODE["float32"]: 4}
    H = cfg["hidden_size"]

    def esize(t: int) -> int:
        return isz[dts[t]]

    def fused(rows: _Rows, key: str, parts: list[tuple[str, int, int]], cols: tuple[int, int],
              with_scale: bool = True) -> None:
        """Rows [lo, lo+n) of each named tensor (columns cols) stacked along dim 0 under one key,
        plus the same for their FP8 scales under key + '_scale_inv'."""
        c0, c1 = cols
        tids = [idx[p] for p, _, _ in parts]
        total = sum(n for _, _, n in parts)
        k = rows.new_key(key, total * (c1 - c0) * esize(tids[0]))
        at = 0
        for t, (_, lo, n) in zip(tids, parts, strict=True):
            rows.add(t, (lo, c0), (n, c1 - c0), k, at * (c1 - c0) * esize(t), c1 - c0)
            at += n
        if with_scale and tids[0] in scale_id:
            bm, bn = block
            s0, s1 = c0 // bn, -(-c1 // bn)
            stot = sum(-(-(lo + n) // bm) - lo // bm for _, lo, n in parts)
            ks = rows.new_key(key + SCALE, stot * (s1 - s0) * 4)
            at = 0
            for t, (_, lo, n) in zip(tids, parts, strict=True):
                r0, r1 = lo // bm, -(-(lo + n) // bm)
                rows.add(scale_id[t], (r0, s0), (r1 - r0, s1 - s0), ks, at * (s1 - s0) * 4, s1 - s0)
                at += r1 - r0

    def rep(rows: _Rows, name: str, key: str | None = None) -> None:
        t = idx[name]
        n0, n1 = gsh[t]
        fused(rows, key or name, [(name, 0, n0)], (0, n1))

    def col(rows: _Rows, key: str, names_: list[str], tp: int, r: int) -> None:
        parts = []
        for nm in names_:
            lo, n = _chunk(np.int64(gsh[idx[nm]][0]), tp, r)
            parts.append((nm, int(lo), int(n)))
        fused(rows, key, parts, (0, gsh[idx[names_[0]]][1]))

    def row(rows: _Rows, key: str, name: str, tp: int, r: int) -> None:
        n0, n1 = gsh[idx[name]]
        lo, n = _chunk(np.int64(n1), tp, r)
        fused(rows, key, [(name, 0, n0)], (int(lo), int(lo + n)))

    def vocab(rows: _Rows, name: str, r: int) -> None:
        t = idx[name]
        V = gsh[t][0]
        padded = -(-V // 64) * 64
        per = -(-padded // K)
        lo = min(r * per, V)
        n = max(0, min(lo + per, V) - lo)
        k = rows.new_key(name, per * H * esize(t))  # padding rows are allocated, never written
        if n:
            rows.add(t, (lo, 0), (n, H), k, 0, H)

    def heads_rows(name: str, nheads: int, hd: int, r: int) -> tuple[int, int]:
        # vLLM: KV heads split over TP, or replicated when there are fewer heads than ranks
        if nheads >= K:
            per = nheads // K
            return r * per * hd, per * hd
        return (r * nheads // K) * hd, hd

    layouts: list[Layout] = []
    E = cfg.get("n_routed_experts") or cfg.get("num_experts") or 0
    for r in range(K):
        rows = _Rows()
        vocab(rows, "model.embed_tokens.weight", r)
        for i in range(cfg["num_hidden_layers"]):
            p = f"model.layers.{i}."
            rep(rows, p + "input_layernorm.weight")
            rep(rows, p + "post_attention_layernorm.weight")
            a = p + "self_attn."
            if fam == "deepseek":
                ga, gkv = gsh[idx[a + "q_a_proj.weight"]], gsh[idx[a + "kv_a_proj_with_mqa.weight"]]
                fused(rows, a + "fused_qkv_a_proj.weight",
                      [(a + "q_a_proj.weight", 0, ga[0]), (a + "kv_a_proj_with_mqa.weight", 0, gkv[0])],
                      (0, H))
                rep(rows, a + "q_a_layernorm.weight")
                rep(rows, a + "kv_a_layernorm.weight")
                col(rows, a + "q_b_proj.weight", [a + "q_b_proj.weight"], K, r)
                col(rows, a + "kv_b_proj.weight", [a + "kv_b_proj.weight"], K, r)
                row(rows, a + "o_proj.weight", a + "o_proj.weight", K, r)
                dense = i < cfg.get("first_k_dense_replace", 0)
            else:
                hd = cfg.get("head_dim") or H // cfg["num_attention_heads"]
                qlo, qn = heads_rows(a + "q_proj.weight", cfg["num_attention_heads"], hd, r)
                klo, kn = heads_rows(a + "k_proj.weight", cfg["num_key_value_heads"], hd, r)
                fused(rows, a + "qkv_proj.weight", [(a + "q_proj.weight", qlo, qn),
                                                    (a + "k_proj.weight", klo, kn),
                                                    (a + "v_proj.weight", klo, kn)], (0, H))
                row(rows, a + "o_proj.weight", a + "o_proj.weight", K, r)
                if fam == "qwen3moe":
                    rep(rows, a + "q_norm.weight")
                    rep(rows, a + "k_norm.weight")
                dense = fam == "llama" or i in cfg.get("mlp_only_layers", [])
            m = p + "mlp."
            if dense:
                col(rows, m + "gate_up_proj.weight", [m + "gate_proj.weight", m + "up_proj.weight"], K, r)
                row(rows, m + "down_proj.weight", m + "down_proj.weight", K, r)
                continue
            rep(rows, m + "gate.weight")
            if fam == "deepseek":
                rep(rows, m + "gate.e_score_correction_bias")
            if cfg.get("n_shared_experts"):
                s = m + "shared_experts."
                col(rows, s + "gate_up_proj.weight", [s + "gate_proj.weight", s + "up_proj.weight"], K, r)
                row(rows, s + "down_proj.weight", s + "down_proj.weight", K, r)
            _experts(rows, m, E, K, r, expert_parallel, idx, gsh, scale_id, esize, block)
        rep(rows, "model.norm.weight")
        if not cfg.get("tie_word_embeddings"):
            vocab(rows, "lm_head.weight", r)
        layouts.append(rows.layout(table))
    return [layouts[j % K] for j in range(gpus)]


def _experts(rows: _Rows, m: str, E: int, K: int, r: int, ep: bool, idx: dict[str, int],
             gsh: list[tuple[int, ...]], scale_id: dict[int, int], esize: Any,
             block: tuple[int, int]) -> None:
    """vLLM FusedMoE (its experts in a ``routed_experts`` submodule): w13_weight [E_local, 2*I_local, H]
    = per expert [gate; up], w2_weight [E_local, H, I_local]; whole experts per rank with EP, every
    expert's TP slice without."""
    g0 = idx[f"{m}experts.0.gate_proj.weight"]
    inter, H = gsh[g0]
    if ep:
        if E % K:
            raise LayoutError(f"{E} experts do not split evenly over {K} expert-parallel ranks")
        experts = range(r * E // K, (r + 1) * E // K)
        ilo, il = 0, inter
    else:
        experts = range(E)
        lo, n = _chunk(np.int64(inter), K, r)
        ilo, il = int(lo), int(n)
    ne = len(experts)
    fp8 = g0 in scale_id
    es = esize(g0)
    bm, bn = block
    fused = m + "experts.routed_experts."
    k13 = rows.new_key(fused + "w13_weight", ne * 2 * il * H * es)
    k2 = rows.new_key(fused + "w2_weight", ne * H * il * es)
    if fp8:
        sr, sc = -(-il // bm), -(-H // bn)
        k13s = rows.new_key(fused + "w13_weight" + SCALE, ne * 2 * sr * sc * 4)
        k2s = rows.new_key(fused + "w2_weight" + SCALE, ne * sc * sr * 4)
    for j, e in enumerate(experts):
        x = f"{m}experts.{e}."
        tg, tu, td = idx[x + "gate_proj.weight"], idx[x + "up_proj.weight"], idx[x + "down_proj.weight"]
        base13 = j * 2 * il * H * es
        rows.add(tg, (ilo, 0), (il, H), k13, base13, H)
        rows.add(tu, (ilo, 0), (il, H), k13, base13 + il * H * es, H)
        rows.add(td, (0, ilo), (H, il), k2, j * H * il * es, il)
        if fp8:
            s0, s1 = ilo // bm, -(-(ilo + il) // bm)
            c0, c1 = ilo // bn, -(-(ilo + il) // bn)
            b13 = j * 2 * sr * sc * 4
            rows.add(scale_id[tg], (s0, 0), (s1 - s0, sc), k13s, b13, sc)
            rows.add(scale_id[tu], (s0, 0), (s1 - s0, sc), k13s, b13 + sr * sc * 4, sc)
            rows.add(scale_id[td], (0, c0), (sc, c1 - c0), k2s, j * sc * sr * 4, c1 - c0)


def model_bytes(layouts: list[Layout]) -> int:
    """Bytes of all regions of distinct ranks (a replica's worth times replicas)."""
    return int(sum(lay.nbytes() for lay in layouts))


def fmt_gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB"


__all__ = ["Checkpoint", "checkpoint", "counts", "family", "fmt_gib", "inference_layouts", "load_config",
           "model_bytes", "trainer_layouts"]
