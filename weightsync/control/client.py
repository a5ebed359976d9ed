"""What a participant's runtime asks of the control plane, behind one object: join, fetch its plan part,
learn the plan epoch, report dead peers, exchange FP8 receive buffers, record metrics.

The runtime (weightsync.runtime) never imports Ray: it holds a :class:`ControlClient`, which does.
"""

from __future__ import annotations

import logging
import socket
import time
import weakref
from collections.abc import Callable, Mapping
from typing import Any

from weightsync.control.admission import Proof, admission_key, prove
from weightsync.control.engine_key import engine_key
from weightsync.control.group import actor_name, participant_secret
from weightsync.control.watcher import DROPPED, MEMBER, SUPERSEDED, EpochWatcher, MembershipWatcher
from weightsync.errors import TimeoutError, WeightSyncError  # noqa: A004
from weightsync.plan.parts import EngineInfo, Part, PlanFailure, unpack_part

log = logging.getLogger("weightsync")


def host_id() -> str:
    """This process's host as the planner compares hosts: Ray's node id inside Ray, else the host name."""
    try:
        import ray

        if ray.is_initialized():
            return ray.get_runtime_context().get_node_id()
    except Exception:  # outside Ray: the host name is as good an identity
        pass
    return socket.gethostname()


class ControlClient:
    """One participant's connection to its group's coordinator (found by name in the caller's Ray
    namespace). ``secret`` None: the group's secret as this process knows it (its environment's
    WEIGHTSYNC_SECRET; weightsync.control.group.resolve_secret), else an error saying how to share it."""

    # What a participant is to the coordinator (``membership``, ``start_member_watcher``).
    MEMBER, DROPPED, SUPERSEDED = MEMBER, DROPPED, SUPERSEDED

    def __init__(self, group: str, role: str, rank: int, secret: str | None = None) -> None:
        import ray

        self.group = group
        self.role = role
        self.rank = int(rank)
        try:
            self._coord = ray.get_actor(actor_name(group))
        except ValueError:  # Ray's "Failed to look up actor": name the group and what to do instead
            namespace = ray.get_runtime_context().namespace
            raise WeightSyncError(
                f"group {group!r} does not exist in Ray namespace {namespace!r}: create it with "
                f"ws.Group.create({group!r}, ...) before its sources and destinations (or it was shut "
                "down)") from None
        secret = participant_secret(group, secret)
        # Only the two keys derived from the secret are kept: proofs made with the admission key are all
        # the coordinator gets from this participant; the engine key only its transfer engine gets.
        self._admission_key = admission_key(secret, group)
        self._engine_key = engine_key(secret, group)
        self._reported: Any = None  # the last report_dead, not yet known to have re-planned
        self._metrics: Any = None

    def engine_key(self) -> bytes:
        """The key this participant's transfer engine proves to other members' engines (and demands of
        them): weightsync.control.engine_key, from the group's secret."""
        return self._engine_key

    def _prove(self, method: str) -> Proof:
        """A fresh proof of the group's secret for one call of the coordinator's ``method``."""
        return prove(self._admission_key, self.group, method)

    def _get(self, ref: Any, timeout: float, what: str) -> Any:
        """``ray.get`` of a coordinator call, with weightsync errors only: the coordinator's own error
        (a refusal, a failed wait) as its weightsync type, not wrapped in Ray's RayTaskError; no answer
        within ``timeout`` as a weightsync TimeoutError saying ``what`` was asked; a coordinator that is
        gone as a WeightSyncError naming the group."""
        import ray

        try:
            return ray.get(ref, timeout=timeout)
        except ray.exceptions.RayTaskError as exc:
            cause = exc.cause if isinstance(getattr(exc, "cause", None), Exception) else exc
            if isinstance(cause, WeightSyncError):
                raise type(cause)(str(cause)) from None
            raise WeightSyncError(f"group {self.group!r}: {self.role} rank {self.rank}: {what} failed in "
                                  f"the coordinator: {type(cause).__name__}: {cause}") from None
        except ray.exceptions.RayActorError:
            raise self._gone() from None
        except ray.exceptions.GetTimeoutError:
            raise TimeoutError(f"group {self.group!r}: {self.role} rank {self.rank}: the coordinator did "
                               f"not answer {what} within {timeout:.3g} s") from None

    def _gone(self) -> WeightSyncError:
        return WeightSyncError(f"group {self.group!r}: its coordinator is gone (the group was shut down or "
                               f"its actor died); {self.role} rank {self.rank} cannot reach it")

    # -- membership and parts ----------------------------------------------------------------------
    def join(self, layout: bytes, address: bytes, engine: EngineInfo, descriptors: Mapping[str, list[bytes]],
             mailbox: bytes, timeout: float, rejoin: bool = False) -> int:
        """Joins the group; returns the plan epoch before the join (the first part is newer than it).
        ``rejoin``: this process was dropped and asks to be taken back (refused with a WeightSyncError if
        another process holds its rank by then)."""
        return self._get(self._coord.join.remote(
            self._prove("join"), self.role, self.rank, layout, address, host_id(), engine.to_dict(),
            dict(descriptors), mailbox, rejoin), timeout, "its join")

    def membership(self, address: bytes, timeout: float) -> tuple[str, int]:
        """What this process (its engine ``address``) is to the group now and the plan epoch:
        ("member" | "dropped" | "superseded", epoch) (weightsync.control.watcher)."""
        state, epoch = self._get(self._coord.wait_member.remote(
            self._prove("wait_member"), self.role, self.rank, address, "", 0.0), timeout,
            "what this process is to the group")
        return str(state), int(epoch)

    def start_member_watcher(self, owner: object, address: bytes,
                             on_answer: Callable[[str, int], None]) -> MembershipWatcher:
        """Starts this participant's membership watcher (``on_answer(state, epoch)`` on every answer, from
        its thread); it stops when ``owner`` is collected without close()."""
        watcher = MembershipWatcher(self._coord, self._prove, self.group, self.role, self.rank, address,
                                    on_answer)
        weakref.finalize(owner, watcher.stop, 0.0)
        return watcher

    def fetch_part(self, after_epoch: int, timeout: float) -> Part:
        """This participant's part of the first plan newer than ``after_epoch``. A failed planning
        comes back as a PlanFailure (its ``error()`` is what to raise)."""
        # The coordinator itself waits up to ``timeout`` for the plan (and says so): Ray gets a margin.
        blob = self._get(self._coord.part.remote(self._prove("part"), self.role, self.rank, after_epoch,
                                                 timeout),
                         timeout + 10, f"a plan newer than epoch {after_epoch}")
        return unpack_part(blob)

    def current_epoch(self, timeout: float) -> int:
        """The coordinator's plan epoch (a round trip: sources use their watcher first)."""
        return int(self._get(self._coord.current_epoch.remote(self._prove("current_epoch")), timeout,
                             "the plan epoch"))

    def report_dead(self, role: str, ranks: list[int], epoch: int) -> None:
        """Reports peers that failed during plan ``epoch``; not awaited here (see ``reported_epoch``)."""
        self._reported = self._coord.report_dead.remote(self._prove("report_dead"),
                                                        f"{self.role} {self.rank}", role, ranks, epoch)

    def reported_epoch(self, timeout: float) -> int:
        """The epoch after the last report (-1: none pending); a lost report is logged, not raised."""
        import ray

        if self._reported is None:
            return -1
        ref, self._reported = self._reported, None
        try:
            return int(ray.get(ref, timeout=timeout))
        except Exception as exc:  # the report is lost; the epoch still comes from the watcher
            log.warning("%s %d: reporting failed destinations failed: %s", self.role, self.rank, exc)
            return -1

    def start_watcher(self, owner: object) -> EpochWatcher:
        """Starts this source's epoch watcher; it stops when ``owner`` is collected without close()."""
        watcher = EpochWatcher(self._coord, self._prove, self.group, self.rank)
        weakref.finalize(owner, watcher.stop, 0.0)
        return watcher

    # -- FP8 gathers -------------------------------------------------------------------------------
    def publish_receive(self, epoch: int, descriptor: bytes, timeout: float) -> None:
        """Publishes this source's FP8 receive buffer for plan ``epoch``."""
        self._get(self._coord.publish_receive.remote(self._prove("publish_receive"), self.rank, epoch,
                                                     descriptor), timeout,
                  f"publishing its receive buffer of plan epoch {epoch}")

    def receive_buffers(self, epoch: int, ranks: list[int], deadline: float) -> dict[int, bytes]:
        """The receive-buffer descriptors of source ``ranks`` for plan ``epoch`` (by a monotonic deadline)."""
        left = max(deadline - time.monotonic(), 0.1)
        ref = self._coord.receive_buffers.remote(self._prove("receive_buffers"), epoch, ranks, left)
        return self._get(ref, left + 10, f"the receive buffers of source ranks {ranks}")

    # -- metrics -----------------------------------------------------------------------------------
    def record_push(self, seconds: float, nbytes: int) -> None:
        """Ray metrics of one push (best effort: no metrics agent outside a cluster)."""
        try:
            from ray.util import metrics

            if self._metrics is None:
                tags = ("group", "rank")
                self._metrics = (
                    metrics.Histogram("weightsync_push_seconds", "Seconds per push",
                                      boundaries=[0.001, 0.01, 0.1, 1, 10, 60], tag_keys=tags),
                    metrics.Counter("weightsync_push_bytes", "Bytes pushed", tag_keys=tags),
                )
            tags = {"group": self.group, "rank": str(self.rank)}
            self._metrics[0].observe(seconds, tags=tags)
            self._metrics[1].inc(nbytes, tags=tags)
        except Exception:  # metrics are best effort: no Ray metrics agent outside a cluster
            pass


__all__ = ["ControlClient", "PlanFailure", "host_id"]
