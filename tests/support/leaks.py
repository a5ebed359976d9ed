"""What a test leaves behind that the next one would meet: child processes of the test process still
running, and network namespaces it made and did not remove. Read from /proc and /run/netns, so a check
costs a few directory listings."""

from __future__ import annotations

import os
import re
import time
from pathlib import Path

NETNS_DIR = Path("/run/netns")


# Helpers multiprocessing starts once and keeps for the interpreter's life, whichever test uses it first.
INTERPRETER_HELPERS = ("multiprocessing.resource_tracker", "multiprocessing.forkserver")


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


def namespaces() -> set[str]:
    """The named network namespaces of this process tree: those tests/support/netns tags with the pid of
    this process or of a descendant, or of a process gone (nobody is left to remove them); a namespace of
    another live process tree (a second test run on the machine) is not ours to count."""
    try:
        names = os.listdir(NETNS_DIR)
    except OSError:
        return set()
    return {n for n in names if _ours(n)}


def _ours(name: str) -> bool:
    tag = re.search(r"(\d+)x\d+$", name)
    if tag is None:
        return True
    pid = int(tag.group(1))
    me = os.getpid()
    while pid > 1:
        if pid == me:
            return True
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            return True  # its creator (or an ancestor of it) is gone
        pid = int(stat[stat.rindex(")") + 2:].split()[1])
    return False


def _describe(pid: int) -> str:
    return f"{pid} ({_cmdline(pid).strip()[:120]})"


def leaked(before_children: set[int], before_namespaces: set[str], grace_s: float = 10.0) -> list[str]:
    """What exists now that did not before, once ``grace_s`` has passed for it to go (a process a test
    killed can take a moment to exit, Ray's helpers a moment to follow ``ray.shutdown``)."""
    deadline = time.monotonic() + grace_s
    while True:
        kids = children() - before_children
        ns = namespaces() - before_namespaces
        if (not kids and not ns) or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    return ([f"child process {_describe(p)}" for p in sorted(kids)]
            + [f"network namespace {n}" for n in sorted(ns)])
