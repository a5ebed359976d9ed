"""The rooms' import boundaries, read from the source (AST, so lazy imports inside functions count too):
only weightsync/control imports Ray; weightsync/plan imports neither torch nor Ray; the runtime reaches
the control plane only through weightsync.control.client; no two modules of weightsync import each other,
directly or around a circle; no module is over MAX_LINES lines."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "weightsync"
MAX_LINES = 800


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
                                                       "weightsync.engine", "weightsync.sim")))
    assert not upward, f"{path.relative_to(PACKAGE)} imports {upward}: planning depends on no other room"


@pytest.mark.parametrize("path", _modules("runtime"), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_the_runtime_reaches_the_control_plane_through_its_client(path: Path) -> None:
    control = {m for m in _imports(path) if m.startswith("weightsync.control")}
    assert control <= {"weightsync.control", "weightsync.control.client",
                       "weightsync.control.client.ControlClient"}, (
        f"{path.relative_to(PACKAGE)} imports {sorted(control)}")


@pytest.mark.parametrize("path", _modules("sim"), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_the_simulator_drives_the_planner_alone(path: Path) -> None:
    """weightsync/sim builds layouts and runs the planner's plans through a cost model: like the planner
    it imports neither torch nor Ray, and of weightsync only the planner (and errors)."""
    found = _imports(path)
    heavy = sorted({"torch", "ray"} & found)
    assert not heavy, f"{path.relative_to(PACKAGE)} imports {heavy}"
    other = sorted(m for m in found if m.startswith(("weightsync.control", "weightsync.runtime",
                                                      "weightsync.engine", "weightsync.delta",
                                                      "weightsync.integrations")))
    assert not other, f"{path.relative_to(PACKAGE)} imports {other}"


def test_planning_loads_without_torch_or_ray() -> None:
    """Importing every planning module (and the wire protocol) in a fresh interpreter loads no torch and
    no Ray."""
    import subprocess
    import sys

    code = ("import sys, weightsync.plan, weightsync.plan.lower, weightsync.plan.parts, "
            "weightsync.sim.simulate, weightsync.sim.models, weightsync.wire; "
            "print(sorted({m.split('.')[0] for m in sys.modules} & {'torch', 'ray'}))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]", out.stdout


def _module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph(root: Path) -> dict[str, set[str]]:
    """Module -> the modules of ``root``'s package it imports (AST: lazy imports inside functions count).
    ``from a.b import c`` names module ``a.b.c`` where that is a module, else ``a.b``; an import of
    ``a.b.c`` is an edge to ``a.b.c`` alone (its packages' ``__init__`` run first, but importing a
    module from inside its own package is no circle of the code's making)."""
    paths = sorted(root.rglob("*.py"))
    modules = {_module_name(p, root): p for p in paths}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        edges: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                    mod = f"{base}.{node.module}" if node.module else base
                else:
                    mod = node.module or ""
                targets = [f"{mod}.{a.name}" if f"{mod}.{a.name}" in modules else mod for a in node.names]
            else:
                continue
            edges.update(t for t in targets if t in modules and t != name)
        graph[name] = edges
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle of ``graph`` (its modules in order, the first repeated at the end), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        path.append(m)
        for n in sorted(graph[m]):
            if state.get(n) == 1:
                return [*path[path.index(n):], n]
            if n not in state:
                found = visit(n)
                if found:
                    return found
        state[m] = 2
        path.pop()
        return None

    for m in sorted(graph):
        if m not in state:
            found = visit(m)
            if found:
                return found
    return None


def test_no_import_circle_in_the_package() -> None:
    cycle = find_cycle(import_graph(PACKAGE))
    assert cycle is None, f"an import circle inside weightsync: {' -> '.join(cycle)}"


def test_the_circle_check_can_fail(tmp_path: Path) -> None:
    """A circle made of a lazy import inside a function, through ``from pkg import module``, is found."""
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "codec.py").write_text("def f():\n    from pkg.sub import kernels\n    return kernels\n")
    (pkg / "sub" / "kernels.py").write_text("from pkg.codec import f\n")
    (pkg / "plain.py").write_text("import pkg.codec\n")
    assert find_cycle(import_graph(pkg)) == ["pkg.codec", "pkg.sub.kernels", "pkg.codec"]
    (pkg / "sub" / "kernels.py").write_text("X = 1\n")
    assert find_cycle(import_graph(pkg)) is None


@pytest.mark.parametrize("path", _modules(), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_no_module_is_over_max_lines(path: Path) -> None:
    rel = path.relative_to(PACKAGE).as_posix()
    lines = len(path.read_text().splitlines())
    assert lines <= MAX_LINES, f"weightsync/{rel} has {lines} lines (at most {MAX_LINES})"
