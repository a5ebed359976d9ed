"""Fixtures the engine tests share: an engine in this process and one in a child process, both over
tcp;ofi_rxm on loopback (the provider CI has everywhere). Both are fabric-only: on a GPU host transport
"auto" would also open a cuda lane (CUDA started in every test's child process), which nothing written
between these host buffers uses; tests/engine/test_cuda.py and test_landing.py cover the cuda lane."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.support.peer import PeerProcess
from weightsync.engine import TransferEngine


@pytest.fixture()
def engine() -> Iterator[TransferEngine]:
    """An engine here, with a short stall timeout so failure tests finish quickly."""
    eng = TransferEngine(transport="fabric", stall_timeout=2.0)
    yield eng
    eng.close()


@pytest.fixture()
def remote() -> Iterator[PeerProcess]:
    """An engine in a child process (``remote.address`` is its address); closed after the test."""
    peer = PeerProcess()
    peer.address = peer.call("engine", transport="fabric", stall_timeout=2.0)
    yield peer
    peer.close()
