"""The layers between packages hold, and no modules import each other in a circle. `lint-imports` checks
the contracts in pyproject.toml (the layers of docs/layers.md; gateway and engines independent;
fleetdata, planfile, cliutil, workqueue and protos at the bottom; engines and gateway without the
planner; load and sim on top; planner, predictor and quant free of serving code)."""

from __future__ import annotations

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


def test_no_modules_import_each_other_in_a_circle():
    import grimp

    packages = sorted(p.parent.name for p in REPO.glob("*/__init__.py") if p.parent.name != "tests")
    graph = grimp.build_graph(*packages, cache_dir=None)
    assert len(graph.modules) > 100
    assert import_cycles(graph) == [], (
        "modules that import each other in a circle (move the shared piece down)"
    )


def test_the_cycle_finder_sees_a_circle_of_three():
    import grimp

    graph = grimp.ImportGraph()
    for a, b in [("p.a", "p.b"), ("p.b", "p.c"), ("p.c", "p.a"), ("p.c", "p.d"), ("p.e", "p.d")]:
        graph.add_import(importer=a, imported=b)
    assert import_cycles(graph) == [["p.a", "p.b", "p.c"]]
