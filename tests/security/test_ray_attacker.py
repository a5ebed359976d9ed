"""Runs tests/security/ray_attacker_scenarios.py in a fresh interpreter.

Those scenarios make their process a driver of a cluster started with ``ray start`` (token
authentication off). A process that has run a local Ray (``ray.init(address="local")``, as earlier
test modules do) is left with ``RAY_AUTH_MODE=token`` in its environment and Ray's configuration, and
as a driver of the other cluster it lost the coordinator actor it created ("all references removed
... cancelled before it started"), so the scenarios get a process of their own, with that variable
set to match the cluster.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests import ROOT


# Longer than the default: a whole pytest session (a Ray cluster of its own and three scenarios, each under
# the default timeout there) runs inside this one test.
@pytest.mark.timeout(420)
def test_ray_attacker_scenarios_in_a_fresh_process() -> None:
    env = {**os.environ, "RAY_AUTH_MODE": "disabled"}
    env.pop("RAY_ADDRESS", None)
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                          "tests/security/ray_attacker_scenarios.py"], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=400)
    assert out.returncode == 0, out.stdout[-6000:] + out.stderr[-2000:]
    assert "3 passed" in out.stdout, out.stdout[-2000:]
