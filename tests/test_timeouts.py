"""Every test is bounded: pytest-timeout's signal fails a test whose main thread runs Python, and where the
main thread is stuck in native code that never returns to Python (the signal's handler never runs), the
hard stop in tests/conftest.py writes every thread's stack and ends the run."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

from tests import ROOT

STUCK = textwrap.dedent('''
    import signal
    import time

    import pytest


    @pytest.mark.timeout(1)
    def test_stuck_in_python():
        time.sleep(30)


    @pytest.mark.timeout(1)
    def test_stuck_in_native_code():
        # The timeout's signal held back from this thread: the sleep is not cut short and Python's handler
        # does not run until it returns, as in a native wait that never returns to Python.
        signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGALRM])
        time.sleep(30)
''')


def _run(tmp_path: Path, select: str) -> subprocess.CompletedProcess[str]:
    (tmp_path / "test_stuck.py").write_text(STUCK)
    env = {**os.environ, "WEIGHTSYNC_TEST_HARD_STOP_S": "2", "PYTHONPATH": ROOT}
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "tests.conftest",
           "-o", "timeout_method=signal", f"{tmp_path / 'test_stuck.py'}::{select}"]
    return subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)


def test_a_test_stuck_in_python_fails_with_its_stack(tmp_path: Path) -> None:
    out = _run(tmp_path, "test_stuck_in_python")
    assert out.returncode == 1, out.stdout[-3000:] + out.stderr[-3000:]
    assert "Timeout" in out.stdout and "1 failed" in out.stdout, out.stdout[-3000:]
    assert "time.sleep(30)" in out.stdout, out.stdout[-3000:]


def test_a_test_stuck_in_native_code_ends_the_run_with_every_stack(tmp_path: Path) -> None:
    out = _run(tmp_path, "test_stuck_in_native_code")
    assert out.returncode != 0, out.stdout[-3000:] + out.stderr[-3000:]
    # faulthandler's dump, from its own thread, names the test's frame; the run ended there
    dump = out.stderr
    assert "Timeout (0:00:03)!" in dump and "test_stuck_in_native_code" in dump, dump[-3000:]
