"""Fixtures shared across rooms."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from tests import ROOT
from tests.support import leaks
from weightsync.control.group import new_secret


@pytest.fixture(scope="module")
def ray_cluster() -> Iterator[Any]:
    """A local Ray of 4 CPUs for one test module, its workers able to import ``tests`` (the actors in
    tests/runtime/group_actors.py) and holding the job's WEIGHTSYNC_SECRET; yields the ray module."""
    import ray

    # Every actor of the job knows the groups' secret, as an RL framework would set it up.
    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": ROOT, "WEIGHTSYNC_SECRET": new_secret()}})
    yield ray
    ray.shutdown()


@pytest.fixture(autouse=True)
def leaves_nothing_behind(request: pytest.FixtureRequest) -> Iterator[None]:
    """Fails the test that leaves a child process or a network namespace behind (what fixtures of a wider
    scope hold was there before the test began, so it does not count). A leak found here would otherwise
    surface as a stranger failure in a later test, far from its cause."""
    before_children, before_namespaces = leaks.children(), leaks.namespaces()
    yield
    left = leaks.leaked(before_children, before_namespaces)
    if left:
        pytest.fail(f"{request.node.nodeid} left behind: " + "; ".join(left), pytrace=False)
