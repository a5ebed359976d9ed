"""A fault-injection campaign for a weight-sync group (issue 15, "How it is shown").

Sources and destinations are Ray actors of this file (CPU, public API only). A campaign pushes version
after version; before each push a seeded RNG picks one fault: kill a destination (a replacement joins),
kill a source (a replacement joins), stop a participant (SIGSTOP) for less or more than the push timeout,
cut a NIC and restore it (network-namespace variant), abandon a push (some sources push, the others do
not, so the ones that do time out), or nothing. Two readers run the whole time, one per destination
mode, and check every version they can see against the per-version digests of every tensor:

* staged: a reader thread calls ``apply()`` at safe points (as a generation loop between steps would)
  and compares the live tensors with the digests of the version it made live;
* inplace: a reader thread reads the live tensors whenever ``updating`` is False (and, once it exists,
  ``dirty`` is False) and compares them with ``version``'s digests; a read during which the version or
  ``updating`` changed is not a read a rollout would sample from, and is not counted.

Every tensor of every version is random but reproducible (seeded by the tensor's name and the version,
values in [1, 2), never zero; column 0 holds ``version + 0.5``), so any process can compute the expected
digest. Comparisons are of bytes (blake2b digests, then element bits), never float ``==``. A tensor that
differs is classified element by element: every element equal to the same element of some version
("mixed": bytes of two versions) or not ("wrong": bytes of no version, e.g. never written).

After each push the driver records what it expects: a push that every source reported as successful
succeeded on the destinations none of them reported failed, and those must hold exactly that version
(bit for bit) after ``wait``; a push that raised must raise a ``weightsync`` error. Every wait has a
timeout; a call to an actor that does not answer within its bound is a hang (counted, the actor is
killed and replaced). ``Campaign.run`` returns the summary (see ``Campaign.summary``).
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import random
import signal
import threading
import time
import traceback
import zlib
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from tests.support.netns import TwoHosts
from tests.support.netns import available as netns_available

# Rows of "emb", "w" and "col" are split between sources ("col" by columns: strided 2-D writes); "norm"
# is held whole by every source. About 0.9 MiB per version, several writes per source and destination.
SHAPES: dict[str, tuple[int, ...]] = {"emb": (512, 256), "w": (128, 192), "col": (64, 128), "norm": (384,)}
FAULT_KINDS = ("kill_destination", "kill_source", "stall_short", "stall_long", "nic_cut", "abandon", "none")
CLONE_NEWNET = 0x40000000


# -- what every version holds --------------------------------------------------------------------------

def version_tensor(name: str, version: int) -> np.ndarray:
    """Tensor ``name`` at ``version``: uniform in [1, 2) from a seed of (name, version), column 0 (element 0
    of a vector) = ``version + 0.5``. float32."""
    rng = np.random.default_rng([zlib.crc32(name.encode()), version, 15])
    t = (rng.random(SHAPES[name], dtype=np.float32) + np.float32(1.0)).astype(np.float32)
    if t.ndim == 1:
        t[0] = version + 0.5
    else:
        t[:, 0] = version + 0.5
    return t


def digest(a: np.ndarray) -> bytes:
    return hashlib.blake2b(np.ascontiguousarray(a).view(np.uint8).tobytes(), digest_size=16).digest()


class Expected:
    """Per-version digests (and, for classification, tensors) with a small cache."""

    def __init__(self, keep: int = 16) -> None:
        self._digests: dict[tuple[str, int], bytes] = {}
        self._keep = keep

    def digest(self, name: str, version: int) -> bytes:
        key = (name, version)
        d = self._digests.get(key)
        if d is None:
            if len(self._digests) > self._keep * len(SHAPES):
                self._digests.clear()
            d = self._digests[key] = digest(version_tensor(name, version))
        return d

    def check(self, tensors: dict[str, np.ndarray], version: int) -> tuple[str, str]:
        """("ok" | "mixed" | "wrong", detail) for a whole model read as ``version``."""
        verdict, details = "ok", []
        for name, got in tensors.items():
            if digest(got) == self.digest(name, version):
                continue
            kind, detail = classify(name, got, version)
            details.append(f"{name}: {detail}")
            if kind == "wrong" or verdict == "ok":
                verdict = kind
        return verdict, "; ".join(details)


def classify(name: str, got: np.ndarray, version: int) -> tuple[str, str]:
    """Which versions the elements of ``got`` come from: ("mixed", ...) if each element is bitwise the
    same element of some version near ``version`` (or one its column 0 names), else ("wrong", ...)."""
    bits = np.ascontiguousarray(got).view(np.int32)
    col0 = got if got.ndim == 1 else got[:, 0]
    named = {round(float(x) - 0.5) for x in np.unique(col0[np.isfinite(col0)]) if 0 <= x < 1 << 30}
    # The version read first, then those column 0 names, then the nearest: a version is reported only for
    # elements no earlier candidate explains (random float32 values of two versions coincide now and then).
    candidates = sorted({v for v in range(version - 8, version + 9) if v >= 0} | named | {version},
                        key=lambda v: (v != version, v not in named, abs(v - version)))
    unmatched = np.ones(bits.shape, dtype=bool)
    seen: list[int] = []
    for v in candidates:
        eq = bits == version_tensor(name, v).view(np.int32)
        if np.any(eq & unmatched):
            seen.append(v)
        unmatched &= ~eq
    if not unmatched.any():
        return "mixed", f"read as version {version}, holds bytes of versions {sorted(seen)}"
    return "wrong", (f"read as version {version}, {int(unmatched.sum())} of {unmatched.size} elements "
                     f"match no version near it (others from {sorted(seen)})")


# -- network namespaces ----------------------------------------------------------------------------------

def netns_unavailable() -> str | None:
    """None when namespaces can be made here, else why not."""
    return netns_available()


def make_engine(netns: str | None, nics: list[str] | None, **kw: Any) -> Any:
    """A TransferEngine whose NICs (and threads) live in namespace ``netns``; the calling thread (Ray's
    task thread) stays where it is, so the control plane keeps talking over the host's loopback.

    The engine is created by a helper thread that first joins ``netns`` (setns applies to the calling
    thread only): the engine's worker and provider threads, started by it, inherit the namespace."""
    import weightsync as ws

    if netns is None:
        return ws.TransferEngine(transport="fabric", **kw)
    out: dict[str, Any] = {}

    def build() -> None:
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            fd = os.open(f"/var/run/netns/{netns}", os.O_RDONLY)
            try:
                if libc.setns(fd, CLONE_NEWNET) != 0:
                    raise OSError(ctypes.get_errno(), f"setns({netns})")
            finally:
                os.close(fd)
            out["engine"] = ws.TransferEngine(transport="fabric", nics=nics, **kw)
        except BaseException as exc:  # handed to the caller
            out["error"] = exc

    t = threading.Thread(target=build, name=f"engine-in-{netns}")
    t.start()
    t.join()
    if "error" in out:
        raise out["error"]
    return out["engine"]


# -- the participants (Ray actors) ----------------------------------------------------------------------

def _box(name: str, rank: int, world: int) -> tuple[tuple[slice, ...], tuple[int, ...]]:
    shape = SHAPES[name]
    if len(shape) == 1:
        return (slice(None),), (0,)
    if name == "col":
        n = shape[1] // world
        return (slice(None), slice(rank * n, (rank + 1) * n)), (0, rank * n)
    n = shape[0] // world
    return (slice(rank * n, (rank + 1) * n), slice(None)), (rank * n, 0)


class ChaosSource:
    """Source ``rank`` of ``world``: holds its box of every tensor (``ws.Sharded``), the whole "norm"."""

    def __init__(self, group: str, rank: int, world: int, netns: str | None = None,
                 nics: list[str] | None = None, engine_kw: dict[str, Any] | None = None) -> None:
        import torch

        import weightsync as ws

        self.rank, self.world = rank, world
        self.locals: dict[str, torch.Tensor] = {}
        tensors: dict[str, Any] = {}
        for name, shape in SHAPES.items():
            sl, offs = _box(name, rank, world)
            local = self.locals[name] = torch.from_numpy(version_tensor(name, 0)[sl].copy())
            tensors[name] = local if len(shape) == 1 else ws.Sharded(local, shape, offs)
        engine = make_engine(netns, nics, **(engine_kw or {}))
        self.src = ws.Source(group, rank=rank, tensors=tensors, timeout=120.0, engine=engine)

    def pid(self) -> int:
        return os.getpid()

    def push(self, version: int, timeout: float) -> dict[str, Any]:
        """Fills the tensors with ``version`` (an optimizer step), then pushes. Never raises: the outcome
        comes back as a dict."""
        import torch

        import weightsync as ws

        for name, local in self.locals.items():
            local.copy_(torch.from_numpy(version_tensor(name, version)[_box(name, self.rank, self.world)[0]]))
        start = time.monotonic()
        try:
            stats = ws.push(self.src, version=version, timeout=timeout)
        except Exception as exc:
            return {"ok": False, "seconds": time.monotonic() - start, "type": type(exc).__name__,
                    "weightsync_error": isinstance(exc, ws.WeightSyncError), "error": str(exc)[:500]}
        return {"ok": True, "seconds": time.monotonic() - start, "destinations": list(stats.destinations),
                "failed": list(stats.failed_destinations), "epoch": stats.epoch}


class ChaosDestination:
    """Destination ``rank`` (a full replica, NaN until the first version) with its reader thread."""

    def __init__(self, group: str, rank: int, mode: str, push_timeout: float, netns: str | None = None,
                 nics: list[str] | None = None, engine_kw: dict[str, Any] | None = None,
                 read_interval: float = 0.01) -> None:
        import torch

        import weightsync as ws

        self.mode = mode
        self.tensors = {k: torch.full(s, float("nan")) for k, s in SHAPES.items()}
        self.views = {k: t.numpy() for k, t in self.tensors.items()}  # share memory with the live tensors
        engine = make_engine(netns, nics, **(engine_kw or {}))
        self.dst = ws.Destination(group, rank=rank, tensors=dict(self.tensors), mode=mode, timeout=120.0,
                                  push_timeout=push_timeout, engine=engine)
        self.expected = Expected()
        self.reads = 0          # reads checked (whole model)
        self.raced = 0          # inplace: reads discarded because a push began or ended during them
        self.dirty_skips = 0    # inplace: reads skipped because the destination says it is dirty
        self.checked: set[int] = set()
        self.bad: list[dict[str, Any]] = []   # {"kind": "mixed" | "wrong", "version", "detail"}
        self._interval = read_interval
        self._lock = threading.Lock()         # the reader's check against check_holds's
        self._stop = threading.Event()
        self._reader = threading.Thread(target=self._read_loop, name="chaos-reader", daemon=True)
        self._reader.start()

    def pid(self) -> int:
        return os.getpid()

    def version(self) -> int:
        return self.dst.version

    def _copy(self) -> dict[str, np.ndarray]:
        return {k: v.copy() for k, v in self.views.items()}

    def _record(self, version: int, got: dict[str, np.ndarray], where: str) -> str:
        verdict, detail = self.expected.check(got, version)
        self.reads += 1
        self.checked.add(version)
        if verdict != "ok" and len(self.bad) < 1000:
            self.bad.append({"kind": verdict, "version": version, "where": where, "detail": detail[:400]})
        return verdict

    def _read_once(self) -> None:
        dst = self.dst
        if self.mode == "staged":
            # A safe point of a generation loop: make the newest complete version live, then read it.
            with self._lock:
                version = dst.apply()
                if version >= 0:
                    self._record(version, self._copy(), "staged reader")
            return
        # inplace: read only when nothing is landing; discard reads during which a push began or ended.
        before = (dst.version, dst.updating, bool(getattr(dst, "dirty", False)))
        if before[0] < 0 or before[1]:
            return
        if before[2]:
            self.dirty_skips += 1
            return
        got = self._copy()
        after = (dst.version, dst.updating, bool(getattr(dst, "dirty", False)))
        if after != before:
            self.raced += 1
            return
        with self._lock:
            self._record(before[0], got, "inplace reader")

    def _read_loop(self) -> None:
        while not self._stop.is_set():
            try:
                self._read_once()
            except Exception as exc:  # a reader that dies silently would check nothing
                self.bad.append({"kind": "reader_error", "version": -1, "where": "reader",
                                 "detail": f"{type(exc).__name__}: {exc}"[:400]})
            self._stop.wait(self._interval)

    def check_holds(self, version: int, timeout: float) -> dict[str, Any]:
        """After a push that succeeded on this destination: ``wait(version)``, then the live tensors must
        be exactly ``version`` (staged: once the reader has applied it)."""
        import weightsync as ws

        try:
            got_version = self.dst.wait(version, timeout)
        except ws.TimeoutError as exc:
            return {"verdict": "not_reached", "detail": str(exc)[:300], "version": self.dst.version}
        deadline = time.monotonic() + timeout
        while self.mode == "staged" and self.dst.live_version < got_version and time.monotonic() < deadline:
            time.sleep(0.005)  # the reader thread is the generation loop that applies
        with self._lock:
            live = self.dst.live_version if self.mode == "staged" else self.dst.version
            if live != version:
                return {"verdict": "other_version", "detail": f"holds {live}, expected {version}",
                        "version": live}
            verdict = self._record(version, self._copy(), "after push")
        return {"verdict": verdict, "detail": "", "version": live}

    def report(self) -> dict[str, Any]:
        return {"reads": self.reads, "versions_checked": len(self.checked), "raced": self.raced,
                "dirty_skips": self.dirty_skips, "bad": list(self.bad),
                "readmissions": int(getattr(self.dst, "readmissions", 0))}

    def stop(self) -> dict[str, Any]:
        self._stop.set()
        self._reader.join(10)
        return self.report()


# -- the campaign (driver side) -------------------------------------------------------------------------

@dataclass
class Config:
    pushes: int = 40
    seed: int = 0
    netns: bool = False
    sources: int = 2
    push_timeout: float = 5.0          # the sources' push timeout
    dest_push_timeout: float = 5.0     # how long a destination waits for one version's bytes
    stall_short: float = 1.5           # seconds; shorter than push_timeout
    stall_long: float = 8.0            # longer than push_timeout
    nic_down: float = 4.0              # at most this many seconds a NIC stays cut (netns only)
    hang_margin: float = 60.0          # an actor call this much past its own bound is a hang
    fault_rate: float = 0.6            # share of pushes with a fault (the rest: "none")
    rates_mbit: list[int] = field(default_factory=lambda: [400, 200])
    max_seconds: float | None = None   # stop drawing pushes after this long (then the final push)
    log: Callable[[str], None] | None = None


class Hang(Exception):
    pass


class Campaign:
    """One group of ``sources`` sources and two destinations (rank 0 staged, rank 1 inplace); see the
    module docstring. ``run()`` returns ``summary()`` and always tears down (actors, namespaces)."""

    def __init__(self, cfg: Config, name: str | None = None) -> None:
        import ray

        self.cfg = cfg
        self.name = name or f"chaos{os.getpid()}x{cfg.seed}"
        self.rng = random.Random(cfg.seed)
        self._src_cls = ray.remote(num_cpus=0, max_restarts=0)(ChaosSource)
        self._dst_cls = ray.remote(num_cpus=0, max_restarts=0, max_concurrency=4)(ChaosDestination)
        self.net: TwoHosts | None = None
        self.group: Any = None
        self.sources: list[Any] = []
        self.dests: list[Any] = []
        self.modes = ["staged", "inplace"]
        self.pids: dict[tuple[str, int], int] = {}
        self.stopped: set[int] = set()
        self.generation = {"staged": 0, "inplace": 0}
        self.faults: Counter[str] = Counter()
        self.errors: Counter[str] = Counter()
        self.expect_failures: list[str] = []
        self.hangs = 0
        self.pushes_ok = 0
        self.pushes_failed = 0
        self.replacements = 0
        self.reports: list[tuple[str, dict[str, Any]]] = []  # (reader name, report) of retired readers
        self.fresh: set[int] = set()  # destinations replaced since their last successful push
        self.version = 0
        self._order: list[str] = []
        self.left_behind: list[int] = []
        self.final_pushes = 0  # clean pushes after the faults until every destination held the last one
        self.missing: set[tuple[str, int]] = set()  # ranks whose replacement failed to join
        self.t0 = time.monotonic()

    # -- helpers ------------------------------------------------------------------------------------
    def _log(self, msg: str) -> None:
        if self.cfg.log is not None:
            self.cfg.log(f"[{time.monotonic() - self.t0:7.1f}s] {msg}")

    def _get(self, refs: Any, bound: float, what: str) -> Any:
        import ray

        try:
            return ray.get(refs, timeout=bound + self.cfg.hang_margin)
        except ray.exceptions.GetTimeoutError:
            self.hangs += 1
            self._log(f"HANG: {what} did not answer within {bound + self.cfg.hang_margin:.0f} s")
            raise Hang(what) from None

    def _results(self, refs: list[Any], bound: float, what: str) -> list[dict[str, Any]] | None:
        """Every push's outcome; a source killed during its push gives {"ok": False, "type": "killed"}.
        None (a hang, counted) if one does not answer within its bound."""
        import ray

        deadline = time.monotonic() + bound + self.cfg.hang_margin
        out = []
        for ref in refs:
            try:
                out.append(ray.get(ref, timeout=max(deadline - time.monotonic(), 0.1)))
            except ray.exceptions.GetTimeoutError:
                self.hangs += 1
                self._log(f"HANG: {what} did not answer within {bound + self.cfg.hang_margin:.0f} s")
                return None
            except ray.exceptions.RayActorError as exc:
                out.append({"ok": False, "type": "killed", "weightsync_error": True, "error": str(exc)[:200]})
        return out

    def _engine_kw(self) -> dict[str, Any]:
        # Small pieces and stripes in the namespace variant: writes spread over both NICs, so a cut NIC
        # has pieces in flight.
        # A 2 s stall timeout: a cut longer than that fails the path (its pieces move to the other NIC), a
        # shorter one is ridden out.
        if self.net is None:
            return {}
        return {"stripe_threshold": 64 << 10, "max_piece": 64 << 10, "stall_timeout": 2.0}

    def _ns(self, role: str) -> tuple[str | None, list[str] | None]:
        if self.net is None:
            return None, None
        return (self.net.a if role == "source" else self.net.b), self.net.nic_names

    def _start_source(self, rank: int) -> Any:
        ns, nics = self._ns("source")
        return self._src_cls.remote(self.name, rank, self.cfg.sources, ns, nics, self._engine_kw())

    def _start_dest(self, rank: int) -> Any:
        ns, nics = self._ns("destination")
        return self._dst_cls.remote(self.name, rank, self.modes[rank], self.cfg.dest_push_timeout, ns, nics,
                                    self._engine_kw())

    def _ready(self, actors: list[Any]) -> None:
        self._get([a.__ray_ready__.remote() for a in actors], 120.0, "actors starting")

    def _refresh_pids(self) -> None:
        for i, s in enumerate(self.sources):
            self.pids[("source", i)] = self._get(s.pid.remote(), 30.0, "source pid")
        for j, d in enumerate(self.dests):
            self.pids[("destination", j)] = self._get(d.pid.remote(), 30.0, "destination pid")

    def _kill(self, role: str, rank: int) -> None:
        import ray

        pid = self.pids.get((role, rank))
        if pid is not None:
            self._cont(pid)
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        ray.kill((self.sources if role == "source" else self.dests)[rank], no_restart=True)

    def _stop(self, pid: int) -> None:
        try:
            os.kill(pid, signal.SIGSTOP)
        except ProcessLookupError:  # a participant that is gone (its replacement failed to join)
            return
        self.stopped.add(pid)

    def _cont(self, pid: int) -> None:
        if pid in self.stopped:
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
            self.stopped.discard(pid)

    def _collect(self, rank: int) -> None:
        """Fetches a destination's reader report (before it is killed)."""
        mode = self.modes[rank]
        try:
            rep = self._get(self.dests[rank].report.remote(), 30.0, f"destination {rank} report")
        except Exception as exc:  # a dead or hung reader: what it found is lost, say so
            self.errors[f"report_lost:{type(exc).__name__}"] += 1
            return
        self.reports.append((f"{mode}#{self.generation[mode]}", rep))

    def _replace(self, role: str, rank: int) -> None:
        """Starts a replacement under ``rank``; one that fails to join is counted, and tried again before
        the next push."""
        import ray

        try:
            self._start_replacement(role, rank)
        except Hang:
            self.missing.add((role, rank))
        except ray.exceptions.RayError as exc:
            cause = getattr(exc, "cause", None) or exc
            inner = getattr(cause, "cause", None) or cause  # the actor's creation task wraps the join's error
            self.errors[f"replacement_failed:{type(inner).__name__}"] += 1
            self._log(f"replacement {role} {rank} failed to join: {type(inner).__name__}: "
                      f"{str(inner)[-300:]}")
            self.missing.add((role, rank))

    def _start_replacement(self, role: str, rank: int) -> None:
        self.missing.discard((role, rank))
        if role == "destination":
            self.dests[rank] = self._start_dest(rank)
            self.generation[self.modes[rank]] += 1
            self.fresh.add(rank)
            actor = self.dests[rank]
        else:
            self.sources[rank] = self._start_source(rank)
            actor = self.sources[rank]
        self._ready([actor])
        self.pids[(role, rank)] = self._get(actor.pid.remote(), 30.0, f"{role} {rank} pid")
        self.replacements += 1
        self._log(f"replacement {role} {rank} joined")

    # -- one push --------------------------------------------------------------------------------------
    def _pick(self, index: int) -> str:
        kinds = [k for k in FAULT_KINDS if k != "none" and (k != "nic_cut" or self.net is not None)]
        if index < len(kinds):
            # The first pushes after the warm-up inject every kind once (in a seeded order), so a short
            # campaign covers them all; then faults are drawn at random.
            if index == 0:
                self._order = self.rng.sample(kinds, len(kinds))
            return self._order[index]
        return self.rng.choice(kinds) if self.rng.random() < self.cfg.fault_rate else "none"

    def _push_once(self, kind: str, count: bool = True) -> None:
        cfg = self.cfg
        for role, rank in sorted(self.missing):
            self._replace(role, rank)
        self.version += 1
        v = self.version
        pushing = [i for i in range(cfg.sources) if ("source", i) not in self.missing]
        after: list[Callable[[], None]] = []
        timers: list[threading.Timer] = []
        detail = ""
        if kind == "abandon":
            # Some sources push, the others skip this version: the ones that push time out and abandon it.
            pushing = sorted(self.rng.sample(pushing, self.rng.randint(1, max(len(pushing) - 1, 1))))
            detail = f"only sources {pushing} push"
        # The fault's moment: up to 60 ms before the push starts (the push meets a participant already
        # dead, stopped or cut off) or up to 60 ms into it (pushes here take tens of ms).
        delay = self.rng.uniform(-0.06, 0.06)
        replaced: set[int] = set()

        def inject() -> str:
            if kind in ("kill_destination", "kill_source"):
                role = "destination" if kind == "kill_destination" else "source"
                rank = self.rng.randrange(len(self.dests) if role == "destination" else cfg.sources)
                if role == "destination":
                    self._collect(rank)  # its reader's findings so far (they die with it)
                    replaced.add(rank)
                self._kill(role, rank)
                after.append(lambda: self._replace(role, rank))
                return f"{role} {rank}"
            if kind in ("stall_short", "stall_long"):
                role = self.rng.choice(["source", "destination"])
                rank = self.rng.randrange(cfg.sources if role == "source" else len(self.dests))
                pid = self.pids[(role, rank)]
                hold = cfg.stall_short if kind == "stall_short" else cfg.stall_long
                self._stop(pid)
                t = threading.Timer(hold, self._cont, args=(pid,))
                t.daemon = True
                t.start()
                timers.append(t)
                return f"{role} {rank} stopped {hold:.1f} s"
            if kind == "nic_cut":
                assert self.net is not None
                nic = self.rng.randrange(len(self.net.nic_names))
                down = self.rng.uniform(0.25, 1.0) * cfg.nic_down  # around the engine's stall timeout
                self.net.set_link(nic, False)
                t = threading.Timer(down, self._link_up, args=(nic,))
                t.daemon = True
                t.start()
                timers.append(t)
                return f"NIC {nic} down {down:.1f} s"
            return ""

        if kind in ("none", "abandon"):
            refs = [self.sources[i].push.remote(v, cfg.push_timeout) for i in pushing]
        elif delay < 0:
            detail = inject() + f", {-delay * 1000:.0f} ms before the push"
            time.sleep(-delay)  # the fault's moment (not a synchronisation)
            refs = [self.sources[i].push.remote(v, cfg.push_timeout) for i in pushing]
        else:
            refs = [self.sources[i].push.remote(v, cfg.push_timeout) for i in pushing]
            time.sleep(delay)  # the fault's moment (not a synchronisation)
            detail = inject() + f", {delay * 1000:.0f} ms into the push"
        if count:
            self.faults[kind] += 1
        self._log(f"push {v}: fault {kind} {detail}")
        try:
            results = self._results(refs, cfg.push_timeout, f"push {v}")
        finally:
            # Faults end before the outcome is judged: stopped processes resume, cut links come back,
            # killed participants are replaced.
            for t in timers:
                t.join(max(cfg.stall_long, cfg.nic_down) + 30)
            for fn in after:
                fn()
        if results is None:
            self._recover_hang()
            self.pushes_failed += 1
            return
        self._judge(v, kind, pushing, results, replaced)

    def _link_up(self, nic: int) -> None:
        assert self.net is not None
        try:
            self.net.set_link(nic, True)
        except Exception as exc:
            self.errors[f"link_up:{type(exc).__name__}"] += 1

    def _recover_hang(self) -> None:
        """A push did not answer: every participant that does not answer a ping is killed and replaced."""
        import ray

        for pid in list(self.stopped):
            self._cont(pid)
        for role, actors in (("source", self.sources), ("destination", self.dests)):
            for rank, a in enumerate(actors):
                try:
                    ray.get(a.pid.remote(), timeout=10)
                except Exception:
                    if role == "destination":
                        self.errors["report_lost:hung"] += 1  # its reader's findings die with it
                    self._kill(role, rank)
                    self._replace(role, rank)

    def _judge(self, v: int, kind: str, pushing: list[int], results: list[dict[str, Any]],
               replaced: set[int]) -> None:
        cfg = self.cfg
        for r in results:
            if not r["ok"] and r["type"] != "killed":
                self.errors[r["type"]] += 1
                if not r["weightsync_error"]:
                    self.expect_failures.append(f"push {v}: a non-weightsync error {r['type']}: {r['error']}")
        ok = len(pushing) == cfg.sources and all(r["ok"] for r in results)
        if kind == "abandon" and ok:
            self.expect_failures.append(f"push {v}: only sources {pushing} pushed, yet it succeeded")
        if not ok:
            self.pushes_failed += 1
            self._log(f"push {v}: failed ({[r.get('type') for r in results if not r['ok']]}: "
                      f"{[r.get('error', '')[:160] for r in results if not r['ok']][:1]})")
            return
        self.pushes_ok += 1
        reached = set(range(len(self.dests)))
        for r in results:
            reached &= set(r["destinations"]) - set(r["failed"])
        # A destination killed during this push may have acked it; its replacement holds nothing yet.
        reached -= replaced
        for r in results:
            if r["failed"]:
                self.errors["failed_destinations"] += 1
        took = max(r["seconds"] for r in results)
        failed = sorted({j for r in results for j in r["failed"]})
        self._log(f"push {v}: ok on destinations {sorted(reached)} ({took:.2f} s)"
                  + (f", failed on {failed}" if failed else ""))
        checks = {j: self.dests[j].check_holds.remote(v, 10.0) for j in sorted(reached)}
        for j, ref in checks.items():
            try:
                res = self._get(ref, 20.0, f"destination {j} holds {v}")
            except Hang:
                self._recover_hang()
                continue
            except Exception as exc:
                self.errors[f"check:{type(exc).__name__}"] += 1
                continue
            if res["verdict"] != "ok":
                self.expect_failures.append(f"push {v} succeeded on destination {j} ({self.modes[j]}), "
                                            f"but: {res['verdict']} {res['detail']}")
            else:
                self.fresh.discard(j)

    # -- the whole run --------------------------------------------------------------------------------
    def setup(self) -> None:
        import weightsync as ws

        if self.cfg.netns:
            self.net = TwoHosts(rates_mbit=list(self.cfg.rates_mbit), prefix="wsc", latency_ms=400).create()
        self.group = ws.Group.create(self.name, num_sources=self.cfg.sources,
                                     num_destinations=len(self.modes))
        self.dests = [self._start_dest(j) for j in range(len(self.modes))]
        self.sources = [self._start_source(i) for i in range(self.cfg.sources)]
        self._ready(self.dests + self.sources)
        self._refresh_pids()

    def run(self) -> dict[str, Any]:
        try:
            self.setup()
            # Warm-up: one clean push that every later check builds on.
            self._push_once("none", count=False)
            for i in range(self.cfg.pushes):
                if self.cfg.max_seconds is not None and time.monotonic() - self.t0 > self.cfg.max_seconds:
                    self._log(f"time budget of {self.cfg.max_seconds:.0f} s spent after {i} fault pushes")
                    break
                try:
                    self._push_once(self._pick(i))
                except Hang:
                    self._recover_hang()
                except Exception as exc:  # the harness itself must not stop the campaign silently
                    self.errors[f"harness:{type(exc).__name__}"] += 1
                    self._log(f"harness error: {traceback.format_exc()}")
            # A final clean push: every destination (also every replacement) must then hold it. First
            # every destination must be a member again (one dropped while stopped or cut off joins again
            # once it runs): "every participant up" includes that. A destination that the last fault
            # push's report dropped learns it only after that report landed (the final push awaits it), so
            # it gets more clean pushes (3 in all, a few seconds apart: right after a long stall the
            # sources' engine may still be restoring its paths to it, with probes that back off up to 8 s).
            self.fresh |= set(range(len(self.dests)))
            for attempt in range(3):
                if attempt:
                    time.sleep(3.0)  # the engine's path probes, not a synchronisation
                self._await_members(30.0)
                self.final_pushes += 1
                try:
                    self._push_once("none", count=False)
                except Exception as exc:  # the summary must still come out
                    self.errors[f"harness:{type(exc).__name__}"] += 1
                    self._log(f"harness error in a final push: {traceback.format_exc()}")
                if not self.fresh:
                    break
            for j in sorted(self.fresh):
                # Not brought up to date by a clean push with every source up: dropped from the plan
                # (reported failed while stopped, say) and never taken back, or its replacement never joined.
                try:
                    held: Any = self._get(self.dests[j].version.remote(), 30.0, f"destination {j} version")
                except Exception as exc:
                    held = f"nothing ({type(exc).__name__}: it is not running)"
                self.left_behind.append(j)
                self.expect_failures.append(f"destination {j} ({self.modes[j]}) left behind: holds version "
                                            f"{held} after the final clean push of version {self.version}")
            for j in range(len(self.dests)):
                if ("destination", j) not in self.missing:
                    self._collect(j)
            return self.summary()
        finally:
            self.teardown()

    def _await_members(self, timeout: float) -> None:
        """Waits (at most ``timeout`` s) until the coordinator counts every destination as a member."""
        want = list(range(len(self.dests)))
        deadline = time.monotonic() + timeout
        while True:
            try:
                got = self.group.status()["destinations"]
            except Exception as exc:  # the final push tells what is wrong
                self.errors[f"status:{type(exc).__name__}"] += 1
                return
            if got == want:
                return
            if time.monotonic() > deadline:
                self._log(f"destinations {sorted(set(want) - set(got))} not members {timeout:.0f} s before "
                          "the final push")
                return
            time.sleep(0.1)

    def teardown(self) -> None:
        import ray

        for pid in list(self.stopped):
            self._cont(pid)
        for a in self.sources + self.dests:
            try:
                ray.kill(a, no_restart=True)
            except Exception:
                pass
        if self.group is not None:
            try:
                self.group.shutdown()
            except Exception:
                pass
        if self.net is not None:
            self.net.remove()

    def summary(self) -> dict[str, Any]:
        versions: Counter[str] = Counter()
        reads: Counter[str] = Counter()
        bad_reads: Counter[str] = Counter()
        bad_versions: dict[str, set[tuple[str, int]]] = {"mixed": set(), "wrong": set()}
        samples: list[str] = []
        raced = dirty = readmitted = 0
        for reader, rep in self.reports:
            readmitted += rep.get("readmissions", 0)
            mode = reader.split("#")[0]
            versions[mode] += rep["versions_checked"]
            reads[mode] += rep["reads"]
            raced += rep["raced"]
            dirty += rep["dirty_skips"]
            for b in rep["bad"]:
                kind = b["kind"]
                if kind not in bad_versions:
                    self.errors[kind] += 1
                    continue
                bad_reads[kind] += 1
                key = (reader, b["version"])
                if key not in bad_versions[kind] and len(samples) < 10:
                    samples.append(f"{reader} {b['where']} v{b['version']}: {kind} {b['detail']}")
                bad_versions[kind].add(key)
        return {
            "seed": self.cfg.seed, "netns": self.cfg.netns, "sources": self.cfg.sources,
            "destinations": dict(enumerate(self.modes)),
            "pushes": self.pushes_ok + self.pushes_failed, "pushes_ok": self.pushes_ok,
            "pushes_failed": self.pushes_failed,
            "faults": {k: self.faults[k] for k in FAULT_KINDS if k in self.faults},
            "replacements": self.replacements,
            # Times a destination dropped from the plan while alive (stopped, cut off) joined again.
            "readmissions": readmitted,
            "versions_checked": dict(versions), "reads": dict(reads), "inplace_reads_raced": raced,
            "inplace_reads_dirty": dirty,
            # Versions (per reader) seen torn, and how many reads saw them.
            "mixed": len(bad_versions["mixed"]), "wrong": len(bad_versions["wrong"]),
            "mixed_reads": bad_reads["mixed"], "wrong_reads": bad_reads["wrong"], "hangs": self.hangs,
            "expectation_failures": len(self.expect_failures), "left_behind": self.left_behind,
            "final_pushes": self.final_pushes,
            "errors": dict(self.errors), "seconds": round(time.monotonic() - self.t0, 1),
            "samples": samples, "expectation_samples": self.expect_failures[:8],
        }
