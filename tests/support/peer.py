"""A transfer-engine peer in its own process (optionally inside a network namespace), driven by tests.

The parent speaks length-prefixed msgpack over the child's stdin/stdout: each request is a dict with an
``op``; each answer is ``{"ok": value}`` or ``{"error": "Type: message"}``. Keeping the engine in another
process is the point: writes cross a real connection, and a peer can be killed.
"""

from __future__ import annotations

import hashlib
import os
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import msgpack
import numpy as np

POISON = 0xA5


def _read(stream: Any) -> Any:
    head = stream.read(4)
    if len(head) < 4:
        return None
    (n,) = struct.unpack("<I", head)
    return msgpack.unpackb(stream.read(n), raw=False)


def _write(stream: Any, obj: Any) -> None:
    data = msgpack.packb(obj, use_bin_type=True)
    stream.write(struct.pack("<I", len(data)) + data)
    stream.flush()


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` still exists (a zombie counts until reaped)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def digest(buf: np.ndarray) -> str:
    return hashlib.blake2b(memoryview(buf), digest_size=16).hexdigest()


def random_bytes(size: int, seed: int) -> np.ndarray:
    return np.frombuffer(np.random.default_rng(seed).bytes(size), dtype=np.uint8).copy()


def _rows(buf: np.ndarray, off: int, rows: int, row_bytes: int, pitch: int) -> np.ndarray:
    if rows == 0 or row_bytes == 0:
        return buf[:0]
    return np.concatenate([buf[off + r * pitch : off + r * pitch + row_bytes] for r in range(rows)])


def rows_digest(buf: np.ndarray, off: int, rows: int, row_bytes: int, pitch: int) -> str:
    """Digest of ``rows`` rows of ``row_bytes`` bytes of ``buf``, ``pitch`` apart, back to back."""
    return digest(_rows(buf, off, rows, row_bytes, pitch))


class _Server:
    def __init__(self) -> None:
        self.engine: Any = None
        self.buffers: dict[int, np.ndarray] = {}
        self.regions: dict[int, Any] = {}
        self.peers: dict[int, Any] = {}
        self.transfers: dict[int, Any] = {}
        self.forwards: dict[int, Any] = {}
        # Work that must run while the parent keeps driving this process (benchmarks): key -> thread, box.
        self.background: dict[str, tuple[threading.Thread, list[Any]]] = {}

    def engine_(self, **kwargs: Any) -> bytes:
        from weightsync.engine import TransferEngine

        hooks = {k: kwargs.pop(k) for k in ("stage_host_sources", "land_host_regions") if k in kwargs}
        self.engine = TransferEngine._for_tests(**hooks, **kwargs) if hooks else TransferEngine(**kwargs)
        return self.engine.address

    def alloc(self, size: int, seed: int | None = None) -> list[Any]:
        buf = np.full(size, POISON, dtype=np.uint8) if seed is None else random_bytes(size, seed)
        region = self.engine.register(buf, name=f"buffer{len(self.buffers)}")
        self.buffers[region.id] = buf
        self.regions[region.id] = region
        return [region.id, region.descriptor]

    def digest(self, region: int, off: int, size: int) -> str:
        return digest(self.buffers[region][off : off + size])

    def poison(self, region: int, off: int, size: int) -> None:
        """Refills a range with the poison byte: a later digest then proves that new writes landed there."""
        self.buffers[region][off : off + size] = POISON

    def poisoned_outside(self, region: int, off: int, size: int) -> bool:
        buf = self.buffers[region]
        return bool((buf[:off] == POISON).all() and (buf[off + size :] == POISON).all())

    def rows_digest(self, region: int, off: int, rows: int, row_bytes: int, pitch: int) -> str:
        """Digest of ``rows`` rows of ``row_bytes`` bytes, ``pitch`` apart, back to back."""
        return digest(_rows(self.buffers[region], off, rows, row_bytes, pitch))

    def rows_digest_on(self, imm: int, n: int, region: int, off: int, rows: int, row_bytes: int, pitch: int,
                       timeout: float = 60.0) -> str:
        """On a thread: waits for ``n`` immediates, then at once takes the digest of the rows (``joined``
        returns it). What an immediate promises has to be in place the moment it is counted."""

        def watch() -> str:
            self.engine.counter(imm).wait(n, timeout)
            return digest(_rows(self.buffers[region], off, rows, row_bytes, pitch))

        return self._spawn(f"rows{imm}", watch)

    def poisoned_outside_rows(self, region: int, off: int, rows: int, row_bytes: int, pitch: int) -> bool:
        """Every byte outside the rows (before, between and after them) is still poison."""
        buf = self.buffers[region]
        mask = np.ones(buf.size, dtype=bool)
        for r in range(rows):
            mask[off + r * pitch : off + r * pitch + row_bytes] = False
        return bool((buf[mask] == POISON).all())

    def deregister(self, region: int) -> None:
        """Deregisters a region (its buffer stays allocated here, so a stray write would show)."""
        self.engine.deregister(self.regions.pop(region))

    def forward(self, on_imm: int, count: int, region: int, src_off: int, peer: int, descriptor: bytes,
                dst_off: int, size: int, imm: int | None = None, rows: int = 1, src_pitch: int = 0,
                dst_pitch: int = 0) -> int:
        """Registers a triggered write (``TransferEngine.forward``); returns its id for ``forward_wait``."""
        fwd = self.engine.forward(on_imm, count, self.regions[region], src_off, self.peers[peer], descriptor,
                                  dst_off, size, imm, rows=rows, src_pitch=src_pitch, dst_pitch=dst_pitch)
        self.forwards[fwd.id] = fwd
        return fwd.id

    def forward_wait(self, forward: int, timeout: float = 60.0) -> int:
        """Waits for a triggered write to complete locally; returns the immediates it delivers."""
        fwd = self.forwards[forward]
        fwd.transfer.wait(timeout)
        return fwd.transfer.imm_count

    def pending_forwards(self) -> int:
        return self.engine.pending_forwards

    def counter_total(self, imm: int) -> int:
        return self.engine.counter(imm).total

    def connect(self, address: bytes) -> int:
        peer = self.engine.connect(address)
        self.peers[len(self.peers)] = peer
        return len(self.peers) - 1

    def write(self, region: int, src_off: int, peer: int, descriptor: bytes, dst_off: int, size: int,
              imm: int | None = None, timeout: float = 60.0, rows: int = 1, src_pitch: int = 0,
              dst_pitch: int = 0) -> list[Any]:
        t0 = time.perf_counter()
        t = self.engine.write(self.regions[region], src_off, self.peers[peer], descriptor, dst_off, size, imm,
                              rows=rows, src_pitch=src_pitch, dst_pitch=dst_pitch)
        t.wait(timeout)
        return [t.imm_count, time.perf_counter() - t0]

    def write_async(self, region: int, src_off: int, peer: int, descriptor: bytes, dst_off: int, size: int,
                    imm: int | None = None) -> int:
        t = self.engine.write(self.regions[region], src_off, self.peers[peer], descriptor, dst_off, size, imm)
        self.transfers[len(self.transfers)] = t
        return len(self.transfers) - 1

    def wait(self, transfer: int, timeout: float = 60.0) -> list[Any]:
        t0 = time.perf_counter()
        t = self.transfers[transfer]
        t.wait(timeout)
        return [t.imm_count, time.perf_counter() - t0]

    def counter_wait(self, imm: int, n: int, timeout: float = 60.0) -> None:
        self.engine.counter(imm).wait(n, timeout)

    def imm_count(self, nbytes: int, rows: int = 1) -> int:
        return self.engine.imm_count(nbytes, rows=rows)

    def counter_value(self, imm: int) -> int:
        return self.engine.counter(imm).value

    def stats(self) -> list[dict[str, Any]]:
        return self.engine.stats()

    def _spawn(self, key: str, fn: Callable[[], Any]) -> str:
        if key in self.background:
            raise ValueError(f"background task {key} is already running")
        box: list[Any] = []

        def run() -> None:
            try:
                box.append(("ok", fn()))
            except Exception as exc:  # handed to the parent by joined()
                box.append(("error", exc))

        thread = threading.Thread(target=run, name=key, daemon=True)
        thread.start()
        self.background[key] = (thread, box)
        return key

    def joined(self, key: str, timeout: float = 60.0) -> Any:
        """Waits for a background task (``counter_watch``, ``pong``) and returns its result."""
        thread, box = self.background.pop(key)
        thread.join(timeout)
        if thread.is_alive():
            self.background[key] = (thread, box)  # still running: the parent may join again
            raise TimeoutError(f"background task {key} still running after {timeout} s")
        status, value = box[0]
        if status == "error":
            raise value
        return value

    def counter_watch(self, imm: int, n: int, timeout: float = 60.0) -> str:
        """Waits for ``n`` immediates on a thread; ``joined`` returns when (``time.monotonic``) they were in.

        CLOCK_MONOTONIC is one clock for every process of a host, so the parent can time submit-to-landed
        across processes. Immediates that beat the thread into ``wait`` only make the time later, never
        earlier: the figure is an upper bound on when the bytes landed.
        """

        def watch() -> float:
            self.engine.counter(imm).wait(n, timeout)
            return time.monotonic()

        return self._spawn(f"watch{imm}", watch)

    def digest_watch(self, imm: int, n: int, region: int, off: int, size: int, timeout: float = 60.0) -> str:
        """``counter_watch`` and a digest of ``size`` bytes at ``off`` taken the moment the immediates are in:
        ``joined`` returns ``[time.monotonic(), digest]`` (one waiter: a wait consumes its credits)."""

        def watch() -> list[Any]:
            self.engine.counter(imm).wait(n, timeout)
            at = time.monotonic()
            return [at, digest(self.buffers[region][off : off + size])]

        return self._spawn(f"watch{imm}", watch)

    def pong(self, region: int, peer: int, descriptor: bytes, size: int, n: int, imm_in: int, imm_out: int,
             timeout: float = 60.0) -> str:
        """Answers each of the next ``n`` immediates ``imm_in`` with a write of ``size`` bytes carrying
        ``imm_out``, on a thread: the far end of a round-trip latency measurement."""

        def serve_pongs() -> int:
            counter = self.engine.counter(imm_in)
            for _ in range(n):
                counter.wait(1, timeout)
                self.engine.write(self.regions[region], 0, self.peers[peer], descriptor, 0, size,
                                  imm_out).wait(timeout)
            return n

        return self._spawn("pong", serve_pongs)

    def failed_paths(self, peer: int) -> list[bool]:
        return self.peers[peer].failed_paths

    def pid(self) -> int:
        return os.getpid()


def serve() -> None:
    server = _Server()
    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
    sys.stdout = sys.stderr  # stray prints must not corrupt the protocol
    while True:
        req = _read(stdin)
        if req is None or req.get("op") == "exit":
            break
        op = req.pop("op")
        try:
            fn = getattr(server, "engine_" if op == "engine" else op)
            _write(stdout, {"ok": fn(**req)})
        except Exception as exc:  # reported to the parent, which re-raises it
            _write(stdout, {"error": f"{type(exc).__name__}: {exc}"})
    if server.engine is not None:
        server.engine.close()


class PeerError(Exception):
    """An operation failed in the peer process; the message starts with the exception's type."""


class PeerProcess:
    """Parent-side handle: ``peer.call("alloc", size=...)``."""

    def __init__(self, netns: str | None = None, env: dict[str, str] | None = None) -> None:
        cmd = [sys.executable, "-m", "tests.support.peer"]
        if netns:
            cmd = ["ip", "netns", "exec", netns, *cmd]
        # The repository root (tests/support/peer.py -> three levels up), so that ``-m tests.support.peer``
        # resolves without relying on an editable install putting the root on sys.path.
        root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        self.proc = subprocess.Popen(
            cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, cwd=root, env={**os.environ, **(env or {})}
        )

    def call(self, op: str, **kwargs: Any) -> Any:
        _write(self.proc.stdin, {"op": op, **kwargs})
        answer = _read(self.proc.stdout)
        if answer is None:
            raise PeerError(f"peer process exited (code {self.proc.poll()}) during {op}")
        if "error" in answer:
            raise PeerError(answer["error"])
        return answer["ok"]

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                _write(self.proc.stdin, {"op": "exit"})
                self.proc.wait(20)
            except (BrokenPipeError, subprocess.TimeoutExpired):
                self.kill()


if __name__ == "__main__":
    serve()
