"""Smoke test of scripts/bench_push.py --cpu --quick: it runs, verifies the pushed bytes, reports JSON."""

from __future__ import annotations

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_bench_push_cpu_quick() -> None:
    out = subprocess.run([sys.executable, "scripts/bench_push.py", "--cpu", "--quick"], cwd=ROOT,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    for key in ("small_push_median_ms", "big_push_gbps", "engine_one_write_gbps", "push_vs_engine"):
        assert result[key] > 0, key
