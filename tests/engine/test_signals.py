"""Loading the engine leaves the process's signals to it. libfabric's PSM provider links libinfinipath,
whose load-time constructor takes over SIGINT, SIGTERM and the crash signals of the whole process: SIGINT
and SIGTERM then call exit(1) inside the handler (C++ static destructors run under live threads: a crash,
or a process that never ends), and a crash writes a "*.btr" file into the working directory."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests import ROOT

SCRIPT = """
import sys, time
import weightsync.engine
try:
    print("ready", flush=True)  # inside the try: the signal may come as soon as the line is out
    time.sleep(60)
except KeyboardInterrupt:
    print("interrupted", flush=True)
    sys.exit(3)
"""


@pytest.mark.parametrize(("sig", "returncode"), [(signal.SIGINT, 3), (signal.SIGTERM, -signal.SIGTERM)],
                         ids=["SIGINT", "SIGTERM"])
def test_a_process_that_loaded_the_engine_keeps_its_signals(tmp_path: Path, sig: int,
                                                             returncode: int) -> None:
    env = {k: v for k, v in os.environ.items() if k != "IPATH_NO_BACKTRACE"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p)
    # The child starts with the default dispositions whatever the test runner set (pytest-xdist's workers
    # ignore SIGINT, and Python keeps a SIGINT it inherits ignored).
    proc = subprocess.Popen([sys.executable, "-c", SCRIPT], cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        assert proc.stdout is not None and proc.stdout.readline() == "ready\n"
        proc.send_signal(sig)
        # SIGINT is Python's KeyboardInterrupt (the script's except runs); SIGTERM ends it by the signal
        assert proc.wait(30) == returncode, proc.communicate()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert list(tmp_path.iterdir()) == []  # no crash report dropped where the process ran
