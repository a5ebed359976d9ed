"""Fixtures shared across rooms."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from tests import ROOT


@pytest.fixture(scope="module")
def ray_cluster() -> Iterator[Any]:
    """A local Ray of 4 CPUs for one test module, its workers able to import ``tests`` (the actors in
    tests/runtime/group_actors.py); yields the ray module."""
    import ray

    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": ROOT}})
    yield ray
    ray.shutdown()
