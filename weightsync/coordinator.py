"""The coordinator: a named Ray actor per group that collects layouts, plans, and hands out plan parts.

It is the only place that sees every participant. Sources and destinations join with their layout,
engine address and descriptors; once every rank of both roles is present it plans (weightsync.plan),
lowers each source's ops to writes (weightsync.writes) and keeps, per participant, the part it needs.
A change of membership (a rank reported dead, a replacement or a new destination joining) re-plans
under a new *epoch*; participants notice the epoch on their next push and fetch their new part.
"""

from __future__ import annotations

import hmac
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import msgpack
import numpy as np

from weightsync.errors import LayoutError, PlanError, WeightSyncError
from weightsync.layout import Layout
from weightsync.plan import plan as make_plan
from weightsync.writes import DEFAULT_CHUNK_BYTES, K_DATA, K_GATHER, imm_count_for, lower

log = logging.getLogger("weightsync.coordinator")

SOURCE, DESTINATION = "source", "destination"


@dataclass
class Member:
    role: str
    rank: int
    layout: bytes
    address: bytes
    host: str
    engine: dict[str, int]  # nics, stripe_threshold, max_piece: how the engine splits writes
    descriptors: dict[str, list[bytes]]  # local key -> descriptor per buffer (staged: 2 shadows)
    mailbox: bytes  # descriptor of the slots peers signal into (announces or acks)
    joined_epoch: int = 0  # the plan epoch when it joined: reports about older epochs do not apply to it
    joined: float = field(default_factory=time.time)


class Coordinator:
    """Runs as ``ray.remote(max_concurrency=...)(Coordinator)``; methods are called by participants."""

    def __init__(self, name: str, num_sources: int, num_destinations: int, secret: str,
                 allow_cast: bool = False, fp8_block: tuple[int, int] | None = (128, 128)) -> None:
        self.name = name
        self.allow_cast = allow_cast
        self.fp8_block = None if fp8_block is None else (int(fp8_block[0]), int(fp8_block[1]))
        # Per plan epoch: the receive-buffer descriptor each gathering source published (FP8 tiles).
        self._recv: dict[int, dict[int, bytes]] = {}
        self.num_sources = num_sources
        self.num_destinations = num_destinations
        self._secret = secret
        self._cv = threading.Condition()
        self._members: dict[tuple[str, int], Member] = {}
        self._dead: set[tuple[str, int]] = set()
        self.epoch = 0
        self._parts: dict[tuple[str, int], bytes] = {}
        self._error: dict[str, Any] | None = None  # why the last planning attempt failed

    # -- membership ----------------------------------------------------------------------------------
    def join(self, secret: str, role: str, rank: int, layout: bytes, address: bytes, host: str,
             engine: dict[str, int], descriptors: dict[str, list[bytes]], mailbox: bytes) -> int:
        if not hmac.compare_digest(secret, self._secret):
            raise WeightSyncError(f"group {self.name!r}: {role} rank {rank} presented a wrong secret")
        if role not in (SOURCE, DESTINATION):
            raise WeightSyncError(f"group {self.name!r}: unknown role {role!r}")
        # Destinations may grow the group (a new replica); sources are fixed at create time.
        if rank < 0 or (role == SOURCE and rank >= self.num_sources):
            raise LayoutError(f"group {self.name!r}: {role} rank {rank} is outside the group "
                              f"(sources 0..{self.num_sources - 1})")
        with self._cv:
            if role == DESTINATION and rank >= self.num_destinations:
                # A destination beyond the initial count: a new rollout replica joining at run time.
                self.num_destinations = rank + 1
            before = self.epoch
            self._members[(role, rank)] = Member(role, rank, layout, address, host, engine, descriptors,
                                                 mailbox, joined_epoch=before)
            self._dead.discard((role, rank))
            log.info("group %s: %s rank %d joined from %s", self.name, role, rank, host)
            self._replan_if_complete()
            # The epoch before this join: the member's first part is the first plan newer than it.
            return before

    def report_dead(self, reporter: str, role: str, ranks: list[int], epoch: int) -> int:
        """A participant saw these ranks fail during plan ``epoch``: drop them and re-plan.

        A rank that (re)joined after that epoch is a new process and is left alone."""
        with self._cv:
            changed = False
            for r in ranks:
                key = (role, int(r))
                member = self._members.get(key)
                if member is not None and member.joined_epoch < epoch:
                    del self._members[key]
                    self._dead.add(key)
                    changed = True
                    log.warning("group %s: %s rank %d reported dead by %s", self.name, role, r, reporter)
            if changed:
                self._replan_if_complete()
            return self.epoch

    # -- planning ----------------------------------------------------------------------------------
    def _alive(self, role: str) -> list[Member]:
        return sorted((m for (r, _), m in self._members.items() if r == role), key=lambda m: m.rank)

    def _replan_if_complete(self) -> None:
        sources, dests = self._alive(SOURCE), self._alive(DESTINATION)
        dead_sources = [r for (role, r) in self._dead if role == SOURCE]
        missing_src = [r for r in range(self.num_sources) if (SOURCE, r) not in self._members]
        live_dst = {m.rank for m in dests}
        missing_dst = [r for r in range(self.num_destinations)
                       if r not in live_dst and (DESTINATION, r) not in self._dead]
        if missing_src or missing_dst:
            if dead_sources:
                log.warning("group %s: waiting for source ranks %s to rejoin", self.name, missing_src)
            return
        try:
            parts = self._plan(sources, dests)
        except (LayoutError, PlanError) as exc:
            self._error = {"type": type(exc).__name__, "message": str(exc)}
            self.epoch += 1
            self._parts = {}
            log.error("group %s: planning failed: %s", self.name, exc)
        else:
            self._error = None
            self.epoch += 1
            self._parts = parts
            log.info("group %s: plan epoch %d for %d sources and %d destinations", self.name, self.epoch,
                     len(sources), len(dests))
        self._cv.notify_all()

    def _plan(self, sources: list[Member], dests: list[Member]) -> dict[tuple[str, int], bytes]:
        src_layouts = [Layout.from_msgpack(m.layout) for m in sources]
        dst_layouts = [Layout.from_msgpack(m.layout) for m in dests]
        p = make_plan(src_layouts, dst_layouts, source_hosts=[m.host for m in sources],
                      destination_hosts=[m.host for m in dests], allow_cast=self.allow_cast,
                      fp8_block=self.fp8_block)
        epoch = self.epoch + 1
        expected = np.zeros(len(dests), dtype=np.int64)
        dst_bytes = p.bytes_per_destination() if len(p.ops) else np.zeros(len(dests), np.int64)
        writers: list[set[int]] = [set() for _ in dests]
        parts: dict[tuple[str, int], bytes] = {}
        # Sources are all present when planning, so plan index i is source rank i.
        gather_expected = np.zeros(len(sources), dtype=np.int64)
        providers: list[set[int]] = [set() for _ in sources]
        gatherers: list[set[int]] = [set() for _ in sources]
        lowered_by: list[Any] = []
        for i, src in enumerate(sources):
            part = p.part(sources=[i])
            provided = part.gathers[part.gathers["provider"] == i]
            chunk = src.engine.get("chunk_bytes", DEFAULT_CHUNK_BYTES)
            lowered = lower(p.for_source(i), chunk, part, provided)
            lowered_by.append((part, lowered))
            w = lowered.writes
            imms = imm_count_for(w["nbytes"], src.engine["nics"], src.engine["stripe_threshold"],
                                 src.engine["max_piece"], w["rows"])
            data = w["kind"] == K_DATA
            np.add.at(expected, w["dst_rank"][data], imms[data])
            # a gather to oneself is a local copy: no immediate
            remote = (w["kind"] == K_GATHER) & (w["dst_rank"] != i)
            np.add.at(gather_expected, w["dst_rank"][remote], imms[remote])
            for g in np.unique(w["dst_rank"][remote]):
                gatherers[i].add(int(g))
                providers[int(g)].add(i)
            for j in np.unique(w["dst_rank"][data]):
                writers[int(j)].add(src.rank)
        for i, src in enumerate(sources):
            part, lowered = lowered_by[i]
            w = lowered.writes
            data = w["kind"] == K_DATA
            used = {int(j) for j in np.unique(w["dst_rank"][data])}
            parts[(SOURCE, src.rank)] = msgpack.packb({
                "epoch": epoch,
                "writes": w.tobytes(),
                "copies": lowered.copies.tobytes(),
                "chunks": lowered.chunks.tobytes(),
                "units": lowered.units.tobytes(),
                "chunk_bytes": lowered.chunk_bytes,
                "plan": part.to_msgpack(),
                "keys": p.keys,
                "destinations": {dests[j].rank: {
                    "slot": j,
                    "address": dests[j].address,
                    "descriptors": dests[j].descriptors,
                    "mailbox": dests[j].mailbox,
                } for j in sorted(used)},
                "bytes": int(w["nbytes"][data].sum()),
                "gather_expected": int(gather_expected[i]),
                "gatherers": {sources[g].rank: {"address": sources[g].address, "mailbox": sources[g].mailbox}
                              for g in sorted(gatherers[i])},
                "providers": {sources[g].rank: {"address": sources[g].address, "mailbox": sources[g].mailbox}
                              for g in sorted(providers[i])},
            }, use_bin_type=True)
        for j, dst in enumerate(dests):
            parts[(DESTINATION, dst.rank)] = msgpack.packb({
                "epoch": epoch,
                "expected": int(expected[j]),
                "bytes": int(dst_bytes[j]),
                "sources": {s.rank: {"address": s.address, "mailbox": s.mailbox}
                            for s in sources if s.rank in writers[j]},
            }, use_bin_type=True)
        return parts

    # -- participants fetch their part ------------------------------------------------------------
    def part(self, secret: str, role: str, rank: int, after_epoch: int, timeout: float) -> bytes:
        """This participant's part of the first plan newer than ``after_epoch`` (waits up to timeout)."""
        if not hmac.compare_digest(secret, self._secret):
            raise WeightSyncError(f"group {self.name!r}: {role} rank {rank} presented a wrong secret")
        deadline = time.monotonic() + timeout
        with self._cv:
            while self.epoch <= after_epoch:
                left = deadline - time.monotonic()
                if left <= 0:
                    missing = self._missing()
                    raise WeightSyncError(
                        f"group {self.name!r}: no plan for {role} rank {rank} within {timeout} s; "
                        f"still waiting for {missing or 'nothing (planning did not finish)'}")
                self._cv.wait(left)
            if self._error is not None:
                return msgpack.packb({"epoch": self.epoch, "error": self._error}, use_bin_type=True)
            part = self._parts.get((role, rank))
            if part is None:
                raise WeightSyncError(f"group {self.name!r}: {role} rank {rank} is not a member of plan "
                                      f"epoch {self.epoch} (reported dead?)")
            return part

    def current_epoch(self) -> int:
        return self.epoch

    # -- FP8 gathers: sources expose a receive buffer to each other ---------------------------------
    def publish_receive(self, secret: str, rank: int, epoch: int, descriptor: bytes) -> None:
        """Source ``rank`` registered its receive buffer for plan ``epoch`` (sized by that plan)."""
        if not hmac.compare_digest(secret, self._secret):
            raise WeightSyncError(f"group {self.name!r}: source rank {rank} presented a wrong secret")
        with self._cv:
            self._recv.setdefault(epoch, {})[rank] = descriptor
            for e in [e for e in self._recv if e < epoch - 1]:
                del self._recv[e]
            self._cv.notify_all()

    def receive_buffers(self, secret: str, epoch: int, ranks: list[int], timeout: float) -> dict[int, bytes]:
        """The receive-buffer descriptors of ``ranks`` for plan ``epoch`` (waits until all published)."""
        if not hmac.compare_digest(secret, self._secret):
            raise WeightSyncError(f"group {self.name!r}: wrong secret")
        deadline = time.monotonic() + timeout
        with self._cv:
            while True:
                got = self._recv.get(epoch, {})
                missing = [r for r in ranks if r not in got]
                if not missing:
                    return {r: got[r] for r in ranks}
                left = deadline - time.monotonic()
                if left <= 0 or self.epoch != epoch:
                    raise WeightSyncError(f"group {self.name!r}: source ranks {missing} published no receive "
                                          f"buffer for plan epoch {epoch} within {timeout} s")
                self._cv.wait(left)

    def _missing(self) -> str:
        parts = []
        ms = [r for r in range(self.num_sources) if (SOURCE, r) not in self._members]
        md = [r for r in range(self.num_destinations) if (DESTINATION, r) not in self._members]
        if ms:
            parts.append(f"source ranks {ms}")
        if md:
            parts.append(f"destination ranks {md}")
        return ", ".join(parts)

    def status(self) -> dict[str, Any]:
        with self._cv:
            return {
                "name": self.name,
                "epoch": self.epoch,
                "sources": sorted(r for (role, r) in self._members if role == SOURCE),
                "destinations": sorted(r for (role, r) in self._members if role == DESTINATION),
                "dead": sorted(f"{role} {r}" for role, r in self._dead),
                "error": self._error,
            }
