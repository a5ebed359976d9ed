"""One tensor-parallel rank of vLLM on CPU (run as ``python -m tests.vllm.tp_rank RANK TP PORT MODEL [ep]``,
MODEL a config name of tests.vllm.models, ``ep`` for expert parallelism): builds the tiny model at this
rank, loads the reference with vLLM's own load_weights, fills a second instance through the layout derived
from the loaders (planner + reference executor, from two FSDP-style halves) and prints a JSON line: the
parameters whose bytes differ and the layout's pieces."""

from __future__ import annotations

import json
import sys

from tests.vllm import models


def main() -> None:
    from vllm.config import set_current_vllm_config

    from tests.vllm.test_layouts import fill_through_planner, raw
    from weightsync.integrations.vllm.layouts import checkpoint_of, derive_layout

    rank, tp, port = (int(x) for x in sys.argv[1:4])
    config = getattr(models, sys.argv[4] if len(sys.argv) > 4 else "LLAMA")
    ep = len(sys.argv) > 5 and sys.argv[5] == "ep"
    sd = models.hf_state_dict(config)
    ref, ref_config = models.build(config, tp=tp, rank=rank, port=port, ep=ep)
    with set_current_vllm_config(ref_config):
        ref.load_weights(iter(sd.items()))
    target, target_config = models.build(config, tp=tp, rank=rank, port=port, ep=ep)
    with set_current_vllm_config(target_config):
        layout = derive_layout(target, checkpoint_of(sd))
    fill_through_planner(target, layout, sd)
    want, got = dict(ref.named_parameters()), dict(target.named_parameters())
    print(json.dumps({"differ": [k for k in want if raw(want[k]) != raw(got[k])],
                      "shapes": {k: list(v.shape) for k, v in got.items()},
                      "pieces": {k: [[n, list(o), list(s), list(a)] for n, _, o, s, a in v]
                                 for k, v in layout.pieces.items()},
                      "unused": layout.unused, "unloaded": layout.unloaded}))


if __name__ == "__main__":
    main()
