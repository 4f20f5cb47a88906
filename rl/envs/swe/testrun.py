"""One way to run a repository's tests, for the grader (rl/envs/swe/grader.py) and the agent's
`run_tests` tool (rl/envs/swe/tools.py) alike.

The reward and the feedback the policy trains on must come from the same run, and that run must be the
one the repository's developers and SWE-bench's harness make: `python -m pytest` in the tree's root with
the repository's own configuration (conftest.py files, ini/toml options, `addopts` with its markers and
`-p` plugins, `filterwarnings`) and the pytest plugins the task's environment has installed, loaded by
their entry points as plain pytest loads them. What we add only changes how results are printed, never
what passes: `-rA`, `-q`, `--tb=short`, `--no-header`, and our own plugin (`-p _hetrl_report`,
rl/envs/swe/pytest_report.py), whose structured report gives each test's outcome, whatever the
repository's colour, verbosity or capture options; the terminal text is only for reading. There is no `-W ignore` (a fix that adds a warning fails under `filterwarnings = error`,
as it does upstream), no `-o addopts=` (`-m 'not stress'` keeps stress tests out), no
`-p no:cacheprovider` (an `addopts` with `--lf` or `--sw` needs it), no `--noconftest`.

The code under test is the tree's: its source roots (the root, `src/` when it holds Python files, a
setuptools `package-dir` / `packages.find.where`) go on PYTHONPATH ahead of site-packages, so a copy of
the same package installed on the node (click, cachetools, python-dotenv in this venv; pluggy and
packaging, which pytest itself imports) cannot stand in for the agent's edits. Image runtimes get no
PYTHONPATH: the image has the package installed from its own tree.

Plugin autoloading stays on. What made it unsafe is handled where it matters, in the grading copy:
pytest finds plugins through installed distributions' `pytest11` entry points, and importlib.metadata
looks for distributions on every sys.path entry, the tree's roots included; so the grader removes
`*.dist-info` / `*.egg-info` / `*.egg-link` the starting tree does not have from those roots (a planted
one would register a plugin that rewrites outcomes), resets the ones it has, and removes planted
modules at the roots named like an installed plugin's module (`plugin_modules`), which would be imported
in its place. The agent's own `run_tests` runs on its tree as it is: its feedback, its business.
"""
from __future__ import annotations

import configparser
import functools
import os
import sys
import tomllib
from pathlib import Path, PurePosixPath
from typing import Callable

# Only what changes how results are printed: one summary line per test, short tracebacks.
PYTEST_ARGS = ["-m", "pytest", "-rA", "-q", "--tb=short", "--no-header"]
# Suffixes of distribution metadata at a sys.path entry: how importlib.metadata (hence pytest's plugin
# autoload) finds a distribution and its entry points.
DIST_SUFFIXES = (".dist-info", ".egg-info", ".egg-link")


def argv(targets: list[str], python: str = sys.executable) -> list[str]:
    """The pytest command over `targets` (files or ids, relative to the tree; none: the repository's
    own discovery, its `testpaths`)."""
    for t in targets:  # pytest has no `--` end of options: a target must not look like one
        if not isinstance(t, str) or not t or t.startswith("-"):
            raise ValueError(f"pytest target {str(t)[:80]!r}: empty or starts with '-' (it would read as an "
                             "option)")
    return [python, *PYTEST_ARGS, *targets]


def env(roots: list[str] | None) -> dict[str, str]:
    """The command's environment: the tree's source roots on PYTHONPATH (None: none, as image runtimes
    want), nothing that changes what pytest loads or reports."""
    return {} if roots is None else {"PYTHONPATH": os.pathsep.join(r or "." for r in roots)}


def run(sb, targets: list[str], roots: list[str] | None, timeout_s: float, install: dict | None = None):
    """Run the repository's tests on `targets` in sandbox `sb`: (the runtime's Result, the
    pytest_report.Report of what pytest recorded). `install`: the tree's install spec (install.py), None
    for none (image runtimes: the image installed the package)."""
    from rl.envs.swe import pytest_report
    rel = pytest_report.report_name()
    cmd, environ = pytest_report.command(targets, roots, install, rel)
    r = sb.run(cmd, timeout_s=timeout_s, env=environ)
    return r, pytest_report.collect(sb, rel)


# -- where the tree's code is ------------------------------------------------------------------------
def source_roots(paths: set[str] | list[str], read: Callable[[str], bytes | None]) -> list[str]:
    """Directories of a tree that hold the repository's importable code, root first: "" (the root),
    `src` if it holds Python files, and setuptools' package-dir / packages.find where. `paths` are the
    tree's files (relative), `read(rel)` their bytes (None: absent)."""
    paths = set(paths)
    roots = [""]
    if any(p.startswith("src/") and p.endswith(".py") for p in paths):
        roots.append("src")
    for cand in _declared_roots(read):
        cand = cand.strip().strip("/").removeprefix("./")
        parts = PurePosixPath(cand).parts
        if cand in ("", ".") or not parts or ".." in parts or PurePosixPath(cand).is_absolute() or "\0" in cand:
            continue
        if cand not in roots and any(p.startswith(cand + "/") and p.endswith(".py") for p in paths):
            roots.append(cand)
    return roots


def _declared_roots(read: Callable[[str], bytes | None]) -> list[str]:
    out: list[str] = []
    got = read("pyproject.toml")
    if got:
        try:
            st = tomllib.loads(got.decode()).get("tool", {}).get("setuptools", {})
            pd = st.get("package-dir", {})
            if isinstance(pd, dict) and isinstance(pd.get(""), str):
                out.append(pd[""])
            where = st.get("packages", {}).get("find", {}).get("where", []) if isinstance(
                st.get("packages"), dict) else []
            out += [w for w in where if isinstance(w, str)]
        except (ValueError, UnicodeDecodeError, AttributeError):
            pass
    got = read("setup.cfg")
    if got:
        cp = configparser.ConfigParser(interpolation=None)
        try:
            cp.read_string(got.decode("utf-8", "replace"))
            for line in cp.get("options", "package_dir", fallback="").splitlines():
                k, _, v = line.partition("=")
                if v and not k.strip():
                    out.append(v.strip())
            out += [w.strip() for w in cp.get("options.packages.find", "where", fallback="").split() if w.strip()]
        except configparser.Error:
            pass
    return out


def tree_roots(tree: Path) -> list[str]:
    """source_roots of a tree on disk (the agent's, when no task says what its starting tree was):
    only the top two levels are listed (roots are `src/` or a declared directory), links not followed."""
    tree = Path(tree)
    paths: set[str] = set()
    try:
        top = list(os.scandir(tree))
    except OSError:
        return [""]
    for e in top:
        if e.is_file(follow_symlinks=False):
            paths.add(e.name)
        elif e.is_dir(follow_symlinks=False):
            try:
                for s in os.scandir(e.path):
                    if s.is_file(follow_symlinks=False):
                        paths.add(f"{e.name}/{s.name}")
                    elif s.is_dir(follow_symlinks=False) and os.path.isfile(os.path.join(s.path, "__init__.py")):
                        paths.add(f"{e.name}/{s.name}/__init__.py")  # a package one level down (src/pkg)
            except OSError:
                pass

    def read(rel: str) -> bytes | None:
        p = tree / rel
        if p.is_symlink() or not p.is_file():
            return None
        with open(p, "rb") as f:  # the agent's file, read on the host: a bounded read
            return f.read(1 << 20)
    return source_roots(paths, read)


@functools.cache
def plugin_modules() -> frozenset[str]:
    """Top-level module names of the pytest plugins installed for this Python (entry points of group
    `pytest11`): a module of that name planted at a source root would be imported instead."""
    from importlib.metadata import entry_points
    names = set()
    for ep in entry_points(group="pytest11"):
        top = ep.value.split(":", 1)[0].strip().split(".", 1)[0]
        if top.isidentifier():
            names.add(top)
    return frozenset(names)
