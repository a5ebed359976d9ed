#!/usr/bin/env python
"""Simulated delta pushes at cluster scale (issue 18): one plan, the dense push and delta pushes at several
changed fractions through the same cost model (weightsync.sim.simulate, ``CostModel.changed_fraction``).

The encode and apply rates are inputs (GB/s of dense bytes per GPU): take them from
scripts/bench_delta.py on the GPUs (model bytes / encode or apply seconds at the fraction measured).

    python scripts/simulate_delta.py --model kimi-k2 --changed 0.01 0.02 0.05 \\
        --encode-gbs 575 --apply-gbs 575

The last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from weightsync.plan import plan
from weightsync.sim.models import inference_layouts, load_config, trainer_layouts
from weightsync.sim.simulate import CostModel, simulate


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True,
                    help="a model config: a JSON file, or a name in weightsync/sim/configs (kimi-k2)")
    ap.add_argument("--trainers", type=int, default=256)
    ap.add_argument("--trainer-layout", default="hsdp:8")
    ap.add_argument("--inference-gpus", type=int, default=128)
    ap.add_argument("--replica-gpus", type=int, default=16)
    ap.add_argument("--inference-dtype", choices=["fp8", "bf16"], default="fp8")
    ap.add_argument("--nic-gbps", type=float, default=400.0)
    ap.add_argument("--nics-per-gpu", type=int, default=1)
    ap.add_argument("--nvlink-gbps", type=float, default=400.0)
    ap.add_argument("--gpus-per-host", type=int, default=8)
    ap.add_argument("--changed", type=float, nargs="+", default=[0.01, 0.02, 0.05])
    ap.add_argument("--encode-gbs", type=float, required=True, help="GB/s of sent bytes a source encodes")
    ap.add_argument("--apply-gbs", type=float, required=True, help="GB/s of received bytes a destination "
                    "applies")
    args = ap.parse_args(argv)
    cfg = load_config(args.model)
    t0 = time.perf_counter()
    src = trainer_layouts(cfg, args.trainers, args.trainer_layout)
    dst = inference_layouts(cfg, args.inference_gpus, args.replica_gpus, args.inference_dtype)
    s_hosts = [r // args.gpus_per_host for r in range(args.trainers)]
    first = (args.trainers + args.gpus_per_host - 1) // args.gpus_per_host
    d_hosts = [first + r // args.gpus_per_host for r in range(args.inference_gpus)]
    p = plan(src, dst, source_hosts=s_hosts, destination_hosts=d_hosts,
             fp8_block=(128, 128) if args.inference_dtype == "fp8" else None, validate=False)
    print(f"{cfg.get('_name', args.model)}: {args.trainers} trainer GPUs ({args.trainer_layout}) -> "
          f"{args.inference_gpus} {args.inference_dtype} inference GPUs; planned in "
          f"{time.perf_counter() - t0:.1f} s, {len(p):,} writes", flush=True)
    base = CostModel(nic_gbps=args.nic_gbps, nics_per_gpu=args.nics_per_gpu, nvlink_gbs=args.nvlink_gbps)
    rows = []
    for changed in [None, *args.changed]:
        cost = base if changed is None else replace(base, changed_fraction=changed,
                                                    encode_gbs=args.encode_gbs, apply_gbs=args.apply_gbs)
        r = simulate(p, s_hosts, d_hosts, cost)
        rows.append({"changed": changed, "sim_s": round(r.sim_s, 4), "bound_s": round(r.bound_s, 4),
                     "encode_s_max": round(r.encode_s_max, 4), "apply_s_max": round(r.apply_s_max, 4)})
        what = "dense" if changed is None else f"delta at {changed:.2%} changed"
        print(f"  {what:25s} simulated {r.sim_s:.3f} s (link bound {r.bound_s:.3f} s, encode "
              f"{r.encode_s_max * 1e3:.1f} ms, apply {r.apply_s_max * 1e3:.1f} ms)", flush=True)
    print(json.dumps({"model": cfg.get("_name", args.model), "trainers": args.trainers,
                      "inference_gpus": args.inference_gpus, "inference_dtype": args.inference_dtype,
                      "cost_model": asdict(base), "encode_gbs": args.encode_gbs, "apply_gbs": args.apply_gbs,
                      "results": rows}), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
