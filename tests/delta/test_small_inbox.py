"""A destination whose delta inbox cannot hold even a source's entry tables (``delta_bytes=64``) next to a
healthy one, on CPU over TCP loopback (issue 41, item 4). The tiny inbox must cost only its own
deltas: every version reaches both destinations byte for byte (the tiny one's as planned writes), no
push fails, nobody is dropped. In a relay chain every member takes the same entries, so the chain's
share is its smallest member's: a source whose entries do not fit it sends the chain every write as
planned."""

from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

import weightsync as ws
from tests.delta.test_push import CASES, Team, step

SHAPES = {"emb": (256, 64), "w1": (96, 40), "w2": (40, 96), "norm": (64,)}
DTYPES = {"emb": torch.bfloat16, "w2": torch.bfloat16}
HEALTHY, TINY = 0, 1
PUSHES = 4


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int16 if t.element_size() == 2 else torch.int32)


def changed(full: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    """``full`` with ~5% of each tensor's elements set to new random values."""
    g = torch.Generator().manual_seed(seed)
    out = {k: v.clone() for k, v in full.items()}
    for t in out.values():
        flat = t.view(-1)
        pos = torch.randperm(flat.numel(), generator=g)[:max(1, flat.numel() // 20)]
        flat[pos] = torch.randn(len(pos), generator=g).to(t.dtype)
    return out


@pytest.mark.parametrize("relay", [None, False])
def test_a_tiny_inbox_costs_only_its_own_deltas(ray_cluster, relay: bool | None,
                                                caplog: pytest.LogCaptureFixture) -> None:
    name = f"tiny-inbox-{relay}"
    group = ws.Group.create(name, num_sources=1, num_destinations=1, relay=relay)
    g = torch.Generator().manual_seed(3)
    full = {k: torch.randn(s, generator=g).to(DTYPES.get(k, torch.float32)) for k, s in SHAPES.items()}
    local = {k: v.clone() for k, v in full.items()}
    poisoned = [{k: torch.full_like(v, float("nan")) for k, v in full.items()} for _ in range(2)]
    with ThreadPoolExecutor(2) as ex:
        src_f = ex.submit(ws.Source, name, 0, local, timeout=60, delta=True)
        healthy = ws.Destination(name, HEALTHY, poisoned[HEALTHY], "inplace", timeout=60, push_timeout=8,
                                 delta_bytes=1 << 20)
        src = src_f.result(timeout=120)
    dsts = [healthy]
    try:
        caplog.set_level(logging.WARNING, logger="weightsync")
        got: dict[int, list[int]] = {HEALTHY: [], TINY: []}
        errors: list[str] = []
        for version in range(PUSHES + 1):
            if version:
                full = changed(full, seed=version)
                for k, t in local.items():
                    t.copy_(full[k])
            try:
                stats = src.push(version, timeout=10)
            except (ws.WeightSyncError, TimeoutError) as exc:  # recorded: the figures below say what it cost
                errors.append(f"version {version}: {exc}")
                stats = None
            if stats is not None and stats.failed_destinations:
                errors.append(f"version {version}: failed {stats.failed_destinations}")
            for j, d in enumerate(dsts):
                try:
                    if d.wait(version, timeout=5) != version:
                        continue
                except ws.TimeoutError:
                    continue
                if d.mode == "staged":
                    d.apply()
                if all(torch.equal(bits(poisoned[j][k]), bits(t)) for k, t in full.items()):
                    got[j].append(version)
            if version and stats is not None:
                # the healthy destination takes deltas unless it shares a chain with the tiny inbox
                want = [] if relay is None else [HEALTHY]
                if stats.delta_destinations != want:
                    errors.append(f"version {version}: deltas to {stats.delta_destinations}, not {want}")
            if version == 0:  # the tiny inbox joins the group (a rank past its first plan) once it runs
                dsts.append(ws.Destination(name, TINY, poisoned[TINY], "staged", timeout=60, push_timeout=8,
                                           delta_bytes=64))
                assert bool(group.status()["relay"]) == (relay is None), \
                    "the default plan of 2 identical destinations and 1 source relays"
        assert got == {HEALTHY: list(range(PUSHES + 1)), TINY: list(range(1, PUSHES + 1))}, (got, errors)
        assert errors == []
        assert [d.readmissions for d in dsts] == [0, 0]
        # the source says once why the tiny destination takes no deltas, naming it
        notes = [r.getMessage() for r in caplog.records if "delta inbox" in r.getMessage()]
        assert len(notes) == 1 and f"destination {TINY}'s delta inbox" in notes[0], notes
    finally:
        for p in [src, *dsts]:
            p.close()
        group.shutdown()


def test_a_part_refused_while_applied_is_applied_again_by_the_next_push(ray_cluster) -> None:
    """The source refuses its new part (its delta sender raises while loading it, once): that push fails,
    and the source has not taken the new plan epoch, so the next push fetches and applies the part
    again rather than running on one half applied (the new destinations with the old inboxes)."""
    name = "refused-part"
    group = ws.Group.create(name, num_sources=1, num_destinations=1, relay=False)
    g = torch.Generator().manual_seed(4)
    full = {k: torch.randn(s, generator=g).to(DTYPES.get(k, torch.float32)) for k, s in SHAPES.items()}
    local = {k: v.clone() for k, v in full.items()}
    poisoned = [{k: torch.full_like(v, float("nan")) for k, v in full.items()} for _ in range(2)]
    with ThreadPoolExecutor(2) as ex:
        src_f = ex.submit(ws.Source, name, 0, local, timeout=60, delta=True)
        dsts = [ws.Destination(name, 0, poisoned[0], "inplace", timeout=60, push_timeout=8,
                               delta_bytes=1 << 20)]
        src = src_f.result(timeout=120)
    try:
        src.push(0, timeout=10)
        dsts.append(ws.Destination(name, 1, poisoned[1], "staged", timeout=60, push_timeout=8,
                                   delta_bytes=1 << 20))
        load = src._delta.load
        refused: list[int] = []

        def refuse_once(*args: object, **kwargs: object) -> None:
            if not refused:
                refused.append(src.epoch)
                raise ws.WeightSyncError("refused by the test")
            load(*args, **kwargs)  # type: ignore[arg-type]

        src._delta.load = refuse_once  # type: ignore[method-assign]
        full = changed(full, seed=1)
        for k, t in local.items():
            t.copy_(full[k])
        with pytest.raises(ws.WeightSyncError, match="refused by the test"):
            src.push(1, timeout=10)
        for version in (2, 3):
            full = changed(full, seed=version)
            for k, t in local.items():
                t.copy_(full[k])
            stats = src.push(version, timeout=10)
            assert stats.failed_destinations == [], stats
            for j, d in enumerate(dsts):
                assert d.wait(version, timeout=10) == version
                if d.mode == "staged":
                    d.apply()
                for k, t in full.items():
                    assert torch.equal(bits(poisoned[j][k]), bits(t)), (j, k, version)
        assert stats.delta_destinations == [0, 1], stats
    finally:
        for p in [src, *dsts]:
            p.close()
        group.shutdown()


def test_a_chain_member_with_a_tiny_inbox_makes_the_chain_take_every_write_as_planned(ray_cluster) -> None:
    """Two sources into three replicas in a chain whose middle member's inbox is 64 bytes: the chain's
    share is that member's, neither source's entries fit it, so each source's header tells every member
    that its relay chunks came as planned (two sources: two ranges of chunks); every member is exact at
    every version and nobody fails."""
    team = Team("tiny-chain-member", ["replica"] * 3, ["inplace", "staged", "staged"], relay=True,
                delta_bytes=[1 << 20, 64, 1 << 20])
    try:
        assert team.group.status()["relay"], "no relay chain: the test misses its point"
        for v, case in enumerate(["none", *CASES[:4]]):
            if v:
                team.set(step(team.full, case, seed=700 + v))
            stats = team.push()
            team.check()
            for s in stats:
                assert s.failed_destinations == [] and s.delta_destinations == [], (case, s)
                assert s.wire_bytes == s.dense_bytes, (case, s)
        assert [d.readmissions for d in team.dsts] == [0, 0, 0]
    finally:
        team.close()
