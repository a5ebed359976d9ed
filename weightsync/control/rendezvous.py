"""How a process finds its group's Ray cluster.

A Ray worker (an actor or task) is connected already: its group is found in its own namespace. A process
that Ray did not start (vLLM's multiprocessing workers, a trainer launched by torchrun) has to be told
where the cluster is: an explicit Ray address and namespace, handed in or set as
``WEIGHTSYNC_RAY_ADDRESS`` / ``WEIGHTSYNC_RAY_NAMESPACE``. Such a process never starts a Ray of its own:
a local Ray would hold no coordinator, and the join would wait for a group that is not there.

Joining is bounded: an address nobody answers on fails within ``timeout`` with an error that names it,
instead of holding up the start-up of the process (an inference worker) that joins.
"""

from __future__ import annotations

import os
import socket
import threading
from dataclasses import dataclass
from typing import Any

from weightsync.errors import TimeoutError, WeightSyncError  # noqa: A004

ADDRESS_ENV = "WEIGHTSYNC_RAY_ADDRESS"
NAMESPACE_ENV = "WEIGHTSYNC_RAY_NAMESPACE"
# Ray addresses that start a new cluster instead of joining one: refused for participants.
_STARTS_A_CLUSTER = {"local", ""}


@dataclass(frozen=True)
class Rendezvous:
    """Where a group's coordinator lives: a Ray address (``host:port`` of the cluster's GCS, ``auto``
    for the cluster of this machine, or a ``ray://`` client address) and a Ray namespace."""

    address: str
    namespace: str

    @classmethod
    def from_env(cls) -> Rendezvous | None:
        """The rendezvous named by ``WEIGHTSYNC_RAY_ADDRESS`` / ``WEIGHTSYNC_RAY_NAMESPACE``, or None."""
        address = os.environ.get(ADDRESS_ENV, "")
        if not address:
            return None
        return cls(address, os.environ.get(NAMESPACE_ENV, ""))


def current_namespace() -> str | None:
    """The Ray namespace this process is connected in, or None when it is not connected."""
    import ray

    if not ray.is_initialized():
        return None
    return ray.get_runtime_context().namespace


def _probe(address: str, timeout: float) -> None:
    """Fails fast when nothing listens at a ``host:port`` address (Ray itself would retry for a minute
    or more before giving up)."""
    if address == "auto" or "://" in address or ":" not in address:
        return
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host, int(port)), timeout=max(0.1, min(timeout, 5.0))):
            pass
    except (OSError, ValueError) as exc:
        raise WeightSyncError(f"no Ray cluster answers at {address!r} ({exc}); weightsync does not start "
                              "one: start the cluster first (ray start --head) or pass its address") from None


def connect(address: str | None = None, namespace: str | None = None, *, timeout: float = 60.0) -> str:
    """Connects this process to the group's Ray cluster unless it is connected already; returns the
    namespace it is connected in.

    ``address``/``namespace`` None: taken from ``WEIGHTSYNC_RAY_ADDRESS`` / ``WEIGHTSYNC_RAY_NAMESPACE``.
    A process that Ray started (connected already) keeps its connection; a namespace handed in must then
    be the one it runs in. A process that is not connected and knows no address gets an error; it never
    starts a local Ray. ``timeout`` bounds the connection (seconds)."""
    import ray

    if namespace is None:
        namespace = os.environ.get(NAMESPACE_ENV) or None
    here = current_namespace()
    if here is not None:
        if namespace is not None and namespace != here:
            raise WeightSyncError(f"this process is connected to Ray in namespace {here!r}, not in "
                                  f"{namespace!r} where the group was said to be")
        return here
    if address is None:
        address = os.environ.get(ADDRESS_ENV, "")
    if address in _STARTS_A_CLUSTER:
        raise WeightSyncError(
            "this process is not a Ray worker and was given no Ray address: pass the group's Ray address "
            f"and namespace (or set {ADDRESS_ENV} and {NAMESPACE_ENV}); weightsync does not start a "
            "local Ray here, which would hold no group")
    _probe(address, timeout)
    failure: list[BaseException] = []

    def init() -> None:
        try:
            ray.init(address=address, namespace=namespace, log_to_driver=False, ignore_reinit_error=True)
        except BaseException as exc:  # handed to the caller's thread
            failure.append(exc)

    # ray.init has no timeout of its own: it runs in a helper thread so that the caller gets its answer
    # in time (the thread, if stuck, ends with the process).
    worker = threading.Thread(target=init, name="weightsync-ray-connect", daemon=True)
    worker.start()
    worker.join(timeout)
    if worker.is_alive():
        raise TimeoutError(f"connecting to the Ray cluster at {address!r} took more than {timeout} s")
    if failure:
        raise WeightSyncError(
            f"cannot connect to the Ray cluster at {address!r}: {failure[0]}") from failure[0]
    return ray.get_runtime_context().namespace


def ensure_ray(init_kwargs: dict[str, Any] | None = None) -> None:
    """The driver's path (``Group.create``): connected already, or to the cluster the environment names
    (``WEIGHTSYNC_RAY_ADDRESS``), or else a Ray of its own as ``ray.init()`` makes it (a driver may host
    the group: its participants then run as its Ray workers or join with its address)."""
    import ray

    if ray.is_initialized():
        return
    where = Rendezvous.from_env()
    if where is not None:
        connect(where.address, where.namespace or None)
        return
    ray.init(**(init_kwargs or {}))


__all__ = ["ADDRESS_ENV", "NAMESPACE_ENV", "Rendezvous", "connect", "current_namespace", "ensure_ray"]
