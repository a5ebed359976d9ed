"""What a test leaves behind that the next one would meet: child processes of the test process still
running, and network namespaces it made and did not remove. Read from /proc and /run/netns, so a check
costs a few directory listings."""

from __future__ import annotations

import os
import time
from pathlib import Path

NETNS_DIR = Path("/run/netns")


def children() -> set[int]:
    """The running (not zombie) child processes of this process, from every thread's children list."""
    pids: set[int] = set()
    task = Path(f"/proc/{os.getpid()}/task")
    for t in task.iterdir() if task.exists() else ():
        try:
            pids.update(int(p) for p in (t / "children").read_text().split())
        except OSError:
            continue
    return {p for p in pids if _running(p)}


def _running(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2] != "Z"


def namespaces() -> set[str]:
    """The named network namespaces of the machine."""
    try:
        return set(os.listdir(NETNS_DIR))
    except OSError:
        return set()


def _describe(pid: int) -> str:
    try:
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        cmd = "?"
    return f"{pid} ({cmd.strip()[:120]})"


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
