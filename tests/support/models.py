"""Where the model configs (``shared/models/*.json``) are: beside the repository (the layout of a
checkout), inside it (where a copy travels with the tree, as to the GPU hosts), or at /work/shared."""

from __future__ import annotations

from pathlib import Path

from tests import ROOT


def models_dir() -> Path:
    """The first of those folders that exists (the one beside the repository where none does, so that
    a missing config names the usual place)."""
    root = Path(ROOT)
    candidates = [root.parent / "shared" / "models", root / "shared" / "models", Path("/work/shared/models")]
    return next((p for p in candidates if p.is_dir()), candidates[0])
