"""Runs a fault-injection campaign against a weight-sync group and prints its summary (docs/FAULTS.md).

    .venv/bin/python scripts/chaos.py --pushes 300 --seed 1 --netns

Sources and destinations are Ray actors (tests/support/chaos.py) on a local Ray of this process. The
summary is printed as a table and as one JSON line (prefixed ``CHAOS_SUMMARY``); ``--json PATH`` also
writes it to a file. Exit status 0 when no mixed or wrong version was seen, no hang and no broken
expectation, 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import sys
import time
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from tests.support.chaos import Campaign, Config, netns_unavailable  # noqa: E402


def table(summary: dict[str, Any]) -> str:
    rows: list[tuple[str, str]] = []
    for key in ("seed", "netns", "sources", "destinations", "pushes", "pushes_ok", "pushes_failed",
                "replacements", "readmissions", "mixed", "mixed_reads", "wrong", "wrong_reads", "hangs",
                "expectation_failures", "left_behind", "final_pushes",
                "inplace_reads_raced", "inplace_reads_dirty", "seconds"):
        rows.append((key, str(summary[key])))
    for group in ("faults", "versions_checked", "reads", "errors"):
        for k, v in summary[group].items():
            rows.append((f"{group}.{k}", str(v)))
    width = max(len(k) for k, _ in rows)
    out = [f"{k:<{width}}  {v}" for k, v in rows]
    for key in ("samples", "expectation_samples"):
        if summary[key]:
            out.append(f"{key}:")
            out += [f"  {s}" for s in summary[key]]
    return "\n".join(out)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pushes", type=int, default=300)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--netns", action="store_true", help="sources and destinations in two network "
                    "namespaces joined by two rate-limited veth pairs (needs root); adds NIC cuts")
    ap.add_argument("--push-timeout", type=float, default=5.0)
    ap.add_argument("--fault-rate", type=float, default=0.6)
    ap.add_argument("--max-minutes", type=float, help="stop drawing pushes after this long (then one final "
                    "clean push and the summary)")
    ap.add_argument("--json", help="also write the summary to this file")
    ap.add_argument("--quiet", action="store_true", help="no per-push log")
    args = ap.parse_args()
    if args.netns and netns_unavailable():
        print(f"--netns: {netns_unavailable()}", file=sys.stderr)
        return 2

    import ray

    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": ROOT, "WEIGHTSYNC_SECRET": secrets.token_hex(16)}})
    try:
        cfg = Config(pushes=args.pushes, seed=args.seed, netns=args.netns, push_timeout=args.push_timeout,
                     dest_push_timeout=args.push_timeout, fault_rate=args.fault_rate,
                     max_seconds=None if args.max_minutes is None else args.max_minutes * 60,
                     log=None if args.quiet else lambda m: print(m, flush=True))
        start = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
        summary = Campaign(cfg).run()
        summary["started"] = start
    finally:
        ray.shutdown()
    print(table(summary))
    print("CHAOS_SUMMARY " + json.dumps(summary, sort_keys=True))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=1, sort_keys=True)
    bad = summary["mixed"] or summary["wrong"] or summary["hangs"] or summary["expectation_failures"]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
