"""Host-clock marks of a push's steps (sent, counted, read, applied), to see where a push's time goes
beside a device profile (``scripts/bench_delta.py --profile``). Off unless ``WEIGHTSYNC_TRACE`` is set or
:func:`enable` is called; a mark then costs one clock read and one append, and its label is formatted
only then."""

from __future__ import annotations

import os
import threading
import time

_on = bool(os.environ.get("WEIGHTSYNC_TRACE"))
_lock = threading.Lock()
_marks: list[tuple[int, str]] = []


def enable(on: bool = True) -> None:
    """Starts (or stops) recording marks in this process; what was recorded is kept until :func:`take`."""
    global _on
    _on = on


def mark(label: str, *args: object) -> None:
    """Records ``label % args`` at this moment (``time.time_ns``, comparable across processes of one host)
    where recording is on."""
    if _on:
        text = label % args if args else label
        with _lock:  # the clock read inside: the marks stay in time order across threads
            _marks.append((time.time_ns(), text))


def take() -> list[tuple[int, str]]:
    """The marks recorded so far, in order; forgets them."""
    global _marks
    with _lock:
        out, _marks = _marks, []
    return out
