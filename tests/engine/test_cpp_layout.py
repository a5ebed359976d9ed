"""The C++ engine's rooms, read from the source: core/ (the engine, its lane workers, counters) includes
nothing from the lanes built on it (fabric/, cuda/), and no file grows past what a reader takes in."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

CPP = Path(__file__).resolve().parents[2] / "cpp"
MAX_LINES = 1000


def _sources() -> list[Path]:
    return sorted(p for p in CPP.rglob("*") if p.suffix in (".cpp", ".hpp", ".cu", ".cuh"))


def test_the_scan_sees_the_engine() -> None:
    """The checks are able to fail: the sources are found, and an include of a lane is seen."""
    assert CPP / "core" / "engine.cpp" in _sources()
    assert "fabric/msg_lane.hpp" in _includes(CPP / "fabric" / "fabric_lane.cpp")


def _includes(path: Path) -> set[str]:
    return set(re.findall(r'^#include "([^"]+)"', path.read_text(), re.MULTILINE))


@pytest.mark.parametrize("path", sorted((CPP / "core").iterdir()), ids=lambda p: p.name)
def test_core_includes_no_lane(path: Path) -> None:
    upward = sorted(i for i in _includes(path) if not i.startswith("core/"))
    assert not upward, f"cpp/core/{path.name} includes {upward}: core depends on no lane"


@pytest.mark.parametrize("path", _sources(), ids=lambda p: str(p.relative_to(CPP)))
def test_no_file_over_the_limit(path: Path) -> None:
    n = len(path.read_text().splitlines())
    where = path.relative_to(CPP)
    assert n <= MAX_LINES, f"cpp/{where} has {n} lines (at most {MAX_LINES}): split it along a seam"
