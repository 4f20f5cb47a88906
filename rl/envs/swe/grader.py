"""Grading a tree against a task's hidden tests, as SWE-bench's harness does, for rows made from real
repositories: `grade(task, tree, ...)` -> Grade (rl/envs/swe/grading.py).

Steps, in a fresh sandbox of the episode's runtime over a copy of the agent's tree (the tree itself is
never modified):

1. The reference patch (`extra_patch`, to check a task) is applied, if given (rl/envs/swe/patches.py:
   `git apply`, GNU patch as the fallback).
2. What the agent may not shape is put back as the starting tree has it, byte for byte (every file is
   read and written as bytes, whatever its encoding; executable bits kept):
   - every path test_patch touches (both sides of a rename; test files and data files alike), and the
     test file of every graded test id (FAIL_TO_PASS + PASS_TO_PASS), test files only: the module of a
     doctest id (`pkg/mod.py::pkg.mod.f`) is the code under test, never reset;
   - the repository's conftest.py files: each one in the starting tree or in test_patch is reset, any
     other conftest.py in the copy (planted by the agent) is removed;
   - pytest's config files (pytest.ini, .pytest.ini, pyproject.toml, tox.ini, setup.cfg) in the root and
     every directory above a test file: reset, or removed when the starting tree has none there;
   - modules that would run before or instead of the tests from the import path (sitecustomize,
     usercustomize, pytest, _pytest, py, in any form: .py, .pyc, extension, package) in the root and the
     source roots, unless the starting tree has them; every __pycache__, `.pytest_cache` and a `.git`
     of the copy;
   - at the source roots, distribution metadata (`*.dist-info`, `*.egg-info`, `*.egg-link`: how pytest's
     plugin autoload finds `pytest11` entry points) is reset to the starting tree's (removed when it
     has none), and a module named like an installed pytest plugin's module is removed unless the
     starting tree has it (the plugin would import it instead of its own).
   A link or file standing where a directory of a reset path should be is removed from the copy first,
   never followed, and files are written below directories checked to be real (O_NOFOLLOW).
3. test_patch is applied (same tool chain: binary files, renames and mode changes apply).
4. pytest runs on the test files of the graded ids (never on data files; if no graded id names a file,
   the .py files test_patch writes) exactly as the agent's `run_tests` tool runs it
   (rl/envs/swe/testrun.py): the repository's own conftest.py files and ini options, `addopts`,
   markers and `filterwarnings` included, the installed plugins loaded by their entry points, and
   only `-rA` (and other output-only options) added. The code under test is the repository's: its
   source roots (the root, `src/` when the starting tree has Python files there, a setuptools
   `package-dir`/`where` of pyproject.toml or setup.cfg) go on PYTHONPATH, before site-packages, so a
   copy of the same package installed on the node cannot shadow the agent's edits. Under image
   runtimes with the row's own test command (SWE-rebench `install_config`), that command runs instead:
   the image has the package installed from its tree.
   Before pytest starts, the tree is installed in the sandbox (rl/envs/swe/install.py: its metadata as
   a dist-info in the sandbox's /tmp, generated version files; none under image runtimes).
5. Outcomes are what pytest recorded (rl/envs/swe/pytest_report.py: our plugin's results file, subtests
   included), scored by grading.swebench_reward; the row's own test command under image runtimes is
   read by its log parser instead. A grading that cannot be trusted (pytest never started, none of
   the graded tests ran, ids found nowhere) carries its reason in `Grade.grading_error`.

R2E-Gym rows are graded against their expected output, as before.

The base files come from the row: its `files` snapshot, `git ls-tree` / `git cat-file` of base_commit in
its repository (bytes; rl/envs/swe/repos.py's `show` decodes text), or, for a repository that lives only
in the task's image, a pristine sandbox of that image opened on first use.
"""
from __future__ import annotations

import dataclasses
import os
import shlex
import stat
import subprocess
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

from rl.envs.swe import install, patches, pytest_report, testrun, trees
from rl.envs.swe.grading import Grade, expected_output_reward, parse_r2e, parser, swebench_reward
from rl.envs.swe.sandbox import Limits
from rl.contract.sandbox_runtimes import IMAGE_RUNTIMES
from rl.envs.swe.tasks import Task, open_sandbox

PYTEST = testrun.PYTEST_ARGS  # what grading adds to `python`: output options only (testrun.py)
INI_FILES = ("pytest.ini", ".pytest.ini", "pyproject.toml", "tox.ini", "setup.cfg")
SHADOWS = ("sitecustomize", "usercustomize", "pytest", "_pytest", "py")
_GIT_ENV = {"GIT_CONFIG_NOSYSTEM": "1", "GIT_CONFIG_GLOBAL": os.devnull, "GIT_TERMINAL_PROMPT": "0",
            "LC_ALL": "C"}


# -- the starting tree, as bytes ----------------------------------------------------------------------
@dataclass
class BaseTree:
    """Files of the task's starting tree: `paths` (regular files), `read(rel)` -> (bytes, mode) or
    None (absent, a link, or a directory)."""
    paths: set[str]
    _read: object
    _cache: dict = field(default_factory=dict)

    def read(self, rel: str) -> tuple[bytes, int] | None:
        if rel not in self._cache:
            self._cache[rel] = self._read(rel) if rel in self.paths else None
        return self._cache[rel]


def _git(repo_dir, *args: str, input: bytes | None = None) -> bytes:
    r = subprocess.run(["git", *args], cwd=repo_dir, input=input, capture_output=True,
                       env={**os.environ, **_GIT_ENV})
    if r.returncode != 0:
        raise RuntimeError(f"git {' '.join(args)} in {repo_dir}: {r.stderr.decode(errors='replace').strip()}")
    return r.stdout


def git_tree(repo_dir: str | Path, commit: str) -> BaseTree:
    """The regular files of `commit` (links and submodules left out), read as bytes on demand."""
    entries = {}
    for rec in _git(repo_dir, "ls-tree", "-r", "-z", "--full-tree", commit).split(b"\0"):
        if not rec:
            continue
        meta, path = rec.split(b"\t", 1)
        mode, kind, sha = meta.split()
        if kind == b"blob" and mode in (b"100644", b"100755"):
            entries[path.decode("utf-8", "surrogateescape")] = (sha.decode(), 0o755 if mode == b"100755" else 0o644)

    def read(rel):
        sha, mode = entries[rel]
        return _git(repo_dir, "cat-file", "blob", sha), mode
    return BaseTree(set(entries), read)


def show_bytes(repo_dir: str | Path, commit: str, rel: str) -> bytes | None:
    """`git show commit:rel` as bytes (None if there is no such file)."""
    r = subprocess.run(["git", "cat-file", "blob", f"{commit}:{rel}"], cwd=repo_dir, capture_output=True,
                       env={**os.environ, **_GIT_ENV})
    return r.stdout if r.returncode == 0 else None


def snapshot_tree(files: dict[str, str]) -> BaseTree:
    return BaseTree(set(files), lambda rel: (files[rel].encode("utf-8", "surrogateescape"), 0o644))


def host_tree(root: Path) -> BaseTree:
    """The regular files under `root` (a pristine sandbox's tree), links never followed."""
    paths = set()
    for d, dirs, files in os.walk(root):
        for name in files:
            p = os.path.join(d, name)
            if stat.S_ISREG(os.lstat(p).st_mode):
                paths.add(os.path.relpath(p, root))

    def read(rel):
        fd = _open_dir(root, str(PurePosixPath(rel).parent), create=False)
        if fd is None:
            return None
        try:
            f = os.open(PurePosixPath(rel).name, os.O_RDONLY | os.O_NOFOLLOW, dir_fd=fd)
        except OSError:
            return None
        finally:
            os.close(fd)
        with os.fdopen(f, "rb") as fh:
            return fh.read(), os.fstat(fh.fileno()).st_mode & 0o777
    return BaseTree(paths, read)


def _base(task: Task, runtime: dict | None, limits: Limits):
    """(BaseTree of the starting tree, closer)."""
    if task.files or not task.repo_dir:
        if task.files or (runtime or {}).get("name") not in IMAGE_RUNTIMES:
            return snapshot_tree(task.files), lambda: None
        pristine = open_sandbox(task, limits, runtime)  # the repository lives only in the image
        return host_tree(pristine.tree), pristine.close
    return git_tree(task.repo_dir, task.base_commit), lambda: None


# -- the grading copy, never through a link -----------------------------------------------------------
def _parts(rel: str) -> list[str]:
    p = PurePosixPath(rel)
    parts = [q for q in p.parts if q not in ("", ".")]
    if not parts or p.is_absolute() or ".." in parts or "\0" in rel:
        raise ValueError(f"graded path {rel!r}: must be relative to the tree, without '..'")
    return parts


def _open_dir(root: Path, rel: str, create: bool) -> int | None:
    """An fd of directory root/rel, each component opened O_NOFOLLOW below the last (made if
    `create`); None if a component is missing or not a real directory."""
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    for name in [q for q in PurePosixPath(rel).parts if q not in ("", ".")]:
        try:
            if create:
                try:
                    os.mkdir(name, 0o755, dir_fd=fd)
                except FileExistsError:
                    pass
            nfd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=fd)
        except OSError:
            os.close(fd)
            return None
        os.close(fd)
        fd = nfd
    return fd


def clear_path(tree: Path, rel: str) -> None:
    """Make every directory component of rel a real directory of the tree (or absent), and rel itself
    absent: a link or file in the way is removed, never followed."""
    parts = _parts(rel)
    cur = tree
    for i, name in enumerate(parts):
        cur = cur / name
        try:
            mode = os.lstat(cur).st_mode
        except FileNotFoundError:
            return
        if stat.S_ISDIR(mode) and i < len(parts) - 1:
            continue
        if stat.S_ISDIR(mode):
            trees.remove_tree(cur)  # never follows links inside, whatever the depth
        else:
            os.unlink(cur)
        return


def write_bytes(tree: Path, rel: str, data: bytes, mode: int = 0o644) -> None:
    """Create tree/rel (absent: clear_path first) with `data`, parents made as real directories."""
    parts = _parts(rel)
    fd = _open_dir(tree, "/".join(parts[:-1]), create=True)
    if fd is None:
        raise OSError(f"{rel}: a parent is not a directory of the tree")
    try:
        f = os.open(parts[-1], os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, mode, dir_fd=fd)
    finally:
        os.close(fd)
    with os.fdopen(f, "wb") as fh:
        fh.write(data)
        os.fchmod(fh.fileno(), mode)


def is_file(tree: Path, rel: str) -> bool:
    fd = _open_dir(tree, str(PurePosixPath(rel).parent), create=False)
    if fd is None:
        return False
    try:
        return stat.S_ISREG(os.stat(PurePosixPath(rel).name, dir_fd=fd, follow_symlinks=False).st_mode)
    except OSError:
        return False
    finally:
        os.close(fd)


def reset(tree: Path, base: BaseTree, rel: str) -> None:
    """tree/rel as the starting tree has it: its bytes and mode, or absent."""
    clear_path(tree, rel)
    got = base.read(rel)
    if got is not None:
        write_bytes(tree, rel, *got)


def _walk(tree: Path):
    """(directory rel path, dir names, file names) of the tree, links not followed, iteratively
    (trees.walk: no depth the agent makes can exhaust the stack). Pruning `dirs` prunes the walk."""
    skip: set[str] = set()
    for d, entries in trees.walk(tree):
        if d and any(d == s or d.startswith(s + "/") for s in skip):
            continue
        dirs = [n for n, st in entries if stat.S_ISDIR(st.st_mode)]
        kept = list(dirs)
        yield d, kept, [n for n, st in entries if not stat.S_ISDIR(st.st_mode)]
        skip |= {_join(d, n) for n in dirs if n not in kept}


# -- what to reset, where the code is, what to run ----------------------------------------------------
def test_file(test_id: str) -> str:
    """The file of a pytest id: what precedes the first "::" (a parametrization may hold "::", but
    always after it); an id without "::" is a file id (or not a path at all)."""
    return test_id.split("::", 1)[0].strip()


def _ancestors(rel: str) -> list[str]:
    """"" (the root) and every directory above rel: "a/b/t.py" -> ["", "a", "a/b"]."""
    parts = PurePosixPath(rel).parts[:-1]
    return [""] + ["/".join(parts[:i + 1]) for i in range(len(parts))]


def _join(d: str, name: str) -> str:
    return f"{d}/{name}" if d else name


def source_roots(base: BaseTree) -> list[str]:
    """Directories of the starting tree that hold the repository's importable code, root first:
    "" (the root), `src` if it holds Python files, and setuptools' package-dir / packages.find where."""
    return testrun.source_roots(base.paths, lambda rel: (base.read(rel) or (None,))[0])


def task_roots(task: Task) -> list[str] | None:
    """source_roots of the task's starting tree (what the agent's run_tests puts on PYTHONPATH, as the
    grader does); None when the tree is in an image (no local repository, no snapshot)."""
    if task.files or not task.repo_dir:
        return source_roots(snapshot_tree(task.files)) if task.files else None
    return source_roots(git_tree(task.repo_dir, task.base_commit))


def run_tests_install(task: Task, runtime: dict | None) -> dict | None:
    """The install spec of the agent's run_tests (install.spec of the starting tree, as grading uses);
    None under image runtimes and for trees in an image."""
    if (runtime or {}).get("name") in IMAGE_RUNTIMES or not (task.files or task.repo_dir):
        return None
    base = snapshot_tree(task.files) if task.files else git_tree(task.repo_dir, task.base_commit)
    return install.spec(task, base)[0]


def run_tests_roots(task: Task, runtime: dict | None) -> list[str] | None:
    """PYTHONPATH roots of the agent's run_tests tool: the grader's own (task_roots), none under image
    runtimes (the image has the package installed from its tree)."""
    return None if (runtime or {}).get("name") in IMAGE_RUNTIMES else task_roots(task)


def _protect(sb_tree: Path, base: BaseTree, task: Task, tp_paths: list[str], graded_files: list[str],
             roots: list[str]) -> None:
    """Step 2 of the module docstring, on the grading copy."""
    tp_new = {p for c in patches.changes(task.test_patch) if c.new for p in [c.new]}
    resets = set(graded_files) | set(tp_paths)
    base_conftests = {p for p in base.paths if PurePosixPath(p).name == "conftest.py"}
    resets |= base_conftests | {p for p in tp_new if PurePosixPath(p).name == "conftest.py"}
    for f in set(graded_files) | {p for p in tp_paths if p.endswith(".py")}:
        for d in _ancestors(f):
            resets |= {_join(d, n) for n in INI_FILES}
    plugins = testrun.plugin_modules()
    planted, shadows = [], []
    for d, dirs, files in _walk(sb_tree):
        for name in dirs + files:
            rel = _join(d, name)
            if name in ("__pycache__", ".pytest_cache") or (rel == ".git"):
                planted.append(rel)
            elif name == "conftest.py" and rel not in base_conftests and rel not in tp_new:
                planted.append(rel)
            elif d in roots and (name.split(".", 1)[0] in SHADOWS or name.endswith(testrun.DIST_SUFFIXES)):
                shadows.append(rel)
            elif d in roots and name.split(".", 1)[0] in plugins and not _in_base(base, rel):
                planted.append(rel)  # would be imported instead of the installed plugin's own module
        dirs[:] = [x for x in dirs if x not in ("__pycache__", ".pytest_cache") and _join(d, x) != ".git"]
    for rel in planted:
        clear_path(sb_tree, rel)
    for rel in shadows:  # base files under a shadowing name (the pytest repository's own) come back
        clear_path(sb_tree, rel)
        for p in sorted(q for q in base.paths if q == rel or q.startswith(rel + "/")):
            write_bytes(sb_tree, p, *base.read(p))
    for rel in sorted(resets):
        reset(sb_tree, base, rel)


def _in_base(base: BaseTree, rel: str) -> bool:
    return rel in base.paths or any(p.startswith(rel + "/") for p in base.paths)


def targets(sb_tree: Path, task: Task, graded_files: list[str], tp: list[patches.FileChange]) -> list[str]:
    got = [f for f in graded_files if is_file(sb_tree, f)]
    if not got:  # ids that name no file (e.g. unittest names): the test files test_patch writes
        got = [c.new for c in tp if c.new and c.new.endswith(".py") and is_file(sb_tree, c.new)]
    return sorted(set(got))


def grade(task: Task, tree: Path | None = None, *, extra_patch: str | None = None,
          limits: Limits = Limits(cpu_s=60), timeout_s: float = 60, partial_credit: bool = True,
          runtime: dict | None = None) -> Grade:
    """Hidden-test reward of `tree` (default: the task's unmodified starting tree), optionally after
    applying `extra_patch` (the reference patch, to check a task), graded inside a fresh sandbox of
    `runtime` (default inprocess). The tree itself is never modified. A tree that cannot be copied (the
    agent left a FIFO, socket or device in it, or nested directories past trees.MAX_DEPTH) grades 0,
    the reason in the output; no partial copy is left."""
    try:
        sb = open_sandbox(task, limits, runtime, tree=tree)
    except trees.TreeError as e:
        return Grade(0.0, [], list(dict.fromkeys(task.graded)), f"not graded: the tree cannot be copied: {e}")
    try:
        base, done = _base(task, runtime, limits)
    except BaseException:
        sb.close()
        raise
    try:
        with sb:
            return _grade_in(task, sb, base, extra_patch, timeout_s, partial_credit,
                             (runtime or {}).get("name", "inprocess"))
    finally:
        done()


def _grade_in(task: Task, sb, base: BaseTree, extra_patch, timeout_s, partial_credit, rt_name) -> Grade:
    if extra_patch:
        r = patches.apply(sb, extra_patch, timeout_s)
        if not r.ok:
            raise ValueError(f"{task.instance_id}: patch does not apply: {r.output}")
    image = rt_name in IMAGE_RUNTIMES
    inst, install_s = (None, 0.0) if image else install.spec(task, base)
    if task.format == "r2e_gym":  # the hidden tests are in the image; here, the repository's own
        if task.image and task.test_cmd:
            r = sb.run(["bash", "-c", task.test_cmd], timeout_s=timeout_s)
            status = parse_r2e(r.stdout)
        else:
            r, rep = testrun.run(sb, [], None if image else source_roots(base), timeout_s, inst)
            status = {".".join(k.split("::")[1:]): v for k, v in rep.outcomes.items()
                      if "::" in k and v in ("PASSED", "FAILED", "ERROR")}
        return expected_output_reward(status, task.expected_output or {},
                                      partial_credit=partial_credit, output=r.stdout + r.stderr)
    tp = patches.changes(task.test_patch)
    tp_paths = list(dict.fromkeys(p for c in tp for p in c.paths))
    for p in tp_paths:
        _parts(p)  # a row's path outside the tree is refused before anything is written
    graded_files = []
    for tid in task.graded:
        f = test_file(tid)
        if f and (f.endswith(".py") or "::" in tid):
            _parts(f)
            graded_files.append(f)
    graded_files = list(dict.fromkeys(graded_files))
    roots = source_roots(base)
    # a doctest id in a source module names the code under test, not a test file: never reset to base
    protected = list(dict.fromkeys(test_file(t) for t in task.graded if test_file(t) in graded_files
                                   and not pytest_report.is_doctest(t)))
    _protect(sb.tree, base, task, tp_paths, protected, roots)
    if task.test_patch:
        r = patches.apply(sb, task.test_patch, timeout_s)
        if not r.ok:
            raise ValueError(f"{task.instance_id}: test_patch does not apply: {r.output}")
    files = targets(sb.tree, task, graded_files, tp)
    known = list(dict.fromkeys(task.graded))
    error = ""
    if task.image and task.test_cmd and image:  # the row's own command (SWE-rebench): its log parser
        r = sb.run(["bash", "-c", " ".join([task.test_cmd, *map(shlex.quote, files)])], timeout_s=timeout_s)
        outcomes = _parse(task.log_parser, r.stdout, known)
    else:  # the same run as the agent's run_tests tool, on these files: what pytest recorded
        r, rep = testrun.run(sb, files, None if image else roots, timeout_s, inst)
        outcomes = pytest_report.with_collect_errors(rep, known)
        error = pytest_report.grading_error(rep, known, r.stdout + r.stderr, r.timed_out)
    output = r.stdout + r.stderr + (f"\n[timed out after {timeout_s:.0f}s]" if r.timed_out else "")
    if error:
        output += f"\n[grading error: {error}]"
    g = swebench_reward(outcomes, task.fail_to_pass, task.pass_to_pass, partial_credit=partial_credit,
                        output=output)
    return dataclasses.replace(g, grading_error=error, install_s=install_s)


def _parse(name: str, log: str, known: list[str]) -> dict[str, str]:
    fn = parser(name)
    try:
        return fn(log, known=known)
    except TypeError:  # a parser that takes no known ids
        return fn(log)
