#!/usr/bin/env python
"""Simulate a weight push at cluster scale: layouts from a model config, the real planner, a cost model.

Example (the setting of arXiv 2510.27656, 1.3 s published):

    python scripts/simulate.py --model kimi-k2 --trainers 256 --trainer-layout hsdp:8 \\
        --inference-gpus 128 --replica-gpus 16 --nic-gbps 400 --nics-per-gpu 1 --nvlink-gbps 400 \\
        --inference-dtype fp8

The last line printed is one JSON object (model, trainers, inference_gpus, bytes_total, bound_s, sim_s,
ratio, plan_s, peak_rss_gib, ...).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from weightsync.sim.simulate import CostModel, run_model

PUBLISHED = {"kimi-k2": (1.3, "arXiv 2510.27656: 256 BF16 trainer GPUs -> 128 FP8 inference GPUs, "
                              "400 Gbit/s")}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True,
                    help="a model config: a JSON file, or a name in weightsync/sim/configs (kimi-k2)")
    ap.add_argument("--trainers", type=int, default=256)
    ap.add_argument("--trainer-layout", default="hsdp:8", help="fsdp | hsdp:G | tp:T,hsdp:G")
    ap.add_argument("--inference-gpus", type=int, default=128)
    ap.add_argument("--replica-gpus", type=int, default=16, help="GPUs per inference replica (TP = EP size)")
    ap.add_argument("--nic-gbps", type=float, default=400.0, help="Gbit/s per NIC")
    ap.add_argument("--nics-per-gpu", type=int, default=1)
    ap.add_argument("--nvlink-gbps", type=float, default=400.0,
                    help="NVLink bandwidth per GPU inside a host, in GB/s (bytes, as NVLink is quoted)")
    ap.add_argument("--inference-dtype", choices=["fp8", "bf16"], default="fp8")
    ap.add_argument("--msg-overhead-us", type=float, default=2.0,
                    help="sender time per write besides its bytes")
    ap.add_argument("--quant-gbs", type=float, default=1500.0, help="GB/s of BF16 a GPU quantizes to FP8")
    ap.add_argument("--window", type=int, default=4, help="rounds a source keeps in flight")
    ap.add_argument("--gpus-per-host", type=int, default=8)
    ap.add_argument("--round-mib", type=int, default=256, help="largest round of one source, MiB")
    a = ap.parse_args(argv)
    cost = CostModel(nic_gbps=a.nic_gbps, nics_per_gpu=a.nics_per_gpu, nvlink_gbs=a.nvlink_gbps,
                     msg_overhead_us=a.msg_overhead_us, quant_gbs=a.quant_gbs, window=a.window)
    out = run_model(a.model, a.trainers, a.trainer_layout, a.inference_gpus, a.replica_gpus,
                    a.inference_dtype, cost, a.gpus_per_host, a.round_mib << 20, echo=print)
    d = out["detail"]
    gb = 1e9
    print(f"model {out['model']}: {out['tensors']:,} tensors on the trainers "
          f"({out['checkpoint_tensors']:,} in the FP8 checkpoint), {a.trainers} trainer GPUs "
          f"({a.trainer_layout}) "
          f"-> {a.inference_gpus} inference GPUs ({a.inference_gpus // a.replica_gpus} replicas x "
          f"{a.replica_gpus}, {a.inference_dtype})")
    print(f"bytes pushed: {out['bytes_total'] / gb:,.1f} GB in {out['writes']:,} writes")
    for label, k in (("out per trainer GPU", "bytes_out_per_trainer"), ("in per inference GPU",
                                                                         "bytes_in_per_inference_gpu")):
        s = d[k]
        print(f"bytes {label}: min {s['min'] / gb:.2f} GB, mean {s['mean'] / gb:.2f} GB, "
              f"max {s['max'] / gb:.2f} GB (imbalance max/mean {s['imbalance']:.3f})")
    w = d["writes_per_trainer"]
    print(f"writes per trainer GPU: min {w['min']:,.0f}, mean {w['mean']:,.0f}, max {w['max']:,.0f} "
          f"({out['bytes_total'] / max(out['writes'], 1) / 2**20:.2f} MiB per write on average)")
    print(f"fp8 tile gathers: {d['gather_bytes'] / gb:.2f} GB in all, slowest GPU "
          f"{d['gather_s_max'] * 1e3:.2f} ms;"
          f" quantization, slowest GPU {d['quant_s_max'] * 1e3:.1f} ms (overlapped with writes)")
    print(f"lower bound (slowest GPU's bytes over its bandwidth): {out['bound_s']:.3f} s")
    print(f"simulated push: {out['sim_s']:.3f} s = {out['ratio']:.3f} x the bound ({d['flows']:,} flows)")
    pub = PUBLISHED.get(out["model"])
    if pub and a.trainers == 256 and a.inference_gpus == 128:
        print(f"published: {pub[0]} s ({pub[1]}); simulated {out['sim_s']:.3f} s")
    print(f"planning took {out['plan_s']:.1f} s wall, {out['plan_cpu_s']:.1f} s CPU (layouts "
          f"{out['layouts_s']:.1f} s, simulation {out['simulate_s']:.1f} s), peak RSS "
          f"{out['peak_rss_gib']:.2f} GiB; load average {out['load_avg_1m'][0]} before planning, "
          f"{out['load_avg_1m'][1]} after")
    if pub:
        out["published_s"] = pub[0]
    del out["detail"]
    print(json.dumps(out, sort_keys=False))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
