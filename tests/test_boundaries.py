"""The rooms' import boundaries, read from the source (AST, so lazy imports inside functions count too):
only weightsync/control imports Ray; weightsync/plan imports neither torch nor Ray; the runtime reaches
the control plane only through weightsync.control.client."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "weightsync"


def _imports(path: Path) -> set[str]:
    """Top-level package names and full module names every import statement of ``path`` names."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            mods = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            mods = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        else:
            continue
        for m in mods:
            names.add(m)
            names.add(m.split(".")[0])
    return names


def _modules(under: str = "") -> list[Path]:
    return sorted((PACKAGE / under).rglob("*.py"))


def test_the_scan_sees_lazy_imports() -> None:
    """The check is able to fail: an import inside a function is found."""
    assert "ray" in _imports(PACKAGE / "control" / "group.py")
    assert "torch" in _imports(PACKAGE / "runtime" / "staging.py")


@pytest.mark.parametrize("path", _modules(), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_only_the_control_plane_imports_ray(path: Path) -> None:
    if path.is_relative_to(PACKAGE / "control"):
        return
    assert "ray" not in _imports(path), f"{path.relative_to(PACKAGE)} imports ray outside weightsync/control"


@pytest.mark.parametrize("path", _modules("plan"), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_planning_imports_neither_torch_nor_ray_nor_the_runtime(path: Path) -> None:
    found = _imports(path)
    heavy = sorted({"torch", "ray"} & found)
    assert not heavy, f"{path.relative_to(PACKAGE)} imports {heavy}"
    upward = sorted(m for m in found if m.startswith(("weightsync.control", "weightsync.runtime",
                                                       "weightsync.engine")))
    assert not upward, f"{path.relative_to(PACKAGE)} imports {upward}: planning depends on no other room"


@pytest.mark.parametrize("path", _modules("runtime"), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_the_runtime_reaches_the_control_plane_through_its_client(path: Path) -> None:
    control = {m for m in _imports(path) if m.startswith("weightsync.control")}
    assert control <= {"weightsync.control", "weightsync.control.client",
                       "weightsync.control.client.ControlClient"}, (
        f"{path.relative_to(PACKAGE)} imports {sorted(control)}")


def test_planning_loads_without_torch_or_ray() -> None:
    """Importing every planning module (and the wire protocol) in a fresh interpreter loads no torch and
    no Ray."""
    import subprocess
    import sys

    code = ("import sys, weightsync.plan, weightsync.plan.lower, weightsync.plan.parts, "
            "weightsync.plan.simulate, weightsync.plan.models, weightsync.wire; "
            "print(sorted({m.split('.')[0] for m in sys.modules} & {'torch', 'ray'}))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]", out.stdout
