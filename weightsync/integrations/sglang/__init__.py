"""weightsync as SGLang's weight updater: a ``weightsync.Destination`` in every SGLang TP worker, driven
through SGLang's own weight-update entry points.

SGLang calls a *custom weight loader* (an import path listed in the server's ``--custom-weight-loader``)
in every TP worker when ``update_weights_from_tensor(named_tensors, load_format=<that path>)`` is called
(``sgl.Engine``, the HTTP server, or its Python client), with the worker's live model. weightsync's
loader, :func:`load_weights` (``LOAD_FORMAT``), takes no weights through that call: the trainers' bytes are
written one-sided into the live parameters by weightsync's engine. What travels through SGLang is small
commands (:mod:`.protocol`): join the group (the layout read off the live model's own loaders, as for
vLLM: weightsync.integrations.recording), wait for a version, verify it, finish.

* :mod:`.worker`: the SGLang side (imports torch, and SGLang's parallel state when it is there);
* :mod:`.trainer`: the trainer side (:class:`~.trainer.SglangTrainer`: a ``weightsync.Source`` over
  FSDP2 DTensors or full tensors, driving the SGLang side through any object with SGLang's
  ``update_weights_from_tensor``).

Nothing here imports SGLang or torch at import time: ``import weightsync`` works without them.
"""

from __future__ import annotations

from typing import Any

# The value of SGLang's --custom-weight-loader and of load_format in update_weights_from_tensor.
LOAD_FORMAT = "weightsync.integrations.sglang.load_weights"


def load_weights(model: Any, named_tensors: list[tuple[str, Any]]) -> None:
    """SGLang's custom weight loader (``--custom-weight-loader`` ``LOAD_FORMAT``): runs the weightsync
    command in ``named_tensors`` on this TP worker's ``model``. Never raises (an exception would take
    SGLang's scheduler down): the outcome goes back to the trainer through the group's Ray cluster."""
    from weightsync.integrations.sglang.worker import handle

    handle(model, named_tensors)


__all__ = ["LOAD_FORMAT", "load_weights"]
