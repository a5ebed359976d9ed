"""FP8 against BF16 pushes of an 8B Llama-shaped model (issue #6), on four GPUs of one host.

2 trainer GPUs hold bf16 FSDP halves (dim 0) of every tensor; 2 rollout GPUs hold full replicas,
either in bf16 (the plain push) or with every linear weight of the decoder layers in
``float8_e4m3fn`` plus its 128x128 ``*_scale_inv`` block scales (the FP8 push: the trainers quantize
whole tiles on their GPUs, gathering the rows of tiles that straddle the shard boundary first). Each
push is timed from the trainers' ``ws.push`` call until every rollout acknowledged the version; the
median over ``--pushes`` after two warm-ups (IPC mappings; CUDA graph capture). After timing, one
layer and the embedding of the last version are checked bit for bit on both rollouts against a
reference quantizer applied to the full tensors (tests/test_transforms.py's, written independently of
weightsync.runtime.transforms): a run that moves wrong bytes exits non-zero instead of reporting a figure.

Reported: both medians, their ratio, the ratio per byte moved (FP8 moves about half the bytes of the
linear weights), the FP8 push's preparation and write times, peak staging against the watermark.

    python scripts/bench_fp8.py [--pushes 4] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import statistics
import sys
import time
import zlib
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import ray  # noqa: E402
import torch  # noqa: E402

import weightsync as ws  # noqa: E402
from tests.support.fp8 import reference_fp8, same_bits  # noqa: E402

FP8 = torch.float8_e4m3fn
LLAMA_LAYERS = 32
NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def llama8b_shapes() -> dict[str, tuple[int, ...]]:
    """Llama-3-8B (public config: hidden 4096, 32 layers, 8 KV heads of 128, FFN 14336, vocab 128256)."""
    h, kv, ffn, vocab = 4096, 1024, 14336, 128256
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (vocab, h),
                                          "lm_head.weight": (vocab, h), "model.norm.weight": (h,)}
    for i in range(LLAMA_LAYERS):
        p = f"model.layers.{i}."
        shapes.update({p + "self_attn.q_proj.weight": (h, h), p + "self_attn.k_proj.weight": (kv, h),
                       p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.o_proj.weight": (h, h),
                       p + "mlp.gate_proj.weight": (ffn, h), p + "mlp.up_proj.weight": (ffn, h),
                       p + "mlp.down_proj.weight": (h, ffn), p + "input_layernorm.weight": (h,),
                       p + "post_attention_layernorm.weight": (h,)})
    return shapes


def is_linear(name: str) -> bool:
    return name.startswith("model.layers.") and name.endswith("_proj.weight")


def llama_shard(name: str, shape: tuple[int, ...], rank: int, version: int, device: str) -> torch.Tensor:
    """Trainer ``rank``'s half (dim 0) of tensor ``name`` at ``version``, from a seed alone."""
    rows = shape[0] // 2
    g = torch.Generator(device=device).manual_seed(zlib.crc32(f"{name}/{rank}/{version}".encode()))
    return torch.randn((rows, *shape[1:]), generator=g, device=device, dtype=torch.float32).to(torch.bfloat16)


class LlamaTrainer:
    def __init__(self, group: str, rank: int) -> None:
        self.rank = rank
        self.shapes = llama8b_shapes()
        self.local = {n: llama_shard(n, s, rank, 0, "cuda") for n, s in self.shapes.items()}
        named = {n: ws.Sharded(t, self.shapes[n], (rank * t.shape[0],) + (0,) * (t.dim() - 1))
                 for n, t in self.local.items()}
        self.src = ws.Source(group, rank=rank, tensors=named)

    def push(self, version: int) -> dict[str, Any]:
        for n, t in self.local.items():
            t.copy_(llama_shard(n, self.shapes[n], self.rank, version, "cuda"))
        torch.cuda.synchronize()
        return ws.push(self.src, version=version, timeout=120.0).__dict__


class LlamaRollout:
    def __init__(self, group: str, rank: int, fp8: bool) -> None:
        self.fp8 = fp8
        self.local: dict[str, torch.Tensor] = {}
        for n, s in llama8b_shapes().items():
            if fp8 and is_linear(n):
                self.local[n] = torch.full(s, 0x7F, dtype=torch.uint8, device="cuda").view(FP8)  # NaN
                self.local[n + "_scale_inv"] = torch.full((-(-s[0] // 128), -(-s[1] // 128)), float("nan"),
                                                          device="cuda")
            else:
                self.local[n] = torch.full(s, float("nan"), dtype=torch.bfloat16, device="cuda")
        self.dst = ws.Destination(group, rank=rank, tensors=self.local, mode="inplace")

    def wait(self, version: int) -> int:
        return self.dst.wait(version, timeout=120.0)

    def check_layer(self, version: int, layer: int) -> list[str]:
        """Names of the tensors of one layer (and the embedding) that differ from what they should be."""
        bad = []
        for n, s in llama8b_shapes().items():
            if not (n.startswith(f"model.layers.{layer}.") or n == "model.embed_tokens.weight"):
                continue
            full = torch.cat([llama_shard(n, s, r, version, "cuda") for r in range(2)])
            if self.fp8 and is_linear(n):
                q, sc = reference_fp8(full)
                got_q, got_s = self.local[n].cpu(), self.local[n + "_scale_inv"].cpu()
                if not (same_bits(got_q, q) and same_bits(got_s, sc)):
                    bad.append(n)
            elif not torch.equal(self.local[n], full):
                bad.append(n)
        return bad


def run(fp8: bool, pushes: int) -> tuple[list[float], list[dict[str, Any]], int]:
    name = f"llama8b-{'fp8' if fp8 else 'bf16'}"
    group = ws.Group.create(name, num_sources=2, num_destinations=2)
    trainers = [ray.remote(num_cpus=0, num_gpus=1)(LlamaTrainer).remote(name, i) for i in range(2)]
    rollouts = [ray.remote(num_cpus=0, num_gpus=1)(LlamaRollout).remote(name, j, fp8) for j in range(2)]
    try:
        ray.get([a.__ray_ready__.remote() for a in trainers + rollouts], timeout=600)
        times: list[float] = []
        last: list[dict[str, Any]] = []
        # versions 0 and 1 warm up: the first opens the CUDA IPC mappings and loads the kernels, the
        # second captures the FP8 preparation as CUDA graphs (replayed from then on)
        for version in range(pushes + 2):
            last = ray.get([t.push.remote(version) for t in trainers], timeout=600)
            if any(s["failed_destinations"] for s in last):
                raise SystemExit(f"{name}: push {version} failed: {last}")
            ray.get([r.wait.remote(version) for r in rollouts], timeout=120)
            if version >= 2:
                times.append(max(s["seconds"] for s in last))
        bad = ray.get([r.check_layer.remote(pushes + 1, 5) for r in rollouts], timeout=600)
        if any(bad):
            raise SystemExit(f"{name}: wrong bytes on the rollouts: {bad}")
        return times, last, sum(s["bytes"] for s in last)
    finally:
        for a in trainers + rollouts:
            ray.kill(a)
        group.shutdown()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pushes", type=int, default=4)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if torch.cuda.device_count() < 4:
        raise SystemExit(f"needs 4 GPUs (2 trainers, 2 rollouts), found {torch.cuda.device_count()}")
    os.environ.update(NO_MULTICAST)
    ray.init(address="local", include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": ROOT, **NO_MULTICAST,
                                       "WEIGHTSYNC_SECRET": secrets.token_hex(16)}})
    try:
        bf16_times, _, bf16_bytes = run(False, args.pushes)
        fp8_times, fp8_stats, fp8_bytes = run(True, args.pushes)
    finally:
        ray.shutdown()
    bf16_s, fp8_s = statistics.median(bf16_times), statistics.median(fp8_times)
    result = {
        "card": torch.cuda.get_device_name(0), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "bf16_s": bf16_s, "fp8_s": fp8_s, "ratio": fp8_s / bf16_s,
        "bf16_bytes": bf16_bytes, "fp8_bytes": fp8_bytes,
        # time per byte moved, FP8 over BF16: what the transform costs beyond the bytes it saves
        "ratio_per_byte": (fp8_s / fp8_bytes) / (bf16_s / bf16_bytes),
        "bf16_times": bf16_times, "fp8_times": fp8_times,
        "fp8_prepare_s": [s["prepare_seconds"] for s in fp8_stats],
        "fp8_write_s": [s["write_seconds"] for s in fp8_stats],
        "fp8_peak_staging": [s["peak_staging_bytes"] for s in fp8_stats],
        "fp8_staging_limit": [s["staging_limit_bytes"] for s in fp8_stats],
        "fp8_gather_bytes": [s["gather_bytes"] for s in fp8_stats],
        "fp8_phases": fp8_stats[0]["phases"],
    }
    print(f"llama-8B, 2 -> 2 GPUs ({result['card']}): "
          f"bf16 {bf16_s * 1e3:.1f} ms ({bf16_bytes / 1e9:.2f} GB), "
          f"fp8 {fp8_s * 1e3:.1f} ms ({fp8_bytes / 1e9:.2f} GB): {result['ratio']:.2f}x the time, "
          f"{result['ratio_per_byte']:.2f}x per byte", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
