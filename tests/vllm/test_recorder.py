"""The recording of weight loaders (weightsync.integrations.vllm.layouts) on hand-written loaders: what
boxes can say becomes pieces, what they cannot is a LayoutError naming the parameter. Needs torch only,
so it runs in the main environment too."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import pytest
import torch

from weightsync.errors import LayoutError
from weightsync.integrations.vllm.layouts import CheckpointTensor, derive_layout


class Fused(torch.nn.Module):
    """A parameter holding [a; b] (rows) and one holding c's columns 2..5 transposed in by a loader."""

    def __init__(self, loader: Callable[[torch.nn.Module, str, Any], None]) -> None:
        super().__init__()
        self.ab = torch.nn.Parameter(torch.zeros(10, 4), requires_grad=False)
        self.pad = torch.nn.Parameter(torch.zeros(3, 8), requires_grad=False)
        self._loader = loader

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> set[str]:
        for name, w in weights:
            self._loader(self, name, w)
        return set()


CKPT = [CheckpointTensor("a", (4, 4), "float32"), CheckpointTensor("b", (6, 4), "float32"),
        CheckpointTensor("c", (2, 8), "float32")]


def good_loader(m: torch.nn.Module, name: str, w: Any) -> None:
    if name == "a":
        m.ab.data.narrow(0, 0, 4).copy_(w)
    elif name == "b":
        m.ab[4:].data.copy_(w)
    else:
        m.pad[:2].data.copy_(w)
        m.pad[2:].data.fill_(0)


def test_slices_and_padding_become_pieces_and_fills() -> None:
    before = {k: v.clone() for k, v in Fused(good_loader).state_dict().items()}
    model = Fused(good_loader)
    layout = derive_layout(model, CKPT)
    assert layout.pieces["ab"] == [("a", (4, 4), (0, 0), (4, 4), (0, 0)),
                                   ("b", (6, 4), (0, 0), (6, 4), (4, 0))]
    assert layout.pieces["pad"] == [("c", (2, 8), (0, 0), (2, 8), (0, 0))]
    assert [(f.at, f.shape, f.value) for f in layout.fills["pad"]] == [((2, 0), (1, 8), 0.0)]
    assert layout.unused == [] and layout.unloaded == []
    # The live parameters were only read
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k])


def test_a_shard_of_a_tensor_is_a_box_with_offsets() -> None:
    def loader(m: torch.nn.Module, name: str, w: Any) -> None:
        if name == "c":  # a TP rank's column shard, as a row-parallel loader narrows it
            m.ab[:2].data.copy_(w.narrow(1, 4, 4))

    layout = derive_layout(Fused(loader), CKPT)
    assert layout.pieces == {"ab": [("c", (2, 8), (0, 4), (2, 4), (0, 0))]}
    assert layout.unused == ["a", "b"]
    assert layout.unloaded == ["pad"]


@pytest.mark.parametrize("case, words", [
    ("transpose", ["'ab'", "'c'"]),
    ("arithmetic", ["'ab'", "mul"]),
    ("cast via scratch", ["'pad'", "scratch"]),
    ("broadcast", ["'ab'", "broadcast"]),
    ("in-place op", ["'ab'", "add_"]),
])
def test_what_boxes_cannot_say_is_refused_naming_the_parameter(case: str, words: list[str]) -> None:
    def loader(m: torch.nn.Module, name: str, w: Any) -> None:
        if name != "c":
            return
        if case == "transpose":
            m.ab.data[:4, :2].copy_(w.t()[:4])
        elif case == "arithmetic":
            m.ab.data[:2, :4].copy_(w[:, :4] * 2)
        elif case == "cast via scratch":
            scratch = torch.empty(2, 8, device="meta")
            scratch.copy_(w)
            m.pad.data[:2].copy_(scratch)
        elif case == "broadcast":
            m.ab.data[:4, :4].copy_(w[:1, :4])
        else:
            m.ab.data.add_(1.0)

    with pytest.raises(LayoutError) as err:
        derive_layout(Fused(loader), CKPT)
    for word in words:
        assert word in str(err.value), str(err.value)


def test_a_loader_that_fails_is_a_layout_error_naming_the_tensor() -> None:
    def loader(m: torch.nn.Module, name: str, w: Any) -> None:
        if name == "b":
            m.ab.data.narrow(0, 8, 4).copy_(w)  # rows 8..11 of a 10-row parameter: torch refuses

    with pytest.raises(LayoutError) as err:
        derive_layout(Fused(loader), CKPT)
    assert "'b' (6, 4) float32" in str(err.value), str(err.value)


class WithBuffers(torch.nn.Module):
    """A parameter, a persistent buffer the loader may fill from the checkpoint, and a non-persistent one
    (computed by the model, never loaded)."""

    def __init__(self, loader: Callable[[torch.nn.Module, str, Any], None]) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(4, 4), requires_grad=False)
        self.register_buffer("scalar", torch.ones(1))
        self.register_buffer("cache", torch.zeros(3), persistent=False)
        self._loader = loader

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> set[str]:
        for name, w in weights:
            self._loader(self, name, w)
        return set()


BUFFER_CKPT = [CheckpointTensor("w", (4, 4), "float32"), CheckpointTensor("scalar", (1,), "float32")]


def test_a_checkpoint_tensor_copied_into_a_persistent_buffer_is_placed_there() -> None:
    def loader(m: torch.nn.Module, name: str, w: Any) -> None:
        getattr(m, name).data.copy_(w)
        m.cache.copy_(torch.arange(3.0))  # the model's own values, from nothing in the checkpoint

    model = WithBuffers(loader)
    layout = derive_layout(model, BUFFER_CKPT)
    assert layout.pieces["scalar"] == [("scalar", (1,), (0,), (1,), (0,))]
    assert "cache" not in layout.pieces and layout.unused == [] and layout.unloaded == []
    assert layout.tensors(model)["scalar"].local_tensor.data_ptr() == model.scalar.data_ptr()
    assert bool((model.scalar == 1).all()) and bool((model.cache == 0).all())  # only read


def test_a_buffer_computed_from_a_checkpoint_tensor_is_refused_naming_it() -> None:
    def loader(m: torch.nn.Module, name: str, w: Any) -> None:
        if name == "scalar":
            m.scalar.copy_(w * 2)
        else:
            m.w.data.copy_(w)

    with pytest.raises(LayoutError, match="buffer 'scalar'"):
        derive_layout(WithBuffers(loader), BUFFER_CKPT)
