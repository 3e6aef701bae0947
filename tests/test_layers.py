"""The layers between packages hold, and no modules import each other in a circle. `lint-imports` checks
the contracts in pyproject.toml (the layers of docs/design/layers.md; gateway and engines independent;
fleetdata, planfile, cliutil, workqueue and protos at the bottom; engines and gateway without the
planner; load and sim on top; planner, predictor and quant free of serving code)."""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
from pathlib import Path

from tests.harness import REPO


def test_import_contracts_are_kept():
    exe = shutil.which("lint-imports") or str(Path(sys.executable).parent / "lint-imports")
    out = subprocess.run([exe], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-2000:]
    assert "0 broken" in out.stdout


def import_cycles(graph) -> list[list[str]]:
    """The groups of modules that import each other in a circle (strongly connected, more than one module),
    imports under ``TYPE_CHECKING`` and inside functions included."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out = []
    for root in sorted(graph.modules):
        if root in index:
            continue
        work = [(root, iter(sorted(graph.find_modules_directly_imported_by(root))))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            v, children = work[-1]
            w = next(children, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph.find_modules_directly_imported_by(w)))))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                group = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    group.append(w)
                    if w == v:
                        break
                if len(group) > 1:
                    out.append(sorted(group))
    return out


def dynamic_imports(root: Path, packages: list[str]) -> list[tuple[str, str]]:
    """``(importer, imported)`` for every ``import_module("a.b")`` / ``importlib.import_module("a.b")`` with a
    constant name in ``packages`` under ``root``: edges grimp does not see (it reads import statements)."""
    out = []
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            parts = path.relative_to(root).with_suffix("").parts
            module = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if not isinstance(node, ast.Call) or not node.args:
                    continue
                f = node.func
                name = f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else ""
                arg = node.args[0]
                if name == "import_module" and isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                    if arg.value.split(".")[0] in packages:
                        out.append((module, arg.value))
    return out


def project_graph(root: Path, packages: list[str]):
    """The import graph of ``packages``: import statements (``TYPE_CHECKING`` and function-level ones
    included) and ``import_module`` calls with a constant name."""
    import grimp

    graph = grimp.build_graph(*packages, cache_dir=None, exclude_type_checking_imports=False)
    for importer, imported in dynamic_imports(root, packages):
        graph.add_import(importer=importer, imported=imported)
    return graph


def test_no_modules_import_each_other_in_a_circle():
    packages = sorted(p.parent.name for p in REPO.glob("*/__init__.py") if p.parent.name != "tests")
    graph = project_graph(REPO, packages)
    assert len(graph.modules) > 100
    assert import_cycles(graph) == [], (
        "modules that import each other in a circle (move the shared piece down)"
    )


def test_the_graph_sees_type_checking_and_import_module_edges(tmp_path, monkeypatch):
    """A circle that runs through a ``TYPE_CHECKING`` import and an ``import_module`` call (as
    gateway.assign's did: estimates -> policies -> prefix_policy -> estimates) is found."""
    pkg = tmp_path / "circ"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from circ.b import X\n"
    )
    (pkg / "b.py").write_text(
        "from importlib import import_module\ndef f():\n    return import_module('circ.c')\n"
    )
    (pkg / "c.py").write_text("from circ import a\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert import_cycles(project_graph(tmp_path, ["circ"])) == [["circ.a", "circ.b", "circ.c"]]


def test_the_cycle_finder_sees_a_circle_of_three():
    import grimp

    graph = grimp.ImportGraph()
    for a, b in [("p.a", "p.b"), ("p.b", "p.c"), ("p.c", "p.a"), ("p.c", "p.d"), ("p.e", "p.d")]:
        graph.add_import(importer=a, imported=b)
    assert import_cycles(graph) == [["p.a", "p.b", "p.c"]]


def test_load_is_kept_in_rooms_by_job():
    """`load/` holds at most 12 modules at its top level; the rest live in subpackages by job (chaos, studies,
    soaks, reports), each saying its role."""
    top = sorted(p.name for p in (REPO / "load").glob("*.py"))
    assert len(top) <= 12, top
    for sub in ("chaos", "studies", "soaks", "reports"):
        assert (REPO / "load" / sub / "__init__.py").read_text().startswith('"""'), sub
