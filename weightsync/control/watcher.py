"""Long-poll threads of the control plane: a source's epoch watcher, so that a push knows the plan epoch
without a Ray round trip on its path, and a destination's membership watcher, so that a destination the
coordinator dropped (reported failed while it was stopped or cut off) learns it and joins again."""

from __future__ import annotations

import atexit
import logging
import secrets
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

from weightsync.errors import TimeoutError  # noqa: A004

log = logging.getLogger("weightsync")

# What a participant is to the coordinator (Coordinator.wait_member): a member of the current plan (this
# very process: its engine address), dropped (reported dead, not joined since), or superseded (another
# process joined under its rank).
MEMBER, DROPPED, SUPERSEDED = "member", "dropped", "superseded"


class _LongPoll:
    """A daemon thread that keeps one long-poll call to the coordinator open: ``_submit`` makes the call
    (it answers as soon as what it watches changes, or after ``POLL_S``), ``_take`` keeps the answer,
    ``_lost`` is told when no answer came.

    The thread never blocks inside Ray: a Ray call made after ``ray.shutdown()`` ends the process (the
    core worker exits it), so the answer is awaited as a Python future that Ray's own thread completes,
    and Ray is entered only for the moment it takes to submit the next call (once per answer), after
    checking that Ray is still up (checked once a second while waiting, too: after a shutdown the answer
    never comes). A watcher that finds Ray shut down stops. ``stop()`` wakes the thread at once; it is
    registered with atexit when the watcher starts, after ``import ray``, so at interpreter exit it runs
    before Ray's own shutdown hook (atexit runs last-registered first).
    """

    KIND = "long-poll"  # what it watches, for log lines
    POLL_S = 10.0  # the coordinator answers at least this often: silence beyond it means trouble
    GRACE_S = 5.0  # a Ray round trip under load, on top of POLL_S
    RETRY_S = 1.0  # after a failed call; doubled per failure up to POLL_S (a group shut down stays so)

    def __init__(self, coord: Any, prove: Callable[[str], Any], group: str, what: str,
                 thread_name: str) -> None:
        self._coord = coord
        self._prove = prove  # method -> a fresh proof of the group's secret for one call of it
        self._group = group
        self._what = what  # "source 3": who watches, for log lines
        self.token = secrets.token_hex(8)
        self._stop = threading.Event()
        self._wake = threading.Event()  # the current call's: its answer arrived, or stop()
        self._thread = threading.Thread(target=self._run, name=thread_name, daemon=True)

    def _start(self) -> None:
        atexit.register(self.stop)
        self._thread.start()

    def _submit(self) -> Any:
        raise NotImplementedError

    def _take(self, answer: Any) -> None:
        raise NotImplementedError

    def _lost(self) -> None:
        pass

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def _run(self) -> None:
        import ray

        log_ = logging.LoggerAdapter(log, {"group": self._group})
        retry = 0.0
        while not self._stop.is_set():
            if not ray.is_initialized():
                break  # Ray was shut down under this thread; calling it would start a new local Ray
            # One event per call: an abandoned call's late answer must not wake the next wait.
            wake = self._wake = threading.Event()
            if self._stop.is_set():
                break
            try:
                future = self._submit().future()
                future.add_done_callback(lambda _, wake=wake: wake.set())
                sent = time.monotonic()
                # Woken by the answer or stop(); once a second, to notice Ray shut down under it (its
                # callbacks then never come).
                while not wake.wait(1.0) and ray.is_initialized() and not future.done():
                    if time.monotonic() - sent > self.POLL_S + self.GRACE_S:
                        raise TimeoutError(f"no answer within {self.POLL_S + self.GRACE_S} s")
                if self._stop.is_set() or not ray.is_initialized():
                    break
                answer = future.result(timeout=0)
            except Exception as exc:  # the coordinator unreachable or gone: say so, try again later
                self._lost()
                if not retry and not self._stop.is_set():
                    log_.warning("%s: %s watcher: %s; trying again", self._what, self.KIND, exc)
                retry = min(retry * 2 or self.RETRY_S, self.POLL_S)
                self._stop.wait(retry)
                continue
            if retry:
                log_.info("%s: %s watcher answered again", self._what, self.KIND)
                retry = 0.0
            self._take(answer)
        self._lost()

    def stop(self, timeout: float = 2.0) -> None:
        """Stops the thread (at once: it waits on an event this sets)."""
        self._stop.set()
        self._wake.set()
        atexit.unregister(self.stop)
        if self._thread is not threading.current_thread():
            self._thread.join(timeout)
        self._lost()


class EpochWatcher(_LongPoll):
    """A source's thread that keeps the coordinator's plan epoch at hand, so that a push does not ask for
    it (a Ray round trip, 1.3-1.6 ms of a 45 ms push on a 4-GPU host, on every push's critical path).

    It loops on the coordinator's long-poll ``wait_epoch``: the call returns as soon as the epoch moves
    past the one this watcher holds, or after ``POLL_S`` with the current one. ``epoch()`` is the newest
    epoch heard, or None when the watcher cannot vouch for it (no answer yet, the coordinator unreachable
    or silent for longer than a poll, the thread gone): the push then asks the coordinator itself.
    """

    KIND = "epoch"

    def __init__(self, coord: Any, prove: Callable[[str], Any], group: str, rank: int) -> None:
        super().__init__(coord, prove, group, f"source {rank}", f"weightsync-{group}-src{rank}-epoch")
        self._rank = rank
        # (epoch, monotonic time heard) as one attribute: push() reads both without a lock
        self._heard: tuple[int, float] | None = None
        self._after = -1  # the first call answers at once: the watcher is of use from the first push on
        self._start()

    def epoch(self) -> int | None:
        """The newest plan epoch heard, or None when the watcher cannot vouch for it."""
        heard = self._heard
        if heard is None or not self._thread.is_alive():
            return None
        epoch, at = heard
        if time.monotonic() - at > self.POLL_S + self.GRACE_S:
            return None
        return epoch

    def _submit(self) -> Any:
        return self._coord.wait_epoch.remote(self._prove("wait_epoch"), self._rank, self.token, self._after,
                                             self.POLL_S)

    def _take(self, answer: Any) -> None:
        self._after = max(self._after, int(answer))
        # Set before the next call: a call with ``after`` tells the coordinator this epoch is held here.
        self._heard = (self._after, time.monotonic())

    def _lost(self) -> None:
        self._heard = None

    def stop(self, timeout: float = 2.0) -> None:
        """Stops the thread (at once: it waits on an event this sets) and tells the coordinator."""
        first = not self._stop.is_set()
        super().stop(timeout)
        if first:
            try:
                import ray

                if ray.is_initialized():
                    self._coord.unwatch.remote(self._prove("unwatch"), self._rank, self.token)
            except Exception:  # best effort: the coordinator forgets a silent watcher after its poll anyway
                pass


class MembershipWatcher(_LongPoll):
    """A destination's thread that learns when the coordinator stops counting it as a member: it was
    reported failed (stopped past the push timeout, its link cut) and dropped from the plan, or another
    process joined under its rank. The destination cannot learn this from its peers: a plan without it
    sends it nothing, not even announces.

    It loops on ``wait_member`` with the state it last heard (the call answers as soon as the state
    differs, or after ``POLL_S``) and hands every answer to ``on_answer(state, epoch)`` (held weakly: a
    destination collected without ``close()`` is not kept alive by its watcher)."""

    KIND = "membership"

    def __init__(self, coord: Any, prove: Callable[[str], Any], group: str, role: str, rank: int,
                 address: bytes, on_answer: Callable[[str, int], None]) -> None:
        super().__init__(coord, prove, group, f"{role} {rank}",
                         f"weightsync-{group}-{role[:3]}{rank}-member")
        self._role, self._rank, self._address = role, rank, address
        self._on_answer = weakref.WeakMethod(on_answer) if hasattr(on_answer, "__self__") else (
            lambda: on_answer)
        self.state = MEMBER  # joined before it starts
        self._start()

    def _submit(self) -> Any:
        return self._coord.wait_member.remote(self._prove("wait_member"), self._role, self._rank,
                                              self._address, self.state, self.POLL_S)

    def _take(self, answer: Any) -> None:
        state, epoch = str(answer[0]), int(answer[1])
        self.state = state
        callback = self._on_answer()
        if callback is None:  # its destination is gone
            self._stop.set()
            return
        callback(state, epoch)
