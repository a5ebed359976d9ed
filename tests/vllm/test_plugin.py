"""vLLM finds the backend by itself: its general-plugin entry point (pyproject.toml) registers
"weightsync" in any process that loads vLLM's plugins, as its multiprocessing workers do, without the
user calling ``register()``. Runs in .venv-vllm."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import textwrap

import pytest

if importlib.util.find_spec("vllm") is None:
    pytest.skip("vLLM is not installed here: tests/vllm run in .venv-vllm (bash scripts/setup_vllm.sh; "
                "scripts/test.sh runs them there)", allow_module_level=True)

from tests import ROOT

PROBE = textwrap.dedent("""
    import os
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    from vllm.distributed.weight_transfer.factory import (
        WeightTransferEngineFactory, WeightTransferTrainerFactory)
    before = "weightsync" in WeightTransferEngineFactory._registry
    from vllm.plugins import load_general_plugins
    load_general_plugins()
    print(before, "weightsync" in WeightTransferEngineFactory._registry,
          "weightsync" in WeightTransferTrainerFactory._registry)
""")


def test_vllm_general_plugins_register_the_backend_in_a_fresh_process() -> None:
    out = subprocess.run([sys.executable, "-c", PROBE], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split()[-3:] == ["False", "True", "True"], out.stdout[-2000:] + out.stderr[-2000:]
