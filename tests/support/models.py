"""Where the model configs are: ``weightsync/sim/configs`` (the large models' Hugging Face configs the
simulator and the real-shape tests take)."""

from __future__ import annotations

from pathlib import Path

from weightsync.sim.models import CONFIGS


def models_dir() -> Path:
    """The folder of the model configs (``NAME.json``)."""
    return CONFIGS
