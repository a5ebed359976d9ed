"""Smoke test of scripts/bench_engine.py --quick: it runs to the end and its last line is the JSON summary.

Timings are not asserted (they are the benchmark's output, not a property); the script itself refuses to
report a run whose landed bytes differ from the source, so exit 0 also means every size was verified.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_bench_engine_quick_runs_and_reports_json(tmp_path) -> None:
    out = tmp_path / "bench.json"
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "scripts", "bench_engine.py"), "--quick", "--json", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert json.loads(out.read_text()) == summary

    assert {"machine", "provider", "socket_copy", "sizes", "latency_4k", "netns", "wall_s"} <= summary.keys()
    assert summary["quick"] is True
    assert summary["socket_copy"]["gbps"] > 0
    assert summary["sizes"], "no write sizes measured"
    for row in summary["sizes"]:
        assert {"size", "writes_per_round", "landed_s", "gbps", "writes_per_s", "vs_socket"} <= row.keys()
        assert row["verified"] is True
    assert {"rtt_us_median", "one_way_us", "src_complete_us_median"} <= summary["latency_4k"].keys()
    netns = summary["netns"]
    if "skipped" not in netns:  # without root the section says why instead
        assert {"one_nic", "two_nics", "ratio", "rate_mbit"} <= netns.keys()
        assert netns["one_nic"]["verified"] and netns["two_nics"]["verified"]
        two = netns["two_nics"]
        assert sum(two["per_nic_bytes"]) == two["bytes"] * two["reps"]  # every striped byte is accounted
