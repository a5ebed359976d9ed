"""The control plane: the only package that imports Ray.

* ``coordinator``: the ``Coordinator`` (a plain class; ``Group.create`` makes it a named actor) that
  collects layouts, lowers the plan into parts (weightsync.plan.lower) and tracks membership;
* ``group``: the driver's ``Group`` handle and the group's secret;
* ``watcher``: a source's epoch watcher (a long-poll thread);
* ``client``: ``ControlClient``, what a participant's runtime calls to join, fetch its part and
  report failures, so that weightsync.runtime never imports Ray.
"""

from weightsync.control.client import ControlClient, host_id
from weightsync.control.coordinator import Coordinator
from weightsync.control.group import Group
from weightsync.control.watcher import EpochWatcher

__all__ = ["ControlClient", "Coordinator", "EpochWatcher", "Group", "host_id"]
