"""The import graph of rl/ and launch/ has no circles, and rl/contract imports nothing else of rl.

Every module is parsed with `ast` (function-level imports included: a lazy import is still an edge,
so a circle cannot hide behind one). An edge goes to the most specific module named: `from rl.models
import common` is an edge to rl.models.common when that is a module, else to the package rl.models;
`import a.b.c` an edge to a.b.c. A package's `__init__` is a module like any other, so a submodule that
imports its own package's `__init__` which imports it back is a circle.

- No circles: a circle means two modules that cannot be understood (or imported) one without the
  other; the layering is leaves first (rl/contract, rl/models/common, ...), roles last.
- rl/contract is the torch-free contract every process imports: it imports no other part of rl, so
  that importing it never drags in a role, torch, or a module that imports the contract back.
"""
from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
ROOTS = ("rl", "launch")

# Packages whose internal circles are tolerated: none.
CYCLE_ALLOWLIST_PACKAGES: tuple[str, ...] = ()


def module_name(path: Path, repo: Path = REPO) -> str:
    parts = list(path.relative_to(repo).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def all_modules(repo: Path = REPO) -> dict[str, Path]:
    out = {}
    for root in ROOTS:
        for p in sorted((repo / root).rglob("*.py")):
            if ".venv" in p.parts or "__pycache__" in p.parts:
                continue
            out[module_name(p, repo)] = p
    return out


def imports_of(name: str, path: Path, known: set[str]) -> set[str]:
    """The modules of `known` that module `name` (at `path`) imports anywhere in its body."""
    tree = ast.parse(path.read_text(), str(path))
    pkg = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    out: set[str] = set()

    def add(target: str) -> None:
        # the most specific known module: a.b.c, else a.b, else a
        parts = target.split(".")
        for i in range(len(parts), 0, -1):
            cand = ".".join(parts[:i])
            if cand in known:
                out.add(cand)
                return

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                add(a.name)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = pkg.split(".")[: len(pkg.split(".")) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            for a in node.names:
                if f"{mod}.{a.name}" in known:
                    out.add(f"{mod}.{a.name}")
                else:
                    add(mod)
    out.discard(name)
    return out


def graph(repo: Path = REPO) -> dict[str, set[str]]:
    mods = all_modules(repo)
    known = set(mods)
    return {n: imports_of(n, p, known) for n, p in mods.items()}


def cycles(g: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    counter = [0]

    def visit(v: str) -> None:
        # iterative Tarjan (deep graphs would hit the recursion limit otherwise)
        work = [(v, iter(sorted(g.get(v, ()))))]
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        while work:
            node, it = work[-1]
            nxt = next(it, None)
            if nxt is not None:
                if nxt not in index:
                    index[nxt] = low[nxt] = counter[0]
                    counter[0] += 1
                    stack.append(nxt)
                    on.add(nxt)
                    work.append((nxt, iter(sorted(g.get(nxt, ())))))
                elif nxt in on:
                    low[node] = min(low[node], index[nxt])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                comp = []
                while True:
                    w = stack.pop()
                    on.discard(w)
                    comp.append(w)
                    if w == node:
                        break
                if len(comp) > 1:
                    out.append(sorted(comp))

    for v in sorted(g):
        if v not in index:
            visit(v)
    return sorted(out)


def _allowed(comp: list[str]) -> bool:
    return all(any(m == p or m.startswith(p + ".") for p in CYCLE_ALLOWLIST_PACKAGES) for m in comp)


def test_no_import_circles():
    found = [c for c in cycles(graph()) if not _allowed(c)]
    assert not found, "import circles:\n" + "\n".join(" <-> ".join(c) for c in found)


def test_contract_imports_nothing_else_of_rl():
    bad = [f"{n} imports {i}" for n, deps in graph().items() if n.startswith("rl.contract")
           for i in deps if i.startswith("rl.") and not i.startswith("rl.contract") or i == "rl"]
    assert not bad, "rl/contract must import no other part of rl:\n" + "\n".join(sorted(bad))


def test_the_check_sees_a_circle_through_a_function_level_import(tmp_path):
    (tmp_path / "rl" / "pkg").mkdir(parents=True)
    (tmp_path / "launch").mkdir()
    (tmp_path / "rl" / "__init__.py").write_text("")
    (tmp_path / "rl" / "pkg" / "__init__.py").write_text("")
    (tmp_path / "rl" / "pkg" / "a.py").write_text("from rl.pkg import b\n")
    (tmp_path / "rl" / "pkg" / "b.py").write_text("def f():\n    from . import a\n")
    (tmp_path / "rl" / "pkg" / "c.py").write_text("import rl.pkg.a\n")
    assert cycles(graph(tmp_path)) == [["rl.pkg.a", "rl.pkg.b"]]
