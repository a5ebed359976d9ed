"""The cuda lane against the copy-engine bound, between Ray GPU actors on one host.

* bound: a plain device-to-device copy between two GPUs in one process (``tensor.copy_`` across
  devices: the copy engines over NVLink), per size, measured in this run;
* weightsync: a source actor (GPU 0) writes into a destination actor's tensor (GPU 1) through the
  engine's cuda lane; each timing runs from submit until the write's completion, whose immediates
  reach the destination over a fabric NIC; every size is verified byte for byte after timing;
* two sources to two destinations at once (GPU 0 -> 1 and GPU 2 -> 3), when four GPUs are present;
* latency of a 4 KiB write plus its counter (median microseconds, source side: submit to completion,
  the completion including the immediate's delivery);
* a push round made of many tensors (``--shards``): the shards an FSDP-2 trainer of Llama-3-8B holds
  (291 tensors, 8.03 GB, 4 MiB to 501 MiB) as one ``write_batch`` into another GPU (one copy-engine
  copy per tensor), against one copy of the same total bytes; verified byte for byte.

The cuda lane's settings can be swept in one run: ``--cuda-piece-mib 16,64,256,0 --cuda-streams 1,2,4
--spin-us 0,50`` measures every combination (both engines reconfigured each time) and prints, per
setting, the ratio to the bound per size and the 4 KiB latency, then the setting whose worst ratio from
256 MiB up is best; the two-pair run and the JSON's top-level figures use that one.

Run as ``python scripts/bench_engine.py --transport cuda`` or directly.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import ray  # noqa: E402
import torch  # noqa: E402

from scripts.bench_push import copy_engine_gbps  # noqa: E402
from tests.support.cuda_actors import GpuEnd  # noqa: E402

MiB = 1 << 20


def copy_bound(nbytes: int, repeat: int) -> float:
    """GB/s of a device-to-device copy from GPU 0 to GPU 1 in this process (the copy engines): the same
    measurement, verified, as bench_push's bound."""
    return copy_engine_gbps(nbytes, repeat)["gbps"]


def parse_list(text: str, kind: type = int) -> list[Any]:
    return [kind(x) for x in text.split(",") if x]


def lane_configs(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Every combination of the cuda-lane settings to sweep (one engine pair per combination)."""
    return [
        {"cuda_piece": piece * MiB, "cuda_streams": streams, "cuda_spin_us": spin}
        for piece in parse_list(args.cuda_piece_mib)
        for streams in parse_list(args.cuda_streams)
        for spin in parse_list(args.spin_us, float)
    ]


def label(cfg: dict[str, Any]) -> str:
    piece = "whole" if cfg["cuda_piece"] == 0 else f"{cfg['cuda_piece'] // MiB}MiB"
    return f"piece={piece} streams={cfg['cuda_streams']} spin={cfg['cuda_spin_us']:g}us"


def emit(result: dict[str, Any], path: str | None) -> None:
    """The run's JSON: into ``path`` if given, and as the last line of the output."""
    if path:
        with open(path, "w") as f:
            json.dump(result, f, indent=1)
    print(json.dumps(result))


def llama8b_fsdp2_shards() -> list[int]:
    """Bytes of each tensor one of two FSDP trainers holds of Llama-3-8B (bf16, dim 0 halved)."""
    h, inter, vocab, layers = 4096, 14336, 128256, 32
    per_layer = [h // 2 * h, 512 * h, 512 * h, h // 2 * h, inter // 2 * h, inter // 2 * h, h // 2 * inter,
                 h // 2, h // 2]
    return [2 * n for n in [vocab // 2 * h] + per_layer * layers + [h // 2, vocab // 2 * h]]


def shards_round(args: argparse.Namespace, card: str) -> dict[str, Any]:
    """One write_batch of a trainer's shards, against one copy of the same bytes."""
    sizes = llama8b_fsdp2_shards()
    total = sum(sizes)
    ops, at = [], 0
    for n in sizes:  # back to back, 512-byte aligned, as a caching allocator places them
        ops.append((at, at, n, 1, n, n))
        at += -(-n // 512) * 512
    bound = copy_engine_gbps(at, args.repeat)
    ray.init(address="local", include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": ROOT}})
    end = ray.remote(num_gpus=1)(GpuEnd)
    out: dict[str, Any] = {"card": card, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                           "tensors": len(sizes), "bytes": total, "bound_gbps": bound["gbps"],
                           "bound_how": bound["how"]}
    print(f"{len(sizes)} tensors, {total / 1e9:.2f} GB; one {at / 1e9:.2f} GB copy: {bound['gbps']:.1f} GB/s",
          flush=True)
    src, dst = end.remote(), end.remote()
    dst_info = ray.get(dst.info.remote())
    imm = 5
    for batch_mib in (float(x) for x in args.cuda_batch_mib.split(",") if x):
        name = f"copies under {batch_mib:g} MiB batched" if batch_mib else "copy engines, one copy per tensor"
        ray.get(src.reconfigure.remote(cuda_batch_bytes=int(batch_mib * 2**20)))
        s_id, _ = ray.get(src.alloc.remote(at, seed=11))
        times = []
        for rep in range(args.repeat + 1):
            imm += 1
            d_id, d_desc = ray.get(dst.alloc.remote(at))  # poisoned afresh each time
            res = ray.get(src.write_batch.remote(s_id, dst_info["address"], d_desc, ops, imm=imm))
            ray.get(dst.counter_wait.remote(imm, res["imm_count"]))
            ok = ray.get(dst.check_ops.remote(d_id, ops, 11, at))
            if ok != {"data": True}:
                raise SystemExit(f"wrong bytes with {name}: {ok}")
            ray.get(dst.free.remote(d_id))
            if rep > 0:
                times.append(res["seconds"])
        ray.get(src.free.remote(s_id))
        gbps = total / statistics.median(times) / 1e9
        out[name] = {"gbps": gbps, "ratio": gbps / bound["gbps"], "times": times}
        print(f"{name}: median {statistics.median(times) * 1e3:.2f} ms, {gbps:.1f} GB/s, "
              f"{gbps / bound['gbps']:.3f} of one copy, verified", flush=True)
    ray.kill(src)
    ray.kill(dst)
    ray.shutdown()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes-mib", default="64,256,1024,4096,8192")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--json", default=None)
    ap.add_argument("--cuda-piece-mib", default="64",
                    help="comma-separated copy sizes to sweep, in MiB (0: one copy per write)")
    ap.add_argument("--cuda-streams", default="2", help="comma-separated stream counts to sweep")
    ap.add_argument("--spin-us", default="50", help="comma-separated idle polling times to sweep (us)")
    ap.add_argument("--latency-samples", type=int, default=200)
    ap.add_argument("--shards", action="store_true", help="only the many-tensor round")
    ap.add_argument("--cuda-batch-mib", default="64,0",
                    help="--shards: cuda_batch_bytes settings to compare, in MiB (0: one call per copy)")
    args = ap.parse_args()
    sizes = [int(s) * MiB for s in args.sizes_mib.split(",")]
    gpus = torch.cuda.device_count()
    if gpus < 2:
        raise SystemExit(f"needs at least 2 GPUs, found {gpus}")
    card = torch.cuda.get_device_name(0)

    if args.shards:
        emit(shards_round(args, card), args.json)
        return
    bounds = {n: copy_bound(n, args.repeat) for n in sizes}

    ray.init(address="local", include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": ROOT}})
    configs = lane_configs(args)
    end = ray.remote(num_gpus=1)(GpuEnd)
    ends = [end.remote(**configs[0]) for _ in range(min(gpus, 4))]
    infos = ray.get([e.info.remote() for e in ends])
    src, dst = ends[0], ends[1]
    sweep: list[dict[str, Any]] = []
    for ci, cfg in enumerate(configs):
        if ci > 0:
            ray.get([src.reconfigure.remote(**cfg), dst.reconfigure.remote(**cfg)])
            infos[:2] = ray.get([src.info.remote(), dst.info.remote()])
        print(f"--- {label(cfg)}", flush=True)
        rows: list[dict[str, Any]] = []
        for n in sizes:
            s_id, _ = ray.get(src.alloc.remote(n, seed=n))
            d_id, d_desc = ray.get(dst.alloc.remote(n))
            out = ray.get(src.write.remote(s_id, 0, infos[1]["address"], d_desc, 0, n, imm=1,
                                           repeat=args.repeat + 1))
            ray.get(dst.counter_wait.remote(1, out["imm_count"]))
            ok = ray.get(dst.check.remote(d_id, 0, n, n, 0))
            if not all(ok.values()):
                raise SystemExit(f"wrong bytes at {n} bytes with {label(cfg)}: {ok}")
            gbps = n / statistics.median(out["times"][1:]) / 1e9
            rows.append({"bytes": n, "weightsync_gbps": gbps, "bound_gbps": bounds[n],
                         "ratio": gbps / bounds[n]})
            ray.get([src.free.remote(s_id), dst.free.remote(d_id)])
            print(f"{n / MiB:8.0f} MiB  weightsync {gbps:7.1f} GB/s  "
                  f"copy-engine bound {bounds[n]:7.1f} GB/s  ratio {gbps / bounds[n]:.3f}", flush=True)
        s_id, _ = ray.get(src.alloc.remote(4096, seed=7))
        d_id, d_desc = ray.get(dst.alloc.remote(4096))
        out = ray.get(src.write.remote(s_id, 0, infos[1]["address"], d_desc, 0, 4096, imm=9,
                                       repeat=args.latency_samples))
        ray.get(dst.counter_wait.remote(9, out["imm_count"]))
        ray.get([src.free.remote(s_id), dst.free.remote(d_id)])
        latency_us = statistics.median(out["times"][args.latency_samples // 10:]) * 1e6
        print(f"4 KiB write + its immediate: median {latency_us:.0f} us", flush=True)
        sweep.append({"config": cfg, "sizes": rows, "latency_4k_us": latency_us})

    # The best setting per size, and the one with the best worst ratio from 256 MiB up (the target).
    big = [n for n in sizes if n >= 256 * MiB] or sizes
    def worst(entry: dict[str, Any]) -> float:
        return min(r["ratio"] for r in entry["sizes"] if r["bytes"] in big)
    best = max(sweep, key=worst)
    if len(sweep) > 1:
        print("--- summary (ratio to the copy-engine bound)", flush=True)
        for entry in sweep:
            cells = "  ".join(f"{r['bytes'] // MiB}M:{r['ratio']:.3f}" for r in entry["sizes"])
            print(f"{label(entry['config']):40s} {cells}  4K:{entry['latency_4k_us']:.0f}us", flush=True)
        print(f"best from {big[0] // MiB} MiB up: {label(best['config'])} (worst ratio {worst(best):.3f})",
              flush=True)

    pair: dict[str, Any] = {}
    if len(ends) >= 4:
        # Two pairs at once, with the best setting (on all four engines).
        ray.get([e.reconfigure.remote(**best["config"]) for e in ends])
        infos = ray.get([e.info.remote() for e in ends])
        n = 1024 * MiB
        allocs = [ray.get(ends[i].alloc.remote(n, seed=i)) for i in range(4)]
        def go(i: int) -> Any:  # GPU i writes into GPU i + 1
            return ends[i].write.remote(allocs[i][0], 0, infos[i + 1]["address"], allocs[i + 1][1], 0, n, 1,
                                        args.repeat)

        t0 = time.perf_counter()
        outs = ray.get([go(0), go(2)])
        wall = time.perf_counter() - t0
        for i in (0, 2):
            ok = ray.get(ends[i + 1].check.remote(allocs[i + 1][0], 0, n, i, 0))
            if not all(ok.values()):
                raise SystemExit(f"wrong bytes on GPU {i + 1} in the two-pair run: {ok}")
        per = [n / statistics.median(o["times"]) / 1e9 for o in outs]
        pair = {"bytes_each": n, "gbps_each": per, "aggregate_gbps": sum(per), "wall_s": wall,
                "config": best["config"]}
        print(f"two pairs at once (0->1, 2->3), 1 GiB each: {per[0]:.1f} + {per[1]:.1f} GB/s", flush=True)
    ray.shutdown()

    result = {"card": card, "gpus": gpus, "date": time.strftime("%Y-%m-%d"), "sizes": best["sizes"],
              "config": best["config"], "sweep": sweep, "two_pairs": pair,
              "latency_4k_us": best["latency_4k_us"]}
    emit(result, args.json)


if __name__ == "__main__":
    main()
