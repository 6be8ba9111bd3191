"""engine/ in layers: no import circle anywhere in the package, and the import-linter contract
(pyproject.toml) refuses an upward import, naming both modules."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

grimp = pytest.importorskip("grimp", reason="import-linter (the dev extras) is not installed")

REPO = Path(__file__).resolve().parent.parent


def _cycles(graph) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan), each sorted."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.find_modules_directly_imported_by(v):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10000))
    for m in sorted(graph.modules):
        if m not in index:
            visit(m)
    return out


def test_engine_has_no_import_circle():
    # Every import counts, the lazy ones inside functions too (type-only imports under
    # TYPE_CHECKING do not: they never run).
    graph = grimp.build_graph("engine", cache_dir=None, exclude_type_checking_imports=True)
    assert len(graph.modules) > 40, "grimp found too few modules: is it reading engine/?"
    assert _cycles(graph) == []


def test_the_cycle_finder_finds_a_planted_circle():
    class G:  # a -> b -> c -> a, d -> a
        modules = {"a", "b", "c", "d"}
        edges = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}

        def find_modules_directly_imported_by(self, m):
            return self.edges[m]

    assert _cycles(G()) == [["a", "b", "c"]]


def test_an_upward_import_breaks_the_contract_naming_both_modules(tmp_path):
    # A copy of the package where the reference imports the server: lint-imports must refuse it.
    shutil.copytree(REPO / "engine", tmp_path / "engine",
                    ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(REPO / "pyproject.toml", tmp_path / "pyproject.toml")
    mla = tmp_path / "engine" / "reference" / "mla.py"
    mla.write_text(mla.read_text() + "\nfrom engine.serving import server  # planted\n")
    argv = [sys.executable, "-c", "from importlinter.cli import lint_imports_command as c; c()",
            "--no-cache"]
    r = subprocess.run(argv, cwd=tmp_path, env={"PYTHONPATH": str(tmp_path), "PATH": "/usr/bin:/bin"},
                       capture_output=True, text=True, timeout=120)
    assert r.returncode != 0, r.stdout
    assert "engine.reference.mla -> engine.serving.server" in r.stdout, r.stdout
    ok = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert "0 broken" in ok.stdout
