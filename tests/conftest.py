"""Fixtures shared across rooms, the leak check every test runs under, and the hard stop behind the
per-test timeout."""

from __future__ import annotations

import faulthandler
import os
from collections.abc import Generator, Iterator
from typing import Any

import pytest

from tests import ROOT
from tests.support import leaks
from weightsync.control.group import new_secret

# A test still running this long after its timeout has a main thread that the timeout's signal cannot
# reach (stuck in native code that never returns to Python): every thread's stack is written to the
# terminal and the run ends, rather than waiting for the suite's own limit.
HARD_STOP_AFTER_S = float(os.environ.get("WEIGHTSYNC_TEST_HARD_STOP_S", "60"))

_stderr_fd: int | None = None

# A Ray actor or task sees only the GPUs it asked Ray for. Ray no longer hides the host's GPUs from one that
# asked for none, so on a GPU host every CPU test's actor (and the engine of every participant in it,
# transport "auto") would start CUDA and open a cuda lane on GPU 0: seconds of start-up per process, all
# of them on one GPU, and not the CPU path those tests are about. Set before any Ray is started here
# (the Rays the tests start, and those of the scripts they run, inherit it).
os.environ.setdefault("RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO", "1")


def pytest_configure(config: pytest.Config) -> None:
    global _stderr_fd
    leaks.track_engines()
    # The terminal itself: what the hard stop writes must not go to a test's captured output.
    _stderr_fd = os.dup(2)


def _timeout_of(item: pytest.Item) -> float:
    """The test's timeout as pytest-timeout applies it: its marker, else --timeout, else the ini's."""
    marker = item.get_closest_marker("timeout")
    if marker is not None and (marker.args or "timeout" in marker.kwargs):
        value = marker.args[0] if marker.args else marker.kwargs["timeout"]
        return float(value or 0)
    given = item.config.getoption("timeout", None)
    if given is not None:
        return float(given)
    try:
        return float(item.config.getini("timeout") or 0)
    except ValueError:  # no pytest-timeout in this environment: no timeout to back up
        return 0.0


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Generator[None, Any, Any]:
    timeout = _timeout_of(item)
    if timeout <= 0 or _stderr_fd is None:
        return (yield)
    faulthandler.dump_traceback_later(timeout + HARD_STOP_AFTER_S, exit=True, file=_stderr_fd)
    try:
        return (yield)
    finally:
        faulthandler.cancel_dump_traceback_later()


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


@pytest.fixture(scope="module", autouse=True)
def module_leaves_nothing_behind(request: pytest.FixtureRequest) -> Iterator[None]:
    """What a module's own fixtures made (a Ray cluster, actors, peers) must be gone once they are torn
    down: this fixture is set up before them and torn down after them. A leak shows as an error in the
    teardown of the module's last test."""
    before = leaks.Snapshot()
    yield
    left = leaks.leaked(before)
    if left:
        pytest.fail(f"{request.node.nodeid} (its fixtures) left behind: " + "; ".join(left), pytrace=False)


@pytest.fixture(autouse=True)
def leaves_nothing_behind(request: pytest.FixtureRequest) -> Iterator[None]:
    """Fails the test that leaves anything of ``tests.support.leaks`` behind (what fixtures of a wider
    scope hold was there before the test began, so it does not count). A leak found here would otherwise
    surface as a stranger failure in a later test, far from its cause."""
    before = leaks.Snapshot()
    yield
    left = leaks.leaked(before)
    if left:
        pytest.fail(f"{request.node.nodeid} left behind: " + "; ".join(left), pytrace=False)
