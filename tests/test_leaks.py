"""The leak check every test runs under (tests/conftest.py) can fail: a child process or a network
namespace a test leaves is reported, one that goes within the grace time is not."""

from __future__ import annotations

import subprocess
import sys

from tests.support import leaks


def test_a_child_left_running_is_reported_and_one_that_exits_is_not() -> None:
    before = leaks.children()
    stays = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    goes = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(0.5)"])
    try:
        left = leaks.leaked(before, leaks.namespaces(), grace_s=3.0)
        assert len(left) == 1 and left[0].startswith(f"child process {stays.pid} "), left
    finally:
        stays.kill()
        stays.wait()
        goes.wait()
    assert leaks.leaked(before, leaks.namespaces(), grace_s=3.0) == []


def test_a_namespace_is_ours_when_this_process_tree_or_nobody_made_it() -> None:
    import os

    assert leaks._ours(f"wsA{os.getpid()}x1")
    assert leaks._ours("wsA999999999x1")  # its creator is gone: left behind
    assert not leaks._ours("wsA1x1")  # init's: another tree, alive
    assert leaks._ours("untagged")
