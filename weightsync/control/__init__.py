"""The control plane: the only package that imports Ray.

* ``coordinator``: the ``Coordinator`` (a plain class; ``Group.create`` makes it a named actor) that
  collects layouts, lowers the plan into parts (weightsync.plan.lower) and tracks membership;
* ``group``: the driver's ``Group`` handle and the group's secret;
* ``watcher``: long-poll threads: a source's epoch watcher, and a destination's membership watcher (it
  hears that the coordinator dropped it, and the destination joins again);
* ``client``: ``ControlClient``, what a participant's runtime calls to join, fetch its part and
  report failures, so that weightsync.runtime never imports Ray.
"""

from weightsync.control.client import ControlClient, host_id
from weightsync.control.coordinator import Coordinator
from weightsync.control.group import Group
from weightsync.control.watcher import EpochWatcher, MembershipWatcher

__all__ = ["ControlClient", "Coordinator", "EpochWatcher", "Group", "MembershipWatcher", "host_id"]
