"""The exceptions weightsync raises. Every one names what it is about (tensor, rank, peer, region)."""

from __future__ import annotations

import builtins


class WeightSyncError(Exception):
    """Base of every error weightsync raises on purpose."""


class LayoutError(WeightSyncError):
    """A layout (what a participant holds or needs) is malformed or inconsistent with the others."""


class PlanError(WeightSyncError):
    """The planner cannot build a valid plan from otherwise well-formed layouts."""


class TransportError(WeightSyncError):
    """The data plane failed: a provider error, a dead peer, a bad descriptor or region."""


class TimeoutError(WeightSyncError, builtins.TimeoutError):  # noqa: A001 - the contract names it so
    """A wait ran past its timeout. Also a builtin ``TimeoutError`` so generic handlers catch it."""
