"""Destination layouts of a live vLLM model, read off vLLM's own weight loaders.

vLLM fills its parameters with ``model.load_weights(iter((hf_name, tensor)))``: per layer type, a weight
loader narrows the checkpoint tensor to this rank's shard and copies it into a slice of a (possibly
fused, padded) parameter. Rather than keeping a table per model, weightsync runs that very code once
with *recording* tensors:

* every checkpoint tensor is handed in as a storage-less ``meta`` tensor of its shape and dtype; the
  view operations a loader applies to it (``narrow``, ``chunk``, ``split``, indexing, ``view``) are
  ordinary meta operations whose result still aliases the checkpoint tensor's storage, so its storage
  offset and strides say exactly which elements of the checkpoint tensor the loader selected;
* a torch function mode watches every write into a parameter (``copy_``, ``__setitem__``, ``fill_``,
  ``zero_``) and records it instead of performing it: the destination slice's offset and strides
  relative to the parameter say where those elements land. The live parameters are never written.

Each recorded copy becomes one piece of a :class:`weightsync.Placed` over the parameter's tensor (a box
of the logical checkpoint tensor placed at an index of the parameter), which the planner takes as it
is. Constant fills (a vocabulary-parallel embedding zeroes its padding rows) are kept and applied once
to the live parameters, since no source holds those rows. What boxes cannot say (a loader that
transposes, casts through arithmetic, computes values, or broadcasts) is a :class:`LayoutError` naming
the parameter and the operation.

torch (and vLLM, through the model handed in) are imported lazily: ``import weightsync`` needs neither.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from weightsync.errors import LayoutError
from weightsync.runtime.describe import Placed

# (logical name, logical shape, offsets in it, box shape, index of the box's first element in the param)
Piece = tuple[str, tuple[int, ...], tuple[int, ...], tuple[int, ...], tuple[int, ...]]

# In-place methods that change no element of the tensor they are called on.
_NOT_WRITES = {"requires_grad_", "retain_grad", "share_memory_", "pin_memory", "record_stream"}


@dataclass(frozen=True)
class CheckpointTensor:
    """One tensor of the checkpoint (Hugging Face) state dict as the trainer holds it."""

    name: str
    shape: tuple[int, ...]
    dtype: str  # torch dtype name without the "torch." prefix, e.g. "bfloat16"


@dataclass(frozen=True)
class Fill:
    """A constant the loaders write into a box of a parameter (padding), not taken from the checkpoint."""

    at: tuple[int, ...]
    shape: tuple[int, ...]
    value: float


@dataclass
class VllmLayout:
    """Where every checkpoint tensor lands in one vLLM rank's parameters.

    ``pieces``: per parameter name (``model.named_parameters()``), its pieces. ``fills``: constants the
    loaders write into parameters. ``unused``: checkpoint tensors no parameter of this rank takes (tied
    ``lm_head``, buffers vLLM recomputes, experts of other expert-parallel ranks). ``unloaded``:
    parameters that receive neither a piece nor a fill (they keep what they hold). ``landing``: for the
    parameters of layers vLLM converts after loading and the backend re-processes (:class:`Reprocess`),
    the checkpoint-format tensors the bytes land in instead of the live (kernel-format) parameter."""

    pieces: dict[str, list[Piece]] = field(default_factory=dict)
    fills: dict[str, list[Fill]] = field(default_factory=dict)
    unused: list[str] = field(default_factory=list)
    unloaded: list[str] = field(default_factory=list)
    landing: dict[str, Any] = field(default_factory=dict)

    def data(self, model: Any) -> dict[str, Any]:
        """``{parameter name: tensor}``: where each parameter of the layout receives its bytes (its
        landing tensor, else the live parameter's ``.data``)."""
        params = dict(model.named_parameters())
        missing = sorted(set(self.pieces) - set(params) - set(self.landing))
        if missing:
            raise LayoutError(f"the layout names parameters the model does not have: {missing[:5]}")
        return {name: self.landing[name] if name in self.landing else params[name].data
                for name in set(self.pieces) | set(self.fills)}

    def tensors(self, model: Any) -> dict[str, Placed]:
        """``{parameter name: Placed}`` over ``model``'s live parameter tensors (or their landing
        tensors): the tensors of a ``weightsync.Destination``. Parameter subclasses are described
        through their ``.data``."""
        data = self.data(model)
        return {name: Placed(data[name], pieces) for name, pieces in self.pieces.items()}

    def apply_fills(self, model: Any) -> None:
        """Writes the loaders' constants (e.g. zero padding rows) into ``model``'s live parameters (or
        their landing tensors)."""
        tensors = self.data(model)
        for name, fills in self.fills.items():
            data = tensors[name]
            for f in fills:
                data[tuple(slice(a, a + n) for a, n in zip(f.at, f.shape, strict=True))].fill_(f.value)


def checkpoint_of(state_dict: Mapping[str, Any]) -> list[CheckpointTensor]:
    """The :class:`CheckpointTensor` list of a state dict of torch tensors (shapes and dtypes only)."""
    return [CheckpointTensor(str(k), tuple(int(x) for x in v.shape), str(v.dtype).removeprefix("torch."))
            for k, v in state_dict.items()]


# --------------------------------------------------------------------------------------------------
# Geometry: a strided view of a contiguous tensor as a box


def _contiguous_strides(shape: Sequence[int]) -> list[int]:
    strides, acc = [0] * len(shape), 1
    for d in range(len(shape) - 1, -1, -1):
        strides[d] = acc
        acc *= max(int(shape[d]), 1)
    return strides


def _unravel(offset: int, shape: Sequence[int]) -> list[int]:
    idx = [0] * len(shape)
    for d in range(len(shape) - 1, -1, -1):
        n = max(int(shape[d]), 1)
        idx[d] = offset % n
        offset //= n
    return idx


def _box(offset: int, shape: Sequence[int], strides: Sequence[int],
         base: Sequence[int]) -> tuple[list[int], list[int], list[int | None]] | None:
    """The view ``(offset, shape, strides)`` of a contiguous tensor of shape ``base`` as a box:
    ``(start, extent, base dim of each view dim)`` (None for the view's size-1 dims), or None when the
    view is not a box with its dimensions in the base's order (transposed, merged or strided)."""
    if offset < 0 or offset >= max(math.prod(base), 1):
        return None
    bstrides = _contiguous_strides(base)
    start = _unravel(offset, base)
    extent = [1] * len(base)
    dims: list[int | None] = []
    last = -1
    for n, s in zip(shape, strides, strict=True):
        if n == 1:
            dims.append(None)
            continue
        found = [k for k in range(len(base)) if bstrides[k] == s and base[k] > 1]
        if len(found) != 1 or found[0] <= last or start[found[0]] + n > base[found[0]]:
            return None
        last = k = found[0]
        extent[k] = int(n)
        dims.append(k)
    return start, extent, dims


# --------------------------------------------------------------------------------------------------
# The recorder


def _storage(t: Any) -> int | None:
    try:
        return int(t.untyped_storage()._cdata)
    except Exception:  # a tensor without storage of its own (a wrapper subclass): not one of ours
        return None


@dataclass
class _ParamRef:
    name: str
    shape: tuple[int, ...]
    offset: int  # storage offset of the parameter's first element
    numel: int  # elements of the storage it spans (its numel when contiguous)
    strides: tuple[int, ...] | None = None  # set for a parameter that is not contiguous


def _recorder_class() -> type:
    import torch
    from torch.overrides import TorchFunctionMode
    from torch.utils._pytree import tree_flatten

    class Recorder(TorchFunctionMode):
        """Records writes of checkpoint slices into parameters instead of doing them."""

        def __init__(self, sources: dict[int, CheckpointTensor], params: dict[int, list[_ParamRef]]) -> None:
            super().__init__()
            self.sources = sources
            self.params = params
            self.derived: dict[int, str] = {}  # storage -> how it was computed from a checkpoint tensor
            self.pieces: dict[str, list[Piece]] = {}
            self.fills: dict[str, list[Fill]] = {}
            self.used: set[str] = set()

        # -- where a tensor sits ------------------------------------------------------------------
        def _param_of(self, t: Any) -> tuple[_ParamRef, int] | None:
            refs = self.params.get(_storage(t)) if isinstance(t, torch.Tensor) else None
            if not refs:
                return None
            off = int(t.storage_offset())
            for ref in refs:
                if ref.offset <= off < ref.offset + max(ref.numel, 1):
                    if ref.strides is not None:
                        raise LayoutError(f"parameter {ref.name!r} is not contiguous (strides {ref.strides}) "
                                          "and its loader writes into it; weightsync registers parameters "
                                          "as they are")
                    return ref, off - ref.offset
            return None

        def _dest_box(self, ref: _ParamRef, rel: int, dest: Any, what: str) -> tuple[list[int], list[int],
                                                                                       list[int | None]]:
            box = _box(rel, tuple(dest.shape), tuple(dest.stride()), ref.shape)
            if box is None:
                raise LayoutError(f"parameter {ref.name!r}: its loader {what} a slice of shape "
                                  f"{tuple(dest.shape)} and strides {tuple(dest.stride())} at element "
                                  f"{rel}, which is not a box of the parameter {ref.shape}")
            return box

        # -- writes -------------------------------------------------------------------------------
        def _copy(self, dest: Any, src: Any) -> None:
            hit = self._param_of(dest)
            sid = _storage(src) if isinstance(src, torch.Tensor) else None
            origin = self.sources.get(sid) if sid is not None else None
            if hit is None:
                # A scratch buffer filled from the checkpoint: whatever is later copied out of it was
                # computed, not sliced.
                if origin is not None or sid in self.derived:
                    self.derived[_storage(dest)] = \
                        f"a copy through a scratch tensor of shape {tuple(dest.shape)}"
                return
            ref, rel = hit
            if origin is None:
                how = self.derived.get(sid) if sid is not None else None
                raise LayoutError(
                    f"parameter {ref.name!r}: its loader writes "
                    f"{how if how else 'values that come from no checkpoint tensor'}; weightsync moves "
                    "checkpoint slices as they are (or cast), not values computed from them")
            self.used.add(origin.name)
            if tuple(src.shape) != tuple(dest.shape):
                if math.prod(src.shape) != math.prod(dest.shape) or [n for n in src.shape if n != 1] != \
                        [n for n in dest.shape if n != 1]:
                    raise LayoutError(f"parameter {ref.name!r}: its loader copies {origin.name!r} "
                                      f"{tuple(src.shape)} into a slice of shape {tuple(dest.shape)} "
                                      "(broadcast or reshaped), which boxes cannot express")
            sbox = _box(int(src.storage_offset()), tuple(src.shape), tuple(src.stride()), origin.shape)
            if sbox is None:
                raise LayoutError(f"parameter {ref.name!r}: its loader takes a slice of {origin.name!r} "
                                  f"{origin.shape} with shape {tuple(src.shape)} and strides "
                                  f"{tuple(src.stride())} (transposed or reshaped), not a box")
            dstart, dext, ddims = self._dest_box(ref, rel, dest, "copies into")
            sstart, sext, sdims = sbox
            delta = len(ref.shape) - len(origin.shape)
            pairs = list(zip([k for k in sdims if k is not None], [m for m in ddims if m is not None],
                             strict=True))
            if delta < 0 or any(m != k + delta for k, m in pairs) or \
                    any(dext[m] != 1 for m in range(delta)) or \
                    any(dext[k + delta] != sext[k] for k in range(len(origin.shape))):
                raise LayoutError(f"parameter {ref.name!r}: its loader places {origin.name!r} "
                                  f"{origin.shape} with its dimensions permuted or spread over the "
                                  f"parameter {ref.shape}, which a box cannot express")
            self.pieces.setdefault(ref.name, []).append(
                (origin.name, origin.shape, tuple(sstart), tuple(sext), tuple(dstart)))

        def _fill(self, dest: Any, value: Any) -> None:
            hit = self._param_of(dest)
            if hit is None:
                return
            ref, rel = hit
            if isinstance(value, torch.Tensor):
                if value.numel() != 1 or _storage(value) in self.sources or _storage(value) in self.derived:
                    raise LayoutError(f"parameter {ref.name!r}: its loader fills it from a tensor")
                value = value.item()
            start, ext, _ = self._dest_box(ref, rel, dest, "fills")
            self.fills.setdefault(ref.name, []).append(Fill(tuple(start), tuple(ext), float(value)))

        def __torch_function__(self, func: Any, types: Any, args: Sequence[Any] = (),
                               kwargs: Mapping[str, Any] | None = None) -> Any:
            kwargs = dict(kwargs or {})
            name = getattr(func, "__name__", "")
            if func is torch.Tensor.copy_:
                self._copy(args[0], args[1] if len(args) > 1 else kwargs["src"])
                return args[0]
            if func is torch.Tensor.__setitem__:
                dest = args[0][args[1]]
                value = args[2]
                if isinstance(value, torch.Tensor) and (value.numel() != 1 or _storage(value) in self.sources
                                                        or _storage(value) in self.derived):
                    self._copy(dest, value)
                else:
                    self._fill(dest, args[2])
                return None
            if func in (torch.Tensor.fill_, torch.Tensor.zero_):
                self._fill(args[0], 0.0 if func is torch.Tensor.zero_ else args[1])
                return args[0]
            if name.endswith("_") and not name.endswith("__") and name not in _NOT_WRITES and args:
                hit = self._param_of(args[0])
                if hit is not None:
                    raise LayoutError(f"parameter {hit[0].name!r}: its loader runs {name} on it, which "
                                      "weightsync cannot reproduce with writes of checkpoint slices")
            out = func(*args, **kwargs)
            flat_in, _ = tree_flatten((args, kwargs))
            made_from = [self.sources[s].name if s in self.sources else self.derived[s]
                         for s in (_storage(t) for t in flat_in if isinstance(t, torch.Tensor))
                         if s is not None and (s in self.sources or s in self.derived)]
            if made_from:
                flat_out, _ = tree_flatten(out)
                for t in flat_out:
                    s = _storage(t) if isinstance(t, torch.Tensor) else None
                    # A view keeps the checkpoint tensor's storage: only a new storage is derived data.
                    if s is not None and s not in self.sources and s not in self.derived:
                        self.derived[s] = f"the result of {name or func} on {made_from[0]!r}"
            return out

    return Recorder


def derive_layout(model: Any, checkpoint: Sequence[CheckpointTensor], *,
                  loader: Any = None) -> VllmLayout:
    """Runs ``model.load_weights`` (or ``loader(model, weights)``) on recording tensors for
    ``checkpoint`` and returns where each checkpoint tensor lands in this rank's parameters.

    Call it where vLLM itself would load weights: inside the model's ``set_current_vllm_config`` and
    with vLLM's distributed state (tensor/expert-parallel ranks) set up, since the loaders read both.
    The model's parameters are read (shapes, strides, storage) but never written."""
    import torch

    params: dict[int, list[_ParamRef]] = {}
    names: list[str] = []
    for name, p in model.named_parameters():
        data = p.data
        # A parameter that is not contiguous (one vLLM made after loading, e.g. MLA's W_UV) is refused
        # only if a loader writes into it.
        strides = None if data.is_contiguous() else tuple(int(x) for x in data.stride())
        sid = _storage(data)
        if sid is None:
            raise LayoutError(f"parameter {name!r} ({type(p).__name__}) has no storage of its own")
        span = 1 + sum((int(n) - 1) * abs(int(st)) for n, st in zip(data.shape, data.stride(), strict=True)) \
            if data.numel() else 0
        params.setdefault(sid, []).append(_ParamRef(name, tuple(int(x) for x in data.shape),
                                                    int(data.storage_offset()), span, strides))
        names.append(name)
    sources: dict[int, CheckpointTensor] = {}
    fakes: list[tuple[str, Any]] = []
    for ct in checkpoint:
        fake = torch.empty(ct.shape, dtype=getattr(torch, ct.dtype), device="meta")
        sources[_storage(fake)] = ct
        fakes.append((ct.name, fake))

    current: list[CheckpointTensor] = []

    def weights() -> Iterator[tuple[str, Any]]:
        for ct, (name, fake) in zip(checkpoint, fakes, strict=True):
            current[:] = [ct]
            yield name, fake

    recorder = _recorder_class()(sources, params)
    try:
        with torch.no_grad(), recorder:
            if loader is None:
                model.load_weights(weights())
            else:
                loader(model, weights())
    except LayoutError:
        raise
    except Exception as err:
        # The loader itself failed on the recording tensors (shapes it does not accept, an operation a
        # meta tensor cannot do): name the checkpoint tensor it was loading.
        at = f"checkpoint tensor {current[0].name!r} {current[0].shape} {current[0].dtype}" if current \
            else "the checkpoint"
        raise LayoutError(f"the model's load_weights failed on {at}: {type(err).__name__}: {err}") from err
    layout = VllmLayout(pieces=recorder.pieces, fills=recorder.fills)
    layout.unused = [ct.name for ct in checkpoint if ct.name not in recorder.used]
    layout.unloaded = [n for n in names if n not in recorder.pieces and n not in recorder.fills]
    return layout


# --------------------------------------------------------------------------------------------------
# FP8 block-quantized models


SCALE_SUFFIX = "_scale_inv"  # weightsync's planner and Hugging Face FP8 checkpoints name scales alike


def fp8_checkpoint(model: Any, checkpoint: Sequence[CheckpointTensor], block: Sequence[int], *,
                   loader: Any = None) -> list[CheckpointTensor]:
    """The checkpoint as a block-quantized FP8 Hugging Face checkpoint of ``model`` holds it (DeepSeek-V3
    style): every tensor the model's loaders put into a ``float8_*`` parameter becomes that dtype, with a
    float32 ``<name>_scale_inv`` of its tile grid (``block`` = vLLM's ``weight_block_size``, tiles of the
    last two dimensions) beside it. Tensors already in FP8 (a trainer that holds FP8) are kept.

    Derive the layout from the result: the weights and their scales then land as vLLM's loaders put an
    FP8 checkpoint's, and weightsync's planner (``fp8_block=block``) makes the FP8 values and scales on
    the senders from their full-precision tensors. Call it where :func:`derive_layout` is called."""
    import torch

    bm, bn = (int(x) for x in block)
    probe = derive_layout(model, checkpoint, loader=loader)
    dtypes = {name: p.dtype for name, p in model.named_parameters()}
    into_fp8: dict[str, set[bool]] = {}
    for pname, pieces in probe.pieces.items():
        fp8 = dtypes[pname].is_floating_point and dtypes[pname].itemsize == 1
        for name, *_ in pieces:
            into_fp8.setdefault(name, set()).add(fp8)
    mixed = sorted(n for n, kinds in into_fp8.items() if len(kinds) > 1)
    if mixed:
        raise LayoutError(f"checkpoint tensor {mixed[0]!r} lands in FP8 and in full-precision parameters; "
                          "one tensor has one dtype in a checkpoint")
    fp8_param_dtype = next((str(d).removeprefix("torch.") for d in dtypes.values()
                            if d.is_floating_point and d.itemsize == 1), "float8_e4m3fn")
    out: list[CheckpointTensor] = []
    for ct in checkpoint:
        if into_fp8.get(ct.name) != {True} or getattr(torch, ct.dtype).itemsize == 1:
            out.append(ct)
            continue
        if len(ct.shape) < 2:
            raise LayoutError(f"checkpoint tensor {ct.name!r} {ct.shape} lands in an FP8 parameter but has "
                              "fewer than 2 dimensions: block quantization tiles the last two")
        *lead, rows, cols = ct.shape
        out.append(CheckpointTensor(ct.name, ct.shape, fp8_param_dtype))
        out.append(CheckpointTensor(ct.name + SCALE_SUFFIX, (*lead, -(-rows // bm), -(-cols // bn)),
                                    "float32"))
    return out


# --------------------------------------------------------------------------------------------------
# What vLLM does to the parameters after loading


# Quantization methods whose process_weights_after_loading leaves the parameters the loaders filled as
# the kernels read them (CPU GEMM prepacking is checked apart, below).
_KEEPS_CHECKPOINT_FORMAT = {"UnquantizedLinearMethod", "UnquantizedEmbeddingMethod"}
# Unquantized fused-MoE backends that run on w13/w2 as loaded; the others shuffle, swap, pad or prepack.
_MOE_BACKENDS_IN_PLACE = {"TRITON", "BATCHED_TRITON"}


def _holds_private_copy(fn: Any) -> bool:
    """Whether a GEMM closure vLLM's CPU dispatch made holds something of its own (a prepacked weight, a
    oneDNN handle) rather than reading the layer's parameter at call time."""
    cells = getattr(fn, "__closure__", None) or ()
    for cell in cells:
        try:
            value = cell.cell_contents
        except ValueError:  # an empty cell
            continue
        if not isinstance(value, (bool, int, float, str, type(None))):
            return True
    return False


@dataclass(frozen=True)
class Refresh:
    """A derivation vLLM makes after loading that the backend re-runs after every update, so the kernel
    tensors it makes follow the new weights: ``run()`` recomputes the kernel tensors of ``module`` from
    the parameters ``inputs`` (as the loaders fill them)."""

    module: str
    inputs: tuple[str, ...]
    run: Any  # Callable[[], None]


def _plain_mla(module: Any, rerun: Collection[Any] = ()) -> bool:
    """Whether ``module`` is vLLM's MLA attention on its plain path: after loading it only computes
    ``W_UK_T``/``W_UV`` from ``kv_b_proj``'s weight (what vLLM re-runs on a reload too), with neither a
    backend that packs them (AMX, AITER's FP4/FP8 BMM) nor a quantized ``kv_b_proj``, unless that is an
    FP8 ``kv_b_proj`` the backend re-processes (``rerun``) and MLA dequantizes by its scales."""
    if type(module).__name__ != "MLAAttention" or not hasattr(module, "kv_b_proj"):
        return False
    if any(getattr(module, flag, False) for flag in ("is_amx_bmm_enabled", "is_aiter_triton_fp4_bmm_enabled",
                                                     "is_aiter_triton_fp8_bmm_enabled")):
        return False
    impl = getattr(module, "impl", None)
    try:
        from vllm.v1.attention.backend import AttentionImplBase

        base = AttentionImplBase.process_weights_after_loading
    except ImportError:
        return False
    if impl is None or getattr(type(impl), "process_weights_after_loading", base) is not base:
        return False  # the backend converts weights of its own after loading
    kv_b = module.kv_b_proj
    method = getattr(kv_b, "quant_method", None)
    if any(kv_b is m for m in rerun):
        # get_and_maybe_dequant_weights dequantizes Fp8LinearMethod's weights by their scales, as
        # loaded, except after Marlin's or DeepGEMM's conversions
        return type(method).__name__ == "Fp8LinearMethod" and not getattr(method, "use_marlin", False) \
            and not getattr(method, "use_deep_gemm", False)
    return type(method).__name__ == "UnquantizedLinearMethod" and \
        not _holds_private_copy(getattr(kv_b, "cpu_linear", None))


def post_load_refreshes(model: Any, act_dtype: Any, rerun: Collection[Any] = ()) -> list[Refresh]:
    """The derivations vLLM made after loading that can be re-run after an update (MLA's ``W_UK_T`` /
    ``W_UV`` from ``kv_b_proj.weight``, on its plain path): run them once the bytes of a version have
    landed. :func:`post_load_conversions` does not name their inputs."""
    from functools import partial

    names: dict[int, str] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), name)  # the first name is the one named_parameters() gives
    out = []
    for mname, module in model.named_modules():
        if _plain_mla(module, rerun):
            weight = module.kv_b_proj.weight
            out.append(Refresh(mname, (names[id(weight)],),
                               partial(module.process_weights_after_loading, act_dtype)))
    return out


def _present(module: Any) -> list[str]:
    """The names of a module's own parameters that exist (a layer without bias registers None)."""
    return [name for name, p in module._parameters.items() if p is not None]


def post_load_conversions(model: Any, rerun: Collection[Any] = ()) -> dict[str, str]:
    """``{parameter name: why}`` for the parameters of ``model`` whose kernels do not read them as the
    loaders wrote them, because vLLM converted them after loading (``process_weights_after_loading``):

    * the parameter vLLM recorded when it built the model (its reload metadata) was replaced or changed
      shape, dtype or strides (repacked, transposed, emptied);
    * vLLM's CPU GEMM for the layer reads a copy prepacked after loading (oneDNN, sgl, zentorch);
    * the layer's quantization method converts its weights into a kernel format (FP8, INT4, NVFP4, ...:
      every method but the unquantized linear and embedding ones), or the unquantized fused-MoE backend
      shuffles, pads or prepacks the experts;
    * an attention layer derives kernel tensors from it after loading, unless the backend can re-run
      that derivation after each update (:func:`post_load_refreshes`: MLA's ``W_UK_T``/``W_UV`` from
      ``kv_b_proj`` on its plain path).

    Writing checkpoint bytes into such a parameter would not change what the model computes, or worse:
    only parameters that appear here *and* receive checkpoint bytes matter (intersect with the layout's
    pieces). The layers in ``rerun`` (the backend re-processes them after every update:
    :func:`reprocessable_layers`) are not named for their quantization method's conversion. Read-only;
    works on a model with or without its weights processed."""
    from torch import nn

    names: dict[int, str] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), name)
    found: dict[str, str] = {}

    def flag(module_name: str, pname: str, why: str) -> None:
        found.setdefault(f"{module_name}.{pname}" if module_name else pname, why)

    try:
        from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO
    except ImportError:  # a vLLM without reload metadata: the other checks still apply
        LAYERWISE_INFO = {}
    try:
        from vllm.model_executor.layers.attention import is_deferred_attention_layer
    except ImportError:
        def is_deferred_attention_layer(layer: Any) -> bool:
            return False

    rerun_ids = {id(m) for m in rerun}
    for mname, module in model.named_modules():
        info = LAYERWISE_INFO.get(module) if isinstance(module, nn.Module) else None
        if id(module) in rerun_ids:
            info = None  # re-processed from its landing tensors: its kernel format may differ
        if info is not None:
            for pname, meta in info.restore_metadata[0].items():
                live = module._parameters.get(pname)
                if live is None:
                    flag(mname, pname, "vLLM removed it after loading")
                elif (tuple(live.shape), live.dtype, tuple(live.stride())) != \
                        (tuple(meta.shape), meta.dtype, tuple(meta.stride())):
                    flag(mname, pname, f"vLLM converted it after loading from {tuple(meta.shape)} "
                                       f"{str(meta.dtype).removeprefix('torch.')} (as loaded) to "
                                       f"{tuple(live.shape)} {str(live.dtype).removeprefix('torch.')} "
                                       "(as the kernel reads it)")
        gemm = getattr(module, "cpu_linear", None)
        if gemm is not None and _holds_private_copy(gemm) and "weight" in module._parameters:
            flag(mname, "weight", "vLLM's CPU GEMM reads a copy of it prepacked after loading")
        method = getattr(module, "quant_method", None)
        kind = type(method).__name__
        if method is not None and kind not in _KEEPS_CHECKPOINT_FORMAT and id(module) not in rerun_ids:
            backend = getattr(getattr(method, "unquantized_backend", None), "name", None)
            if kind == "UnquantizedFusedMoEMethod":
                if backend not in _MOE_BACKENDS_IN_PLACE:
                    for pname in _present(module):
                        flag(mname, pname, f"vLLM's {backend} fused-MoE backend converts the experts "
                                           "into its kernel format after loading")
            else:
                for pname in _present(module):
                    flag(mname, pname, f"its quantization method {kind} converts it into a kernel "
                                       "format after loading (process_weights_after_loading)")
        if is_deferred_attention_layer(module) and not _plain_mla(module, rerun):
            for p in module.parameters():
                pname = names.get(id(p))
                if pname is not None:
                    found.setdefault(pname, f"the attention layer {mname!r} ({type(module).__name__}) "
                                            "derives its kernel tensors from it after loading")
    return found


# --------------------------------------------------------------------------------------------------
# Layers re-processed after every update (FP8 block quantization and other quantization methods)


def _layerwise_info(module: Any) -> Any:
    """vLLM's reload metadata of ``module`` (its parameters as created, before processing, as meta
    tensors with their loaders), or None."""
    try:
        from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO
    except ImportError:
        return None
    info = LAYERWISE_INFO.get(module)
    return info if info is not None and info.restore_metadata[0] else None


def reprocessable_layers(model: Any) -> dict[str, Any]:
    """``{module name: module}`` of the layers whose quantization method converts their weights into a
    kernel format after loading (``process_weights_after_loading``: FP8 block-quantized linears and
    experts, other quantized methods) and that vLLM's reload machinery can restore to the format its
    loaders fill (vLLM recorded their parameters as created). The backend lands the trainers' bytes in a
    checkpoint-format copy of such a layer and re-runs the method's processing after every update
    (:class:`Reprocess`), as vLLM's own in-place reload does. Unquantized layers, unquantized fused
    experts and attention layers are not among them."""
    from vllm.model_executor.layers.attention import is_deferred_attention_layer
    from vllm.model_executor.layers.quantization.base_config import QuantizeMethodBase

    out = {}
    for mname, module in model.named_modules():
        method = getattr(module, "quant_method", None)
        kind = type(method).__name__
        if not isinstance(method, QuantizeMethodBase) or kind in _KEEPS_CHECKPOINT_FORMAT or \
                kind == "UnquantizedFusedMoEMethod" or is_deferred_attention_layer(module):
            continue
        if _layerwise_info(module) is not None:
            out[mname] = module
    return out


def _place(layer: Any, params: Mapping[str, Any], buffers: Mapping[str, Any],
           non_persistent: Collection[str]) -> None:
    """Makes ``params`` and ``buffers`` the layer's tensors (and only them; None entries, a layer's
    absent bias, stay registered as None)."""
    for name in list(layer._parameters) + list(layer._buffers):
        delattr(layer, name)
    for name, p in params.items():
        layer.register_parameter(name, p)
    for name, b in buffers.items():
        layer.register_buffer(name, b, persistent=name not in non_persistent)


@contextmanager
def checkpoint_format(layers: Mapping[str, Any]) -> Iterator[dict[str, dict[str, Any]]]:
    """Inside: each of ``layers`` holds fresh parameters in the format vLLM's loaders fill (its
    parameters as created, materialized from vLLM's reload metadata, uninitialized), yielded as
    ``{module name: {parameter name: tensor}}``; on exit the layer's own (kernel-format) tensors are
    back, untouched. What the model computes is never changed."""
    from vllm.model_executor.model_loader.reload.meta import materialize_layer, restore_layer_on_meta

    saved = []
    try:
        made: dict[str, dict[str, Any]] = {}
        for mname, layer in layers.items():
            saved.append((layer, dict(layer._parameters), dict(layer._buffers),
                          set(layer._non_persistent_buffers_set)))
            info = _layerwise_info(layer)
            restore_layer_on_meta(layer, info)
            materialize_layer(layer, info)
            made[mname] = {n: p for n, p in layer._parameters.items() if p is not None}
        yield made
    finally:
        for layer, params, buffers, non_persistent in saved:
            _place(layer, params, buffers, non_persistent)


@dataclass
class Reprocess:
    """A layer whose quantization method converts its weights after loading, re-processed after every
    update: the trainers' bytes land in ``landing`` (the layer's parameters in the format its loaders
    fill, a copy the backend keeps: checkpoint FP8 values and scales), and :meth:`run` does what vLLM's
    in-place reload does with loaded weights: the layer gets fresh checkpoint-format parameters holding
    a copy of ``landing``, its quantization method's ``process_weights_after_loading`` makes the kernel
    format of them, and that is copied into the layer's live tensors (same storage, so graphs and
    registered addresses stay valid) before they are put back. ``landing`` is never changed by it."""

    module: str
    layer: Any
    landing: dict[str, Any]  # parameter name in the layer -> checkpoint-format tensor

    def _processed(self) -> tuple[dict[str, Any], dict[str, Any]]:
        """The layer's parameters and buffers as its method makes them from ``landing``; the layer
        keeps them (the caller puts its own back)."""
        import torch
        from vllm.model_executor.model_loader.reload.meta import materialize_layer, restore_layer_on_meta

        layer = self.layer
        info = _layerwise_info(layer)
        restore_layer_on_meta(layer, info)
        materialize_layer(layer, info)
        with torch.no_grad():
            for name, t in self.landing.items():
                getattr(layer, name).data.copy_(t)
        if hasattr(layer, "_already_called_process_weights_after_loading"):
            delattr(layer, "_already_called_process_weights_after_loading")
        layer.quant_method.process_weights_after_loading(layer)
        if hasattr(layer, "update_param_tp_status"):
            layer.update_param_tp_status()
        return ({n: p for n, p in layer._parameters.items() if p is not None},
                {n: b for n, b in layer._buffers.items() if b is not None})

    def _kernel_pairs(self, live: tuple[dict[str, Any], dict[str, Any]],
                      made: tuple[dict[str, Any], dict[str, Any]]) -> list[tuple[Any, Any]]:
        """(live tensor, processed tensor) for every live parameter and buffer; refuses, naming the
        tensor, where the processing gives no tensor of the live one's shape and dtype."""
        pairs = []
        for kind, have, got in (("parameter", live[0], made[0]), ("buffer", live[1], made[1])):
            for name, t in have.items():
                new = got.get(name)
                if new is None or tuple(new.shape) != tuple(t.shape) or new.dtype != t.dtype:
                    what = "none" if new is None else f"{tuple(new.shape)} {new.dtype}"
                    raise LayoutError(
                        f"{kind} '{self.module}.{name}' {tuple(t.shape)} {t.dtype}: re-running "
                        f"{type(self.layer.quant_method).__name__}.process_weights_after_loading gives "
                        f"{what}, so the kernel tensor cannot be updated in place")
                pairs.append((t, new))
        return pairs

    def _swap(self, write: bool) -> None:
        import torch

        layer = self.layer
        live = (dict(layer._parameters), dict(layer._buffers))
        non_persistent = set(layer._non_persistent_buffers_set)
        try:
            pairs = self._kernel_pairs(({n: p for n, p in live[0].items() if p is not None},
                                        {n: b for n, b in live[1].items() if b is not None}),
                                       self._processed())
            if write:
                with torch.no_grad():
                    for t, new in pairs:
                        t.data.copy_(new)
        finally:
            _place(layer, live[0], live[1], non_persistent)

    def _state(self) -> list[tuple[Any, dict[str, Any]]]:
        """Shallow copies of the attributes the processing may set besides tensors: the layer's, its
        quantization method's and those of the method's helper objects (kernels, which may keep handles
        or prepacked copies made from the weights they processed)."""
        layer, method = self.layer, self.layer.quant_method
        owners = [layer, method] + [v for v in vars(method).values()
                                    if hasattr(v, "__dict__") and not isinstance(v, type)
                                    and type(v).__module__.startswith("vllm.")]
        skip = {"_parameters", "_buffers", "_modules"}
        return [(o, {k: v for k, v in vars(o).items() if k not in skip}) for o in owners]

    def check(self) -> None:
        """Runs the processing once on ``landing`` (at init, before anything is joined) without
        writing the live tensors, and puts back whatever it set on the layer and its method (a kernel
        handle made from the trial's zeros must not replace the live one): refuses, naming the layer's
        parameter and vLLM's error, a method that cannot be re-run on this platform or whose result the
        live tensors cannot take."""
        saved = self._state()
        try:
            self._swap(write=False)
        except LayoutError:
            raise
        except Exception as err:
            pname = next(iter(self.landing), "weight")
            raise LayoutError(
                f"parameter '{self.module}.{pname}': vLLM converts it after loading "
                f"({type(self.layer.quant_method).__name__}), and re-running that processing here fails: "
                f"{type(err).__name__}: {err}") from err
        finally:
            for owner, attrs in saved:
                for k in [k for k in vars(owner) if k not in attrs and k not in
                          ("_parameters", "_buffers", "_modules")]:
                    vars(owner).pop(k)
                vars(owner).update(attrs)

    def run(self) -> None:
        """Re-processes the layer from ``landing`` into its live kernel tensors."""
        self._swap(write=True)


def landing_layout(model: Any, checkpoint: Sequence[CheckpointTensor], block: Sequence[int] | None,
                   layers: Mapping[str, Any]) -> tuple[VllmLayout, list[Reprocess], list[CheckpointTensor]]:
    """The layout of ``model`` for ``checkpoint`` (an FP8 checkpoint of it with ``block``) with the
    parameters of ``layers`` (:func:`reprocessable_layers`) landing in checkpoint-format copies, the
    :class:`Reprocess` of each such layer, and the checkpoint the layout was derived for."""
    import torch

    with checkpoint_format(layers) as made:
        if block:
            checkpoint = fp8_checkpoint(model, checkpoint, tuple(int(x) for x in block))
        layout = derive_layout(model, checkpoint)
    reprocess = []
    for mname, tensors in made.items():
        landing = {}
        for pname, p in tensors.items():
            data = p.data
            with torch.no_grad():
                data.zero_()  # defined bytes until the first version lands
            landing[pname] = data
            layout.landing[f"{mname}.{pname}" if mname else pname] = data
        reprocess.append(Reprocess(mname, layers[mname], landing))
    return layout, reprocess, list(checkpoint)


__all__ = ["SCALE_SUFFIX", "CheckpointTensor", "Fill", "Piece", "Refresh", "Reprocess", "VllmLayout",
           "checkpoint_format", "checkpoint_of", "derive_layout", "fp8_checkpoint", "landing_layout",
           "post_load_conversions", "post_load_refreshes", "reprocessable_layers"]
