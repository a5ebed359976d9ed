"""examples/vllm_update.py, run as a user runs it (``python -m examples.vllm_update``, its own Ray): FSDP2
trainer ranks push through vLLM's weight-transfer API into the weightsync backend on vLLM's CPU platform,
every push is verified by checksums, and the model ends byte-identical to vLLM's own loading of the
trainers' weights. Runs in .venv-vllm."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys

import pytest

if importlib.util.find_spec("vllm") is None:
    pytest.skip("vLLM is not installed here: tests/vllm run in .venv-vllm (bash scripts/setup_vllm.sh; "
                "scripts/test.sh runs them there)", allow_module_level=True)

from tests import ROOT


def test_the_vllm_example_pushes_and_verifies_every_step() -> None:
    proc = subprocess.run([sys.executable, "-m", "examples.vllm_update", "--steps", "3"], cwd=ROOT,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary["steps"] == 3
    assert summary["differ"] == []
    # the last push's verification compared every tensor the trainers hold with what landed
    assert summary["verification"] == {"version": 3, "checked": summary["tensors"], "skipped": 0}
    assert summary["losses"][-1] < summary["losses"][0]
