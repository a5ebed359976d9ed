"""Planning: from layouts (what every participant holds or needs) to a per-participant program.

numpy only: no Ray, no torch, no I/O (tests/test_boundaries.py checks it). The rooms inside:

* ``layout``: the tensor ``Box`` and the columnar ``Layout`` of one participant;
* ``planner`` with ``intersect``, ``schedule``, ``tiles`` and ``validate``: ``plan()`` and its steps;
* ``ops``: what the planner emits (``Plan``, the ops table, transforms, round sizes);
* ``writes``: one source's ops lowered to engine writes and staged chunks;
* ``lower`` and ``parts``: the whole group's plan lowered into typed, frozen parts, one per
  participant (what the coordinator hands out);
* ``models`` and ``simulate``: layouts from model configs and the cluster-scale cost model.
"""

from weightsync.plan.layout import Box, Layout, TensorTable
from weightsync.plan.ops import (
    LOCAL_ROUND_BYTES,
    OP_DTYPE,
    ROUND_BYTES,
    T_CAST,
    T_FP8,
    T_NONE,
    T_SCALE,
    TRANSFORMS,
    Expected,
    Plan,
)
from weightsync.plan.planner import plan

__all__ = [
    "LOCAL_ROUND_BYTES",
    "OP_DTYPE",
    "ROUND_BYTES",
    "TRANSFORMS",
    "T_CAST",
    "T_FP8",
    "T_NONE",
    "T_SCALE",
    "Box",
    "Expected",
    "Layout",
    "Plan",
    "TensorTable",
    "plan",
]
