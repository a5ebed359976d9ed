"""A source's epoch watcher: a thread long-polling the coordinator so that a push knows the plan epoch
without a Ray round trip on its path."""

from __future__ import annotations

import atexit
import logging
import secrets
import threading
import time
from typing import Any

from weightsync.errors import TimeoutError  # noqa: A004

log = logging.getLogger("weightsync")


class EpochWatcher:
    """A source's thread that keeps the coordinator's plan epoch at hand, so that a push does not ask for
    it (a Ray round trip, 1.3-1.6 ms of a 45 ms push on a 4-GPU host, on every push's critical path).

    It loops on the coordinator's long-poll ``wait_epoch``: the call returns as soon as the epoch moves
    past the one this watcher holds, or after ``POLL_S`` with the current one. ``epoch()`` is the newest
    epoch heard, or None when the watcher cannot vouch for it (no answer yet, the coordinator unreachable
    or silent for longer than a poll, the thread gone): the push then asks the coordinator itself.

    The thread never blocks inside Ray: a Ray call made after ``ray.shutdown()`` ends the process (the
    core worker exits it), so the answer is awaited as a Python future that Ray's own thread completes,
    and Ray is entered only for the moment it takes to submit the next call (once per answer), after
    checking that Ray is still up (checked once a second while waiting, too: after a shutdown the answer
    never comes). A watcher that finds Ray shut down stops. ``stop()`` wakes the thread at once; it is
    registered with atexit when the watcher starts, after ``import ray``, so at interpreter exit it runs
    before Ray's own shutdown hook (atexit runs last-registered first).
    """

    POLL_S = 10.0  # the coordinator answers at least this often: silence beyond it means trouble
    GRACE_S = 5.0  # a Ray round trip under load, on top of POLL_S
    RETRY_S = 1.0  # after a failed call; doubled per failure up to POLL_S (a group shut down stays so)

    def __init__(self, coord: Any, secret: str, group: str, rank: int) -> None:
        self._coord = coord
        self._secret = secret
        self._group = group
        self._rank = rank
        self.token = secrets.token_hex(8)
        # (epoch, monotonic time heard) as one attribute: push() reads both without a lock
        self._heard: tuple[int, float] | None = None
        self._stop = threading.Event()
        self._wake = threading.Event()  # the current call's: its answer arrived, or stop()
        self._thread = threading.Thread(target=self._run, name=f"weightsync-{group}-src{rank}-epoch",
                                        daemon=True)
        atexit.register(self.stop)
        self._thread.start()

    def epoch(self) -> int | None:
        """The newest plan epoch heard, or None when the watcher cannot vouch for it."""
        heard = self._heard
        if heard is None or not self._thread.is_alive():
            return None
        epoch, at = heard
        if time.monotonic() - at > self.POLL_S + self.GRACE_S:
            return None
        return epoch

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def _run(self) -> None:
        import ray

        log_ = logging.LoggerAdapter(log, {"group": self._group})
        after = -1  # the first call answers at once: the watcher is of use from the first push on
        retry = 0.0
        while not self._stop.is_set():
            if not ray.is_initialized():
                break  # Ray was shut down under this thread; calling it would start a new local Ray
            # One event per call: an abandoned call's late answer must not wake the next wait.
            wake = self._wake = threading.Event()
            if self._stop.is_set():
                break
            try:
                future = self._coord.wait_epoch.remote(self._secret, self._rank, self.token, after,
                                                       self.POLL_S).future()
                future.add_done_callback(lambda _, wake=wake: wake.set())
                sent = time.monotonic()
                # Woken by the answer or stop(); once a second, to notice Ray shut down under it (its
                # callbacks then never come).
                while not wake.wait(1.0) and ray.is_initialized():
                    if time.monotonic() - sent > self.POLL_S + self.GRACE_S:
                        raise TimeoutError(f"no answer within {self.POLL_S + self.GRACE_S} s")
                if self._stop.is_set() or not ray.is_initialized():
                    break
                epoch = int(future.result(timeout=0))
            except Exception as exc:  # the coordinator unreachable or gone: pushes ask it themselves
                self._heard = None
                if not retry and not self._stop.is_set():
                    log_.warning("source %d: epoch watcher: %s; pushes ask the coordinator until it answers",
                                 self._rank, exc)
                retry = min(retry * 2 or self.RETRY_S, self.POLL_S)
                self._stop.wait(retry)
                continue
            if retry:
                log_.info("source %d: epoch watcher answered again", self._rank)
                retry = 0.0
            after = max(after, epoch)
            # Set before the next call: a call with ``after`` tells the coordinator this epoch is held here.
            self._heard = (after, time.monotonic())
        self._heard = None

    def stop(self, timeout: float = 2.0) -> None:
        """Stops the thread (at once: it waits on an event this sets) and tells the coordinator."""
        first = not self._stop.is_set()
        self._stop.set()
        self._wake.set()
        atexit.unregister(self.stop)
        if self._thread is not threading.current_thread():
            self._thread.join(timeout)
        self._heard = None
        if first:
            try:
                import ray

                if ray.is_initialized():
                    self._coord.unwatch.remote(self._secret, self._rank, self.token)
            except Exception:  # best effort: the coordinator forgets a silent watcher after its poll anyway
                pass
