"""The grant round trip of a push (``PushStats.grant_seconds``) with destinations in processes of their
own: one source in this process, N staged destinations in spawned children joined to this Ray instance,
small tensors (the grant dominates), CPU and the tcp lane.

    python scripts/bench_grant.py --destinations 4 --pushes 40
    python scripts/bench_grant.py --destinations 4 --turn-s 0.00025   # a source's turn between counters

Prints the median and 90th percentile of the grant phase over the pushes after the first five.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import secrets
import statistics
import sys
import time
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def destination(group: str, rank: int, namespace: str, stop: Any) -> None:
    import ray
    import torch

    import weightsync as ws

    ray.init(address="auto", namespace=namespace, log_to_driver=False)
    d = ws.Destination(group, rank, {"w": torch.zeros(256, 256)}, "staged", timeout=60)
    stop.wait()
    d.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--destinations", type=int, default=4)
    ap.add_argument("--pushes", type=int, default=40)
    ap.add_argument("--turn-s", type=float, default=None,
                    help="weightsync.runtime.grants.GRANT_TURN_S for this run (default: as shipped)")
    args = ap.parse_args()
    import ray
    import torch

    import weightsync as ws
    import weightsync.runtime.grants as grants

    if args.turn_s is not None:
        grants.GRANT_TURN_S = args.turn_s
    secret = secrets.token_hex(16)
    os.environ["WEIGHTSYNC_SECRET"] = secret  # the children inherit it
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"WEIGHTSYNC_SECRET": secret}})
    os.environ["RAY_ADDRESS"] = ray.get_runtime_context().gcs_address
    namespace = ray.get_runtime_context().namespace
    group = f"bench-grant-{time.time_ns()}"
    handle = ws.Group.create(group, num_sources=1, num_destinations=args.destinations)
    ctx = mp.get_context("spawn")
    stop = ctx.Event()
    procs = [ctx.Process(target=destination, args=(group, j, namespace, stop))
             for j in range(args.destinations)]
    for p in procs:
        p.start()
    src = None
    try:
        src = ws.Source(group, 0, {"w": torch.ones(256, 256)}, timeout=120)
        grant = []
        for v in range(args.pushes):
            st = ws.push(src, v, timeout=30)
            if st.failed_destinations:
                raise SystemExit(f"push {v}: destinations {st.failed_destinations} failed")
            grant.append(st.grant_seconds * 1e3)
        g = sorted(grant[5:])
        print(f"destinations {args.destinations}, turn {grants.GRANT_TURN_S * 1e3:g} ms: grant phase median "
              f"{statistics.median(g):.3f} ms, p90 {g[int(0.9 * len(g))]:.3f} ms over {len(g)} pushes; load "
              f"average {os.getloadavg()[0]:.1f}", flush=True)
    finally:
        stop.set()
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.terminate()
        if src is not None:
            src.close()
        handle.shutdown()
        ray.shutdown()


if __name__ == "__main__":
    main()
