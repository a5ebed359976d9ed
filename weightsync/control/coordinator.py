"""The coordinator: collects layouts, plans, and hands out plan parts. A plain class: ``Group.create``
makes it a named Ray actor per group (weightsync.control.group), and tests drive it directly.

It is the only place that sees every participant. Sources and destinations join with their layout,
engine address and descriptors; once every rank of both roles is present it lowers the plan into one
typed part per participant (weightsync.plan.lower) and keeps them, packed, until they are fetched.
A change of membership (a rank reported dead, a replacement or a new destination joining) re-plans
under a new *epoch*; participants notice the epoch on their next push and fetch their new part.
Sources learn the epoch without a round trip on the push's path: each keeps a long-poll
(``wait_epoch``) open from a thread of its own (weightsync.control.watcher.EpochWatcher).

A destination reported dead is dropped from the plan, and a plan without it sends it nothing. If it was
alive after all (stopped past the push timeout, its link cut for a while), it learns that it was dropped
from its own long-poll (``wait_member``, weightsync.control.watcher.MembershipWatcher) and joins again
under its rank (``join(..., rejoin=True)``, refused if another process holds the rank by then); the
re-plan gives it the next version whole.

Every method called remotely takes a proof that the caller knows the group's secret first and answers
nothing, changes nothing, to a caller without a fresh valid one: the actor is reachable by name from any
Ray namespace and job. Members never send the secret itself, and the coordinator keeps only the
admission key it checks proofs with (weightsync.control.admission): another job that runs code inside
this actor learns no secret and no engine key from it, so it can stop pushes but cannot read or write
weights. Refused calls are counted per method (``status()["rejected"]``) and logged with the caller's
claimed identity, never with what it presented.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from weightsync.control.admission import ProofChecker
from weightsync.control.admission import admission_key as _admission_key
from weightsync.control.watcher import DROPPED, MEMBER, SUPERSEDED
from weightsync.errors import LayoutError, PlanError, WeightSyncError
from weightsync.plan.lower import RELAY_CHUNK_BYTES, GroupOptions, lower_group
from weightsync.plan.ops import LOCAL_ROUND_BYTES, ROUND_BYTES
from weightsync.plan.parts import (
    DESTINATION,
    SOURCE,
    DestinationPart,
    EngineInfo,
    Member,
    PlanFailure,
)

log = logging.getLogger("weightsync.coordinator")

# How long a membership change (join, report_dead) waits, before returning, for every source's epoch
# watcher to have heard the new epoch: so that a push started after the change returned uses the new
# plan, as it did when every push asked the coordinator. A watcher that has not answered by then is
# dropped from the wait (it re-registers with its next long-poll) and its source may push one more
# time with the old plan.
WATCHER_ACK_TIMEOUT = 2.0
# A watcher that has not called for this long past its long-poll's timeout is gone (its process died).
_WATCHER_GRACE = 5.0


def _claimed(who: object) -> str:
    """A caller-supplied identity as it may appear in a log line: bounded, printable, quoted."""
    text = repr(who)
    return text if len(text) <= 80 else text[:77] + "..."


@dataclass
class _Joined:
    """A member and when it joined: reports about plan epochs older than ``epoch`` do not apply to it."""

    member: Member
    epoch: int = 0
    at: float = field(default_factory=time.time)


class Coordinator:
    """Runs as ``ray.remote(max_concurrency=...)(Coordinator)``; methods are called by participants."""

    def __init__(self, name: str, num_sources: int, num_destinations: int, secret: str | None,
                 allow_cast: bool = False, fp8_block: tuple[int, int] | None = (128, 128),
                 relay: bool | None = None, relay_chunk_bytes: int = RELAY_CHUNK_BYTES,
                 round_bytes: int = ROUND_BYTES, local_round_bytes: int = LOCAL_ROUND_BYTES, *,
                 admission_key: bytes | None = None) -> None:
        """``secret`` or, as ``Group.create`` passes it so that the secret never reaches the actor,
        ``admission_key`` (weightsync.control.admission.admission_key): exactly one of them."""
        if (secret is None) == (admission_key is None):
            raise WeightSyncError(f"group {name!r}: the coordinator needs the secret or its admission key")
        self.name = name
        key = admission_key if admission_key is not None else _admission_key(str(secret), name)
        self._proofs = ProofChecker(bytes(key), name)
        self._rejected: dict[str, int] = {}  # method -> calls refused (no valid proof)
        self._rejected_lock = threading.Lock()
        # relay None: relay when destinations outnumber sources and all hold the same layout (full
        # replicas); True: relay whenever the destinations' layouts are identical; False: never.
        self.options = GroupOptions(
            allow_cast=bool(allow_cast),
            fp8_block=None if fp8_block is None else (int(fp8_block[0]), int(fp8_block[1])),
            relay=relay, relay_chunk_bytes=int(relay_chunk_bytes), round_bytes=int(round_bytes),
            local_round_bytes=int(local_round_bytes))
        self._chain: list[int] = []  # destination ranks of the current plan's relay chain (empty: direct)
        # Per plan epoch: the receive-buffer descriptor each gathering source published (FP8 tiles).
        self._recv: dict[int, dict[int, bytes]] = {}
        self.num_sources = num_sources
        self.num_destinations = num_destinations
        self._cv = threading.Condition()
        self._members: dict[tuple[str, int], _Joined] = {}
        self._dead: set[tuple[str, int]] = set()
        self.epoch = 0
        self._parts: dict[tuple[str, int], bytes] = {}
        self._error: PlanFailure | None = None  # why the last planning attempt failed
        # Sources' epoch watchers, by source rank: (token, the newest epoch it has heard: the after_epoch of
        # its latest wait_epoch, monotonic time after which it counts as gone).
        self._watchers: dict[int, tuple[str, int, float]] = {}
        self._ack_waiters = 0  # membership changes waiting for watchers to hear their epoch

    # -- access ------------------------------------------------------------------------------------
    def _admit(self, proof: object, method: str, who: object) -> None:
        """Raises unless ``proof`` is a fresh proof of the group's secret for ``method``
        (weightsync.control.admission); counts and logs a refusal (the method and the caller's claimed
        identity ``who``, never what it presented)."""
        why = self._proofs.check(proof, method)
        if why is None:
            return
        with self._rejected_lock:
            self._rejected[method] = self._rejected.get(method, 0) + 1
            count = self._rejected[method]
        log.warning("group %s: %s refused: %s (caller says %s; %d refused %s calls so far)",
                    self.name, method, why, "nothing" if who is None else _claimed(who), count, method)
        raise WeightSyncError(f"group {self.name!r}: {method} refused: {why}")

    # -- membership ----------------------------------------------------------------------------------
    def join(self, proof: object, role: str, rank: int, layout: bytes, address: bytes, host: str,
             engine: dict[str, int], descriptors: dict[str, list[bytes]], mailbox: bytes,
             rejoin: bool = False) -> int:
        """Adds (or replaces: a new process under the same rank) a member and re-plans once every rank is
        present. ``rejoin``: a process that was dropped asks to be taken back; refused if another process
        holds its rank by then (the newer process wins, the old one stops)."""
        self._admit(proof, "join", f"{role} {rank}")
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
            held = self._members.get((role, rank))
            if rejoin and held is not None and held.member.address != address:
                raise WeightSyncError(f"group {self.name!r}: {role} rank {rank} cannot join again: another "
                                      f"process joined under rank {rank} since it was dropped")
            member = Member(role, rank, layout, address, host, EngineInfo.from_dict(engine),
                            descriptors, mailbox)
            self._members[(role, rank)] = _Joined(member, before)
            was_dead = (role, rank) in self._dead
            self._dead.discard((role, rank))
            if role == SOURCE:
                self._watchers.pop(rank, None)  # a new process: the old one's watcher is not its own
            if rejoin:
                log.warning("group %s: %s rank %d (dropped%s) joined again from %s", self.name, role, rank,
                            " as dead" if was_dead else "", host)
            else:
                log.info("group %s: %s rank %d joined from %s", self.name, role, rank, host)
            self._cv.notify_all()  # membership watchers: this rank is held, and by whom
            self._replan_if_complete()
            self._await_watchers(self.epoch)
            # The epoch before this join: the member's first part is the first plan newer than it.
            return before

    def report_dead(self, proof: object, reporter: str, role: str, ranks: list[int], epoch: int) -> int:
        """A participant saw these ranks fail during plan ``epoch``: drop them and re-plan.

        A rank that (re)joined after that epoch is a new process and is left alone."""
        self._admit(proof, "report_dead", reporter)
        with self._cv:
            changed = False
            for r in ranks:
                key = (role, int(r))
                joined = self._members.get(key)
                if joined is not None and joined.epoch < epoch:
                    del self._members[key]
                    self._dead.add(key)
                    changed = True
                    log.warning("group %s: %s rank %d reported dead by %s", self.name, role, r, reporter)
            if changed:
                self._cv.notify_all()  # membership watchers of the dropped ranks, also without a re-plan
                self._replan_if_complete()
            self._await_watchers(self.epoch)
            return self.epoch

    def _member_state(self, role: str, rank: int, address: bytes) -> str:
        joined = self._members.get((role, rank))
        if joined is None:
            return DROPPED
        return MEMBER if joined.member.address == address else SUPERSEDED

    def wait_member(self, proof: object, role: str, rank: int, address: bytes, known: str,
                    timeout: float) -> tuple[str, int]:
        """Long-poll of a participant's membership watcher: what the process with engine ``address`` is
        to the group (``member``; ``dropped``: reported dead and not joined since; ``superseded``:
        another process holds the rank) and the plan epoch, as soon as that differs from ``known``, else
        after ``timeout`` s. A dropped destination that is alive joins again when it hears it."""
        self._admit(proof, "wait_member", f"{role} {rank}")
        deadline = time.monotonic() + timeout
        with self._cv:
            while True:
                state = self._member_state(role, int(rank), address)
                left = deadline - time.monotonic()
                if state != known or left <= 0:
                    return state, self.epoch
                self._cv.wait(left)

    # -- planning ----------------------------------------------------------------------------------
    def _alive(self, role: str) -> list[Member]:
        return sorted((j.member for (r, _), j in self._members.items() if r == role), key=lambda m: m.rank)

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
            lowered = lower_group(sources, dests, self.epoch + 1, self.options)
        except (LayoutError, PlanError) as exc:
            self.epoch += 1
            self._error = PlanFailure(self.epoch, type(exc).__name__, str(exc))
            self._parts = {}
            self._chain = []
            log.error("group %s: planning failed: %s", self.name, exc)
        else:
            self._error = None
            self.epoch += 1
            self._parts = {key: part.to_msgpack() for key, part in lowered.parts.items()}
            self._chain = lowered.chain
            if lowered.chain:
                relay = lowered.parts[(DESTINATION, lowered.chain[0])]
                assert isinstance(relay, DestinationPart) and relay.relay is not None
                log.info("group %s: relay chain %s, %d chunks", self.name, lowered.chain,
                         len(relay.relay.imm))
            log.info("group %s: plan epoch %d for %d sources and %d destinations", self.name, self.epoch,
                     len(sources), len(dests))
        self._cv.notify_all()

    # -- participants fetch their part ------------------------------------------------------------
    def part(self, proof: object, role: str, rank: int, after_epoch: int, timeout: float) -> bytes:
        """This participant's part of the first plan newer than ``after_epoch`` (waits up to timeout): a
        packed SourcePart / DestinationPart, or a PlanFailure (weightsync.plan.parts.unpack_part)."""
        self._admit(proof, "part", f"{role} {rank}")
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
                return self._error.to_msgpack()
            part = self._parts.get((role, rank))
            if part is None:
                raise WeightSyncError(f"group {self.name!r}: {role} rank {rank} is not a member of plan "
                                      f"epoch {self.epoch} (reported dead?)")
            return part

    def current_epoch(self, proof: object) -> int:
        self._admit(proof, "current_epoch", None)
        return self.epoch

    # -- sources' epoch watchers: the plan epoch without a round trip on the push's path ---------------
    def wait_epoch(self, proof: object, rank: int, token: str, after_epoch: int, timeout: float) -> int:
        """Long-poll of source ``rank``'s epoch watcher: returns the epoch as soon as it is newer than
        ``after_epoch``, or the current one after ``timeout`` s. A call says that the watcher already
        holds ``after_epoch`` (it sets it before calling again), which is what ``_await_watchers`` waits
        for."""
        self._admit(proof, "wait_epoch", f"source {rank}")
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

    def unwatch(self, proof: object, rank: int, token: str) -> None:
        """Source ``rank``'s watcher stopped (the source closed): membership changes no longer wait for it."""
        self._admit(proof, "unwatch", f"source {rank}")
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
    def publish_receive(self, proof: object, rank: int, epoch: int, descriptor: bytes) -> None:
        """Source ``rank`` registered its receive buffer for plan ``epoch`` (sized by that plan)."""
        self._admit(proof, "publish_receive", f"source {rank}")
        with self._cv:
            self._recv.setdefault(epoch, {})[rank] = descriptor
            for e in [e for e in self._recv if e < epoch - 1]:
                del self._recv[e]
            self._cv.notify_all()

    def receive_buffers(self, proof: object, epoch: int, ranks: list[int],
                        timeout: float) -> dict[int, bytes]:
        """The receive-buffer descriptors of ``ranks`` for plan ``epoch`` (waits until all published)."""
        self._admit(proof, "receive_buffers", None)
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

    def status(self, proof: object) -> dict[str, Any]:
        self._admit(proof, "status", None)
        with self._rejected_lock:
            rejected = dict(self._rejected)
        with self._cv:
            return {
                "name": self.name,
                "epoch": self.epoch,
                "sources": sorted(r for (role, r) in self._members if role == SOURCE),
                "destinations": sorted(r for (role, r) in self._members if role == DESTINATION),
                "dead": sorted(f"{role} {r}" for role, r in self._dead),
                "error": None if self._error is None else {"type": self._error.kind,
                                                           "message": self._error.message},
                "relay": bool(self._chain),
                "chain": list(self._chain),  # relay: destination ranks in forwarding order (head first)
                # sources' epoch watchers: rank -> the newest epoch each has heard
                "watchers": {r: seen for r, (_, seen, _) in sorted(self._watchers.items())},
                # calls refused for want of a valid proof, per method
                "rejected": rejected,
            }
