"""A grant record is read only once the immediate of the write that placed it has arrived.

A destination answers an announce with a GRANT_RECORD written into each writer's grant slot (its sources,
and in a relay chain its predecessor). Nothing orders the bytes of that write as they are placed (EFA SRD
and multipath place packets out of order) nor a weakly ordered reader's loads (aarch64), so a slot can
show the new version beside fields of the record it replaces. Here every staged destination first places
such a torn record (the new version, but the shadow readers use, or a refusal) with no immediate, and only
later writes the real one with its immediate: sources and relay members must take the real one."""

from __future__ import annotations

import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
import torch

import weightsync as ws
from weightsync.runtime.destination import Destination
from weightsync.wire import GRANTED, REFUSED_BUSY, SLOT_BYTES, grant_slot

SHAPE = (48, 32)
SEEN_WITHOUT_IMMEDIATE_S = 0.3  # how long a torn record sits in the slots before the real grant


def _torn_first(field: str) -> Any:
    real_grant = Destination._grant

    def grant(self: Destination, version: int, shadow: int, status: int, ranks: list[int],
              held: int | None = None) -> None:
        if status == GRANTED:
            slot = self._grant_record(version, shadow, status, held)
            torn = self._grant_out[slot:slot + 1]
            if field == "shadow":  # the shadow that holds the complete version apply() copies from
                torn["shadow"] = 1 - shadow
            else:  # a refusal's status beside the new version
                torn["status"] = REFUSED_BUSY
            targets = [(self._sources[r], self.rank) for r in ranks if r in self._sources]
            if self._relay is not None and self._relay.predecessor is not None:
                targets.append((self._relay.predecessor, 0))
            for link, sender in targets:  # placed, and no immediate yet
                self.engine.write(self._outbox_region, slot * SLOT_BYTES, link.peer, link.mailbox,
                                  grant_slot(sender, version) * SLOT_BYTES, SLOT_BYTES).wait(10.0)
            time.sleep(SEEN_WITHOUT_IMMEDIATE_S)
        real_grant(self, version, shadow, status, ranks, held)

    return grant


def _weights(version: int) -> torch.Tensor:
    return torch.arange(SHAPE[0] * SHAPE[1], dtype=torch.float32).reshape(SHAPE) + 1000.0 * (version + 1)


class Pair:
    """One source holding the whole tensor, two staged destinations (relay: a chain of them)."""

    def __init__(self, name: str, relay: bool) -> None:
        self.group = ws.Group.create(name, num_sources=1, num_destinations=2, relay=relay)
        self.weights = _weights(-1)
        self.live = [torch.full(SHAPE, float("nan")) for _ in range(2)]
        with ThreadPoolExecutor(3) as ex:
            src = ex.submit(ws.Source, name, 0, {"w": self.weights}, timeout=60)
            dsts = [ex.submit(ws.Destination, name, j, {"w": t}, "staged", timeout=60, push_timeout=20)
                    for j, t in enumerate(self.live)]
            self.src = src.result(timeout=120)
            self.dsts = [f.result(timeout=120) for f in dsts]

    def close(self) -> None:
        for p in [self.src, *self.dsts]:
            p.close()
        self.group.shutdown()


@pytest.fixture
def pairs(ray_cluster) -> Iterator[list[Pair]]:
    made: list[Pair] = []
    yield made
    for p in made:
        p.close()


@pytest.mark.parametrize(("field", "relay"), [("shadow", False), ("status", False), ("shadow", True)])
def test_a_grant_placed_before_its_immediate_is_not_taken(pairs: list[Pair], monkeypatch, field: str,
                                                          relay: bool) -> None:
    monkeypatch.setattr(Destination, "_grant", _torn_first(field))
    pair = Pair(f"grant-imm-{field}-{'relay' if relay else 'direct'}", relay)
    pairs.append(pair)
    for version in range(3):
        pair.weights.copy_(_weights(version))
        stats = ws.push(pair.src, version, timeout=30)
        assert stats.failed_destinations == [], stats
        for j, d in enumerate(pair.dsts):
            assert d.wait(version, timeout=30) == version
            assert d.apply() == version
            assert torch.equal(pair.live[j], _weights(version)), f"destination {j} at version {version}"
