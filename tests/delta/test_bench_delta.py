"""Smoke tests of scripts/bench_delta.py on CPU: the codec alone (``--compare``) and the in-process delta
push (``--micro``) run to the end; each checks its own results (the two compare paths find the same
changes, every scatter and every push leaves the source's bytes) and exits non-zero otherwise."""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

from tests import ROOT


def _run(*args: str) -> dict[str, Any]:
    out = subprocess.run([sys.executable, "scripts/bench_delta.py", *args], cwd=ROOT, capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_compare_runs_both_paths_on_cpu() -> None:
    res = _run("--compare", "--device", "cpu", "--model", "llama-tiny", "--steps", "2")
    assert set(res["results"]) == {"kernel", "torch"}
    for path in res["results"].values():
        assert path["compare_ms"] > 0 and path["apply_idx16_ms"] > 0 and path["apply_bitmap_ms"] > 0


def test_micro_pushes_deltas_in_one_process() -> None:
    res = _run("--micro", "--model", "llama-tiny", "--lrs", "1e-6", "--steps", "2")
    (row,) = res["results"]
    assert row["adam_steps"] == [3, 4]
    assert 0 < row["wire_gb"] < row["dense_gb"]
    assert row["encode_ms"] > 0 and row["apply_ms"] > 0
