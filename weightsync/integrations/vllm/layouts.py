"""Destination layouts of a live vLLM model, read off vLLM's own weight loaders.

vLLM fills its parameters with ``model.load_weights(iter((hf_name, tensor)))``: per layer type, a weight
loader narrows the checkpoint tensor to this rank's shard and copies it into a slice of a (possibly
fused, padded) parameter. Rather than keeping a table per model, weightsync runs that very code once
with *recording* tensors (weightsync.integrations.recording, shared with the SGLang backend):

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

from collections.abc import Collection, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from weightsync.errors import LayoutError
from weightsync.integrations.recording import (
    CheckpointTensor,
    Fill,
    Piece,
    RecordedLayout,
    checkpoint_of,
    derive_layout,
)

# vLLM's name for the recorded layout (with landing tensors for the layers it re-processes).
VllmLayout = RecordedLayout




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
