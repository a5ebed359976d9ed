"""Helpers of the engine fault tests: a TransferEngine in a child process, and two hosts in namespaces.

``EngineProc`` runs this file as a script in a child process (optionally inside a network namespace, via
``ip netns exec``) and drives it with pickled requests over its stdin/stdout. The child uses only the
public face of the package (``import weightsync as ws``). A child can be stopped (SIGSTOP), resumed and
killed, which is the point: a peer that is slow, gone or cut off is a real process on a real connection.

Two hosts in network namespaces for these tests are ``tests.support.netns.TwoHosts``.
"""

from __future__ import annotations

import hashlib
import os
import pickle
import select
import signal
import struct
import subprocess
import sys
import time
from typing import Any

POISON = 0xA5
# Arguments of TransferEngine._for_tests (test-only switches): an engine given one is made by it.
_TEST_HOOKS = {"stage_host_sources", "land_host_regions", "lose_imm_acks", "no_path_abort"}
_HEAD = struct.Struct("<I")


def random_bytes(size: int, seed: int) -> Any:
    import numpy as np

    return np.frombuffer(np.random.default_rng(seed).bytes(size), dtype=np.uint8).copy()


def digest(buf: Any) -> str:
    return hashlib.blake2b(memoryview(buf), digest_size=16).hexdigest()


class ProcError(Exception):
    """An operation failed in the child; ``kind`` is the exception's class name there."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(f"{kind}: {message}")
        self.kind = kind
        self.message = message


class EngineProc:
    """A child process holding one engine; ``call(op, **kwargs)`` runs ``_Child.<op>`` there."""

    def __init__(self, netns: str | None = None) -> None:
        cmd = [sys.executable, os.path.abspath(__file__)]
        if netns is not None:
            cmd = ["ip", "netns", "exec", netns, *cmd]
        repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        env = dict(os.environ, PYTHONPATH=repo + os.pathsep + os.environ.get("PYTHONPATH", ""))
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, cwd=repo)
        self.address: bytes = b""

    def call(self, op: str, answer_within: float = 90.0, **kwargs: Any) -> Any:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        data = pickle.dumps((op, kwargs))
        self.proc.stdin.write(_HEAD.pack(len(data)) + data)
        self.proc.stdin.flush()
        deadline = time.monotonic() + answer_within
        (n,) = _HEAD.unpack(self._read(_HEAD.size, deadline, op))
        status, value = pickle.loads(self._read(n, deadline, op))
        if status == "error":
            raise ProcError(*value)
        return value

    def _read(self, n: int, deadline: float, op: str) -> bytes:
        assert self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        out = b""
        while len(out) < n:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"engine process {self.proc.pid}: no answer to {op!r} in time")
            ready, _, _ = select.select([fd], [], [], left)
            if not ready:
                continue
            chunk = os.read(fd, n - len(out))
            if not chunk:
                rc = self.proc.poll()
                raise RuntimeError(f"engine process {self.proc.pid} exited (rc {rc}) during {op!r}")
            out += chunk
        return out

    def stop(self) -> None:
        os.kill(self.proc.pid, signal.SIGSTOP)

    def cont(self) -> None:
        os.kill(self.proc.pid, signal.SIGCONT)

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGCONT)  # a stopped process must run to die cleanly
            self.proc.kill()
        self.proc.wait(timeout=10)

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                os.kill(self.proc.pid, signal.SIGCONT)
                self.call("quit", answer_within=10)
            except (ProcError, TimeoutError, RuntimeError, OSError, BrokenPipeError):
                pass
        self.kill()


class _Child:
    """What the child process does: it owns the engine and every object the parent refers to by number."""

    def __init__(self) -> None:
        self.engine: Any = None
        self.objects: dict[int, Any] = {}
        self.next_id = 1

    def _keep(self, obj: Any) -> int:
        key = self.next_id
        self.next_id += 1
        self.objects[key] = obj
        return key

    def engine_(self, **kwargs: Any) -> bytes:
        import weightsync as ws

        if _TEST_HOOKS & kwargs.keys() and hasattr(ws.TransferEngine, "_for_tests"):
            # A test-only switch (host regions written through the landing ring, as GPU memory without
            # FI_HMEM is; acknowledgements lost): engines take it through their test constructor.
            self.engine = ws.TransferEngine._for_tests(transport="fabric", **kwargs)
        else:
            self.engine = ws.TransferEngine(transport="fabric", **kwargs)
        return self.engine.address

    def alloc(self, size: int, seed: int | None = None) -> list[Any]:
        import numpy as np

        buf = np.full(size, POISON, dtype=np.uint8) if seed is None else random_bytes(size, seed)
        region = self.engine.register(buf)
        return [self._keep(region), region.descriptor]

    def fill(self, region: int, seed: int) -> None:
        buf = self.objects[region].buffer
        buf[:] = random_bytes(buf.size, seed)

    def poison(self, region: int) -> None:
        self.objects[region].buffer[:] = POISON

    def digest(self, region: int, off: int, size: int) -> str:
        return digest(self.objects[region].buffer[off : off + size])

    def deregister(self, region: int) -> None:
        # The buffer stays allocated here (the Region keeps it), so a stray write would still show.
        self.engine.deregister(self.objects[region])

    def connect(self, address: bytes) -> int:
        return self._keep(self.engine.connect(address))

    def write(self, region: int, peer: int, descriptor: bytes, size: int, imm: int | None = None,
              src_off: int = 0, dst_off: int = 0) -> list[int]:
        src, dst_peer = self.objects[region], self.objects[peer]
        t = self.engine.write(src, src_off, dst_peer, descriptor, dst_off, size, imm=imm)
        return [self._keep(t), t.imm_count]

    def wait(self, transfer: int, timeout: float) -> float:
        start = time.monotonic()
        self.objects[transfer].wait(timeout)
        return time.monotonic() - start

    def failed_paths(self, peer: int) -> list[bool]:
        return self.objects[peer].failed_paths

    def stats(self) -> list[dict[str, Any]]:
        return self.engine.stats()

    def counter_wait(self, imm: int, n: int, timeout: float) -> float:
        start = time.monotonic()
        self.engine.counter(imm).wait(n, timeout)
        return time.monotonic() - start

    def counter_total(self, imm: int) -> int:
        return self.engine.counter(imm).total

    def quit(self) -> None:
        self.engine.close()


def _serve() -> None:
    # Requests arrive on stdin and answers leave on the original stdout; anything else the child prints
    # (the engine's diagnostics, a stray print) goes to stderr, so it cannot corrupt the answers.
    answers = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    requests = sys.stdin.buffer
    child = _Child()
    while True:
        head = requests.read(_HEAD.size)
        if len(head) < _HEAD.size:
            return
        op, kwargs = pickle.loads(requests.read(_HEAD.unpack(head)[0]))
        try:
            reply: tuple[str, Any] = ("ok", getattr(child, "engine_" if op == "engine" else op)(**kwargs))
        except Exception as exc:
            reply = ("error", (type(exc).__name__, str(exc)))
        data = pickle.dumps(reply)
        answers.write(_HEAD.pack(len(data)) + data)
        answers.flush()
        if op == "quit":
            return


if __name__ == "__main__":
    _serve()
