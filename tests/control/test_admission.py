"""What a member presents to the coordinator: a proof of the secret bound to one call, which the
coordinator takes once, and nothing from which the secret or the engines' key follows."""

from __future__ import annotations

import time

import pytest

import weightsync as ws
from weightsync.control.admission import PROOF_WINDOW_S, admission_key, prove
from weightsync.control.coordinator import Coordinator
from weightsync.control.engine_key import engine_key

SECRET = "0123456789abcdef0123456789abcdef"


def test_a_proof_works_once_for_its_method_and_group_only() -> None:
    c = Coordinator("unit", 1, 1, SECRET)
    key = admission_key(SECRET, "unit")
    proof = prove(key, "unit", "status")
    assert c.status(proof)["name"] == "unit"
    with pytest.raises(ws.WeightSyncError, match="status refused: a proof presented before"):
        c.status(proof)
    with pytest.raises(ws.WeightSyncError, match="current_epoch refused: wrong secret"):
        c.current_epoch(prove(key, "unit", "status"))  # made for another method
    with pytest.raises(ws.WeightSyncError, match="status refused: wrong secret"):
        c.status(prove(admission_key(SECRET, "other"), "other", "status"))  # another group's
    with pytest.raises(ws.WeightSyncError, match="status refused: wrong secret"):
        c.status(SECRET)  # the secret itself is no proof
    assert c.status(prove(key, "unit", "status"))["rejected"] == {"status": 3, "current_epoch": 1}


def test_a_proof_from_outside_the_time_window_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    c = Coordinator("unit", 1, 1, SECRET)
    key = admission_key(SECRET, "unit")
    now = time.time()
    monkeypatch.setattr(time, "time", lambda: now - PROOF_WINDOW_S - 5)
    old = prove(key, "unit", "status")
    monkeypatch.setattr(time, "time", lambda: now)
    with pytest.raises(ws.WeightSyncError, match="status refused: a proof made"):
        c.status(old)


def test_the_coordinator_holds_neither_the_secret_nor_the_engine_key() -> None:
    key = admission_key(SECRET, "unit")
    c = Coordinator("unit", 1, 1, None, admission_key=key)
    held = repr(vars(c)) + repr(vars(c._proofs))
    assert SECRET not in held
    assert engine_key(SECRET, "unit") not in key
    assert engine_key(SECRET, "unit").hex() not in held and repr(engine_key(SECRET, "unit")) not in held
