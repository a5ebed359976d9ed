"""examples/minimal.py, README's first example, run as a user runs it (``python -m examples.minimal``, its
own Ray): one push lands, and README shows the file's code as it is."""

from __future__ import annotations

import os
import subprocess
import sys

from tests import ROOT


def test_the_minimal_example_pushes_and_is_what_readme_shows() -> None:
    proc = subprocess.run([sys.executable, "-m", "examples.minimal"], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.stdout.strip().splitlines()[-1] == "64 16.0"
    with open(os.path.join(ROOT, "examples", "minimal.py")) as f:
        code = f.read()
    with open(os.path.join(ROOT, "README.md")) as f:
        readme = f.read()
    assert "```python\n" + code[code.index("import ray"):].rstrip() + "\n```" in readme
