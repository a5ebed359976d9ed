"""Cost model and simulator: small and fast (the full Kimi-K2 run is scripts/simulate.py's)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from weightsync.plan import plan
from weightsync.runtime.describe import Sharded, describe_tensors
from weightsync.sim.models import CONFIGS
from weightsync.sim.simulate import CostModel, run_model, simulate, simulate_relay

ROOT = Path(__file__).resolve().parents[2]
MODELS = CONFIGS

TINY_MOE = {"architectures": ["DeepseekV3ForCausalLM"], "hidden_size": 512, "num_hidden_layers": 3,
            "first_k_dense_replace": 1, "intermediate_size": 1024, "moe_intermediate_size": 256,
            "n_routed_experts": 16, "n_shared_experts": 1, "num_experts_per_tok": 2, "num_attention_heads": 8,
            "num_key_value_heads": 8, "q_lora_rank": 256, "kv_lora_rank": 128, "qk_nope_head_dim": 32,
            "qk_rope_head_dim": 16, "v_head_dim": 32, "vocab_size": 4096, "tie_word_embeddings": False,
            "quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]}}


def test_two_by_two_one_writer_at_a_time_meets_the_bound() -> None:
    """The DESIGN measurement, simulated: two sources holding halves, two destinations needing all."""
    g = np.zeros((1 << 12, 1 << 12), np.float32)
    srcs = [describe_tensors({"w": Sharded(g[:2048], g.shape, (0, 0))}),
            describe_tensors({"w": Sharded(g[2048:], g.shape, (2048, 0))})]
    dsts = [describe_tensors({"w": g}) for _ in range(2)]
    p = plan(srcs, dsts, source_hosts=[0, 1], destination_hosts=[2, 3])
    for window in (1, 4):
        r = simulate(p, [0, 1], [2, 3], CostModel(msg_overhead_us=0.0, window=window))
        assert r.bound_s == pytest.approx(g.nbytes / 50e9)
        assert r.sim_s == pytest.approx(r.bound_s, rel=0.01)


def test_same_host_writes_use_nvlink() -> None:
    g = np.zeros((1024, 1024), np.float32)
    srcs = [describe_tensors({"w": g}) for _ in range(2)]
    dsts = [describe_tensors({"w": g})]
    p = plan(srcs, dsts, source_hosts=[0, 1], destination_hosts=[1])
    assert set(p.ops["src_rank"].tolist()) == {1}
    r = simulate(p, [0, 1], [1], CostModel(nvlink_gbs=400.0, msg_overhead_us=0.0))
    assert r.bound_s == pytest.approx(g.nbytes / 400e9)


def test_tiny_moe_fp8_through_run_model(tmp_path: Path) -> None:
    path = tmp_path / "tiny-moe.json"
    path.write_text(json.dumps(TINY_MOE))
    out = run_model(path, trainers=16, trainer_layout="hsdp:8", inference_gpus=8, replica_gpus=4,
                    inference_dtype="fp8")
    for k in ("model", "trainers", "inference_gpus", "bytes_total", "bound_s", "sim_s", "ratio", "plan_s",
              "peak_rss_gib"):
        assert k in out
    assert out["bound_s"] > 0 and out["ratio"] >= 0.999
    assert out["detail"]["gather_bytes"] > 0  # 192-row q_a shards: tiles span shards, rows are gathered


def test_llama_70b_moderate_scale_near_bound() -> None:
    out = run_model(MODELS / "llama-3.1-70b.json", trainers=32, trainer_layout="hsdp:8", inference_gpus=16,
                    replica_gpus=8, inference_dtype="fp8")
    assert out["ratio"] < 1.1
    assert out["writes_per_trainer_gpu"]["max"] < 10_000


def test_cli_prints_json_last(tmp_path: Path) -> None:
    path = tmp_path / "tiny-moe.json"
    path.write_text(json.dumps(TINY_MOE))
    res = subprocess.run([sys.executable, str(ROOT / "scripts" / "simulate.py"), "--model", str(path),
                          "--trainers", "16", "--trainer-layout", "hsdp:8", "--inference-gpus", "8",
                          "--replica-gpus", "4", "--nic-gbps", "400", "--nics-per-gpu", "2",
                          "--nvlink-gbps", "400", "--inference-dtype", "bf16"],
                         capture_output=True, text=True, check=True, timeout=120)
    last = json.loads(res.stdout.strip().splitlines()[-1])
    assert last["trainers"] == 16 and last["inference_gpus"] == 8
    assert last["cost_model"]["nics_per_gpu"] == 2
    assert "lower bound" in res.stdout and "writes per trainer GPU" in res.stdout


def test_engine_nic_bytes_follows_the_pieces() -> None:
    """Pieces as the engine cuts them: a write up to the stripe threshold whole, a longer one in equal
    4 KiB-aligned pieces over all NICs, a 2-D write's rows one piece each; each piece on the NIC with
    the fewest bytes of that (source, destination) so far, ties to the next NIC after the last."""
    from weightsync.plan.ops import OP_DTYPE
    from weightsync.sim.simulate import engine_nic_bytes

    ops = np.zeros(6, OP_DTYPE)
    ops["rows"] = [1, 1, 1, 3, 1, 1]
    ops["row_bytes"] = [1 << 20, 1 << 20, (3 << 20) + 5, 1000, 7, 9]
    ops["src_rank"] = [0, 0, 0, 0, 1, 0]
    ops["dst_rank"] = [0, 0, 0, 0, 0, 1]
    ops["dst_pitch"] = ops["row_bytes"]
    ops["dst_pitch"][3] = 4096  # rows apart at the destination: one write each
    nbytes = (ops["rows"] * ops["row_bytes"]).astype(np.float64)
    got = engine_nic_bytes(ops, nbytes, ops["src_rank"].astype(np.int64), 2)
    assert got.sum(axis=1) == pytest.approx(nbytes)
    assert got[0].tolist() == [1 << 20, 0]           # both empty: NIC 0
    assert got[1].tolist() == [0, 1 << 20]           # the less loaded
    piece = -(-((3 << 20) + 6) // 2 // 4096) * 4096  # 2 pieces (a multiple of 2 NICs), 4 KiB aligned
    assert got[2].tolist() == [piece, (3 << 20) + 5 - piece]  # a tie: NIC 0 (after 1), then the other
    assert got[3].tolist() == [0, 3000]              # NIC 1 holds 8187 bytes less: all three rows
    assert got[4].tolist() == [7, 0]                 # another source: loads of its own
    assert got[5].tolist() == [9, 0]                 # another destination: loads of its own


def test_engine_striping_finds_an_unbalanced_destination_nic() -> None:
    """Three 1 MiB writes into a destination with two NICs: whole pieces put 2 MiB on one NIC and 1 MiB
    on the other, so the push takes 2 MiB at one NIC's rate, not 1.5 MiB ("ideal" striping)."""
    g = np.zeros((3 * 256, 1024), np.float32)  # three 1 MiB tensors' worth, as three tensors
    srcs = [describe_tensors({f"t{i}": g[i * 256:(i + 1) * 256] for i in range(3)})]
    dsts = [describe_tensors({f"t{i}": np.zeros((256, 1024), np.float32) for i in range(3)})]
    p = plan(srcs, dsts, source_hosts=[0], destination_hosts=[1])
    base = dict(nic_gbps=1.0, nics_per_gpu=2, msg_overhead_us=0.0)
    ideal = simulate(p, [0], [1], CostModel(**base))
    eng = simulate(p, [0], [1], CostModel(**base, striping="engine"))
    nic = 1e9 / 8
    assert ideal.sim_s == pytest.approx((3 << 20) / (2 * nic), rel=0.02)
    assert eng.sim_s == pytest.approx((2 << 20) / nic, rel=0.02)
    assert eng.nic_bytes_in is not None and sorted(eng.nic_bytes_in[0].tolist()) == [1 << 20, 2 << 20]
    # the payload share of the wire and a fixed cost per push add up as they should
    more = simulate(p, [0], [1],
                    CostModel(**base, striping="engine", wire_efficiency=0.5, push_overhead_s=0.1))
    assert more.sim_s == pytest.approx(2 * eng.sim_s + 0.1, rel=0.02)


def test_relay_chain_is_store_and_forward_per_chunk() -> None:
    """One source pushes 4 MiB into the head of a chain of three hosts (one 1 Gbit/s NIC each). With
    1 MiB chunks each hop adds one chunk's time after the head has the last one (6 chunk times in all);
    with the whole 4 MiB as one chunk nothing overlaps (3 x 4 chunk times); the bound is the model
    once at one NIC's rate either way."""
    g = np.zeros((1024, 1024), np.float32)  # 4 MiB
    p = plan([describe_tensors({"w": g})], [describe_tensors({"w": np.zeros_like(g)})],
             source_hosts=[0], destination_hosts=[1])
    cost = CostModel(nic_gbps=1.0, nics_per_gpu=1, msg_overhead_us=0.0)
    t = (1 << 20) / (1e9 / 8)  # one MiB at the link's rate
    piped = simulate_relay(p, [0], [1, 2, 3], cost, chunk_bytes=1 << 20)
    assert piped.sim_s == pytest.approx(6 * t, rel=1e-6)
    assert piped.bound_s == pytest.approx(4 * t, rel=1e-6)
    whole = simulate_relay(p, [0], [1, 2, 3], cost, chunk_bytes=4 << 20)
    assert whole.sim_s == pytest.approx(12 * t, rel=1e-6)
    # a hop inside a host goes over NVLink: the head's host forwarding to its neighbour costs ~nothing
    same = simulate_relay(p, [0], [1, 1, 2], cost, chunk_bytes=1 << 20)
    assert 5 * t < same.sim_s < 5.01 * t


def test_relay_with_engine_striping_moves_small_chunks_whole_one_per_nic() -> None:
    """Two 1 Gbit/s NICs per GPU, 4 MiB in 1 MiB chunks from one source to a head and a tail. Ideal
    striping: the head has chunk c at (c + 1) / 2 chunk times t (4 MiB over 2 Gbit/s take 2 t) and each
    chunk crosses the hop in t / 2, one after the other: the tail has all at 2.5 t. As the engine places
    them (chunks up to stripe_threshold go whole on one NIC, measured on the emulated cluster): the head
    gets the chunks two at a time, at t and 2 t, and each crosses the hop in t on one NIC while the next
    goes on the other: the tail has all at 3 t. The bound is the model once at both NICs' rate."""
    g = np.zeros((1024, 1024), np.float32)  # 4 MiB
    p = plan([describe_tensors({"w": g})], [describe_tensors({"w": np.zeros_like(g)})],
             source_hosts=[0], destination_hosts=[1])
    t = (1 << 20) / (1e9 / 8)
    for striping, want in (("ideal", 2.5), ("engine", 3.0)):
        cost = CostModel(nic_gbps=1.0, nics_per_gpu=2, msg_overhead_us=0.0, striping=striping)
        r = simulate_relay(p, [0], [1, 2], cost, chunk_bytes=1 << 20)
        assert r.sim_s == pytest.approx(want * t, rel=1e-6), striping
        assert r.bound_s == pytest.approx(2 * t, rel=1e-6)
    # chunks above stripe_threshold are cut over both NICs: the engine model is the ideal one again
    cost = CostModel(nic_gbps=1.0, nics_per_gpu=2, msg_overhead_us=0.0, striping="engine",
                     stripe_threshold=1 << 19)
    ideal = CostModel(nic_gbps=1.0, nics_per_gpu=2, msg_overhead_us=0.0)
    assert simulate_relay(p, [0], [1, 2], cost, chunk_bytes=1 << 20).sim_s == pytest.approx(
        simulate_relay(p, [0], [1, 2], ideal, chunk_bytes=1 << 20).sim_s, rel=0.02)
