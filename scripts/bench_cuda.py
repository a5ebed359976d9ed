"""The cuda lane against the copy-engine bound, between Ray GPU actors on one host.

* bound: a plain device-to-device copy between two GPUs in one process (``tensor.copy_`` across
  devices: the copy engines over NVLink), per size, measured in this run;
* weightsync: a source actor (GPU 0) writes into a destination actor's tensor (GPU 1) through the
  engine's cuda lane; each timing runs from submit until the write's completion, whose immediates
  reach the destination over a fabric NIC; every size is verified byte for byte after timing;
* two sources to two destinations at once (GPU 0 -> 1 and GPU 2 -> 3), when four GPUs are present;
* latency of a 4 KiB write plus its counter (median microseconds, source side: submit to completion,
  the completion including the immediate's delivery).

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

from tests.cuda_actors import GpuEnd  # noqa: E402

MiB = 1 << 20


def copy_bound(nbytes: int, repeat: int) -> float:
    """GB/s of a device-to-device copy from GPU 0 to GPU 1 in this process (the copy engines)."""
    a = torch.empty(nbytes, dtype=torch.uint8, device="cuda:0")
    b = torch.empty(nbytes, dtype=torch.uint8, device="cuda:1")
    b.copy_(a)
    torch.cuda.synchronize(0)
    torch.cuda.synchronize(1)
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        b.copy_(a, non_blocking=True)
        torch.cuda.synchronize(0)
        torch.cuda.synchronize(1)
        times.append(time.perf_counter() - t0)
    del a, b
    torch.cuda.empty_cache()
    return nbytes / statistics.median(times) / 1e9


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes-mib", default="64,256,1024,4096,8192")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    sizes = [int(s) * MiB for s in args.sizes_mib.split(",")]
    gpus = torch.cuda.device_count()
    if gpus < 2:
        raise SystemExit(f"needs at least 2 GPUs, found {gpus}")
    card = torch.cuda.get_device_name(0)

    bounds = {n: copy_bound(n, args.repeat) for n in sizes}

    ray.init(address="local", include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": ROOT}})
    end = ray.remote(num_gpus=1)(GpuEnd)
    ends = [end.remote() for _ in range(min(gpus, 4))]
    infos = ray.get([e.info.remote() for e in ends])
    src, dst = ends[0], ends[1]
    rows: list[dict[str, Any]] = []
    for n in sizes:
        s_id, _ = ray.get(src.alloc.remote(n, seed=n))
        d_id, d_desc = ray.get(dst.alloc.remote(n))
        out = ray.get(src.write.remote(s_id, 0, infos[1]["address"], d_desc, 0, n, imm=1,
                                       repeat=args.repeat + 1))
        ray.get(dst.counter_wait.remote(1, out["imm_count"]))
        ok = ray.get(dst.check.remote(d_id, 0, n, n, 0))
        if not all(ok.values()):
            raise SystemExit(f"wrong bytes at {n} bytes: {ok}")
        gbps = n / statistics.median(out["times"][1:]) / 1e9
        rows.append({"bytes": n, "weightsync_gbps": gbps, "bound_gbps": bounds[n],
                     "ratio": gbps / bounds[n]})
        ray.get([src.free.remote(s_id), dst.free.remote(d_id)])
        print(f"{n / MiB:8.0f} MiB  weightsync {gbps:7.1f} GB/s  copy-engine bound {bounds[n]:7.1f} GB/s  "
              f"ratio {gbps / bounds[n]:.3f}", flush=True)

    pair: dict[str, Any] = {}
    if len(ends) >= 4:
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
        pair = {"bytes_each": n, "gbps_each": per, "aggregate_gbps": sum(per), "wall_s": wall}
        print(f"two pairs at once (0->1, 2->3), 1 GiB each: {per[0]:.1f} + {per[1]:.1f} GB/s", flush=True)

    s_id, _ = ray.get(src.alloc.remote(4096, seed=7))
    _d_id, d_desc = ray.get(dst.alloc.remote(4096))
    out = ray.get(src.write.remote(s_id, 0, infos[1]["address"], d_desc, 0, 4096, imm=9, repeat=200))
    latency_us = statistics.median(out["times"][20:]) * 1e6
    print(f"4 KiB write + its immediate: median {latency_us:.0f} us", flush=True)
    ray.shutdown()

    result = {"card": card, "gpus": gpus, "date": time.strftime("%Y-%m-%d"), "sizes": rows, "two_pairs": pair,
              "latency_4k_us": latency_us}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
