"""Re-registration after vLLM moves or frees the weights (sleep mode level 1 and 2, expert rebalancing or
a reload that swaps tensors): the worker notices at the next update's start that registered parameters
have new memory, registers the model again and the group re-plans, so the push lands in the memory the
model uses now, bit-identical to vLLM's own loading, and nothing is written into the memory it left.
vLLM's CPU worker ignores sleep, so the move is emulated by giving every parameter new storage
(tests/vllm/backend_actors.py: VllmWorker.sleep_and_wake). Runs in .venv-vllm, on CPU with Ray."""

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


def test_a_worker_whose_weights_moved_registers_again_and_is_updated_bit_identically(ray_cluster) -> None:
    group = ws.Group.create("vllm-sleep", num_sources=2, num_destinations=1)
    worker = ray.remote(num_cpus=0)(VllmWorker).remote(models.LLAMA)
    port = free_port()
    trainers = [ray.remote(num_cpus=0)(Trainer).remote(models.LLAMA, r, 1, port) for r in range(2)]
    try:
        ray.get([a.__ray_ready__.remote() for a in [worker, *trainers]], timeout=300)
        ray.get([t.init.remote(group.name, worker) for t in trainers], timeout=300)
        stats = ray.get([t.step.remote(1, 0) for t in trainers], timeout=300)
        assert all(s["failed"] == [] for s in stats)
        assert ray.get(worker.reregistrations.remote()) == 0
        for version, (level, seed) in enumerate([(1, 2), (2, 3)], start=1):
            ray.get(worker.sleep_and_wake.remote(level))
            stats = ray.get([t.step.remote(seed, version) for t in trainers], timeout=300)
            assert all(s["failed"] == [] for s in stats)
            assert ray.get(worker.reregistrations.remote()) == version
            assert ray.get(worker.differs_from_vllm_loading.remote(seed), timeout=300) == []
            assert ray.get(worker.freed_memory_untouched.remote())
            checked = ray.get(worker.last_verification.remote())
            assert checked["checked"] == len(models.hf_state_dict(models.LLAMA)), checked
        # moved after the update's start: the update is refused, naming parameters
        error = ray.get(worker.update_after_a_move.remote(3), timeout=300)
        assert "moved or freed" in error and "model.embed_tokens.weight" in error, error
    finally:
        for a in [worker, *trainers]:
            ray.kill(a)
        group.shutdown()


def test_expert_rebalancing_is_refused_naming_the_experts() -> None:
    """Expert rebalancing rearranges experts in place, which no memory check sees, and vLLM's loaders place
    experts by the initial map: a worker with enable_eplb is refused at init, naming w13_weight."""
    from tests.vllm.test_post_load import backend
    from weightsync.errors import LayoutError
    from weightsync.integrations.vllm.layouts import checkpoint_of

    model, vllm_config = models.build(models.QWEN3_MOE)
    # set on the built model's config: vLLM's CPU platform does not start EPLB itself
    vllm_config.parallel_config.enable_eplb = True
    with pytest.raises(LayoutError) as err:
        backend(model, vllm_config).derive(checkpoint_of(models.hf_state_dict(models.QWEN3_MOE)))
    assert "'model.layers.0.mlp.experts.routed_experts.w13_weight'" in str(err.value), str(err.value)
    assert "enable_eplb" in str(err.value)
