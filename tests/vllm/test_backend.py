"""The "weightsync" backend of vLLM's weight-transfer API end to end, on CPU with Ray: a vLLM worker
(a tiny Llama vLLM builds, its engine made by vLLM's WeightTransferEngineFactory) and two FSDP-style
trainer ranks (the trainer side, made by WeightTransferTrainerFactory); after each push the worker's
parameters are bit-identical to what vLLM's own load_weights gives for the same state dict, and the
verification mode checks every tensor (and catches two swapped rows)."""

from __future__ import annotations

import importlib.util

import pytest

if importlib.util.find_spec("vllm") is None:
    pytest.skip("vLLM is not installed here: tests/vllm run in .venv-vllm (bash scripts/setup_vllm.sh; "
                "scripts/test.sh runs them there)", allow_module_level=True)

import ray

import weightsync as ws
from tests.runtime.group_actors import free_port
from tests.vllm import models
from tests.vllm.backend_actors import Trainer, VllmWorker


def test_two_trainer_ranks_push_into_a_vllm_worker_bit_identically(ray_cluster) -> None:
    group = ws.Group.create("vllm-backend", num_sources=2, num_destinations=1)
    worker = ray.remote(num_cpus=0)(VllmWorker).remote(models.LLAMA)
    port = free_port()
    trainers = [ray.remote(num_cpus=0)(Trainer).remote(models.LLAMA, r, 1, port) for r in range(2)]
    try:
        ray.get([a.__ray_ready__.remote() for a in [worker, *trainers]], timeout=300)
        ray.get([t.init.remote(group.name, worker) for t in trainers], timeout=300)
        for version, seed in enumerate([1, 2]):
            stats = ray.get([t.step.remote(seed, version) for t in trainers], timeout=300)
            assert all(s["failed"] == [] for s in stats)
            assert ray.get(worker.differs_from_vllm_loading.remote(seed), timeout=300) == []
            checked = ray.get(worker.last_verification.remote())
            assert checked == {"version": version, "checked": len(models.hf_state_dict(models.LLAMA)),
                               "skipped": 0}
        checksums = ray.get([t.checksums.remote() for t in trainers])[0]
        error = ray.get(worker.verify_with_swapped_heads.remote(checksums))
        assert "model.layers.0.self_attn.k_proj.weight" in error, error
    finally:
        for a in [worker, *trainers]:
            ray.kill(a)
        group.shutdown()


def test_a_checkpoint_tensor_vllm_loads_into_a_buffer_is_pushed_and_verified(ray_cluster) -> None:
    """Gemma 4's ``layer_scalar`` lands in a persistent buffer of vLLM's model: the trainers push it like
    every other tensor, and the worker's verification finds it there (checked, not skipped)."""
    group = ws.Group.create("vllm-backend-buffer", num_sources=2, num_destinations=1)
    worker = ray.remote(num_cpus=0)(VllmWorker).remote(models.GEMMA4)
    port = free_port()
    trainers = [ray.remote(num_cpus=0)(Trainer).remote(models.GEMMA4, r, 1, port) for r in range(2)]
    try:
        ray.get([a.__ray_ready__.remote() for a in [worker, *trainers]], timeout=300)
        ray.get([t.init.remote(group.name, worker) for t in trainers], timeout=300)
        stats = ray.get([t.step.remote(1, 0) for t in trainers], timeout=300)
        assert all(s["failed"] == [] for s in stats)
        assert ray.get(worker.differs_from_vllm_loading.remote(1), timeout=300) == []
        assert ray.get(worker.last_verification.remote()) == {
            "version": 0, "checked": len(models.hf_state_dict(models.GEMMA4)), "skipped": 0}
    finally:
        for a in [worker, *trainers]:
            ray.kill(a)
        group.shutdown()
