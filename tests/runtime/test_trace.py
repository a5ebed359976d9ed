"""weightsync.runtime.trace: host-clock marks, recorded only while on."""

from __future__ import annotations

import threading
import time

from weightsync.runtime import trace


def test_marks_only_while_on_in_order_and_taken_once() -> None:
    trace.enable(False)
    trace.take()
    trace.mark("off %d", 1)
    assert trace.take() == []
    trace.enable()
    try:
        before = time.time_ns()
        trace.mark("part %d posted to %s", 3, [1, 2])
        threads = [threading.Thread(target=trace.mark, args=("thread %d", i)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        trace.mark("plain % sign kept")  # no arguments: the label as it is
        got = trace.take()
    finally:
        trace.enable(False)
    assert got[0][1] == "part 3 posted to [1, 2]"
    assert sorted(label for _, label in got[1:5]) == [f"thread {i}" for i in range(4)]
    assert got[-1][1] == "plain % sign kept"
    times = [t for t, _ in got]
    assert times == sorted(times) and times[0] >= before
    assert trace.take() == []
