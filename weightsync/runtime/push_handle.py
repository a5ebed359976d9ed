"""A push in flight: what ``ws.push_async`` returns, and the watch over the tensors it reads.

A trainer's weights do not change between one ``optimizer.step()`` and the next, so a push started right
after a step can move its bytes while the next forward and backward run. The contract: the trainer waits
for the push (``handle.wait()``, ``src.wait_pushed()``, or the optimizer hook ``src.guard(optimizer)``)
before it changes the weights again. Until then the push reads them: the direct writes, and the
sender-side preparation of staged chunks (packs, casts, FP8 quantization, gathers of tile rows).

A push that finds its tensors changed under it fails and no destination takes that version. It holds
back one write per destination (its *tail*, served from a private copy): a destination flips a version
only when it has every immediate of it, so without the tail it never does, and it abandons the version
at the next push's announce. The tails go only once a check has passed, and what that check can prove
depends on where a tensor lives:

* Host memory (``HostCopy``). Torch moves a CPU tensor's version counter (``Tensor._version``) when an
  in-place op *returns*, so an op another thread is still running is invisible to the counter. A push
  therefore never sends the live host tensors: it copies them into a private copy when it starts (after
  reading their counters), every write and every staged chunk reads that copy, and once the engine has
  sent everything but the tails the push compares the live tensors with the copy byte for byte, then
  reads the counters again. What a destination takes is exactly the copy, and every byte of it was in
  the tensor both when the copy read it and when the compare read it, with no in-place op returning on
  the tensor in between; a write in that interval (an op running on another thread, a write through
  ``.data`` or a numpy view) fails the push. Not seen: an op that was already part-way through when the
  copy read the bytes it had written, and that writes nothing more the compare would see before the
  check (a writer thread descheduled for the whole push): its partial result is in memory throughout
  and is what the push publishes. No check of the memory can tell that apart from bytes meant to be
  there.
* GPU memory: no copy (it would double the model's footprint). Torch moves the counter when an op is
  *queued*, before its kernel runs, and the push reads only once the caller's current stream has reached
  ``push_async`` (an event); the engine has finished reading the live tensors before the check, and
  the tails come from the copy. So any in-place op queued after the counters were read and before the
  check is seen, and one queued after the check cannot change what is sent. Not seen: kernels queued
  before ``push_async`` on another stream than the caller's current one (still running when the push
  reads), an op whose thread stalls between queuing its kernel and moving the counter, and writes that
  bypass the counter (``.data``, another process).

For a DTensor the counter watched is its own as well as its local shard's.
"""

from __future__ import annotations

import queue
import threading
import time
import weakref
from dataclasses import dataclass
from typing import Any, Protocol

from weightsync.errors import TimeoutError, WeightSyncError  # noqa: A004
from weightsync.runtime.push_stats import PushStats

# wait() without a timeout: the push's own timeout plus this. A push ends by its deadline; after it come
# only bounded steps (reporting failures to the coordinator), so the slack is never the binding limit.
WAIT_SLACK_S = 30.0
# Source.close(): how long it lets a push that already told destinations the version is complete finish
# (its acks), and how long it waits for a cancelled push's thread to return once the engine is closed.
CLOSE_WAIT_S = 10.0


def _words(t: Any) -> Any:
    """A flat torch view of a contiguous host tensor (torch or numpy) as integers of its bytes, widest
    first: compared with ``torch.equal`` it is a byte compare (floats would compare values: NaN is not
    equal to itself, -0.0 is equal to 0.0)."""
    import numpy as np
    import torch

    flat = torch.from_numpy(np.ascontiguousarray(t).reshape(-1).view(np.uint8)) if isinstance(t, np.ndarray) \
        else t.detach().reshape(-1).view(torch.uint8)
    if flat.numel() % 8 == 0:
        try:
            return flat.view(torch.int64)
        except RuntimeError:  # a storage offset that is not a multiple of 8
            pass
    return flat


def _on_host(t: Any) -> bool:
    import numpy as np
    import torch

    return isinstance(t, np.ndarray) or (isinstance(t, torch.Tensor) and t.device.type == "cpu")


class HostCopy:
    """The private copy a push sends a source's host-memory tensors from (see the module doc): ``take``
    refreshes it from the live tensors when a push starts; ``changed`` says which keys' live bytes no
    longer equal it. ``tensors`` maps each host key to its copy, which the engine registers and every
    write and staged chunk of the source reads instead of the live tensor."""

    def __init__(self, live: dict[str, Any]) -> None:
        import numpy as np

        self.keys = [k for k, t in live.items() if _on_host(t)]
        self.tensors: dict[str, Any] = {}
        for k in self.keys:
            t = live[k]
            self.tensors[k] = np.array(t, copy=True) if isinstance(t, np.ndarray) else t.detach().clone()
        self._live = [_words(live[k]) for k in self.keys]
        self._copies = [_words(self.tensors[k]) for k in self.keys]

    @property
    def nbytes(self) -> int:
        return sum(c.numel() * c.element_size() for c in self._copies)

    def take(self) -> None:
        """Copies every live host tensor into its copy."""
        for live, copy in zip(self._live, self._copies, strict=True):
            copy.copy_(live)

    def changed(self) -> list[str]:
        """Keys whose live bytes differ from their copy now."""
        import torch

        return [k for k, live, copy in zip(self.keys, self._live, self._copies, strict=True)
                if not torch.equal(live, copy)]


@dataclass(frozen=True)
class Watched:
    """The tensors a push watches and the key each stands for (``keys[i]`` for ``tensors[i]``): two
    plain lists, so a push reads the counters with one list comprehension and keeps them as ints; and
    the copy of the host tensors (``host``), which the push sends instead of them."""

    keys: list[str]
    tensors: list[Any]
    host: HostCopy

    def versions(self) -> list[int]:
        """Every watched tensor's version counter now, in order."""
        return [t._version for t in self.tensors]

    def sent(self, live: dict[str, Any]) -> dict[str, Any]:
        """What the engine reads for each key: the private copy of a host tensor, else the live tensor."""
        return {k: self.host.tensors.get(k, t) for k, t in live.items()}


def watched_tensors(tensors: dict[str, Any], locals_: dict[str, Any]) -> Watched:
    """The torch tensors whose version counters say whether ``key``'s bytes changed: the object the
    user gave (a tensor, Parameter or DTensor: a DTensor's in-place ops bump its own counter, not the
    local shard's) and the local tensor registered with the engine, where that is another tensor.
    Tensors without a counter (inference-mode tensors, numpy arrays) are left out of the counters; the
    host ones among ``locals_`` (the live local tensors) get a private copy all the same."""
    import torch

    out: list[tuple[str, Any]] = []
    for key, value in tensors.items():
        local = locals_[key]
        inner = getattr(value, "local_tensor", None)  # Sharded, Fused, Placed: the user's tensor
        kept: list[Any] = []  # this key's tensors so far (the user's and the local one may be one object)
        for t in (value if inner is None else inner, local):
            if not isinstance(t, torch.Tensor) or any(t is seen for seen in kept):
                continue
            try:
                t._version  # noqa: B018 - raises for inference tensors, which keep no counter
            except RuntimeError:
                continue
            kept.append(t)
            out.append((key, t))
    return Watched([k for k, _ in out], [t for _, t in out], HostCopy(locals_))


class PushingSource(Protocol):
    """What a handle needs of its source (weightsync.runtime.source.Source, which imports this module):
    its name for messages, the tensors it watches, and the push itself."""

    group: str
    rank: int
    _watched: Watched

    def _run_push(self, h: PushHandle) -> PushStats: ...


class PushHandle:
    """One push of a source, started by ``ws.push_async`` (or by ``ws.push``, which waits for it).

    ``done()`` says whether it has ended; ``wait(timeout)`` returns its ``PushStats`` or raises what the
    push raised (the same errors as ``ws.push``: ``ws.TimeoutError`` when no destination confirmed,
    ``ws.WeightSyncError`` for a refused version, a changed tensor or a cancelled push; destinations
    that failed are in ``PushStats.failed_destinations``). Waiting again gives the same answer.
    """

    def __init__(self, src: PushingSource, version: int, timeout: float, background: bool) -> None:
        self.version = version
        self.timeout = timeout
        self.background = background
        self.started = time.monotonic()
        self._src = src
        # The counters as ints: a tuple per tensor, kept until the next push, was enough at Qwen3-30B-A3B's
        # 18,867 tensors to set off a full garbage collection every few pushes (115-140 ms on the CPU VM,
        # inside the push).
        self._watched: Watched = src._watched
        self._versions = self._watched.versions()
        self._ready: Any = None  # the caller's stream event (CUDA, background): what the push waits for
        self._finished = threading.Event()
        self._stats: PushStats | None = None
        self._error: BaseException | None = None
        self._observed = False  # wait() has returned or raised once
        self._lock = threading.Lock()
        self._cancelled: str | None = None
        self._committed = False

    def __repr__(self) -> str:
        state = "done" if self.done() else "in flight"
        return (f"PushHandle(group={self._src.group!r}, source={self._src.rank}, version={self.version}, "
                f"{state})")

    # -- what the trainer calls ---------------------------------------------------------------------
    def done(self) -> bool:
        """Whether the push has ended (completed, failed or cancelled): ``wait`` would not block."""
        return self._finished.is_set()

    def wait(self, timeout: float | None = None) -> PushStats:
        """Blocks until the push has ended and returns its ``PushStats``, or raises its error.

        ``timeout`` None: the push's own timeout (counted from its start) plus a slack. If it has not
        ended by then, raises ``ws.TimeoutError``; the push goes on and can be waited for again."""
        if timeout is None:
            limit = self.timeout + WAIT_SLACK_S - (time.monotonic() - self.started)
        else:
            limit = timeout
        if not self._finished.wait(max(limit, 0.0)):
            raise TimeoutError(f"group {self._src.group!r}: push of version {self.version} from source "
                               f"{self._src.rank} still in flight after waiting {max(limit, 0.0):.3g} s "
                               "(it goes on: wait again)")
        self._observed = True
        if self._error is not None:
            raise self._error
        assert self._stats is not None
        return self._stats

    # -- what the push and Source.close call ----------------------------------------------------------
    def changed(self) -> list[str]:
        """Keys of the tensors that changed since the push started: host tensors whose bytes differ from
        the copy the push sends, then (read after that compare) watched tensors whose version counter
        moved."""
        differ = self._watched.host.changed()
        now = self._watched.versions()
        if now == self._versions:  # one comparison in C: the usual answer
            return differ
        keys = self._watched.keys
        return sorted({*differ, *(key for key, v, w in zip(keys, self._versions, now, strict=True)
                                  if v != w)})

    def check_cancelled(self) -> None:
        if self._cancelled is not None:
            raise WeightSyncError(self._cancelled)

    def commit(self) -> None:
        """Called by the push right before it posts the tails (from then on destinations may complete
        the version): raises if the push was cancelled first."""
        with self._lock:
            self.check_cancelled()
            self._committed = True

    def cancel(self, why: str) -> bool:
        """Cancels the push unless it has committed; True if it is cancelled (no destination will be
        told the version is complete)."""
        with self._lock:
            if self._committed:
                return False
            self._cancelled = (f"group {self._src.group!r}: push of version {self.version} from source "
                               f"{self._src.rank} cancelled: {why} (no destination takes this version)")
            return True

    def run(self) -> None:
        """Runs the push (in the caller's thread, or in the push's own thread) and records its end."""
        try:
            # The copy the push sends its host tensors from, taken after the counters were read (__init__).
            self._watched.host.take()
            self._stats = self._src._run_push(self)
        except BaseException as exc:  # kept for wait(), which raises it in the trainer's thread
            if self._cancelled is not None and str(exc) != self._cancelled:
                cancelled = WeightSyncError(self._cancelled)
                cancelled.__cause__ = exc
                exc = cancelled
            self._error = exc
        finally:
            self._finished.set()

    def start(self, worker: PushWorker | None = None) -> None:
        """Runs the push now (``background`` False) or hands it to the source's push thread."""
        if not self.background:
            self.run()
            return
        assert worker is not None
        worker.submit(self)

    def join(self, timeout: float) -> bool:
        """Waits for the push to end without observing its result; True if it has."""
        return self._finished.wait(max(timeout, 0.0))


class PushWorker:
    """The thread a source's background pushes run in, one after another, for the source's life.

    Started once rather than per push: ``threading.Thread.start`` waits until the new thread runs, and a
    new push thread goes straight into the push's Python work, so the trainer's thread waited for the GIL
    inside ``push_async`` (up to the switch interval, 5 ms) before it could queue the next forward on an
    idle GPU. Handing a push to a waiting thread only wakes it: the caller keeps the GIL and goes on
    queueing kernels, and the push thread takes its turns while the GPU has work queued.

    The thread holds a push (whose handle refers to its source) only while it runs it: waiting for the
    next one it refers to nothing of the source's, so a source dropped without ``close()`` is collected
    once its last push has ended, and that ends the thread (``owner``'s finalizer)."""

    def __init__(self, name: str, owner: object) -> None:
        self._pushes: queue.SimpleQueue[PushHandle | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=_push_loop, args=(self._pushes,), name=name, daemon=True)
        self._thread.start()
        weakref.finalize(owner, self._pushes.put, None)

    def submit(self, h: PushHandle) -> None:
        self._pushes.put(h)

    def stop(self, timeout: float) -> bool:
        """Lets the thread end after the push it runs, if any; True if it has ended within ``timeout``."""
        self._pushes.put(None)
        self._thread.join(max(timeout, 0.0))
        return not self._thread.is_alive()


def _push_loop(pushes: queue.SimpleQueue[PushHandle | None]) -> None:
    """The push thread: runs each push handed to it until it is handed None. A function of the queue
    alone, and the handle let go before the next wait: the thread keeps nothing that refers to a source."""
    while True:
        h = pushes.get()
        if h is None:
            return
        h.run()
        del h
