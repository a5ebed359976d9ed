"""What the delta benchmarks (scripts/bench_push.py ``--delta-lr``, scripts/bench_delta.py ``--micro``)
share: their Adam options, how many Adam steps they push untimed, the rounding of an Adam step's masters
into the BF16 weights (which counts the values that changed), the pieces of the lines they print about it
(the timed steps, the per-step changed fractions, the goals), and the recording of one push's timeline on
every participant. Each script keeps its own wording around them."""

from __future__ import annotations

import argparse
import json
import os
from typing import Any

import torch

# The goal at lr 1e-6: a delta push takes at most this fraction of the dense push's time.
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


class Recording:
    """This process's device timeline (torch.profiler: every thread's CUDA kernels and copies; a
    destination's scatter runs in its receiving thread) and weightsync.runtime.trace's host marks, from
    its making to :meth:`stop`."""

    def __init__(self, dev: torch.device, device_events: bool) -> None:
        from torch.profiler import ProfilerActivity, profile

        from weightsync.runtime import trace as marks

        self.dev, self.marks = dev, marks
        self.prof = profile(activities=[ProfilerActivity.CUDA]) if device_events else None
        marks.take()
        marks.enable()
        if self.prof is not None:
            self.prof.start()

    def stop(self, path: str, **extra: Any) -> None:
        """Stops recording and writes what was recorded to ``path`` (:func:`export_events`), with
        ``extra``."""
        if self.dev.type == "cuda":
            torch.cuda.synchronize(self.dev)
        if self.prof is not None:
            self.prof.stop()
        self.marks.enable(False)
        export_events(self.prof, path, marks=self.marks.take(), **extra)


def record(dev: torch.device, device_events: bool = True) -> Recording:
    """A recording started (``device_events``: the profiler's kernels and copies too, which slow every CUDA
    call, and only on a GPU; else the host marks alone)."""
    return Recording(dev, device_events and dev.type == "cuda")


def export_events(prof: Any, path: str, **extra: Any) -> None:
    """The device events of ``prof`` (None: none recorded) as JSON rows (name, start and end in ns on the
    host's clock, stream, kind), with ``extra``."""
    rows: list[dict[str, Any]] = []
    if prof is not None:
        prof.export_chrome_trace(path + ".chrome.json")
        with open(path + ".chrome.json") as f:
            trace = json.load(f)
        base = int(trace.get("baseTimeNanoseconds", 0))
        rows = [{"name": e["name"], "start": base + int(e["ts"] * 1e3),
                 "end": base + int((e["ts"] + e["dur"]) * 1e3), "stream": e.get("args", {}).get("stream", -1),
                 "cat": e.get("cat", "")}
                for e in trace.get("traceEvents", [])
                if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
        os.unlink(path + ".chrome.json")
    with open(path, "w") as f:
        json.dump({"events": rows, **extra}, f)


def timeline(paths: dict[str, str], push_ns: tuple[int, int]) -> list[str]:
    """One recorded push in time order over its participants (``paths``: who -> the file
    :meth:`Recording.stop` wrote): runs of the same kernel or copy on one stream merged, and the host
    marks, in ms from the push's start ``push_ns`` (the host clock: every participant runs on this host)."""
    t0, t1 = push_ns
    runs: list[tuple[int, int, str, str, int]] = []  # start, end, who, name, count
    for who, path in paths.items():
        with open(path) as f:
            rec = json.load(f)
        cur: list[Any] | None = None
        for e in sorted(rec["events"], key=lambda e: (e["stream"], e["start"])):
            if e["end"] < t0 - 5_000_000 or e["start"] > t1 + 5_000_000:
                continue
            name = e["name"].split("(")[0][:48]
            if cur is not None and cur[3] == name and cur[5] == e["stream"] and e["start"] - cur[1] < 200_000:
                cur[1] = max(cur[1], e["end"])
                cur[4] += 1
                continue
            if cur is not None:
                runs.append((cur[0], cur[1], cur[2], cur[3], cur[4]))
            cur = [e["start"], e["end"], f"{who} s{e['stream']}", name, 1, e["stream"]]
        if cur is not None:
            runs.append((cur[0], cur[1], cur[2], cur[3], cur[4]))
        for t, label in rec.get("marks", []):  # weightsync.runtime.trace
            runs.append((t, t, f"{who} host", label, 1))
    lines = [f"push {(t1 - t0) / 1e6:.2f} ms (host clock); from its start, ms:"]
    for a, b, who, name, n in sorted(runs):
        times = f"  {(a - t0) / 1e6:8.2f} {(b - t0) / 1e6:8.2f}"
        lines.append(f"{times}  {who:<16} {name}{f' x{n}' if n > 1 else ''}")
    return lines
