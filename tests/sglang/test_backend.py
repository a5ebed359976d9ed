"""The SGLang backend end to end, on CPU with Ray: SGLang TP workers (models SGLang builds, updated
through SGLang's own ``update_weights_from_tensor`` with weightsync's custom loader) and two trainer
ranks holding the checkpoint as FSDP2 DTensors. After each push every parameter of every worker is
bit-identical to what SGLang's own ``load_weights`` makes of the same checkpoint, at TP 1 and TP 2;
verification checks what each worker holds whole and catches two swapped rows, naming the tensor.
Runs in .venv-sglang (scripts/setup_sglang.sh)."""

from __future__ import annotations

import importlib.util
from typing import Any

import pytest

if importlib.util.find_spec("sglang") is None:
    pytest.skip("SGLang is not installed here: tests/sglang run in .venv-sglang (bash "
                "scripts/setup_sglang.sh; scripts/test.sh runs them there)", allow_module_level=True)

import ray

import weightsync as ws
from tests.sglang import models
from tests.sglang.actors import SglangWorker, Trainer
from tests.sglang.models import free_port


def _start(config: dict[str, Any], tp: int, ep: int = 1) -> tuple[list[Any], list[Any]]:
    port, trainer_port = free_port(), free_port()
    workers = [ray.remote(num_cpus=0)(SglangWorker).remote(config, tp, r, port, ep) for r in range(tp)]
    trainers = [ray.remote(num_cpus=0)(Trainer).remote(config, r, 2, trainer_port) for r in range(2)]
    ray.get([a.__ray_ready__.remote() for a in [*workers, *trainers]], timeout=300)
    return workers, trainers


def _stop(actors: list[Any], group: Any) -> None:
    for a in actors:
        ray.kill(a)
    group.shutdown()


@pytest.mark.parametrize(("config", "tp", "ep"), [(models.LLAMA, 1, 1), (models.QWEN3_MOE, 1, 1),
                                                  (models.LLAMA, 2, 1), (models.QWEN3, 2, 1),
                                                  (models.QWEN3_MOE, 2, 1), (models.QWEN3_MOE, 2, 2)],
                         ids=["llama-tp1", "qwen3-moe-tp1", "llama-tp2", "qwen3-tp2", "qwen3-moe-tp2",
                              "qwen3-moe-tp2-ep2"])
def test_trainer_pushes_into_sglang_workers_bit_identically(ray_cluster: Any, config: dict[str, Any], tp: int,
                                                            ep: int) -> None:
    name = f"sglang-{config['model_type']}-tp{tp}-ep{ep}"
    group = ws.Group.create(name, num_sources=2, num_destinations=tp)
    workers, trainers = _start(config, tp, ep)
    try:
        if ep > 1:  # each worker holds its share of the experts, each whole
            w13 = ray.get(workers[0].shapes.remote())["model.layers.0.mlp.experts.w13_weight"]
            assert w13[:2] == [config["num_experts"] // ep, 2 * config["moe_intermediate_size"]], w13
        ray.get([t.init.remote(group.name, workers) for t in trainers], timeout=300)
        for version, seed in enumerate([1, 2]):
            outcomes = ray.get([t.step.remote(seed, version) for t in trainers], timeout=300)[0]
            assert sorted(outcomes) == list(range(tp))
            assert ray.get([w.differs_from_sglang_loading.remote(seed) for w in workers],
                           timeout=300) == [[]] * tp
            for result in outcomes.values():
                assert result["version"] == version
                # every tensor a worker holds whole is checked (at TP 1: all of them)
                checked = result["verification"]["checked"]
                assert checked > 0 and (tp > 1 or result["verification"]["skipped"] == 0), result
    finally:
        ray.get([t.close.remote() for t in trainers], timeout=120)
        _stop([*workers, *trainers], group)


def test_verification_names_a_tensor_in_the_wrong_place(ray_cluster: Any) -> None:
    group = ws.Group.create("sglang-verify", num_sources=2, num_destinations=1)
    workers, trainers = _start(models.LLAMA, 1)
    try:
        ray.get([t.init.remote(group.name, workers) for t in trainers], timeout=300)
        ray.get([t.step.remote(1, 0) for t in trainers], timeout=300)
        # after the next push lands, its input_layernorm rows 0 and 1 are swapped before verification
        ray.get(workers[0].swap_rows_after_next_update.remote("model.layers.0.input_layernorm.weight"))
        errors = ray.get([t.push_expecting_refusal.remote(1) for t in trainers], timeout=300)
        assert "model.layers.0.input_layernorm.weight" in errors[0], errors
    finally:
        _stop([*workers, *trainers], group)


def test_a_parameter_sglang_moved_fails_the_update_naming_it(ray_cluster: Any) -> None:
    group = ws.Group.create("sglang-moved", num_sources=2, num_destinations=1)
    workers, trainers = _start(models.LLAMA, 1)
    try:
        ray.get([t.init.remote(group.name, workers) for t in trainers], timeout=300)
        ray.get([t.step.remote(1, 0) for t in trainers], timeout=300)
        ray.get(workers[0].replace_memory.remote("model.layers.1.mlp.down_proj.weight"))
        errors = ray.get([t.push_expecting_refusal.remote(1) for t in trainers], timeout=300)
        assert "model.layers.1.mlp.down_proj.weight" in errors[0], errors
        assert "replaced the memory" in errors[0], errors
    finally:
        _stop([*workers, *trainers], group)


def test_a_refused_model_fails_the_trainers_init_naming_the_tensor(ray_cluster: Any) -> None:
    """The workers read their layouts before anything joins: the sender's init fails at once with the
    worker's reason (here a checkpoint tensor SGLang's loader does not take), not after a timeout."""
    group = ws.Group.create("sglang-refused", num_sources=2, num_destinations=2)
    workers, trainers = _start(models.LLAMA, 2)
    try:
        bad = "model.layers.1.mlp.up_proj.weight"
        error = ray.get(trainers[0].init_expecting_refusal.remote(group.name, workers, bad), timeout=300)
        assert "refused weightsync command 'init'" in error and bad in error, error
    finally:
        _stop([*workers, *trainers], group)
