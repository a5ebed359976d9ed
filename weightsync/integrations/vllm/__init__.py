"""weightsync as a vLLM weight-transfer backend (``WeightTransferConfig(backend="weightsync")``).

* :mod:`.layouts`: destination layouts read off the live model's own weight loaders (torch only);
* :mod:`.engine`: the vLLM side (``WeightTransferEngine``) and the trainer side
  (``TrainerWeightTransferEngine``), registered with vLLM's factories by :func:`register`.

Nothing here imports vLLM or torch at import time: ``import weightsync`` works without them.
"""

from __future__ import annotations

BACKEND = "weightsync"


def register() -> None:
    """Registers the ``weightsync`` backend with vLLM's ``WeightTransferEngineFactory`` and
    ``WeightTransferTrainerFactory`` (idempotent). Call it in every process that creates vLLM workers
    or trainer engines before they are created."""
    from vllm.distributed.weight_transfer.factory import (
        WeightTransferEngineFactory,
        WeightTransferTrainerFactory,
    )

    module = "weightsync.integrations.vllm.engine"
    if BACKEND not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(BACKEND, module, "WeightsyncWeightTransferEngine")
    if BACKEND not in WeightTransferTrainerFactory._registry:
        WeightTransferTrainerFactory.register_engine(BACKEND, module, "WeightsyncTrainerEngine")


__all__ = ["BACKEND", "register"]
