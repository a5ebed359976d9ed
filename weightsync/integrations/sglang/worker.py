"""The SGLang side: a ``weightsync.Destination`` over one TP worker's live model.

SGLang runs the custom loader in its scheduler's event loop, between forward passes, in every TP worker;
:func:`handle` runs the command there:

* ``init``: connects to the group's Ray cluster (explicit address and namespace, or the environment's:
  weightsync.control.rendezvous) and reads this rank's layout off the live model's own ``load_weights``
  with recording tensors (weightsync.integrations.recording: fused qkv/gate_up rows, each expert's
  ``w13``/``w2``, vocabulary padding, as SGLang's loaders place them in this very server, so with the
  switches it chose for its platform); a model it cannot update is refused here, naming the parameter.
* ``join``: joins the group as an ``inplace`` Destination; returns once every trainer rank joined.
* ``update``: waits until version ``v`` has landed whole in the parameters and, in verification mode,
  compares per-tensor checksums of what landed with the trainers' (weightsync.integrations.vllm.verify).
* ``finish``: checks that no update is landing and that the model holds a whole version.
* ``close``: leaves the group.

Writes land while SGLang may be generating: as with every in-place update, the caller pauses generation
around a push (SGLang's ``pause_generation`` / ``continue_generation``) and flushes the cache after it.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping, Sequence
from typing import Any

from weightsync.control.rendezvous import connect
from weightsync.errors import LayoutError, WeightSyncError
from weightsync.integrations import recording
from weightsync.integrations.recording import CheckpointTensor, RecordedLayout
from weightsync.integrations.sglang import protocol
from weightsync.integrations.vllm.verify import MASK64, add, box_checksum
from weightsync.runtime.destination import Destination

log = logging.getLogger("weightsync.sglang")


def worker_rank() -> int:
    """This worker's rank among the TP workers of its SGLang instance (0 without SGLang's groups)."""
    try:
        from sglang.srt.runtime_context import get_parallel

        return int(get_parallel().world_group.rank_in_group)
    except Exception:  # SGLang's process groups not set up: a single worker
        return 0


def _quantized(model: Any) -> dict[str, str]:
    """``{parameter: quantization method}`` for the layers with a quantization method other than
    SGLang's unquantized ones: those methods may convert the weights after loading (FP8 scales,
    kernel layouts), so checkpoint bytes written in place would not be what the kernels read."""
    out = {}
    for mname, module in model.named_modules():
        method = getattr(module, "quant_method", None)
        if method is None or type(method).__name__.startswith("Unquantized"):
            continue
        for p, _ in module.named_parameters(recurse=False):
            out[f"{mname}.{p}" if mname else p] = type(method).__name__
    return out


def _fingerprint(t: Any) -> tuple[Any, ...]:
    storage = t.untyped_storage()
    return (int(t.data_ptr()), int(storage.data_ptr()), int(storage.nbytes()), tuple(t.shape),
            tuple(t.stride()), str(t.dtype))


class SglangDestination:
    """weightsync's state in one SGLang TP worker, for one model (``id(model)``)."""

    def __init__(self, model: Any) -> None:
        self.model = model
        self._registered: dict[str, tuple[Any, ...]] = {}
        self.destination: Destination | None = None
        self.layout: RecordedLayout | None = None
        self.checkpoint: dict[str, CheckpointTensor] = {}
        self.last_verification: dict[str, Any] | None = None
        self.version = -1

    def derive(self, checkpoint: Sequence[CheckpointTensor]) -> RecordedLayout:
        """This rank's layout for the trainers' ``checkpoint``, read off the live model's loaders.
        Refuses, naming the parameters, what in-place writes of checkpoint slices cannot update."""
        quantized = _quantized(self.model)
        layout = recording.derive_layout(self.model, checkpoint)
        refused = sorted(n for n in layout.pieces if n in quantized)
        if refused:
            raise LayoutError(
                f"the weightsync backend cannot update parameter {refused[0]!r} of this SGLang model in "
                f"place (quantization method {quantized[refused[0]]}; {len(refused)} such parameters): "
                "quantized layers may convert their weights after loading, so checkpoint bytes written "
                "into them would not be what the kernels read")
        return layout

    def init(self, args: Mapping[str, Any]) -> dict[str, Any]:
        """Reads the layout for the trainers' checkpoint off the live model: everything that can refuse
        the model runs here, before anything joins the group."""
        if self.destination is not None:
            raise WeightSyncError(f"this SGLang worker already joined group {self.destination.group!r}")
        checkpoint = [CheckpointTensor(str(n), tuple(int(x) for x in s), str(d).removeprefix("torch."))
                      for n, s, d in args["checkpoint"]]
        self.layout = self.derive(checkpoint)
        self.checkpoint = {ct.name: ct for ct in checkpoint}
        return {"pieces": sum(len(p) for p in self.layout.pieces.values()), "unused": self.layout.unused,
                "unloaded": self.layout.unloaded}

    def join(self, args: Mapping[str, Any], rank: int) -> dict[str, Any]:
        """Joins the group as an ``inplace`` Destination over the layout :meth:`init` derived; returns
        once every participant joined."""
        if self.layout is None:
            raise WeightSyncError("weightsync join before init on this SGLang worker")
        if self.destination is not None:
            raise WeightSyncError(f"this SGLang worker already joined group {self.destination.group!r}")
        self.layout.apply_fills(self.model)
        self.destination = Destination(str(args["group"]), rank, self.layout.tensors(self.model),
                                       mode="inplace", timeout=float(args["timeout"]),
                                       push_timeout=float(args["push_timeout"]), secret=args.get("secret"))
        self.version = self.destination.version
        self._registered = {name: _fingerprint(placed.local_tensor)
                            for name, placed in self.layout.tensors(self.model).items()}
        return {"version": self.version}

    def moved(self) -> list[str]:
        """Registered parameters whose memory SGLang replaced since the join (a quantization method's
        ``restore_weights_before_loading``/``process_weights_after_loading`` in a weight-update session,
        a memory release and resume): writes aimed at the registered memory would miss the model."""
        assert self.layout is not None
        now = self.layout.data(self.model)
        return sorted(n for n, was in self._registered.items() if n not in now or _fingerprint(now[n]) != was)

    def _dst(self) -> Destination:
        if self.destination is None:
            raise WeightSyncError("this SGLang worker has not joined a weightsync group (send init first)")
        return self.destination

    def update(self, args: Mapping[str, Any]) -> dict[str, Any]:
        dst = self._dst()
        version = int(args["version"])
        if version <= self.version:
            raise WeightSyncError(f"version {version} is not newer than the version this worker holds "
                                  f"({self.version})")
        moved = self.moved()
        if moved:
            raise WeightSyncError(f"SGLang replaced the memory of {len(moved)} registered parameters since "
                                  f"this worker joined group {dst.group!r} (e.g. {moved[:3]}): version "
                                  f"{version} was written where the model no longer reads; re-create the "
                                  "trainer side (close, then a new SglangTrainer) so the workers register "
                                  "the new memory")
        got = dst.wait(version, timeout=float(args["timeout"]))
        if got != version:
            raise WeightSyncError(f"waited for version {version}, the model holds {got}: a newer push "
                                  "landed in between")
        self.version = got
        checksums = args.get("checksums")
        self.last_verification = self.verify(checksums) if checksums is not None else None
        return {"version": got, "verification": self.last_verification}

    def finish(self) -> dict[str, Any]:
        dst = self._dst()
        if dst.updating or dst.dirty:
            raise WeightSyncError(f"group {dst.group!r}: an update is still landing or was abandoned half "
                                  f"written (version {dst.version}); the model is not a whole version")
        return {"version": dst.version}

    def verify(self, checksums: Mapping[str, int]) -> dict[str, Any]:
        """Compares ``checksums`` (per checkpoint tensor, as the trainers hold it) with what this worker's
        parameters hold. Tensors this worker holds in part only (tensor parallelism) or narrower than
        the checkpoint's dtype are skipped; returns what was checked."""
        import torch

        assert self.layout is not None
        data = self.layout.data(self.model)
        sums: dict[str, int] = {}
        held: dict[str, int] = {}
        lossy: set[str] = set()
        for pname, pieces in self.layout.pieces.items():
            for name, gshape, offsets, shape, at in pieces:
                k = data[pname].dim() - len(shape)
                view = data[pname][tuple(at[:k]) + tuple(slice(a, a + n) for a, n in zip(at[k:], shape,
                                                                                       strict=True))]
                want = getattr(torch, self.checkpoint[name].dtype)
                if view.dtype != want:
                    if view.element_size() < torch.empty((), dtype=want).element_size():
                        lossy.add(name)
                        continue
                    view = view.to(want)
                sums[name] = add([sums.get(name, 0), box_checksum(view, gshape, offsets)])
                held[name] = held.get(name, 0) + math.prod(shape)
        checked, mismatched = [], []
        for name, want_sum in checksums.items():
            ct = self.checkpoint.get(name)
            if ct is None or name in lossy or held.get(name) != math.prod(ct.shape):
                continue
            (checked if sums[name] == int(want_sum) & MASK64 else mismatched).append(name)
        if mismatched:
            raise WeightSyncError(f"verification after version {self.version}: {len(mismatched)} tensors "
                                  f"differ from the trainers' (checksums), e.g. {sorted(mismatched)[:5]}")
        return {"version": self.version, "checked": len(checked), "skipped": len(checksums) - len(checked)}

    def close(self) -> dict[str, Any]:
        if self.destination is not None:
            self.destination.close()
            self.destination = None
        return {}


_destinations: dict[int, SglangDestination] = {}


def destination_of(model: Any) -> SglangDestination | None:
    """The weightsync state of ``model`` in this process, if a command reached it."""
    return _destinations.get(id(model))


def handle(model: Any, named_tensors: Sequence[tuple[str, Any]]) -> None:
    """Runs one command (SGLang's custom-loader call) and puts the outcome where the trainer reads it.
    Never raises: SGLang's scheduler would go down with it."""
    try:
        op, args = protocol.parse(named_tensors)
    except Exception as err:  # nothing to reply to
        log.error("weightsync: ignored an update_weights_from_tensor call: %s", err)
        return
    rank = int(args.get("rank_offset", 0)) + worker_rank()
    outcome: dict[str, Any]
    try:
        if op == "init":
            # Connected first so that a refusal of the model reaches the trainer; nothing is joined yet.
            connect(args.get("ray_address"), args.get("ray_namespace"), timeout=float(args["timeout"]))
        state = _destinations.setdefault(id(model), SglangDestination(model))
        if op == "init":
            outcome = {"result": state.init(args)}
        elif op == "join":
            outcome = {"result": state.join(args, rank)}
        elif op == "update":
            outcome = {"result": state.update(args)}
        elif op == "finish":
            outcome = {"result": state.finish()}
        else:
            outcome = {"result": state.close()}
            _destinations.pop(id(model), None)
    except Exception as err:
        log.error("weightsync %s on rank %d failed: %s: %s", op, rank, type(err).__name__, err)
        outcome = {"error": f"{type(err).__name__}: {err}"}
    try:
        protocol.reply(args["reply_to"], rank, outcome)
    except Exception as err:  # not connected to Ray: the trainer times out, naming this rank
        log.error("weightsync: rank %d could not report the outcome of %s: %s", rank, op, err)


__all__ = ["SglangDestination", "destination_of", "handle", "worker_rank"]
