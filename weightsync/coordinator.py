"""The coordinator: a named Ray actor per group that collects layouts, plans, and hands out plan parts.

It is the only place that sees every participant. Sources and destinations join with their layout,
engine address and descriptors; once every rank of both roles is present it plans (weightsync.plan),
lowers each source's ops to writes (weightsync.writes) and keeps, per participant, the part it needs.
A change of membership (a rank reported dead, a replacement or a new destination joining) re-plans
under a new *epoch*; participants notice the epoch on their next push and fetch their new part.
Sources learn the epoch without a round trip on the push's path: each keeps a long-poll
(``wait_epoch``) open from a thread of its own (weightsync.group._EpochWatcher).
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
from weightsync.plan import LOCAL_ROUND_BYTES, ROUND_BYTES
from weightsync.plan import plan as make_plan
from weightsync.writes import DEFAULT_CHUNK_BYTES, K_DATA, K_GATHER, WRITE_DTYPE, imm_count_for, lower

log = logging.getLogger("weightsync.coordinator")

SOURCE, DESTINATION = "source", "destination"
# Relay: the largest write a chain member forwards at once. Each relay chunk is forwarded as soon as it
# has landed, so a chunk is the pipeline's step: smaller chunks shorten the chain's fill time (64 MiB:
# about 170 us per hop on NVLink), larger ones cost fewer copies and triggers (the cuda lane reached
# 0.89-0.92 of the copy bound with 16 MiB copies, 0.96-0.97 with 64 MiB, 0.99 from 256 MiB:
# docs/BENCHMARKS.md).
RELAY_CHUNK_BYTES = 64 << 20
_RELAY_MAX_CHUNKS = 1 << 24  # chunk index bits of a relay immediate
# How long a membership change (join, report_dead) waits, before returning, for every source's epoch
# watcher to have heard the new epoch: so that a push started after the change returned uses the new
# plan, as it did when every push asked the coordinator. A watcher that has not answered by then is
# dropped from the wait (it re-registers with its next long-poll) and its source may push one more
# time with the old plan.
WATCHER_ACK_TIMEOUT = 2.0
# A watcher that has not called for this long past its long-poll's timeout is gone (its process died).
_WATCHER_GRACE = 5.0


def relay_imm(epoch: int, chunk: int) -> int:
    """The immediate of relay chunk ``chunk``: tag 0b101 in the top bits, so never equal to a data
    immediate (top bit 0), a gather (0b100), gathered (0b110), ANNOUNCE or ACK (0xFF...)."""
    return 0xA0000000 | ((epoch & 0x1F) << 24) | (chunk & 0xFFFFFF)


def split_writes(w: np.ndarray, cap: int) -> np.ndarray:
    """Data writes larger than ``cap`` bytes cut into consecutive writes of at most ``cap`` (2-D writes
    by whole rows), in place in the order: a relay forwards a chunk once all of it landed, so a chunk is
    the pipeline's step. Staged writes keep their staging chunk (their offsets move inside it)."""
    rows = np.maximum(w["rows"].astype(np.int64), 1)
    row_bytes = w["nbytes"].astype(np.int64) // rows
    one_d = rows == 1
    per_rows = np.where(one_d, 1, np.maximum(cap // np.maximum(row_bytes, 1), 1))  # rows per piece (2-D)
    pieces_1d = np.maximum(-(-w["nbytes"].astype(np.int64) // cap), 1)
    n = np.where(w["kind"] != K_DATA, 1, np.where(one_d, pieces_1d, -(-rows // per_rows)))
    if (n == 1).all():
        return w
    k = np.repeat(np.arange(len(w)), n)
    j = np.arange(len(k)) - np.repeat(np.cumsum(n) - n, n)
    out = w[k].copy()
    od = one_d[k]
    cut = w["kind"][k] == K_DATA  # other writes (gathers) stay whole
    total = w["nbytes"][k].astype(np.int64)
    # 1-D: bytes j*cap.. ; 2-D: rows j*per_rows..
    start_b = j * cap
    nb_1d = np.minimum(cap, total - start_b)
    r0 = j * per_rows[k]
    nr = np.minimum(per_rows[k], rows[k] - r0)
    for side in ("src", "dst"):
        base = w[f"{side}_offset"][k]
        out[f"{side}_offset"] = np.where(cut, np.where(od, base + start_b, base + r0 * w[f"{side}_pitch"][k]),
                                         base)
    out["nbytes"] = np.where(cut, np.where(od, nb_1d, nr * row_bytes[k]), total)
    out["rows"] = np.where(cut, np.where(od, 1, nr), w["rows"][k])
    return out.astype(WRITE_DTYPE)


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
                 allow_cast: bool = False, fp8_block: tuple[int, int] | None = (128, 128),
                 relay: bool | None = None, relay_chunk_bytes: int = RELAY_CHUNK_BYTES,
                 round_bytes: int = ROUND_BYTES, local_round_bytes: int = LOCAL_ROUND_BYTES) -> None:
        self.name = name
        # None: relay when destinations outnumber sources and all hold the same layout (full replicas);
        # True: relay whenever the destinations' layouts are identical; False: never.
        self.relay = relay
        self.relay_chunk_bytes = int(relay_chunk_bytes)
        self.round_bytes, self.local_round_bytes = int(round_bytes), int(local_round_bytes)
        self._chain: list[int] = []  # destination ranks of the current plan's relay chain (empty: direct)
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
        # Sources' epoch watchers, by source rank: (token, the newest epoch it has heard: the after_epoch of
        # its latest wait_epoch, monotonic time after which it counts as gone).
        self._watchers: dict[int, tuple[str, int, float]] = {}
        self._ack_waiters = 0  # membership changes waiting for watchers to hear their epoch

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
            if role == SOURCE:
                self._watchers.pop(rank, None)  # a new process: the old one's watcher is not its own
            log.info("group %s: %s rank %d joined from %s", self.name, role, rank, host)
            self._replan_if_complete()
            self._await_watchers(self.epoch)
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
            self._await_watchers(self.epoch)
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
            self._chain = []
            log.error("group %s: planning failed: %s", self.name, exc)
        else:
            self._error = None
            self.epoch += 1
            self._parts, self._chain = parts
            log.info("group %s: plan epoch %d for %d sources and %d destinations", self.name, self.epoch,
                     len(sources), len(dests))
        self._cv.notify_all()

    def _use_relay(self, sources: list[Member], dests: list[Member]) -> bool:
        if self.relay is False or len(dests) < 2:
            return False
        if self.relay is None and len(dests) <= len(sources):
            return False
        # Full replicas only: a chain member forwards what it received at the same keys and offsets.
        return all(d.layout == dests[0].layout for d in dests[1:])

    def _plan(self, sources: list[Member], dests: list[Member]
              ) -> tuple[dict[tuple[str, int], bytes], list[int]]:
        relay = self._use_relay(sources, dests)
        # With relay the sources write only into the head of the chain; the others get it by forwarding.
        targets = dests[:1] if relay else dests
        src_layouts = [Layout.from_msgpack(m.layout) for m in sources]
        dst_layouts = [Layout.from_msgpack(m.layout) for m in targets]
        p = make_plan(src_layouts, dst_layouts, source_hosts=[m.host for m in sources],
                      destination_hosts=[m.host for m in targets], allow_cast=self.allow_cast,
                      fp8_block=self.fp8_block, round_bytes=self.round_bytes,
                      local_round_bytes=self.local_round_bytes)
        epoch = self.epoch + 1
        expected = np.zeros(len(targets), dtype=np.int64)
        dst_bytes = p.bytes_per_destination() if len(p.ops) else np.zeros(len(targets), np.int64)
        writers: list[set[int]] = [set() for _ in targets]
        parts: dict[tuple[str, int], bytes] = {}
        # Sources are all present when planning, so plan index i is source rank i.
        gather_expected = np.zeros(len(sources), dtype=np.int64)
        providers: list[set[int]] = [set() for _ in sources]
        gatherers: list[set[int]] = [set() for _ in sources]
        lowered_by: list[Any] = []
        relay_imms: list[np.ndarray] = []
        chunk_writes: list[np.ndarray] = []  # relay: the head's incoming data writes, in chunk order
        chunk_base = 0
        for i, src in enumerate(sources):
            part = p.part(sources=[i])
            provided = part.gathers[part.gathers["provider"] == i]
            chunk = src.engine.get("chunk_bytes", DEFAULT_CHUNK_BYTES)
            lowered = lower(p.for_source(i), chunk, part, provided,
                            pack_strided=bool(src.engine.get("pack_strided", 1)))
            if relay:
                lowered.writes = split_writes(lowered.writes, self.relay_chunk_bytes)
            lowered_by.append((part, lowered))
            w = lowered.writes
            imms = imm_count_for(w["nbytes"], src.engine["nics"], src.engine["stripe_threshold"],
                                 src.engine["max_piece"], w["rows"])
            data = w["kind"] == K_DATA
            ri = np.zeros(len(w), np.uint32)
            if relay:
                # Every data write into the head is a relay chunk with an immediate of its own.
                idx = np.flatnonzero(data)
                if chunk_base + len(idx) > _RELAY_MAX_CHUNKS:
                    raise PlanError(f"group {self.name!r}: {chunk_base + len(idx)} relay chunks, more than "
                                    f"{_RELAY_MAX_CHUNKS} (raise relay_chunk_bytes)")
                ri[idx] = [relay_imm(epoch, chunk_base + c) for c in range(len(idx))]
                chunk_base += len(idx)
                cw = w[idx]
                chunk_writes.append(cw)
            else:
                np.add.at(expected, w["dst_rank"][data], imms[data])
            relay_imms.append(ri)
            # a gather to oneself is a local copy: no immediate
            remote = (w["kind"] == K_GATHER) & (w["dst_rank"] != i)
            np.add.at(gather_expected, w["dst_rank"][remote], imms[remote])
            for g in np.unique(w["dst_rank"][remote]):
                gatherers[i].add(int(g))
                providers[int(g)].add(i)
            for j in np.unique(w["dst_rank"][data]):
                writers[int(j)].add(src.rank)
        chain = [d.rank for d in dests] if relay else []
        for i, src in enumerate(sources):
            part, lowered = lowered_by[i]
            w = lowered.writes
            data = w["kind"] == K_DATA
            used = {int(j) for j in np.unique(w["dst_rank"][data])}
            destinations = {dests[j].rank: {
                "slot": j,
                "address": dests[j].address,
                "descriptors": dests[j].descriptors,
                "mailbox": dests[j].mailbox,
            } for j in sorted(used)}
            if relay and used:
                # A source that writes into the head announces to and waits for every chain member
                # (slot -1: no write of this source names them).
                for j, d in enumerate(dests):
                    if j:
                        destinations[d.rank] = {"slot": -1, "address": d.address,
                                                "descriptors": d.descriptors, "mailbox": d.mailbox}
                    destinations[d.rank]["successor"] = dests[j + 1].rank if j + 1 < len(dests) else -1
            parts[(SOURCE, src.rank)] = msgpack.packb({
                "epoch": epoch,
                "writes": w.tobytes(),
                "imms": relay_imms[i].tobytes(),
                "relay": chain if used else [],
                "copies": lowered.copies.tobytes(),
                "chunks": lowered.chunks.tobytes(),
                "units": lowered.units.tobytes(),
                "chunk_bytes": lowered.chunk_bytes,
                "plan": part.to_msgpack(),
                "keys": p.keys,
                "destinations": destinations,
                "bytes": int(w["nbytes"][data].sum()),
                "gather_expected": int(gather_expected[i]),
                "gatherers": {sources[g].rank: {"address": sources[g].address, "mailbox": sources[g].mailbox}
                              for g in sorted(gatherers[i])},
                "providers": {sources[g].rank: {"address": sources[g].address, "mailbox": sources[g].mailbox}
                              for g in sorted(providers[i])},
            }, use_bin_type=True)
        if relay:
            cw = np.concatenate(chunk_writes) if chunk_writes else np.zeros(0, WRITE_DTYPE)
            cimm = np.concatenate([ri[ri != 0] for ri in relay_imms]).astype(np.uint32)
            # What the head receives per chunk from its source, and each later member from its predecessor:
            # the same write, so the same bytes, counted with the sending engine's piece rule.
            src_of = np.concatenate([np.full(len(c), i, np.int64) for i, c in enumerate(chunk_writes)]
                                    ) if chunk_writes else np.zeros(0, np.int64)
            head_pieces = np.zeros(len(cw), np.int64)
            for i, src in enumerate(sources):
                sel = src_of == i
                head_pieces[sel] = imm_count_for(cw["nbytes"][sel], src.engine["nics"],
                                                 src.engine["stripe_threshold"], src.engine["max_piece"],
                                                 cw["rows"][sel])
            rows = np.maximum(cw["rows"].astype(np.int64), 1)
            keys = [p.keys[int(k)] for k in cw["dst_key"]]
            head_writers = sorted(writers[0])
            for j, dst in enumerate(dests):
                if j == 0:
                    pieces = head_pieces
                else:
                    e = dests[j - 1].engine
                    pieces = imm_count_for(cw["nbytes"], e["nics"], e["stripe_threshold"], e["max_piece"],
                                           cw["rows"])
                succ = dests[j + 1] if j + 1 < len(dests) else None
                parts[(DESTINATION, dst.rank)] = msgpack.packb({
                    "epoch": epoch,
                    "expected": 0,
                    "bytes": int(dst_bytes[0]),
                    "sources": {s.rank: {"address": s.address, "mailbox": s.mailbox}
                                for s in sources if s.rank in head_writers},
                    "relay": {
                        "chain": chain,
                        "position": j,
                        "successor": None if succ is None else {
                            "rank": succ.rank, "address": succ.address, "descriptors": succ.descriptors},
                        "imm": cimm.tobytes(),
                        "pieces": pieces.astype(np.int64).tobytes(),
                        "keys": keys,
                        "offset": cw["dst_offset"].astype(np.int64).tobytes(),
                        "row_bytes": (cw["nbytes"].astype(np.int64) // rows).tobytes(),
                        "rows": rows.tobytes(),
                        "pitch": cw["dst_pitch"].astype(np.int64).tobytes(),
                    },
                }, use_bin_type=True)
            log.info("group %s: relay chain %s, %d chunks", self.name, chain, len(cw))
            return parts, chain
        for j, dst in enumerate(dests):
            parts[(DESTINATION, dst.rank)] = msgpack.packb({
                "epoch": epoch,
                "expected": int(expected[j]),
                "bytes": int(dst_bytes[j]),
                "sources": {s.rank: {"address": s.address, "mailbox": s.mailbox}
                            for s in sources if s.rank in writers[j]},
            }, use_bin_type=True)
        return parts, chain

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

    # -- sources' epoch watchers: the plan epoch without a round trip on the push's path ---------------
    def wait_epoch(self, secret: str, rank: int, token: str, after_epoch: int, timeout: float) -> int:
        """Long-poll of source ``rank``'s epoch watcher: returns the epoch as soon as it is newer than
        ``after_epoch``, or the current one after ``timeout`` s. A call says that the watcher already
        holds ``after_epoch`` (it sets it before calling again), which is what ``_await_watchers`` waits
        for."""
        if not hmac.compare_digest(secret, self._secret):
            raise WeightSyncError(f"group {self.name!r}: source rank {rank} presented a wrong secret")
        deadline = time.monotonic() + timeout
        with self._cv:
            self._watchers[int(rank)] = (token, int(after_epoch), deadline + _WATCHER_GRACE)
            if self._ack_waiters:
                self._cv.notify_all()
            while self.epoch <= after_epoch:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._cv.wait(left)
            return self.epoch

    def unwatch(self, secret: str, rank: int, token: str) -> None:
        """Source ``rank``'s watcher stopped (the source closed): membership changes no longer wait for it."""
        if not hmac.compare_digest(secret, self._secret):
            raise WeightSyncError(f"group {self.name!r}: source rank {rank} presented a wrong secret")
        with self._cv:
            w = self._watchers.get(int(rank))
            if w is not None and w[0] == token:
                del self._watchers[int(rank)]
                self._cv.notify_all()

    def _await_watchers(self, epoch: int) -> None:
        """Called holding the lock after a membership change: waits (at most WATCHER_ACK_TIMEOUT) until
        every live source's watcher holds ``epoch``. The change is then visible to any push that starts
        after the caller got its answer, without that push asking the coordinator."""
        deadline = time.monotonic() + WATCHER_ACK_TIMEOUT
        while True:
            now = time.monotonic()
            behind = [r for r, (_, seen, gone) in self._watchers.items()
                      if seen < epoch and now < gone and (SOURCE, r) in self._members]
            if not behind:
                return
            left = deadline - now
            if left <= 0:
                for r in behind:
                    del self._watchers[r]
                log.warning("group %s: the epoch watchers of source ranks %s did not hear plan epoch %d "
                            "within %s s (their next push may still use the previous plan)", self.name,
                            behind, epoch, WATCHER_ACK_TIMEOUT)
                return
            self._ack_waiters += 1
            try:
                self._cv.wait(left)
            finally:
                self._ack_waiters -= 1

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
                "relay": bool(self._chain),
                "chain": list(self._chain),  # relay: destination ranks in forwarding order (head first)
                # sources' epoch watchers: rank -> the newest epoch each has heard
                "watchers": {r: seen for r, (_, seen, _) in sorted(self._watchers.items())},
            }
