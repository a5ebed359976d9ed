"""What the trainer side and SGLang's TP workers say to each other.

Commands go through SGLang's ``update_weights_from_tensor``: one named tensor whose name says the command
(``weightsync.<op>``) and whose bytes are its arguments as JSON, which SGLang hands unchanged to the
custom weight loader of every TP worker. SGLang reports nothing back from a custom loader (it answers
success whenever the loader returns), so each worker puts its outcome under the command's reply key in
the group's Ray cluster (internal key-value store, weightsync.control.kv), where the trainer side reads
one per worker. Any job of the cluster can write that store, so an outcome is a report, not a proof: a
job that forges one can make the trainer believe a command succeeded or failed, never put bytes into a
model (weights arrive only through the group's authenticated engines).
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Sequence
from typing import Any

from weightsync.control import kv
from weightsync.errors import WeightSyncError

PREFIX = "weightsync."
OPS = ("init", "join", "update", "finish", "close")
_KV_NAMESPACE = "weightsync-sglang"


def command(op: str, args: dict[str, Any]) -> tuple[list[tuple[str, Any]], str]:
    """``(named_tensors, reply key)`` for ``op`` with ``args``: what to pass to SGLang's
    ``update_weights_from_tensor`` (with ``load_format=LOAD_FORMAT``)."""
    import torch

    if op not in OPS:
        raise ValueError(f"unknown weightsync command {op!r}")
    reply_to = f"{op}-{uuid.uuid4().hex}"
    body = json.dumps({**args, "reply_to": reply_to}).encode()
    return [(PREFIX + op, torch.frombuffer(bytearray(body), dtype=torch.uint8))], reply_to


def parse(named_tensors: Sequence[tuple[str, Any]]) -> tuple[str, dict[str, Any]]:
    """The ``(op, args)`` of a command as the custom loader receives it."""
    if len(named_tensors) != 1 or not str(named_tensors[0][0]).startswith(PREFIX):
        names = [str(n) for n, _ in named_tensors][:3]
        raise WeightSyncError(f"weightsync's loader takes one weightsync command, got {len(named_tensors)} "
                              f"tensors ({names}): weights reach the model through weightsync's engine, "
                              "not through update_weights_from_tensor")
    name, tensor = named_tensors[0]
    op = str(name)[len(PREFIX):]
    if op not in OPS:
        raise WeightSyncError(f"unknown weightsync command {name!r}")
    return op, json.loads(bytes(tensor.cpu().numpy().tobytes()).decode())


def reply(reply_to: str, rank: int, outcome: dict[str, Any]) -> None:
    """Puts this worker's ``outcome`` of a command where the trainer side looks for it."""
    kv.put(f"{reply_to}/{rank}", json.dumps(outcome).encode(), _KV_NAMESPACE)


def collect(reply_to: str, ranks: Sequence[int], timeout: float) -> dict[int, dict[str, Any]]:
    """Every worker's outcome of a command (``{rank: outcome}``), removed from the store; raises naming
    the ranks that did not answer within ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    got: dict[int, dict[str, Any]] = {}
    while True:
        for r in ranks:
            if r in got:
                continue
            raw = kv.take(f"{reply_to}/{r}", _KV_NAMESPACE)
            if raw is not None:
                got[r] = json.loads(raw)
        if len(got) == len(ranks):
            return got
        if time.monotonic() > deadline:
            missing = sorted(set(ranks) - set(got))
            raise WeightSyncError(f"SGLang worker ranks {missing} did not answer weightsync command "
                                  f"{reply_to.split('-')[0]!r} within {timeout} s: were they started with "
                                  "--custom-weight-loader weightsync.integrations.sglang.load_weights and "
                                  "can they reach the group's Ray cluster? (their log says why)")
        time.sleep(0.02)


def raise_failures(op: str, outcomes: dict[int, dict[str, Any]]) -> None:
    failed = {r: o["error"] for r, o in sorted(outcomes.items()) if o.get("error")}
    if failed:
        shown = "; ".join(f"rank {r}: {e}" for r, e in list(failed.items())[:3])
        raise WeightSyncError(f"SGLang workers refused weightsync command {op!r}: {shown}")


__all__ = ["OPS", "PREFIX", "collect", "command", "parse", "raise_failures", "reply"]
