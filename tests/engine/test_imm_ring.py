"""The shared-memory immediate ring of the cuda lane, between real processes (no GPU needed)."""

from __future__ import annotations

import multiprocessing as mp
import os
import time

from weightsync._ext import ImmRing


def _producer(pid: int, fd: int, start: int, count: int) -> None:
    ring = ImmRing.open(pid, fd)
    for i in range(start, start + count):
        while not ring.push(i):  # full: the consumer drains it
            time.sleep(0.0001)


def test_ring_carries_every_immediate_from_several_processes() -> None:
    ring = ImmRing.create()
    per, producers = 50_000, 3
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_producer, args=(os.getpid(), ring.fd, k * per, per))
             for k in range(producers)]
    for p in procs:
        p.start()
    seen: list[int] = []
    deadline = time.monotonic() + 60
    while len(seen) < per * producers and time.monotonic() < deadline:
        imm = ring.pop()
        if imm is None:
            ring.sleep(1000)  # woken by the producers' pushes
        else:
            seen.append(imm)
    for p in procs:
        p.join(10)
    assert sorted(seen) == list(range(per * producers))
    assert ring.pop() is None


def test_open_of_a_missing_ring_is_an_error() -> None:
    import pytest

    import weightsync as ws

    with pytest.raises(ws.TransportError, match="cannot open the immediate ring"):
        ImmRing.open(os.getpid(), 987654)


def test_a_wake_after_the_ticket_ends_the_sleep_at_once() -> None:
    # The worker takes a ticket before it looks for work; a wake in between (a write submitted after the
    # look, before the sleep) must end the sleep at once. Taking the bell inside the sleep lost it: the
    # worker slept out its timeout with the write queued.
    ring = ImmRing.create()
    ticket = ring.ticket()
    ring.wake()
    t0 = time.monotonic()
    ring.sleep(5_000_000, ticket)
    assert time.monotonic() - t0 < 1.0
    # no wake since the ticket: the sleep lasts its timeout
    t0 = time.monotonic()
    ring.sleep(100_000, ring.ticket())
    assert time.monotonic() - t0 >= 0.09
    # a wake before a sleep without a ticket is the sleep's own business: it takes the bell as it is
    ring.wake()
    t0 = time.monotonic()
    ring.sleep(100_000)
    assert time.monotonic() - t0 >= 0.09
