"""What a participant sees when a coordinator call fails: weightsync errors, never Ray's wrappers (Ray's
RayTaskError already passes for the cause's class when the cause is a weightsync error; a Ray timeout
or another error inside the coordinator does not)."""

from __future__ import annotations

import time

import pytest

import weightsync as ws
from weightsync.control.client import ControlClient


def test_coordinator_refusals_and_failed_waits_are_weightsync_errors(ray_cluster) -> None:
    group = ws.Group.create("client-errors", num_sources=1, num_destinations=1)
    try:
        # A refusal raised inside the coordinator arrives as the weightsync error it is, not a RayTaskError.
        wrong = ControlClient("client-errors", "source", 0, secret="not-the-group-secret-0123456789")
        with pytest.raises(ws.WeightSyncError, match="current_epoch refused: wrong secret"):
            wrong.current_epoch(30.0)
        with pytest.raises(ws.WeightSyncError, match="publish_receive refused: wrong secret"):
            wrong.publish_receive(0, b"x", 30.0)

        # A wait the coordinator gives up on is a weightsync error naming what was missing.
        client = ControlClient("client-errors", "source", 0, secret=group.secret)
        assert client.current_epoch(30.0) == group.status()["epoch"]
        with pytest.raises(ws.WeightSyncError, match=r"source ranks \[3\] published no receive buffer"):
            client.receive_buffers(0, [3], time.monotonic() + 0.3)
        # A bug inside the coordinator (here: a bad argument) is a weightsync error saying what was asked,
        # not Ray's RayTaskError(TypeError).
        with pytest.raises(ws.WeightSyncError, match="the receive buffers of source ranks None failed in the "
                                                     "coordinator: TypeError"):
            client.receive_buffers(0, None, time.monotonic() + 0.3)  # type: ignore[arg-type]
        # No answer in time: weightsync's TimeoutError, not Ray's GetTimeoutError.
        with pytest.raises(ws.TimeoutError, match="did not answer the plan epoch within 0 s"):
            client.current_epoch(0.0)
    finally:
        group.shutdown()
    # The coordinator gone (its actor ends asynchronously: an answer may still come for a while): a
    # weightsync error naming the group.
    deadline = time.monotonic() + 30
    while True:
        try:
            client.current_epoch(30.0)
        except ws.WeightSyncError as exc:
            assert "client-errors" in str(exc) and "coordinator is gone" in str(exc), exc
            break
        assert time.monotonic() < deadline, "the coordinator still answers 30 s after the shutdown"
        time.sleep(0.1)
