"""A real vLLM engine on CPU (``LLM(...)``, in-process engine core) for the tiny Llama, loaded from a
safetensors checkpoint with the weightsync backend configured; run as ``python -m tests.vllm.llm_engine``.
In the engine's worker (the model as vLLM's loader left it after process_weights_after_loading) the
backend derives its layout; if it refuses, the error and the parameters post_load_conversions names are
reported; otherwise every parameter is poisoned, filled through the planner from FSDP-style halves of
the same state dict and the post-load derivations re-run, and the parameters whose bytes differ from the
engine's own loading, with greedy tokens before and after, are reported. Prints one JSON line; where
vLLM's engine cannot start on this machine, ``{"unavailable": vLLM's error}``."""

from __future__ import annotations

import json
import os
import tempfile
from typing import Any

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the worker in this process: collective_rpc callables
os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

from tests.vllm import models


def main() -> None:
    from safetensors.torch import save_file

    config = models.LLAMA
    sd = models.hf_state_dict(config)
    folder = tempfile.mkdtemp(prefix="ws-vllm-engine-")
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(config, f)
    save_file({k: v.contiguous() for k, v in sd.items()}, os.path.join(folder, "model.safetensors"))
    try:
        from vllm import LLM, SamplingParams
        from vllm.config import WeightTransferConfig

        llm = LLM(model=folder, skip_tokenizer_init=True, dtype="bfloat16", max_model_len=64,
                  enforce_eager=True, max_num_seqs=2, load_format="safetensors",
                  weight_transfer_config=WeightTransferConfig(backend="weightsync"))
    except Exception as err:  # vLLM's own error, reported for the test to skip with
        print(json.dumps({"unavailable": f"{type(err).__name__}: {err}"[:800]}))
        return
    prompt = [{"prompt_token_ids": [1, 5, 9, 13]}]
    greedy = SamplingParams(max_tokens=6, temperature=0.0)
    before = list(llm.generate(prompt, greedy)[0].outputs[0].token_ids)

    def update(worker: Any) -> dict[str, Any]:
        from tests.vllm.test_layouts import fill_through_planner, raw
        from weightsync.errors import LayoutError
        from weightsync.integrations.vllm.layouts import checkpoint_of, post_load_conversions

        engine = worker.weight_transfer_engine
        model = worker.get_model()
        loaded = {k: raw(v) for k, v in model.named_parameters()}
        try:
            layout = engine.derive(checkpoint_of(sd))
        except LayoutError as err:
            return {"refused": str(err), "converted": sorted(post_load_conversions(model))}
        fill_through_planner(model, layout, sd)
        engine.after_update()
        return {"differ": [k for k, v in model.named_parameters() if raw(v) != loaded[k]]}

    result = llm.collective_rpc(update)[0]
    if "differ" in result:
        result["before"] = before
        result["after"] = list(llm.generate(prompt, greedy)[0].outputs[0].token_ids)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
