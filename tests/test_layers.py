"""The house rules of the package, read from its source: who imports whom.

- no import circle in ``fxremat/`` or ``benchmarks/`` (lazy imports inside functions count);
- the planning core — ``fxremat.core``, the solvers, the simulator, the planner and the plan
  records — imports no torch, not even through another fxremat module: it takes plain data
  (a :class:`~fxremat.core.CostGraph`) and returns plain data;
- ``fxremat.core`` imports no other fxremat module; the command line imports no private name.
"""

from __future__ import annotations

import ast
import pathlib

import networkx as nx
import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
TORCH_FREE = ("fxremat.core", "fxremat.planner", "fxremat.simulate", "fxremat.records", "fxremat.lowersets",
              "fxremat.solvers.kusumoto", "fxremat.solvers.rotor", "fxremat.solvers.chain", "fxremat.solvers.chen",
              "fxremat.solvers.hong", "fxremat.budget", "fxremat.errors", "fxremat.plots")


def _modules(package: str) -> dict[str, pathlib.Path]:
    found = {}
    for path in sorted((ROOT / package).rglob("*.py")):
        name = ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
        found[name] = path
    return found


def _imports(name: str, path: pathlib.Path, known) -> list[tuple[str, list[str]]]:
    """``(module imported, names taken from it)`` for every import statement in the file."""
    base = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                parts = base.split(".")
                parent = ".".join(parts[:len(parts) - node.level + 1])
                module = f"{parent}.{node.module}" if node.module else parent
            else:
                module = node.module or ""
            names = [a.name for a in node.names]
            subs = [f"{module}.{n}" for n in names if f"{module}.{n}" in known]
            out += [(s, []) for s in subs]
            if len(subs) < len(names):
                out.append((module, [n for n in names if f"{module}.{n}" not in known]))
        elif isinstance(node, ast.Import):
            out += [(a.name, []) for a in node.names]
    return out


def _graph(package: str) -> tuple[nx.DiGraph, dict]:
    modules = _modules(package)
    g = nx.DiGraph()
    imports = {}
    for name, path in modules.items():
        g.add_node(name)
        imports[name] = _imports(name, path, modules)
        for target, _ in imports[name]:
            if target in modules and target != name:
                g.add_edge(name, target)
    return g, imports


@pytest.mark.parametrize("package", ["fxremat", "benchmarks"])
def test_no_import_circle(package):
    g, _ = _graph(package)
    assert nx.is_directed_acyclic_graph(g), f"import circles in {package}/: {list(nx.simple_cycles(g))}"


def test_planning_core_imports_no_torch():
    g, imports = _graph("fxremat")
    for name in TORCH_FREE:
        for module in {name} | nx.descendants(g, name):
            if module == "fxremat":
                raise AssertionError(f"{name} imports the package root (which loads torch) through {module}")
            torch = [t for t, _ in imports[module] if t == "torch" or t.startswith("torch.")]
            assert not torch, f"{name} needs torch: {module} imports {torch}"


def test_core_imports_no_fxremat_module_and_cli_no_private_name():
    g, imports = _graph("fxremat")
    assert not list(g.successors("fxremat.core")), f"fxremat.core imports {list(g.successors('fxremat.core'))}"
    private = [(t, n) for t, names in imports["fxremat.cli"] if t.startswith("fxremat") for n in names
               if n.startswith("_")]
    assert not private, f"fxremat.cli imports private names {private}"
