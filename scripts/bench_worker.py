"""Scenario machinery for scripts/bench_push.py: model shapes, trainer and rollout tensors, and the Ray
actor (one per GPU; one per process with ``--device cpu``) that runs weightsync pushes and the broadcast
baselines on the same tensors, and checks every result byte for byte.

Layouts:

* trainer rank ``t`` of ``T``: every Hugging Face checkpoint tensor sharded along dim 0 with
  ``torch.chunk`` sizes (FSDP2's placement), registered as ``ws.Sharded`` boxes;
* rollout TP rank ``r`` of ``K``: vLLM's parameters: ``qkv_proj`` = ``[q; k; v]`` rows of this rank's
  heads, ``gate_up_proj`` = ``[gate; up]`` rows of this rank, ``o_proj``/``down_proj`` split on dim 1,
  embedding and head split by vocabulary rows (padded to 64), norms and router replicated, MoE experts
  whole per rank (expert parallelism over the TP ranks) in ``w13_weight [E_local, 2I, H]`` and
  ``w2_weight [E_local, H, I]``. ``K = 1`` is a full replica in the same fused layout.

Values: every logical tensor of version ``v`` is ``randn`` (bf16) from a generator seeded by (name, v) on
the actor's own device, so trainers and rollouts build the same bytes independently and a rollout can
check what landed against its own copy of the truth.
"""

from __future__ import annotations

import os
import re
import time
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

import weightsync as ws
from weightsync.sim import models

# Public config facts (Hugging Face config.json) of the models the benchmarks push; no 8B file exists in
# weightsync/sim/configs. Tiny shapes of the same families are for CPU runs and smoke tests.
CONFIGS: dict[str, dict[str, Any]] = {
    # meta-llama/Meta-Llama-3-8B: 8.03e9 parameters, 16.06 GB in bf16
    "llama-3-8b": {"architectures": ["LlamaForCausalLM"], "hidden_size": 4096, "num_hidden_layers": 32,
                   "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
                   "intermediate_size": 14336, "vocab_size": 128256, "tie_word_embeddings": False},
    # Qwen/Qwen3-30B-A3B: 30.5e9 parameters, 61.1 GB in bf16
    "qwen3-30b-a3b": {"architectures": ["Qwen3MoeForCausalLM"], "hidden_size": 2048, "num_hidden_layers": 48,
                      "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128,
                      "num_experts": 128, "moe_intermediate_size": 768, "vocab_size": 151936,
                      "tie_word_embeddings": False, "mlp_only_layers": []},
    "llama-tiny": {"architectures": ["LlamaForCausalLM"], "hidden_size": 256, "num_hidden_layers": 2,
                   "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
                   "intermediate_size": 512, "vocab_size": 1024, "tie_word_embeddings": False},
    # about 0.25 GB in bf16: the CPU section's scenario 1
    "llama-small": {"architectures": ["LlamaForCausalLM"], "hidden_size": 1024, "num_hidden_layers": 4,
                    "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 128,
                    "intermediate_size": 2816, "vocab_size": 32000, "tie_word_embeddings": False},
    "moe-tiny": {"architectures": ["Qwen3MoeForCausalLM"], "hidden_size": 128, "num_hidden_layers": 2,
                 "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32, "num_experts": 8,
                 "moe_intermediate_size": 64, "vocab_size": 512, "tie_word_embeddings": False,
                 "mlp_only_layers": []},
}

DTYPE = torch.bfloat16
ITEM = 2

# A box of a logical tensor placed in a local tensor: (name, global_shape, offsets, shape, at), as ws.Placed
# takes it; the box's dimensions are the local tensor's last len(shape) dimensions.
Piece = tuple[str, tuple[int, ...], tuple[int, ...], tuple[int, ...], tuple[int, ...]]


@dataclass
class Param:
    key: str
    shape: tuple[int, ...]
    pieces: list[Piece] = field(default_factory=list)


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _chunk(size: int, n: int, i: int) -> tuple[int, int]:
    c = -(-size // n)
    lo = min(i * c, size)
    return lo, min(lo + c, size) - lo


def checkpoint_tensors(cfg: dict[str, Any]) -> list[tuple[str, tuple[int, ...]]]:
    """(name, shape) of every checkpoint tensor, in checkpoint order (the order broadcasts send them)."""
    ck = models.checkpoint(cfg)
    return [(n, tuple(int(x) for x in s)) for n, s in zip(ck.names, ck.shapes, strict=True)]


def trainer_params(cfg: dict[str, Any], trainers: int, rank: int) -> list[Param]:
    out = []
    for name, shape in checkpoint_tensors(cfg):
        lo, n = _chunk(shape[0], trainers, rank)
        box = (n, *shape[1:])
        out.append(Param(name, box, [(name, shape, (lo,) + (0,) * (len(shape) - 1), box, (0,) * len(shape))]))
    return out


def rollout_params(cfg: dict[str, Any], tp: int, r: int) -> list[Param]:
    """vLLM's parameters on TP rank ``r`` of ``tp`` (experts: expert parallelism over the same ranks)."""
    shapes = dict(checkpoint_tensors(cfg))
    fam = models.family(cfg)
    H = cfg["hidden_size"]
    out: list[Param] = []

    def rep(name: str) -> None:
        g = shapes[name]
        out.append(Param(name, g, [(name, g, (0,) * len(g), g, (0,) * len(g))]))

    def stack(key: str, parts: list[tuple[str, int, int]], c0: int, c1: int) -> None:
        # rows [lo, lo + n) of each named tensor, columns [c0, c1), stacked along dim 0 under one key
        pieces: list[Piece] = []
        at = 0
        for name, lo, n in parts:
            pieces.append((name, shapes[name], (lo, c0), (n, c1 - c0), (at, 0)))
            at += n
        out.append(Param(key, (at, c1 - c0), pieces))

    def col(key: str, names: list[str]) -> None:
        stack(key, [(nm, *_chunk(shapes[nm][0], tp, r)) for nm in names], 0, shapes[names[0]][1])

    def row(name: str) -> None:
        n0, n1 = shapes[name]
        lo, n = _chunk(n1, tp, r)
        stack(name, [(name, 0, n0)], lo, lo + n)

    def vocab(name: str) -> None:
        V = shapes[name][0]
        per = -(-(-(-V // 64) * 64) // tp)  # vocabulary padded to 64, then split evenly
        lo = min(r * per, V)
        n = max(0, min(lo + per, V) - lo)
        out.append(Param(name, (per, H), [(name, shapes[name], (lo, 0), (n, H), (0, 0))] if n else []))

    def heads(nheads: int, hd: int) -> tuple[int, int]:
        if nheads >= tp:
            per = nheads // tp
            return r * per * hd, per * hd
        return (r * nheads // tp) * hd, hd  # fewer KV heads than ranks: replicated

    vocab("model.embed_tokens.weight")
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        rep(p + "input_layernorm.weight")
        rep(p + "post_attention_layernorm.weight")
        a = p + "self_attn."
        hd = cfg.get("head_dim") or H // cfg["num_attention_heads"]
        qlo, qn = heads(cfg["num_attention_heads"], hd)
        klo, kn = heads(cfg["num_key_value_heads"], hd)
        stack(a + "qkv_proj.weight", [(a + "q_proj.weight", qlo, qn), (a + "k_proj.weight", klo, kn),
                                      (a + "v_proj.weight", klo, kn)], 0, H)
        row(a + "o_proj.weight")
        if fam == "qwen3moe":
            rep(a + "q_norm.weight")
            rep(a + "k_norm.weight")
        m = p + "mlp."
        if fam == "llama" or i in cfg.get("mlp_only_layers", []):
            col(m + "gate_up_proj.weight", [m + "gate_proj.weight", m + "up_proj.weight"])
            row(m + "down_proj.weight")
            continue
        rep(m + "gate.weight")
        E = cfg["num_experts"]
        inter = cfg["moe_intermediate_size"]
        if E % tp:
            raise ValueError(f"{E} experts do not split over {tp} expert-parallel ranks")
        experts = range(r * E // tp, (r + 1) * E // tp)
        w13 = Param(m + "experts.w13_weight", (len(experts), 2 * inter, H))
        w2 = Param(m + "experts.w2_weight", (len(experts), H, inter))
        for j, e in enumerate(experts):
            x = f"{m}experts.{e}."
            w13.pieces.append((x + "gate_proj.weight", (inter, H), (0, 0), (inter, H), (j, 0, 0)))
            w13.pieces.append((x + "up_proj.weight", (inter, H), (0, 0), (inter, H), (j, inter, 0)))
            w2.pieces.append((x + "down_proj.weight", (H, inter), (0, 0), (H, inter), (j, 0, 0)))
        out += [w13, w2]
    rep("model.norm.weight")
    if not cfg.get("tie_word_embeddings"):
        vocab("lm_head.weight")
    return out


def piece_bytes(p: Piece) -> int:
    n = ITEM
    for s in p[3]:
        n *= s
    return n


def overlap_bytes(a: Piece, b: Piece) -> int:
    """Bytes two boxes of the same logical tensor share (0 for different tensors)."""
    if a[0] != b[0]:
        return 0
    n = ITEM
    for oa, sa, ob, sb in zip(a[2], a[3], b[2], b[3], strict=True):
        n *= max(0, min(oa + sa, ob + sb) - max(oa, ob))
    return n


def traffic(cfg: dict[str, Any], trainers: int, rollouts: int, tp: int) -> dict[str, Any]:
    """Bytes per GPU: what each rollout must receive, what each trainer holds, and what each trainer
    sends when every rollout is written directly by the trainer that holds each byte (no relays)."""
    held = [{p.key: p.pieces[0] for p in trainer_params(cfg, trainers, t)} for t in range(trainers)]
    recv, send = [], [0] * trainers
    for j in range(rollouts):
        need = [pc for p in rollout_params(cfg, tp, j % tp) for pc in p.pieces]
        recv.append(sum(piece_bytes(pc) for pc in need))
        for t in range(trainers):
            send[t] += sum(overlap_bytes(pc, held[t][pc[0]]) for pc in need)
    hold = [sum(piece_bytes(pc) for pc in h.values()) for h in held]
    model = sum(piece_bytes(pc) for pc in held[0].values()) if trainers == 1 else sum(hold)
    # Every byte a trainer holds is needed by some rollout here, so a trainer must send at least all it
    # holds once (relays may forward it); a rollout must receive all it needs.
    return {"model_bytes": model, "recv": recv, "hold": hold, "send_direct": send,
            "must_bytes": max(max(recv), max(hold)), "direct_bytes": max(max(recv), max(send))}


def as_ws(param: Param, local: torch.Tensor) -> Any:
    """The weightsync description of a local tensor: plain, Sharded, Fused along dim 0, or Placed."""
    pcs = param.pieces
    if len(pcs) == 1:
        name, g, offs, shape, _ = pcs[0]
        if name == param.key and tuple(shape) == tuple(local.shape):
            return local if tuple(g) == tuple(shape) else ws.Sharded(local, g, offs)
    if local.dim() == 2 and pcs and all(pc[4][1] == 0 and pc[3][1] == local.shape[1] for pc in pcs) and \
            sum(pc[3][0] for pc in pcs) == local.shape[0]:
        return ws.Fused(local, 0, [(n, o, s, g) for n, g, o, s, _ in pcs])
    return ws.Placed(local, pcs)


def seed_of(name: str, version: int) -> int:
    # 32 bits: the CPU generator keeps only the low 32 bits of a seed (a shifted name hash lost the name)
    return zlib.crc32(f"{name}@{version}".encode())


def values(name: str, shape: tuple[int, ...], version: int, device: torch.device) -> torch.Tensor:
    g = torch.Generator(device=device)
    g.manual_seed(seed_of(name, version))
    return torch.randn(shape, generator=g, device=device, dtype=DTYPE)


_EXPERT = re.compile(r"^(.*\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


class Values:
    """Version ``version``'s value of any logical tensor, on ``device``.

    Expert weights come from one ``randn`` per layer and kind (``[E, *shape]``, expert ``e`` its slice):
    Qwen3-30B-A3B has 18,432 of them, and one generator call each made updating and checking a version
    cost seconds of Python. The last few stacks are kept while the caller walks a layer."""

    def __init__(self, cfg: dict[str, Any], version: int, device: torch.device) -> None:
        self.experts = int(cfg.get("num_experts") or 0)
        self.version, self.device = version, device
        self.stacks: dict[tuple[str, str], torch.Tensor] = {}

    def get(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        m = _EXPERT.match(name)
        if m is None or not self.experts:
            return values(name, shape, self.version, self.device)
        key = (m[1], m[3])
        stack = self.stacks.get(key)
        if stack is None:
            if len(self.stacks) >= 3:  # gate, up and down of the layer at hand
                del self.stacks[next(iter(self.stacks))]
            stack = self.stacks[key] = values(f"{m[1]}.*.{m[3]}.weight", (self.experts, *shape), self.version,
                                              self.device)
        return stack[int(m[2])]


def box(offsets: tuple[int, ...], shape: tuple[int, ...]) -> tuple[slice, ...]:
    return tuple(slice(o, o + s) for o, s in zip(offsets, shape, strict=True))


def local_view(local: torch.Tensor, pc: Piece) -> torch.Tensor:
    at, shape = pc[4], pc[3]
    k = local.dim() - len(shape)
    return local[tuple(at[:k]) + box(at[k:], shape)]


def bucket_plan(cfg: dict[str, Any], bucket_bytes: int) -> list[list[tuple[str, tuple[int, ...], int]]]:
    """Checkpoint tensors grouped into buckets of at most ``bucket_bytes`` (a bigger tensor alone);
    ``bucket_bytes == 0``: one tensor per bucket (per-parameter broadcast)."""
    buckets: list[list[tuple[str, tuple[int, ...], int]]] = [[]]
    used = 0
    for name, shape in checkpoint_tensors(cfg):
        n = ITEM
        for s in shape:
            n *= s
        if buckets[-1] and (bucket_bytes == 0 or used + n > bucket_bytes):
            buckets.append([])
            used = 0
        buckets[-1].append((name, shape, n))
        used += n
    return buckets


class Worker:
    """One GPU (or one CPU process): trainer rank ``rank < T`` or rollout ``rank - T``.

    torch.distributed world: all ``T + R`` workers (NCCL on GPUs, gloo on CPU); the trainers form the
    FSDP group that all-gathers, trainer 0 and the rollouts the broadcast group.
    """

    def __init__(self, rank: int, trainers: int, rollouts: int, tp: int, model: str, device: str,
                 port: int) -> None:
        import torch.distributed as dist

        # NVLink multicast stays off on the lent hosts
        os.environ.update({"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
                           "NVSHMEM_DISABLE_NVLS": "1"})
        self.rank, self.T, self.R, self.tp = rank, trainers, rollouts, tp
        self.cfg = CONFIGS[model]
        self.cuda = device == "cuda"
        if self.cuda:
            torch.cuda.set_device(0)  # Ray shows each actor only its own GPU
            self.dev = torch.device("cuda", 0)
        else:
            self.dev = torch.device("cpu")
        world = trainers + rollouts
        dist.init_process_group("nccl" if self.cuda else "gloo", init_method=f"tcp://127.0.0.1:{port}",
                                rank=rank, world_size=world)
        self.dist = dist
        self.world_pg = dist.new_group(list(range(world)))
        self.trainer_pg = dist.new_group(list(range(trainers)))
        self.bcast_pg = dist.new_group([0, *range(trainers, world)])
        self.trainer = rank < trainers
        if self.trainer:
            self.params = trainer_params(self.cfg, trainers, rank)
            # One flat buffer with every shard a view into it (as FSDP1's flat parameters): one CUDA IPC
            # handle shares them all with checkpoint-engine's process. Views start 512-byte aligned, as
            # the caching allocator would place separate tensors.
            self.views: list[tuple[str, int, tuple[int, ...]]] = []
            off = 0
            for p in self.params:
                self.views.append((p.key, off, p.shape))
                off += -(-_numel(p.shape) // 256) * 256
            self.flat = torch.empty(off, dtype=DTYPE, device=self.dev)
            self.local = {k: self.flat[o:o + _numel(sh)].view(sh) for k, o, sh in self.views}
        else:
            self.params = rollout_params(self.cfg, tp, (rank - trainers) % tp)
            self.local = {p.key: torch.full(p.shape, float("nan"), dtype=DTYPE, device=self.dev)
                          for p in self.params}
            # Where each logical tensor goes in this rollout's parameters (vLLM's weight_loader copies).
            self.consumers: dict[str, list[tuple[torch.Tensor, tuple[slice, ...]]]] = {}
            for p in self.params:
                for pc in p.pieces:
                    self.consumers.setdefault(pc[0], []).append((local_view(self.local[p.key], pc),
                                                                 box(pc[2], pc[3])))
        self.src: Any = None
        self.dst: Any = None
        self.engine: Any = None
        self._sync()

    # -- helpers ------------------------------------------------------------------------------------
    def _sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def _barrier(self, pg: Any) -> None:
        # An all-reduce rather than dist.barrier: NCCL's barrier guesses the device from the rank, and
        # every actor here calls its one GPU cuda:0.
        t = torch.zeros(1, device=self.dev)
        self.dist.all_reduce(t, group=pg)
        self._sync()

    def info(self) -> dict[str, Any]:
        out: dict[str, Any] = {"rank": self.rank, "pid": os.getpid()}
        if self.cuda:
            props = torch.cuda.get_device_properties(0)
            out.update(gpu=props.name, uuid=str(getattr(props, "uuid", "")),
                       mem_gib=torch.cuda.memory_allocated() / 2**30)
        return out

    def set_version(self, version: int) -> None:
        """Trainers: new values (an optimizer step); rollouts: poison their parameters (NaN)."""
        if self.trainer:
            vals = Values(self.cfg, version, self.dev)
            for p in self.params:
                name, g, offs, shape, _ = p.pieces[0]
                self.local[p.key].copy_(vals.get(name, g)[box(offs, shape)])
        else:
            for t in self.local.values():
                t.fill_(float("nan"))
        self._sync()

    def verify(self, version: int) -> dict[str, Any]:
        """Rollouts: every byte of every piece equals version ``version``'s value (trainers: nothing)."""
        if self.trainer:
            return {"ok": True, "bytes": 0, "bad": []}
        bad, checked = [], 0
        vals = Values(self.cfg, version, self.dev)
        for p in self.params:
            local = self.local[p.key]
            for pc in p.pieces:
                want = vals.get(pc[0], pc[1])[box(pc[2], pc[3])]
                got = local_view(local, pc)
                if not torch.equal(got.view(torch.int16), want.view(torch.int16)):
                    bad.append(f"{p.key} <- {pc[0]}")
                checked += piece_bytes(pc)
        return {"ok": not bad, "bytes": checked, "bad": bad[:5], "nbad": len(bad)}

    # -- weightsync ---------------------------------------------------------------------------------
    def ws_setup(self, group: str, mode: str = "inplace",
                 tuning: dict[str, Any] | None = None) -> dict[str, Any]:
        """``tuning`` (for A/B runs): ``cuda_streams``, ``cuda_batch_bytes`` for the engine,
        ``cuda_rounds_in_flight`` for the sources (weightsync.runtime.push.ORDERED_ROUNDS_IN_FLIGHT:
        rounds into peers whose lane keeps posting order, the cuda lane); absent keys keep the library's
        defaults."""
        from weightsync.runtime import push as ws_push

        t0 = time.perf_counter()
        tuning = tuning or {}
        if "cuda_rounds_in_flight" in tuning:
            ws_push.ORDERED_ROUNDS_IN_FLIGHT = tuning["cuda_rounds_in_flight"]
        engine_opts = {k: tuning[k] for k in ("cuda_streams", "cuda_batch_bytes") if k in tuning}
        self.engine = ws.TransferEngine(**engine_opts) if engine_opts else None
        tensors = {p.key: as_ws(p, self.local[p.key]) for p in self.params}
        if self.trainer:
            self.src = ws.Source(group, rank=self.rank, tensors=tensors, timeout=300, engine=self.engine)
        else:
            self.dst = ws.Destination(group, rank=self.rank - self.T, tensors=tensors, mode=mode, timeout=300,
                                      push_timeout=120, engine=self.engine)
        return {"setup_s": time.perf_counter() - t0}

    def ws_push(self, version: int) -> dict[str, Any]:
        if not self.trainer:
            return {}
        self._sync()
        if self.T > 1:
            self._barrier(self.trainer_pg)  # SPMD: the sources start together, as after an optimizer step
        return ws.push(self.src, version, timeout=120).__dict__

    def ws_wait(self, version: int) -> int:
        return self.dst.wait(version, timeout=120) if self.dst is not None else version

    def ws_close(self) -> None:
        for p in (self.src, self.dst):
            if p is not None:
                p.close()
        if self.engine is not None:
            self.engine.close()
        self.src = self.dst = self.engine = None

    # -- broadcast baselines ------------------------------------------------------------------------
    def broadcast(self, bucket_bytes: int) -> float:
        """Gather then broadcast, as Ray RL frameworks do it: per bucket, every trainer all-gathers the
        bucket's tensors (FSDP full_tensor(): all_gather_into_tensor of the dim-0 shards, straight into
        the bucket), trainer 0 broadcasts the bucket to the rollouts, every rollout copies each tensor's
        slices into its (fused, sharded) parameters. ``bucket_bytes == 0``: one tensor at a time
        (OpenRLHF). Returns this worker's seconds from a common barrier to its last byte."""
        buckets = bucket_plan(self.cfg, bucket_bytes)
        size = max(sum(n for _, _, n in b) for b in buckets)
        buf = torch.empty(size, dtype=torch.uint8, device=self.dev)
        self._barrier(self.world_pg)
        t0 = time.perf_counter()
        for tensors in self.gather_broadcast(buckets, buf):
            for name, full in tensors:
                for view, src_box in self.consumers.get(name, ()):
                    view.copy_(full[src_box])
        self._sync()
        seconds = time.perf_counter() - t0
        del buf
        if self.cuda:
            torch.cuda.empty_cache()
        return seconds

    def gather_broadcast(self, buckets: list[list[tuple[str, tuple[int, ...], int]]],
                         buf: torch.Tensor) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """Each bucket of checkpoint tensors (``bucket_plan``'s), whole, into ``buf`` on every rollout, as
        the broadcast baselines move it: every trainer all-gathers the bucket's dim-0 shards into ``buf``
        (FSDP full_tensor(): all_gather_into_tensor), trainer 0 broadcasts it to the rollouts. On rollouts
        yields, per bucket once it is in, its tensors as (name, full tensor: a view of ``buf``, valid until
        the next bucket); on trainers yields nothing."""
        dist = self.dist
        for bucket in buckets:
            total = sum(n for _, _, n in bucket)
            if self.trainer:
                off = 0
                for name, _, n in bucket:
                    shard = self.local[name].view(-1).view(torch.uint8)
                    out = buf[off:off + n]
                    if self.T == 1:
                        out.copy_(shard)
                    elif self.cuda:
                        dist.all_gather_into_tensor(out, shard, group=self.trainer_pg)
                    else:  # gloo has no all_gather_into_tensor
                        dist.all_gather(list(out.chunk(self.T)), shard, group=self.trainer_pg)
                    off += n
                if self.rank == 0:
                    dist.broadcast(buf[:total], src=0, group=self.bcast_pg)
                continue
            dist.broadcast(buf[:total], src=0, group=self.bcast_pg)
            tensors, off = [], 0
            for name, shape, n in bucket:
                tensors.append((name, buf[off:off + n].view(DTYPE).view(shape)))
                off += n
            yield tensors

    def close(self) -> None:
        """Leaves the process as it was (the CPU section hosts several workers in one process in turn)."""
        self.ws_close()
        self.ce_stop()
        self.dist.destroy_process_group()

    # -- checkpoint-engine baseline (scripts/bench_ckpt_engine.py) -----------------------------------
    def ce_start(self, port: int, timeout: float) -> None:
        from scripts.bench_ckpt_engine import CkptEngineRank

        # Trainers register their own shards as "<tensor>#<rank>" (views of the flat buffer, rebuilt in
        # checkpoint-engine's process); rollouts own nothing.
        flat = self.flat if self.trainer else None
        views = [(f"{k}#{self.rank}", o, sh) for k, o, sh in self.views] if self.trainer else []
        self.ce = CkptEngineRank(self.rank, self.T + self.R, port, "cuda" if self.cuda else "cpu", flat,
                                 views, self._ce_drop if self.trainer else self._ce_load, timeout)

    def ce_register(self) -> float:
        return self.ce.register()

    def ce_update(self) -> float:
        return self.ce.update()

    def ce_stop(self) -> None:
        if getattr(self, "ce", None) is not None:
            self.ce.stop()
            self.ce = None

    @staticmethod
    def _ce_drop(weights: list[tuple[str, torch.Tensor]]) -> None:
        del weights  # a trainer's rank receives every bucket in broadcast mode and has no model to load

    def _ce_load(self, weights: list[tuple[str, torch.Tensor]]) -> None:
        """vLLM's load_weights for shards: each trainer shard's rows into the fused parameters."""
        shapes = getattr(self, "_shapes", None) or dict(checkpoint_tensors(self.cfg))
        self._shapes = shapes
        for key, shard in weights:
            name, _, owner = key.rpartition("#")
            lo, n = _chunk(shapes[name][0], self.T, int(owner))
            for view, src_box in self.consumers.get(name, ()):
                a = max(lo, src_box[0].start)
                b = min(lo + n, src_box[0].stop)
                if a < b:
                    view[a - src_box[0].start:b - src_box[0].start].copy_(
                        shard[(slice(a - lo, b - lo), *src_box[1:])])
