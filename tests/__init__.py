"""weightsync's tests, by room: tests/plan (numpy only), tests/control (coordinator, epoch watcher),
tests/runtime (sources and destinations through Ray on CPU), tests/engine (the data plane)."""

import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repository
