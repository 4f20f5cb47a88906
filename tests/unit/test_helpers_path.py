"""Tests find what they share through pytest's `pythonpath` (setup.cfg) and tests/helpers, not by
inserting directories into sys.path themselves: `helpers` is this repository's package (ahead of anything
installed under that name), a benchmark module imports by its name, and no test module edits sys.path
(read on the syntax tree) but the few listed below with their reason.
"""
from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

# files that still edit sys.path, each with its reason
ALLOWED = {
    # scripts run as `python FILE`, outside pytest
    "tests/fixtures/swe_real/build.py": "a script run by hand: the repository is not on its path otherwise",
}


def _edits_sys_path(tree: ast.AST) -> list[int]:
    """Lines that call a method of sys.path (insert, append, extend) or assign into it."""
    def is_sys_path(n) -> bool:
        return (isinstance(n, ast.Attribute) and n.attr == "path" and isinstance(n.value, ast.Name)
                and n.value.id == "sys")
    lines = set()
    for node in ast.walk(tree):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and is_sys_path(node.func.value)):
            lines.add(node.lineno)
        if isinstance(node, (ast.Assign, ast.AugAssign)):
            for t in (node.targets if isinstance(node, ast.Assign) else [node.target]):
                if is_sys_path(t) or (isinstance(t, ast.Subscript) and is_sys_path(t.value)):
                    lines.add(node.lineno)
    return sorted(lines)


def test_no_test_module_edits_sys_path():
    bad = []
    for p in sorted((REPO / "tests").rglob("*.py")):
        rel = str(p.relative_to(REPO))
        if rel in ALLOWED:
            continue
        bad += [f"{rel}:{n} edits sys.path (setup.cfg's pythonpath has tests/ and benchmarks/; shared "
                f"helpers go in tests/helpers)" for n in _edits_sys_path(ast.parse(p.read_text(), rel))]
    assert not bad, "\n".join(bad)


def test_the_scan_sees_each_form():
    code = ("import sys\n"
            "sys.path.insert(0, 'a')\n"
            "sys.path[:0] = ['b']\n"
            "sys.path += ['c']\n"
            "sys.path.append('d')\n"
            "x = sys.path[0]\n")
    assert _edits_sys_path(ast.parse(code)) == [2, 3, 4, 5]


def test_helpers_and_benchmarks_import_by_name():
    import helpers
    from helpers import doctor, trainer
    assert Path(helpers.__file__).parent == REPO / "tests" / "helpers"
    assert callable(trainer.synthetic_batch) and callable(doctor.expected_checks)
    import _fault_checks
    assert Path(_fault_checks.__file__).parent == REPO / "benchmarks"
