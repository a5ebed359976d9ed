"""A destination dropped by the coordinator learns it from its membership long-poll (``wait_member``) and
joins again (``join(..., rejoin=True)``); a rank another process took over is not taken back. The
coordinator alone, no Ray (the Ray side: tests/faults/test_group_faults.py, re-admission)."""

from __future__ import annotations

import threading
import time

import pytest
import torch

import weightsync as ws
from weightsync.control.admission import Proof, admission_key, prove
from weightsync.control.coordinator import DESTINATION, SOURCE, Coordinator
from weightsync.control.watcher import DROPPED, MEMBER, SUPERSEDED
from weightsync.runtime.describe import describe_tensors


def _p(method: str) -> Proof:
    """A fresh proof of the secret "s" of group "unit" for one call of ``method``."""
    return prove(admission_key("s", "unit"), "unit", method)

_LAYOUT = describe_tensors({"w": torch.zeros(4, 4)}).to_msgpack()
_ENGINE = {"nics": 1, "stripe_threshold": 1 << 20, "max_piece": 1 << 20}


def _join(c: Coordinator, role: str, rank: int, address: bytes, rejoin: bool = False) -> int:
    return c.join(_p("join"), role, rank, _LAYOUT, address, "host", _ENGINE, {"w": [b"d", b"d"]}, b"mbox",
                  rejoin)


def test_a_dropped_destination_hears_it_and_joins_again() -> None:
    c = Coordinator("unit", 1, 2, "s")
    _join(c, SOURCE, 0, b"src")
    _join(c, DESTINATION, 0, b"d0")
    _join(c, DESTINATION, 1, b"d1")
    assert c.epoch == 1
    # A member: the poll waits its whole timeout, then says so.
    t = time.monotonic()
    assert c.wait_member(_p("wait_member"), DESTINATION, 1, b"d1", MEMBER, 0.3) == (MEMBER, 1)
    assert time.monotonic() - t >= 0.3
    with pytest.raises(ws.WeightSyncError, match="wrong secret"):
        c.wait_member("not the secret", DESTINATION, 1, b"d1", MEMBER, 0.1)

    # Reported dead: a poll in flight is answered at once, with the re-plan's epoch.
    got: list[tuple[str, int]] = []
    poll = threading.Thread(
        target=lambda: got.append(c.wait_member(_p("wait_member"), DESTINATION, 1, b"d1", MEMBER, 10.0)))
    poll.start()
    time.sleep(0.2)
    t = time.monotonic()
    assert c.report_dead(_p("report_dead"), "source 0", DESTINATION, [1], 1) == 2
    poll.join(2)
    assert got == [(DROPPED, 2)] and time.monotonic() - t < 1.0
    assert c.status(_p("status"))["destinations"] == [0]
    # Dropped stays dropped (a poll that knows it waits), until the same process joins again.
    assert c.wait_member(_p("wait_member"), DESTINATION, 1, b"d1", DROPPED, 0.1) == (DROPPED, 2)
    assert _join(c, DESTINATION, 1, b"d1", rejoin=True) == 2
    assert c.epoch == 3 and c.status(_p("status"))["destinations"] == [0, 1]
    assert c.wait_member(_p("wait_member"), DESTINATION, 1, b"d1", DROPPED, 5.0) == (MEMBER, 3)
    # A report about the epoch before its new join is about the old membership: it stays.
    c.report_dead(_p("report_dead"), "source 0", DESTINATION, [1], 2)
    assert c.status(_p("status"))["destinations"] == [0, 1]


def test_a_rank_taken_over_is_not_taken_back() -> None:
    c = Coordinator("unit", 1, 1, "s")
    _join(c, SOURCE, 0, b"src")
    _join(c, DESTINATION, 0, b"old")
    c.report_dead(_p("report_dead"), "source 0", DESTINATION, [0], c.epoch)
    _join(c, DESTINATION, 0, b"new")  # a replacement process joined under rank 0
    assert c.wait_member(_p("wait_member"), DESTINATION, 0, b"old", MEMBER, 1.0)[0] == SUPERSEDED
    assert c.wait_member(_p("wait_member"), DESTINATION, 0, b"new", MEMBER, 0.0)[0] == MEMBER
    epoch = c.epoch
    with pytest.raises(ws.WeightSyncError, match="another process joined under rank 0"):
        _join(c, DESTINATION, 0, b"old", rejoin=True)
    assert c.epoch == epoch
    assert c.wait_member(_p("wait_member"), DESTINATION, 0, b"new", MEMBER, 0.0)[0] == MEMBER
