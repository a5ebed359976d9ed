"""What a test leaves behind that the next one would meet: child processes of the test process still
running, network namespaces it made and did not remove, Python threads still running, transfer engines
of this process not closed, a Ray it started and did not shut down, and Ray actors it started that are
still alive in the Ray of a wider fixture. Read from /proc, /run/netns, the interpreter and one call to
Ray's control store, so a check costs a few milliseconds and runs after every test."""

from __future__ import annotations

import functools
import gc
import os
import re
import sys
import threading
import time
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

NETNS_DIR = Path("/run/netns")


# Helpers multiprocessing starts once and keeps for the interpreter's life, whichever test uses it first.
INTERPRETER_HELPERS = ("multiprocessing.resource_tracker", "multiprocessing.forkserver")

# Threads that libraries start once in a process and keep for its life (or, for Ray's, until
# ``ray.shutdown``, which the Ray check covers), whichever test first uses them.
LIFETIME_THREADS = (
    "PythonGCThread",  # Ray: collects in the background on its own schedule
    "ray_listen_error_messages", "ray_print_logs",  # Ray: the driver's log and error listeners
    "tqdm_monitor",  # tqdm (vLLM's loaders' progress bars): started by the first bar, never joined
)

# Every open TransferEngine of this process (see ``track_engines``).
_engines: weakref.WeakSet[Any] = weakref.WeakSet()


def track_engines() -> None:
    """From now on every ``TransferEngine`` made in this process is remembered (weakly), so that
    ``open_engines`` can name the ones a test did not close. Without weightsync's engine (another
    environment), nothing is tracked."""
    try:
        from weightsync.engine.engine import TransferEngine
    except ImportError:
        return
    init = TransferEngine.__init__
    if getattr(init, "tracked", False):
        return

    @functools.wraps(init)  # its signature stays the engine's (tests read it)
    def tracked_init(self: Any, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        _engines.add(self)

    tracked_init.tracked = True  # type: ignore[attr-defined]
    TransferEngine.__init__ = tracked_init  # type: ignore[method-assign]


def open_engines() -> dict[int, str]:
    """The transfer engines of this process not closed yet: id -> description."""
    out: dict[int, str] = {}
    for eng in list(_engines):
        try:
            if not eng.closed:
                out[id(eng)] = repr(eng)
        except Exception:  # an engine whose construction failed half way holds nothing
            continue
    return out


def children() -> set[int]:
    """The running (not zombie) child processes of this process, from every thread's children list,
    less multiprocessing's own helpers."""
    pids: set[int] = set()
    task = Path(f"/proc/{os.getpid()}/task")
    for t in task.iterdir() if task.exists() else ():
        try:
            pids.update(int(p) for p in (t / "children").read_text().split())
        except OSError:
            continue
    return {p for p in pids if _running(p) and not any(h in _cmdline(p) for h in INTERPRETER_HELPERS)}


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return "?"


def _running(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2] != "Z"


# tests/support/netns.py names a namespace after the process that made it: "{prefix}{host}{pid}x{serial}".
_NETNS_PID = re.compile(r"(\d+)x\d+$")


def namespaces() -> set[str]:
    """The named network namespaces of the machine."""
    try:
        return set(os.listdir(NETNS_DIR))
    except OSError:
        return set()


def _owned_elsewhere(name: str) -> bool:
    """Whether the process named in ``name`` still runs and is neither this process nor one of its
    descendants (a namespace whose maker is gone, or that names no maker, is this run's to account for)."""
    m = _NETNS_PID.search(name)
    if m is None:
        return False
    pid, me = int(m.group(1)), os.getpid()
    seen = 0
    while pid > 1 and seen < 64:
        if pid == me:
            return False
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            return seen > 0  # the maker is gone: a leak; an ancestor gone mid-walk: not ours either
        pid = int(stat[stat.rindex(")") + 2:].split()[1])
        seen += 1
    return True


def threads() -> dict[int, str]:
    """The Python threads of this process other than the main one and libraries' lifetime threads:
    ident -> name."""
    main = threading.main_thread()
    return {t.ident: t.name for t in threading.enumerate()
            if t is not main and t.ident is not None and not t.name.startswith(LIFETIME_THREADS)}


def ray_initialized() -> bool:
    ray = sys.modules.get("ray")
    return bool(ray is not None and ray.is_initialized())


def ray_actors() -> dict[str, str]:
    """The live actors of the Ray this process is connected to (none when it is not): id -> class and
    name. One call to Ray's control store."""
    if not ray_initialized():
        return {}
    try:
        from ray._private import state

        table = state.actors()
    except Exception:  # a Ray without this table: the actor check is skipped, the others still run
        return {}
    return {aid: f"{a.get('ActorClassName', '?').rsplit('.', 1)[-1]} {a.get('Name') or ''}".strip()
            for aid, a in table.items() if a.get("State") not in ("DEAD",)}


@dataclass
class Snapshot:
    """What exists at one moment; what a later snapshot has that this one had not is a leak."""

    children: set[int] = field(default_factory=children)
    namespaces: set[str] = field(default_factory=namespaces)
    threads: dict[int, str] = field(default_factory=threads)
    engines: dict[int, str] = field(default_factory=open_engines)
    ray: bool = field(default_factory=ray_initialized)
    actors: dict[str, str] = field(default_factory=ray_actors)

    def new_since(self, before: Snapshot) -> list[str]:
        out = [f"child process {_describe(p)}" for p in sorted(self.children - before.children)]
        # Another live process tree's (another test run on this machine, another pytest-xdist worker)
        # makes and removes its own.
        out += [f"network namespace {n}" for n in sorted(self.namespaces - before.namespaces)
                if not _owned_elsewhere(n)]
        out += [f"thread {name!r}" for ident, name in self.threads.items() if ident not in before.threads]
        out += [f"open engine {d} (never closed)" for k, d in self.engines.items() if k not in before.engines]
        if self.ray and not before.ray:
            out.append("Ray still initialised (ray.init without ray.shutdown)")
        if self.ray and before.ray:
            out += [f"Ray actor {d} ({aid[:8]}) still alive" for aid, d in self.actors.items()
                    if aid not in before.actors]
        return out


def _describe(pid: int) -> str:
    return f"{pid} ({_cmdline(pid).strip()[:120]})"


def leaked(before: Snapshot, grace_s: float = 10.0) -> list[str]:
    """What exists now that did not at ``before``, once ``grace_s`` has passed for it to go (a process a
    test killed can take a moment to exit, Ray's helpers a moment to follow ``ray.shutdown``, an actor
    a moment to die after ``ray.kill``). An engine only garbage keeps open is collected first."""
    deadline = time.monotonic() + grace_s
    collected = False
    while True:
        left = Snapshot().new_since(before)
        if not left or time.monotonic() > deadline:
            return left
        if not collected and any(item.startswith("open engine") for item in left):
            gc.collect()  # an engine in a reference cycle closes when collected: not a leak
            collected = True
            continue
        time.sleep(0.1)
