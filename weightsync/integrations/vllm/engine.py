"""The ``weightsync`` backend of vLLM's weight-transfer API (vllm/distributed/weight_transfer).

vLLM's four phases map onto weightsync's:

* ``init_transfer_engine`` (once): connect to the group's Ray cluster (an explicit address and
  namespace for processes Ray did not start: weightsync.control.rendezvous), read this rank's
  destination layout off the live model's own weight loaders (weightsync.integrations.vllm.layouts)
  and join the group as a ``weightsync.Destination`` over the model's parameters. The join returns once
  the plan is made, that is once every trainer rank has joined too.
* ``start_weight_update``: nothing moves yet; the trainer side calls it before its push so that vLLM
  treats the update as a session (generation paused by the caller, as for every in-place backend).
* ``receive_weights`` (``update_weights({"version": v})``): the bytes are written one-sided by the
  trainers into the live parameters (``inplace``: no second copy of the model on the GPU); this waits
  until version ``v`` is complete, and refuses a half-written model.
* ``finish_weight_update``: checks that no update is landing and that the model holds a whole version.

Verification mode (``WeightsyncTrainerInitInfo(verify=True)``): after each push the trainer ranks' per-
tensor checksums (weightsync.integrations.vllm.verify, summed over the ranks with torch.distributed) go
with the update, and the worker compares them with checksums of what landed in its parameters; a
mismatch raises, naming the tensors.

The trainer side, ``WeightsyncTrainerEngine``, is a ``weightsync.Source`` per trainer rank fed by vLLM's
``WeightSource`` (``iter_local`` shards with their placements, or full tensors), and drives the round
trip from rank 0 through the ``VLLMWeightSyncClient``: init, then per step start, push (every rank),
update (wait for the version), finish.

Importing this module imports vLLM: it is loaded by vLLM's factories through
:func:`weightsync.integrations.vllm.register`.
"""

from __future__ import annotations

import logging
import math
import threading
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from vllm.distributed.weight_transfer.base import (
    ParamMeta,
    Shard,
    TrainerInitInfo,
    TrainerWeightTransferEngine,
    VLLMWeightSyncClient,
    WeightSource,
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

from weightsync.control.rendezvous import connect
from weightsync.errors import LayoutError, WeightSyncError
from weightsync.integrations.recording import loadable_tensors
from weightsync.integrations.vllm import BACKEND
from weightsync.integrations.vllm.layouts import (
    CheckpointTensor,
    Refresh,
    Reprocess,
    VllmLayout,
    landing_layout,
    post_load_conversions,
    post_load_refreshes,
    reprocessable_layers,
)
from weightsync.integrations.vllm.verify import MASK64, add, box_checksum, to_signed
from weightsync.runtime.describe import Sharded
from weightsync.runtime.destination import Destination
from weightsync.runtime.source import PushStats, Source

log = logging.getLogger("weightsync.vllm")

# --------------------------------------------------------------------------------------------------
# vLLM side


@dataclass
class WeightsyncInitInfo(WeightTransferInitInfo):
    """What a vLLM worker needs to join: the group, where its Ray cluster is, and the checkpoint's
    tensors (names, shapes, dtypes: the trainer's metadata) to read the layout off the loaders with.

    ``rank_offset``: added to the worker's rank in its vLLM world (set it per data-parallel replica when
    several vLLM instances join one group). ``secret``: the group's secret when the worker's environment
    has no ``WEIGHTSYNC_SECRET``."""

    group: str
    checkpoint: list[list[Any]]  # [name, shape, dtype name]
    ray_address: str | None = None
    ray_namespace: str | None = None
    rank_offset: int = 0
    secret: str | None = None
    timeout: float = 120.0
    push_timeout: float = 60.0


@dataclass
class WeightsyncUpdateInfo(WeightTransferUpdateInfo):
    """One update: the version the trainers push (strictly increasing) and, in verification mode, the
    checksum of every checkpoint tensor as the trainers hold it."""

    version: int
    timeout: float = 60.0
    checksums: dict[str, int] | None = None


# What says a registered tensor is still the memory the destination registered: vLLM's sleep mode (on
# platforms where it frees memory), expert rebalancing and reloads may put new tensors, or new storage,
# under the parameters' names.
Fingerprint = tuple[int, int, int, tuple[int, ...], tuple[int, ...], str, str]


def _fingerprint(t: torch.Tensor) -> Fingerprint:
    storage = t.untyped_storage()
    return (int(t.data_ptr()), int(storage.data_ptr()), int(storage.nbytes()), tuple(t.shape),
            tuple(t.stride()), str(t.dtype), str(t.device))


def _world_rank() -> int:
    """This worker's rank among vLLM's workers of its instance (0 without vLLM's distributed state)."""
    try:
        from vllm.distributed.parallel_state import get_world_group

        return int(get_world_group().rank_in_group)
    except Exception:  # vLLM's process groups not set up: a single worker
        return 0


class WeightsyncWeightTransferEngine(WeightTransferEngine[WeightsyncInitInfo, WeightsyncUpdateInfo]):
    """vLLM's worker side: a ``weightsync.Destination`` over the live model's parameters."""

    init_info_cls = WeightsyncInitInfo
    update_info_cls = WeightsyncUpdateInfo
    supports_draft_weight_update = False

    def __init__(self, config: Any, vllm_config: Any, device: torch.device, model: torch.nn.Module) -> None:
        super().__init__(config, vllm_config, device, model)
        self.destination: Destination | None = None
        self.layout: VllmLayout | None = None
        self.checkpoint: dict[str, CheckpointTensor] = {}
        self.last_verification: dict[str, Any] | None = None
        self.refreshes: list[Refresh] = []
        self.reprocess: list[Reprocess] = []
        self._torn: str | None = None  # why the live model is not a whole version, after a failed re-run
        self._init_info: WeightsyncInitInfo | None = None
        self._registered: dict[str, Fingerprint] = {}  # parameter name -> what was registered
        self.reregistrations = 0
        self._version = -1

    def init_transfer_engine(self, init_info: WeightsyncInitInfo) -> None:

        if self.destination is not None:
            raise WeightSyncError(f"this vLLM worker already joined group {self.destination.group!r}")
        checkpoint = [CheckpointTensor(str(n), tuple(int(x) for x in s), str(d).removeprefix("torch."))
                      for n, s, d in init_info.checkpoint]
        # Everything that can refuse this model runs before the worker reaches out to Ray: a model the
        # backend cannot update fails at once, naming the parameter, with nothing joined.
        self.layout = self.derive(checkpoint)
        self.checkpoint = {ct.name: ct for ct in checkpoint}
        if self.layout.unused:
            # Pushed by the trainers but taken by no parameter or buffer of this worker (a tied lm_head,
            # experts of other expert-parallel ranks, a tensor vLLM's loader skips): said once, by name.
            log.info("group %r: this vLLM worker takes none of %d checkpoint tensors the trainers push: %s",
                     init_info.group, len(self.layout.unused), ", ".join(self.layout.unused[:8]) +
                     (f" (and {len(self.layout.unused) - 8} more)" if len(self.layout.unused) > 8 else ""))
        connect(init_info.ray_address, init_info.ray_namespace, timeout=init_info.timeout)
        self._init_info = init_info
        self._register()

    def _register(self) -> None:
        """Joins the group as a ``Destination`` over the layout's tensors as they are now."""
        assert self.layout is not None and self._init_info is not None
        info = self._init_info
        self.layout.apply_fills(self.model)
        tensors = self.layout.tensors(self.model)
        self.destination = Destination(info.group, info.rank_offset + _world_rank(), tensors,
                                       mode="inplace", timeout=info.timeout, push_timeout=info.push_timeout,
                                       secret=info.secret)
        self._registered = {name: _fingerprint(t.local_tensor) for name, t in tensors.items()}
        self._version = self.destination.version

    def moved(self) -> list[str]:
        """The registered parameters whose memory vLLM replaced since they were registered (a new tensor
        or new storage under the name, another shape, or the parameter gone): sleep mode where it frees
        and re-allocates weights, expert rebalancing or a reload that swaps tensors. Writes aimed at the
        registered memory would not reach the model (or land in memory it freed)."""
        if self.layout is None:
            return []
        params = loadable_tensors(self.model)
        out = []
        for name, was in self._registered.items():
            if name in self.layout.landing:
                continue  # the backend's own copy: vLLM never moves it
            p = params.get(name)
            if p is None or _fingerprint(p) != was:
                out.append(name)
        return out

    def reregister(self) -> list[str]:
        """Re-registers the model if vLLM moved or freed registered parameters (:meth:`moved`): derives
        the layout again from the live model (its loaders, the trainers' checkpoint), leaves the group
        and joins it again under the same rank over the new memory, which makes the coordinator re-plan
        (the sources push with the new plan from their next push). Returns the parameters that had
        moved (empty: nothing done). Refuses, as at init, a model the backend cannot update any more."""
        moved = self.moved()
        if not moved:
            return []
        dst = self._dst()
        log.warning(
            "group %r rank %d: vLLM moved or freed %d registered parameters (e.g. %s); registering the "
            "model again and re-planning", dst.group, dst.rank, len(moved), moved[:3])
        layout = self.derive(list(self.checkpoint.values()))
        dst.close()
        self.destination = None
        self.layout = layout
        self._register()
        self.reregistrations += 1
        return moved

    def derive(self, checkpoint: list[CheckpointTensor]) -> VllmLayout:
        """This worker's layout for the trainers' ``checkpoint``, read off the live model's loaders (an
        FP8 block-quantized model's weights and scales as its FP8 checkpoint would land).

        Layers whose quantization method converts their weights into a kernel format after loading
        (FP8 block quantization: ``process_weights_after_loading``) receive the bytes in a checkpoint-
        format copy the backend keeps, and are re-processed into their live kernel tensors once a whole
        version has landed (:class:`Reprocess`, as vLLM's in-place reload does); the processing is tried
        once here, and a method that cannot be re-run on this platform is refused naming the parameter
        and vLLM's error. Refuses, naming the parameters, a model whose kernels read a format vLLM made
        from the weights after loading in a way the backend does not re-run."""
        from vllm.config import set_current_vllm_config

        quant = getattr(self.vllm_config, "quant_config", None)
        block = getattr(quant, "weight_block_size", None) if quant is not None else None
        with set_current_vllm_config(self.vllm_config):
            layers = reprocessable_layers(self.model)
            layout, reprocess, _ = landing_layout(self.model, checkpoint, block, layers)
            # only layers that receive checkpoint bytes are re-processed (and keep a landing copy)
            def lands(r: Reprocess) -> bool:
                return any(f"{r.module}.{n}" in layout.pieces for n in r.landing)

            for r in reprocess:
                if not lands(r):
                    for n in r.landing:
                        layout.landing.pop(f"{r.module}.{n}", None)
            reprocess = [r for r in reprocess if lands(r)]
            rerun = [r.layer for r in reprocess]
        self._refuse_rebalanced_experts(layout)
        with set_current_vllm_config(self.vllm_config):
            converted = post_load_conversions(self.model, rerun)
            self.refreshes = [r for r in post_load_refreshes(self.model, self.model_config.dtype, rerun)
                              if any(name in layout.pieces for name in r.inputs)]
        refused = [(name, converted[name]) for name in layout.pieces if name in converted]
        if refused:
            shown = "; ".join(f"{name!r}: {why}" for name, why in refused[:3])
            more = f" (and {len(refused) - 3} more)" if len(refused) > 3 else ""
            raise LayoutError(
                f"the weightsync backend cannot update this model in place: {shown}{more}. Its kernels "
                "read a format vLLM made from the loaded weights, so checkpoint bytes written into these "
                "parameters would not (or not wholly) change what it computes")
        with set_current_vllm_config(self.vllm_config), torch.no_grad():
            for r in reprocess:
                r.check()
        self.reprocess = reprocess
        return layout

    def _refuse_rebalanced_experts(self, layout: VllmLayout) -> None:
        """Expert rebalancing (``enable_eplb``) moves experts between the physical slots of the fused
        expert weights at run time, in place, while vLLM's loaders (and so the layout read off them) put
        every expert in the slot of the initial placement: pushes would write experts where the router
        no longer looks for them. Refused, naming the parameter."""
        parallel = getattr(self.vllm_config, "parallel_config", None)
        if not getattr(parallel, "enable_eplb", False):
            return
        experts = sorted(n for n in layout.pieces if n.rsplit(".", 1)[-1].startswith(("w13_", "w2_")))
        if experts:
            raise LayoutError(
                f"parameter {experts[0]!r}: expert rebalancing (enable_eplb) rearranges the experts in "
                "place at run time, and vLLM's weight loaders place them by the initial expert map, so "
                "the layout weightsync derives from them would write experts into slots they left; run "
                "vLLM without enable_eplb to update it with weightsync")

    def _dst(self) -> Destination:
        if self.destination is None:
            raise WeightSyncError("the weightsync backend was not initialized: call "
                                  "init_weight_transfer_engine first")
        return self.destination

    def start_weight_update(self) -> None:
        """Before the trainers push: re-registers (and re-plans) first if vLLM moved or freed registered
        parameters since the last update (:meth:`reregister`), so that no byte of this update is
        written into memory the model no longer uses."""
        self._dst()
        self.reregister()
        dst = self._dst()
        if self._torn is None:
            self._version = dst.version

    def receive_weights(self, update_info: WeightsyncUpdateInfo) -> None:
        dst = self._dst()
        moved = self.moved()
        if moved:
            raise WeightSyncError(
                f"vLLM moved or freed {len(moved)} registered parameters (e.g. {moved[:3]}) after this "
                f"update started: version {update_info.version} was written into memory the model no "
                "longer uses. Start the next update (start_weight_update) after vLLM is done moving them "
                "(e.g. after wake_up): the backend registers the new memory then")
        if update_info.version <= self._version:
            raise WeightSyncError(f"version {update_info.version} is not newer than the version this worker "
                                  f"holds ({self._version})")
        got = dst.wait(update_info.version, timeout=update_info.timeout)
        if got != update_info.version:
            raise WeightSyncError(f"waited for version {update_info.version}, the model holds {got}: a newer "
                                  "push landed in between")
        self._version = got
        self.after_update()
        if update_info.checksums is not None:
            self.last_verification = self.verify(update_info.checksums)

    def after_update(self) -> None:
        """Re-runs what vLLM does to the weights after loading, so that the kernels read the version
        that just landed: the quantization methods' processing of the layers whose bytes land in
        checkpoint-format copies (FP8 block quantization), then the derivations of the attention layers
        (MLA's ``W_UK_T``/``W_UV``, from a re-processed ``kv_b_proj`` too); a no-op for most models.

        Runs inside the update (between start and finish, generation paused by the caller as for any
        in-place backend): until it runs the kernels still read the previous version whole. If it fails
        part way, the model is marked torn and ``finish_weight_update`` raises until a later version is
        re-processed whole."""
        from vllm.config import set_current_vllm_config

        done = ""
        try:
            with set_current_vllm_config(self.vllm_config), torch.no_grad():
                for r in self.reprocess:
                    done = r.module
                    r.run()
                for refresh in self.refreshes:
                    done = refresh.module
                    refresh.run()
        except Exception as err:
            self._torn = (f"re-processing {done!r} after version {self._version} failed: "
                          f"{type(err).__name__}: {err}")
            raise WeightSyncError(f"the model is not a whole version: {self._torn}") from err
        self._torn = None

    def verify(self, checksums: Mapping[str, int]) -> dict[str, Any]:
        """Compares ``checksums`` (per checkpoint tensor, as the trainers hold it) with what this
        worker's parameters hold. Tensors this worker holds only in part (tensor parallelism) or in a
        narrower dtype than the checkpoint's (a lossy cast) are skipped; returns what was checked."""
        assert self.layout is not None
        params = self.layout.data(self.model)
        sums: dict[str, int] = {}
        held: dict[str, int] = {}
        lossy: set[str] = set()
        for pname, pieces in self.layout.pieces.items():
            data = params[pname]
            for name, gshape, offsets, shape, at in pieces:
                if name not in self.checkpoint:  # FP8 block scales: made by the senders, not theirs
                    continue
                k = data.dim() - len(shape)
                box = tuple(slice(a, a + n) for a, n in zip(at[k:], shape, strict=True))
                view = data[tuple(at[:k]) + box]
                want = getattr(torch, self.checkpoint[name].dtype)
                if view.dtype != want:
                    if view.element_size() < torch.empty((), dtype=want).element_size():
                        lossy.add(name)
                        continue
                    view = view.to(want)  # a widening cast: back to the checkpoint's values exactly
                sums[name] = add([sums.get(name, 0), box_checksum(view, gshape, offsets)])
                held[name] = held.get(name, 0) + math.prod(shape)
        checked, mismatched = [], []
        for name, want_sum in checksums.items():
            ct = self.checkpoint.get(name)
            if ct is None or name in lossy or held.get(name) != math.prod(ct.shape):
                continue
            (checked if sums[name] == int(want_sum) & MASK64 else mismatched).append(name)
        if mismatched:
            raise WeightSyncError(f"verification after version {self._version}: {len(mismatched)} tensors "
                                  f"differ from the trainers' (checksums), e.g. {sorted(mismatched)[:5]}: "
                                  "the layout put bytes in the wrong place")
        return {"version": self._version, "checked": len(checked),
                "skipped": len(checksums) - len(checked)}

    def update_weights(self, update_info: dict[str, Any]) -> None:
        # The writes land in host or device memory by the engine's own lanes, complete when their
        # immediates are counted: there is no stream of this process's to synchronize.
        self.receive_weights(self.parse_update_info(update_info))

    def finish_weight_update(self) -> None:
        dst = self._dst()
        if self._torn is not None:
            raise WeightSyncError(f"group {dst.group!r}: {self._torn}; the model is not a whole version")
        if dst.updating or dst.dirty:
            raise WeightSyncError(f"group {dst.group!r}: an update is still landing or was abandoned half "
                                  f"written (version {dst.version}); the model is not a whole version")

    def shutdown(self) -> None:
        if self.destination is not None:
            self.destination.close()
            self.destination = None


# --------------------------------------------------------------------------------------------------
# Trainer side


@dataclass
class WeightsyncTrainerInitInfo(TrainerInitInfo):
    """A trainer rank's part of the rendezvous: the group (created beforehand with
    ``weightsync.Group.create(group, num_sources=trainer ranks, num_destinations=vLLM workers)``) and
    where its Ray cluster is; the rest is handed to the vLLM workers at init."""

    backend: ClassVar[str] = BACKEND

    group: str = ""
    ray_address: str | None = None
    ray_namespace: str | None = None
    secret: str | None = None
    timeout: float = 120.0
    push_timeout: float = 60.0
    verify: bool = False
    # Every rank waits (torch.distributed barrier, where a process group of several ranks is set up) for
    # the sender's start of the vLLM side before it pushes: a worker that re-registers moved parameters
    # at start re-plans the group there, and every rank must push with that plan.
    barrier_after_start: bool = True
    # What the vLLM workers need from their side (WeightsyncInitInfo), passed through unchanged.
    worker_ray_address: str | None = None
    worker_ray_namespace: str | None = None
    worker_rank_offset: int = 0
    extra: dict[str, Any] = field(default_factory=dict)


def _box_of(meta: ParamMeta, rank: int, local: torch.Tensor) -> tuple[tuple[int, ...], tuple[int, ...], bool]:
    """(global shape, offsets, whether this rank is the one that counts the piece in checksums) of
    ``rank``'s piece of ``meta`` as its placements lay it out (of replicas, only the first counts)."""
    shape = tuple(int(x) for x in meta.shape)
    if meta.owners is None:
        return shape, (0,) * len(shape), rank == 0
    if meta.placements is None:
        return shape, (0,) * len(shape), rank == meta.owners[0]
    mesh = tuple(meta.mesh_shape or (len(meta.owners),))
    coord, flat = [], meta.owners.index(rank)
    for n in reversed(mesh):
        coord.append(flat % n)
        flat //= n
    coord.reverse()
    offsets, extent = [0] * len(shape), list(shape)
    first = True
    for axis, p in enumerate(meta.placements):
        if not isinstance(p, Shard):
            first = first and coord[axis] == 0
        else:
            # torch.chunk's split of what the outer axes left: ceil-sized chunks, the last ones short
            size = math.ceil(extent[p.dim] / mesh[axis]) if extent[p.dim] else 0
            lo = min(coord[axis] * size, extent[p.dim])
            offsets[p.dim] += lo
            extent[p.dim] = min(size, extent[p.dim] - lo)
    if tuple(local.shape) != tuple(extent):
        raise LayoutError(f"trainer rank {rank}: its piece of {meta.name!r} has shape {tuple(local.shape)}, "
                          f"its placements {meta.placements} on mesh {mesh} give {tuple(extent)}")
    return shape, tuple(offsets), first


def _local_pieces(source: WeightSource, rank: int) -> Iterator[tuple[str, torch.Tensor]]:
    if source.implements_iter_local():
        return source.iter_local()
    return source.iter_full()


class WeightsyncTrainerEngine(TrainerWeightTransferEngine[WeightsyncTrainerInitInfo]):
    """A trainer rank's side: a ``weightsync.Source`` over its pieces of the model, pushed every step."""

    init_info_cls = WeightsyncTrainerInitInfo

    def __init__(self, *, client: VLLMWeightSyncClient, source: WeightSource, info: WeightsyncTrainerInitInfo,
                 is_sender: bool, rank: int) -> None:
        super().__init__(client=client, source=source, is_sender=is_sender, rank=rank)
        self.info = info
        self.version = -1
        self.last_stats: PushStats | None = None
        metas = {m.name: m for m in source.metadata}
        self._registered: dict[str, torch.Tensor] = {}
        tensors: dict[str, Sharded] = {}
        self._counted: list[str] = []  # the pieces this rank adds to the checksums
        for name, local in _local_pieces(source, rank):
            local = local.detach()
            if hasattr(local, "to_local"):  # a DTensor that iter_local gathered or left whole
                local = local.to_local()
            meta = metas[name]
            if source.implements_iter_local():
                gshape, offsets, counts = _box_of(meta, rank, local)
            else:
                gshape, offsets, counts = tuple(int(x) for x in meta.shape), (0,) * local.dim(), rank == 0
            if counts:
                self._counted.append(name)
            local = local.contiguous()
            self._registered[name] = local
            tensors[name] = Sharded(local, gshape, offsets)
        self._tensors = tensors
        self._metas = list(source.metadata)
        self.src: Source | None = None

    @classmethod
    def trainer_init(cls, init_info: WeightsyncTrainerInitInfo, *, client: VLLMWeightSyncClient,
                     source: WeightSource | None = None) -> WeightsyncTrainerEngine:
        if source is None:
            raise WeightSyncError("the weightsync trainer engine pushes a WeightSource: pass source=")
        if not init_info.group:
            raise WeightSyncError("WeightsyncTrainerInitInfo needs the group's name (group=)")
        connect(init_info.ray_address, init_info.ray_namespace, timeout=init_info.timeout)
        engine = cls(client=client, source=source, info=init_info, is_sender=init_info.is_sender,
                     rank=init_info.rank)
        failure: list[BaseException] = []
        helper: threading.Thread | None = None
        if engine.is_sender:
            worker_info = {
                "group": init_info.group,
                "checkpoint": [[m.name, list(m.shape), str(m.dtype).removeprefix("torch.")]
                               for m in engine._metas],
                "ray_address": init_info.worker_ray_address, "ray_namespace": init_info.worker_ray_namespace,
                "rank_offset": init_info.worker_rank_offset, "secret": init_info.secret,
                "timeout": init_info.timeout, "push_timeout": init_info.push_timeout, **init_info.extra}

            def init_workers() -> None:
                try:
                    client.init_weight_transfer_engine(worker_info)
                except BaseException as exc:  # re-raised in the caller's thread below
                    failure.append(exc)

            # The workers' join returns once the plan exists, which needs this rank's join as well:
            # both run at once.
            helper = threading.Thread(target=init_workers, name="weightsync-vllm-init", daemon=True)
            helper.start()
        try:
            engine.src = Source(init_info.group, init_info.rank, engine._tensors, timeout=init_info.timeout,
                                secret=init_info.secret)
        finally:
            if helper is not None:
                helper.join(init_info.timeout)
        if failure:
            raise WeightSyncError(f"the vLLM workers failed to join group {init_info.group!r}: "
                                  f"{failure[0]}") from failure[0]
        if helper is not None and helper.is_alive():
            raise WeightSyncError(f"the vLLM workers did not join group {init_info.group!r} within "
                                  f"{init_info.timeout} s")
        return engine

    def _refresh(self) -> None:
        """Copies this round's pieces into the registered tensors where the source hands out new
        tensors (a cast, a gathered copy); pieces that are the registered memory cost nothing."""
        assert self.source is not None
        for name, local in _local_pieces(self.source, self.rank):
            if hasattr(local, "to_local"):
                local = local.to_local()
            held = self._registered[name]
            if local.data_ptr() != held.data_ptr():
                held.copy_(local.detach())

    def checksums(self) -> dict[str, int]:
        """Per checkpoint tensor, the checksum of the whole tensor as the trainer ranks hold it: this
        rank's sums of the pieces it counts, added over the ranks with torch.distributed (a collective:
        every rank calls it) when a process group is initialized; without one this rank's alone."""
        names = [m.name for m in self._metas]
        counted = set(self._counted)
        mine = [box_checksum(self._tensors[n].local_tensor, self._tensors[n].global_shape,
                             self._tensors[n].offsets) if n in counted else 0 for n in names]
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            total = torch.tensor([to_signed(x) for x in mine], dtype=torch.int64)
            dist.all_reduce(total)  # integer sums wrap modulo 2**64, like the checksums themselves
            mine = [int(x) & MASK64 for x in total.tolist()]
        return dict(zip(names, mine, strict=True))

    def send_weights(self, version: int | None = None) -> PushStats:
        """Pushes this rank's pieces as ``version`` (default: one more than the last) and, on the sender,
        drives the vLLM side's start / update / finish around it. Called on every trainer rank."""
        if self.src is None:
            raise WeightSyncError("trainer_init did not finish")
        version = self.version + 1 if version is None else int(version)
        self._refresh()
        if self.is_sender:
            self.client.start_weight_update()
        if self.info.barrier_after_start:
            import torch.distributed as dist

            if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
                dist.barrier()
        stats = self.src.push(version, self.info.push_timeout)
        self.version = version
        self.last_stats = stats
        update: dict[str, Any] = {"version": version, "timeout": self.info.push_timeout}
        if self.info.verify:
            update["checksums"] = self.checksums()
        if self.is_sender:
            self.client.update_weights(update)
            self.client.finish_weight_update()
        return stats

    def shutdown(self) -> None:
        if self.src is not None:
            self.src.close()
            self.src = None


def module_checkpoint(named: Mapping[str, torch.Tensor]) -> list[list[Any]]:
    """The ``checkpoint`` field of :class:`WeightsyncInitInfo` for a dict of full tensors."""
    return [[k, list(v.shape), str(v.dtype).removeprefix("torch.")] for k, v in named.items()]


__all__ = ["WeightsyncInitInfo", "WeightsyncTrainerEngine", "WeightsyncTrainerInitInfo",
           "WeightsyncUpdateInfo", "WeightsyncWeightTransferEngine", "module_checkpoint"]
