"""Smoke tests of scripts/bench_push.py: the model layouts it builds, and ``--cpu --quick`` end to end (it
runs, verifies the pushed bytes, reports JSON, and scenario 1 beats nothing it should not)."""

from __future__ import annotations

import json
import subprocess
import sys
from collections import defaultdict

from tests import ROOT

sys.path.insert(0, ROOT)

from scripts.bench_worker import CONFIGS, checkpoint_tensors, rollout_params, traffic


def test_model_shapes_and_traffic() -> None:
    # Llama-3-8B: 8.03e9 parameters, 16.06 GB in bf16; FSDP over 2 to 2 replicas moves it twice.
    t = traffic(CONFIGS["llama-3-8b"], 2, 2, 1)
    assert t["model_bytes"] == 2 * 8_030_261_248
    assert t["recv"] == [t["model_bytes"]] * 2 and t["send_direct"] == [t["model_bytes"]] * 2
    # Fan-out 1 -> 3: a rollout must receive the model once, the lone trainer writes it three times.
    t3 = traffic(CONFIGS["llama-3-8b"], 1, 3, 1)
    assert t3["must_bytes"] == t["model_bytes"] and t3["direct_bytes"] == 3 * t["model_bytes"]
    # Qwen3-30B-A3B: 30.5e9 parameters.
    assert traffic(CONFIGS["qwen3-30b-a3b"], 2, 2, 2)["model_bytes"] == 2 * 30_532_122_624


def test_tp_ranks_cover_every_tensor_once() -> None:
    for model in ("llama-tiny", "moe-tiny"):
        cfg = CONFIGS[model]
        held: dict[str, int] = defaultdict(int)
        for r in range(2):
            for p in rollout_params(cfg, 2, r):
                for name, _, _, shape, _ in p.pieces:
                    n = 1
                    for s in shape:
                        n *= s
                    held[name] += n
        for name, shape in checkpoint_tensors(cfg):
            n = 1
            for s in shape:
                n *= s
            # replicated tensors (norms, router) sit on both ranks; everything else is split
            assert held[name] in (n, 2 * n), name
            if "norm" not in name and not name.endswith("mlp.gate.weight"):
                assert held[name] == n, name


def test_bench_push_cpu_quick() -> None:
    out = subprocess.run([sys.executable, "scripts/bench_push.py", "--cpu", "--quick"], cwd=ROOT,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    for key in ("small_push_median_ms", "big_push_gbps", "engine_one_write_gbps", "push_vs_engine"):
        assert result[key] > 0, key
    s1 = result["scenario_1"]
    # Every part that reports a time moved and verified every byte on every rollout.
    for part in ("weightsync", "b"):
        assert s1[part]["median_s"] > 0 and s1[part]["verified_bytes"] > 0, (part, s1[part])
    assert s1["a_best"]["median_s"] > 0
    assert s1["ratio_to_bound"] > 0


def test_bench_push_delta_cpu() -> None:
    # The delta push benchmark on CPU actors: one trainer to one fused replica, Adam kept, every delta push
    # verified against the trainer's bytes by the script itself (it exits non-zero otherwise).
    out = subprocess.run([sys.executable, "scripts/bench_push.py", "--device", "cpu", "--scale", "tiny",
                          "--scenarios", "5", "--baselines", "", "--delta-lr", "1e-6", "--pushes", "2"],
                         cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    (s5,) = json.loads(out.stdout.strip().splitlines()[-1])["scenarios"]
    d = s5["delta"]
    assert d["median_s"] > 0 and d["verified_bytes"] > 0, d
    assert d["adam"] == "kept" and d["adam_steps"] == [3, 4]
    # every timed push went to its destination as a delta, and sent fewer bytes than the dense push
    assert d["not_delta"] == [0, 0]
    assert 0 < d["wire_bytes_median"] < d["dense_bytes_median"]
    assert 0 < d["changed_fraction_median"] < 0.1
    assert "--encode-gbs" in d["simulate_delta"]
