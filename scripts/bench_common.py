"""What the delta benchmarks (scripts/bench_delta.py, scripts/bench_push.py ``--delta-lr``) share: their
Adam options, how many Adam steps they push untimed, the rounding of an Adam step's masters into the BF16
weights (which counts the values that changed), and the pieces of the lines they print about it (the timed
steps, the per-step changed fractions, the goals). Each script keeps its own wording around them."""

from __future__ import annotations

import argparse

import torch

# Issue 21's goal: at lr 1e-6 a delta push takes at most this fraction of the dense push's time.
DELTA_GOAL = 0.35


def add_adam_options(ap: argparse.ArgumentParser, when: str = "") -> None:
    """``--adam`` and ``--adam-warmup``; ``when`` opens the first's help (the option it goes with)."""
    ap.add_argument("--adam", choices=["kept", "first"], default="kept",
                    help=f"{when}Adam's moments kept across steps like a trainer's optimizer, or Adam's "
                         "first step (fresh moments) every step, as before")
    ap.add_argument("--adam-warmup", type=int, default=2,
                    help="with --adam kept: Adam steps pushed untimed before the timed ones (which are then "
                         "steps K+1 on; at lr 1e-6 step 3 changes about 2.3%%, step 1 4.2%%)")


def untimed_steps(adam: str, adam_warmup: int, otherwise: int) -> int:
    """Adam steps pushed before the timed ones: with kept moments ``adam_warmup`` of them (at least one,
    the delta path's own warm-up), else ``otherwise``."""
    return max(1, adam_warmup) if adam == "kept" else otherwise


def round_into(weights: torch.Tensor, master: torch.Tensor) -> torch.Tensor:
    """``weights`` (a 16-bit float tensor) become ``master`` rounded to their dtype. Returns how many of
    their values that changed, as a 0-d tensor on their device: a caller adding up chunks waits once."""
    new = master.to(weights.dtype)
    changed = (new.view(torch.int16) != weights.view(torch.int16)).sum()
    weights.copy_(new)
    return changed


def step_span(steps: list[int]) -> str:
    """The timed pushes' Adam step numbers: "3" or "3-7"; "" where none were recorded."""
    if not steps:
        return ""
    return f"{steps[0]}" if steps[0] == steps[-1] else f"{steps[0]}-{steps[-1]}"


def percents(fractions: list[float]) -> str:
    """Per-step changed fractions as printed: "4.23%, 2.84%"."""
    return ", ".join(f"{x:.2%}" for x in fractions)


def met(ok: bool) -> str:
    """A goal's verdict as printed."""
    return "met" if ok else "NOT met"
