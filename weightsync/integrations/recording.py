"""Recording-tensor layout derivation, shared by the engine integrations (vLLM, SGLang).

An inference engine fills its parameters with ``model.load_weights(iter((hf_name, tensor)))``: per layer
type, a weight loader narrows the checkpoint tensor to this rank's shard and copies it into a slice of a
(possibly fused, padded) parameter. Rather than keeping a table per model, weightsync runs that very
code once with *recording* tensors:

* every checkpoint tensor is handed in as a storage-less ``meta`` tensor of its shape and dtype; the
  view operations a loader applies to it (``narrow``, ``chunk``, ``split``, indexing, ``view``) are
  ordinary meta operations whose result still aliases the checkpoint tensor's storage, so its storage
  offset and strides say exactly which elements of the checkpoint tensor the loader selected;
* a torch function mode watches every write into a parameter (``copy_``, ``__setitem__``, ``fill_``,
  ``zero_``) and records it instead of performing it: the destination slice's offset and strides
  relative to the parameter say where those elements land. The live parameters are never written.
  Persistent buffers are watched the same way: a loader that copies a checkpoint tensor into one (vLLM's
  ``AutoWeightsLoader`` fills them, e.g. Gemma 4's ``layer_scalar``) has it placed there, where the model
  reads it; values a model computes into a buffer from nothing in the checkpoint are left alone.

Each recorded copy becomes one piece of a :class:`weightsync.Placed` over the parameter's tensor (a box
of the logical checkpoint tensor placed at an index of the parameter), which the planner takes as it
is. Constant fills (a vocabulary-parallel embedding zeroes its padding rows) are kept and applied once
to the live parameters, since no source holds those rows. What boxes cannot say (a loader that
transposes, casts through arithmetic, computes values, or broadcasts) is a :class:`LayoutError` naming
the parameter and the operation.

Nothing here imports an engine, and torch only lazily: ``import weightsync`` needs neither.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping, Sequence
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
class RecordedLayout:
    """Where every checkpoint tensor lands in one engine rank's parameters.

    ``pieces``: per parameter name (``model.named_parameters()``), or persistent buffer name where the
    loaders write a checkpoint tensor into a buffer (Gemma 4's ``layer_scalar``), its pieces. ``fills``:
    constants the loaders write into parameters. ``unused``: checkpoint tensors no parameter or buffer of
    this rank takes (tied ``lm_head``, tensors the engine recomputes, experts of other expert-parallel
    ranks). ``unloaded``:
    parameters that receive neither a piece nor a fill (they keep what they hold). ``landing``: for the
    parameters of layers the engine converts after loading and the backend re-processes (:class:`Reprocess`),
    the checkpoint-format tensors the bytes land in instead of the live (kernel-format) parameter."""

    pieces: dict[str, list[Piece]] = field(default_factory=dict)
    fills: dict[str, list[Fill]] = field(default_factory=dict)
    unused: list[str] = field(default_factory=list)
    unloaded: list[str] = field(default_factory=list)
    landing: dict[str, Any] = field(default_factory=dict)

    def data(self, model: Any) -> dict[str, Any]:
        """``{parameter name: tensor}``: where each parameter (or buffer) of the layout receives its
        bytes (its landing tensor, else the live parameter's ``.data`` or the buffer)."""
        params = loadable_tensors(model)
        missing = sorted(set(self.pieces) - set(params) - set(self.landing))
        if missing:
            raise LayoutError(f"the layout names parameters the model does not have: {missing[:5]}")
        return {name: self.landing[name] if name in self.landing else params[name]
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


def persistent_buffers(model: Any) -> dict[str, Any]:
    """``{name: tensor}`` of ``model``'s persistent buffers (those its state dict holds): what a loader
    may fill from the checkpoint besides parameters, as vLLM's ``AutoWeightsLoader`` does. Non-persistent
    buffers are computed by the model, never loaded."""
    out: dict[str, Any] = {}
    for mname, module in model.named_modules():
        skip = getattr(module, "_non_persistent_buffers_set", set())
        for bname, b in getattr(module, "_buffers", {}).items():
            if b is not None and bname not in skip:
                out.setdefault(f"{mname}.{bname}" if mname else bname, b)
    return out


def loadable_tensors(model: Any) -> dict[str, Any]:
    """``{name: tensor}``: every parameter's ``.data`` and every persistent buffer of ``model``, the
    memory its loaders write checkpoint tensors into."""
    out = {name: p.data for name, p in model.named_parameters()}
    for name, b in persistent_buffers(model).items():
        out.setdefault(name, b)
    return out


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
    kind: str = "parameter"  # or "buffer": a persistent buffer the loaders may fill


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
                        raise LayoutError(f"{ref.kind} {ref.name!r} is not contiguous (strides "
                                          f"{ref.strides}) and its loader writes into it; weightsync "
                                          "registers parameters as they are")
                    return ref, off - ref.offset
            return None

        def _dest_box(self, ref: _ParamRef, rel: int, dest: Any, what: str) -> tuple[list[int], list[int],
                                                                                       list[int | None]]:
            box = _box(rel, tuple(dest.shape), tuple(dest.stride()), ref.shape)
            if box is None:
                raise LayoutError(f"{ref.kind} {ref.name!r}: its loader {what} a slice of shape "
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
            if origin is None and ref.kind == "buffer" and (sid is None or sid not in self.derived):
                return  # the model computes this buffer itself, from nothing a push carries
            if origin is None:
                how = self.derived.get(sid) if sid is not None else None
                raise LayoutError(
                    f"{ref.kind} {ref.name!r}: its loader writes "
                    f"{how if how else 'values that come from no checkpoint tensor'}; weightsync moves "
                    "checkpoint slices as they are (or cast), not values computed from them")
            self.used.add(origin.name)
            if tuple(src.shape) != tuple(dest.shape):
                if math.prod(src.shape) != math.prod(dest.shape) or [n for n in src.shape if n != 1] != \
                        [n for n in dest.shape if n != 1]:
                    raise LayoutError(f"{ref.kind} {ref.name!r}: its loader copies {origin.name!r} "
                                      f"{tuple(src.shape)} into a slice of shape {tuple(dest.shape)} "
                                      "(broadcast or reshaped), which boxes cannot express")
            sbox = _box(int(src.storage_offset()), tuple(src.shape), tuple(src.stride()), origin.shape)
            if sbox is None:
                raise LayoutError(f"{ref.kind} {ref.name!r}: its loader takes a slice of {origin.name!r} "
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
                raise LayoutError(f"{ref.kind} {ref.name!r}: its loader places {origin.name!r} "
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
                    raise LayoutError(f"{ref.kind} {ref.name!r}: its loader fills it from a tensor")
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
                if hit is not None and hit[0].kind == "parameter":
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
                  loader: Any = None) -> RecordedLayout:
    """Runs ``model.load_weights`` (or ``loader(model, weights)``) on recording tensors for
    ``checkpoint`` and returns where each checkpoint tensor lands in this rank's parameters.

    Call it where the engine itself would load weights (vLLM: inside ``set_current_vllm_config``),
    with its distributed state (tensor/expert-parallel ranks) set up, since the loaders read both.
    The model's parameters are read (shapes, strides, storage) but never written."""
    import torch

    params: dict[int, list[_ParamRef]] = {}
    names: list[str] = []
    buffers = persistent_buffers(model)
    # Persistent buffers are targets as parameters are: a loader that copies a checkpoint tensor into one
    # (Gemma 4's layer_scalar) puts it where the model reads it, and a push must land there too.
    for name, data in loadable_tensors(model).items():
        # A parameter that is not contiguous (one the engine made after loading, e.g. MLA's W_UV) is refused
        # only if a loader writes into it.
        strides = None if data.is_contiguous() else tuple(int(x) for x in data.stride())
        sid = _storage(data)
        if sid is None:
            raise LayoutError(f"parameter {name!r} ({type(data).__name__}) has no storage of its own")
        span = 1 + sum((int(n) - 1) * abs(int(st)) for n, st in zip(data.shape, data.stride(), strict=True)) \
            if data.numel() else 0
        params.setdefault(sid, []).append(_ParamRef(name, tuple(int(x) for x in data.shape),
                                                    int(data.storage_offset()), span, strides,
                                                    "buffer" if name in buffers else "parameter"))
        if name not in buffers:
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
    layout = RecordedLayout(pieces=recorder.pieces, fills=recorder.fills)
    layout.unused = [ct.name for ct in checkpoint if ct.name not in recorder.used]
    layout.unloaded = [n for n in names if n not in recorder.pieces and n not in recorder.fills]
    return layout


__all__ = ["CheckpointTensor", "Fill", "Piece", "RecordedLayout", "checkpoint_of", "derive_layout",
           "loadable_tensors", "persistent_buffers"]
