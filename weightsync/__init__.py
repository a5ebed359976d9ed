"""weightsync: push RL trainer weights into inference engines, one-sided, over every NIC.

The rooms (docs/ARCHITECTURE.md): the control plane (``weightsync.control``: ``Group``, the
coordinator; the only package that imports Ray), the participant runtime (``weightsync.runtime``:
``Source``, ``Destination``, ``push``), planning (``weightsync.plan``: layouts, ``plan``; numpy only),
the wire protocol (``weightsync.wire``) and the data plane (``TransferEngine``: C++ in cpp/, bound as
``weightsync._ext``).
"""

from weightsync.errors import LayoutError, PlanError, TimeoutError, TransportError, WeightSyncError  # noqa: A004
from weightsync.plan import Plan, plan
from weightsync.runtime.describe import Fused, Placed, Sharded, describe_tensors


def _version() -> str:
    """The installed distribution's version; in a source tree that was never installed, pyproject's."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("weightsync")
    except PackageNotFoundError:
        import re
        from pathlib import Path

        pyproject = Path(__file__).resolve().parent.parent / "pyproject.toml"
        text = pyproject.read_text() if pyproject.exists() else ""
        found = re.search(r'^version\s*=\s*"([^"]+)"', text, re.M)
        return found.group(1) if found else "0+unknown"


__version__ = _version()

__all__ = [
    "Destination",
    "Fused",
    "Group",
    "ImmCounter",
    "LayoutError",
    "Placed",
    "Plan",
    "PlanError",
    "PushHandle",
    "PushStats",
    "Sharded",
    "Source",
    "TimeoutError",
    "Transfer",
    "TransferEngine",
    "TransportError",
    "WeightSyncError",
    "__version__",
    "describe_tensors",
    "new_secret",
    "plan",
    "push",
    "push_async",
]

_LAZY = {
    "TransferEngine": "weightsync.engine",
    "Transfer": "weightsync.engine",
    "ImmCounter": "weightsync.engine",
    "Group": "weightsync.control.group",
    "new_secret": "weightsync.control.group",
    "Source": "weightsync.runtime.source",
    "Destination": "weightsync.runtime.destination",
    "PushStats": "weightsync.runtime.push_stats",
    "PushHandle": "weightsync.runtime.push_handle",
    "push": "weightsync.runtime.source",
    "push_async": "weightsync.runtime.source",
}


def __getattr__(name: str) -> object:
    # The engine and Ray load on first use, so planning and simulation import without them.
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'weightsync' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)
