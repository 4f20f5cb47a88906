"""SWE tasks: the typed task record, loading rows, and grading a tree against a task's hidden tests.

A task is one row of a public SWE dataset, normalized by rl/envs/swe/datasets.py (SWE-bench and its
variants, SWE-smith, SWE-rebench, R2E-Gym; docs/swe.md describes them): instance_id, repo, base_commit,
problem_statement, patch = reference solution, test_patch = hidden tests, FAIL_TO_PASS, PASS_TO_PASS.
The agent's starting tree is `base_commit` of a local git repository (rl/envs/swe/repos.py), or, for the
original built-in rows, `files` (the snapshot inline). The built-in set is 23 tiny Python repositories,
shipped both ways: `data/builtin.jsonl` (snapshots, written by `data/make_builtin.py`) and
`data/builtin_swebench.jsonl` (SWE-bench rows over real git repositories, `data/make_swebench.py`).

Sandboxes come from the runtime named by `env.swe.runtime` (rl/envs/swe/runtimes.py): `open_sandbox`
passes `runtime` ({"name": ..., "image_cache": ...}, what `runtimes.from_config` returns) on to
`open_runtime`, with `image=task.image` for the image runtimes (podman, apptainer).

Grading follows SWE-bench: copy the agent's tree into a fresh sandbox of the same runtime, reset the
graded test files to the starting tree (the agent cannot weaken the tests it is graded on), apply
test_patch, run pytest on those files, and score the log (rl/envs/swe/grading.py: FAIL_TO_PASS fixed
and PASS_TO_PASS kept; all-or-nothing, or the fraction with partial credit). R2E-Gym rows are scored
against their expected output.
pytest runs with `--noconftest` and `-o addopts=` so a conftest.py or ini file the agent wrote cannot
reshape the run, and with plugin autoloading off (which also cuts pytest's start from ~0.8 s to ~0.2 s
here, most of the grading time). It still runs in the same process as the agent's code, so a
deliberately adversarial patch could forge results (as in SWE-bench): the sandbox limits what such code
can touch, not what it can print. The reset never follows a link the agent planted: a link (or a
file) where a directory of a graded path should be is removed from the grading copy first, and files are
written with the runtime's `write_file` (every component opened O_NOFOLLOW), so `tests -> /host/dir`
cannot turn the reset into a write on the host.
"""
from __future__ import annotations

import os
import re
import shlex
import shutil
import stat
import sys
from dataclasses import dataclass, field
from pathlib import Path

from rl.envs.swe import repos
from rl.envs.swe.grading import (Grade, expected_output_reward, parse_pytest, parse_r2e, parser,
                                 swebench_reward)
from rl.envs.swe.runtimes import Runtime, open_runtime
from rl.envs.swe.sandbox import Limits

BUILTIN = Path(__file__).with_name("data") / "builtin.jsonl"
# Shipped task sets, by the names env.swe.tasks accepts besides a path.
SHIPPED = {"builtin": BUILTIN, "builtin_swebench": BUILTIN.with_name("builtin_swebench.jsonl")}
PYTEST = [sys.executable, "-m", "pytest", "-q", "-rA", "--noconftest", "-p", "no:cacheprovider",
          "-o", "addopts=", "--no-header", "-W", "ignore"]
IMAGE_RUNTIMES = ("podman", "apptainer")  # each command runs in the task's own image
PATCH = ["patch", "-p1", "--batch", "--forward", "--fuzz=0", "--no-backup-if-mismatch", "--reject-file=-"]


@dataclass(frozen=True)
class Task:
    """One task, whatever public format its row came in (rl/envs/swe/datasets.py normalizes them).

    The tree the agent starts from is either `files` (the built-in snapshot rows) or `base_commit` of
    the git repository at `repo_dir` (resolved from `repo` when the task is made playable here).
    `image`, `test_cmd` and `log_parser` are the instance's own environment and test command, for
    runtimes that run its image; `expected_output` is R2E-Gym's {test: status}."""
    instance_id: str
    repo: str
    base_commit: str
    problem_statement: str
    patch: str
    test_patch: str
    fail_to_pass: list[str]
    pass_to_pass: list[str]
    files: dict[str, str] = field(default_factory=dict, repr=False)
    format: str = "swe_bench"
    version: str = ""
    environment_setup_commit: str = ""
    image: str = ""
    test_cmd: str = ""
    log_parser: str = "pytest"
    expected_output: dict[str, str] | None = field(default=None, repr=False)
    repo_dir: str = ""

    @property
    def graded(self) -> list[str]:
        return self.fail_to_pass + self.pass_to_pass

    def base_file(self, rel: str) -> str | None:
        """The text of `rel` in the task's starting tree, None if it has no such file."""
        if self.files or not self.repo_dir:
            return self.files.get(rel)
        return repos.show(self.repo_dir, self.base_commit, rel)


def load_tasks(path: str | Path = BUILTIN, format: str = "auto") -> list[Task]:
    """Tasks of one dataset file or directory, in any of the public formats (datasets.load_dataset), or
    of a shipped set named in SHIPPED."""
    from rl.envs.swe.datasets import load_dataset  # datasets.py builds on Task
    return load_dataset(SHIPPED.get(str(path), path), format)


def patched_paths(diff: str) -> list[str]:
    """Paths a unified diff writes (its `+++ b/...` lines), for path checks and test-file resets."""
    return [m.group(1) for m in re.finditer(r"^\+\+\+ (?:b/)?(\S+)", diff, re.M) if m.group(1) != "/dev/null"]


def runtime_args(task: Task, runtime: dict | None) -> dict:
    """open_runtime's keyword arguments for `task`: the runtime settings ({"name": ..., ...}, default
    inprocess) plus, for the image runtimes, the task's image."""
    kw = dict(runtime or {"name": "inprocess"})
    if kw["name"] in IMAGE_RUNTIMES:
        if not task.image:
            raise ValueError(f"{task.instance_id}: env.swe.runtime={kw['name']} runs each task in its "
                             "image, and this row names none (image_name / docker_image)")
        kw["image"] = task.image
    return kw


def apply_patch(sb: Runtime, diff: str, timeout_s: float = 30):
    """Apply a -p1 unified diff inside the sandbox (so a diff cannot write through a link out of the
    tree). Returns the Result; returncode 0 means every hunk applied."""
    return sb.run(PATCH, timeout_s=timeout_s, input=diff)


def run_pytest(sb: Runtime, targets: list[str], timeout_s: float) -> tuple[dict[str, str], str]:
    """Run pytest on targets in the sandbox; returns ({test id: outcome}, combined output)."""
    r = sb.run(PYTEST + targets, timeout_s=timeout_s, env={"PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"})
    out = r.stdout + r.stderr + (f"\n[timed out after {timeout_s:.0f}s]" if r.timed_out else "")
    return parse_pytest(r.stdout), out


def open_sandbox(task: Task, limits: Limits = Limits(), runtime: dict | None = None,
                 tree: Path | None = None) -> Runtime:
    """A sandbox of `runtime` (default inprocess) whose tree is `tree` if given (copied), else the task's
    starting tree: its snapshot, base_commit checked out, or (image runtimes, no local repository) the
    repository inside its image."""
    kw = runtime_args(task, runtime)
    sb = open_runtime(tree=tree, limits=limits, **kw)
    if tree is not None or (kw["name"] in IMAGE_RUNTIMES and not task.files and not task.repo_dir):
        return sb
    try:  # a fresh, empty tree nothing has run in yet: host-side writes are safe here
        if task.files or not task.repo_dir:
            for rel, text in task.files.items():
                p = sb.tree / rel
                p.parent.mkdir(parents=True, exist_ok=True)
                p.write_text(text)
        else:
            repos.checkout(task.repo_dir, task.base_commit, sb.tree)
    except BaseException:
        sb.close()
        raise
    return sb


def _clear_path(rt: Runtime, rel: str) -> None:
    """Make every directory component of rel a real directory of the tree (or absent), and rel itself
    absent: a link or file the agent left in the way is removed from this (grading) copy, never
    followed. Each component is lstat'ed below components already checked to be real directories, and
    nothing runs in the grading sandbox meanwhile."""
    parts = [q for q in Path(rel).parts if q not in ("", ".")]
    if not parts or Path(rel).is_absolute() or ".." in parts:
        raise ValueError(f"graded path {rel!r}: must be relative to the tree, without '..'")
    cur = rt.tree
    for i, name in enumerate(parts):
        cur = cur / name
        try:
            mode = os.lstat(cur).st_mode
        except FileNotFoundError:
            return
        if stat.S_ISDIR(mode) and i < len(parts) - 1:
            continue  # a real directory on the way: go down
        if stat.S_ISDIR(mode):
            shutil.rmtree(cur)  # rmtree never follows links inside the directory
        else:
            os.unlink(cur)  # a link is removed, not followed
        return


def _pristine(task: Task, runtime: dict | None, limits: Limits):
    """How to read a file of the starting tree: from the row (snapshot, git) or, for a repository that
    lives only in the task's image, from a pristine sandbox of that image (opened on first use)."""
    if task.files or task.repo_dir or (runtime or {}).get("name") not in IMAGE_RUNTIMES:
        return task.base_file, lambda: None
    box: list[Runtime] = []

    def read(rel: str) -> str | None:
        if not box:
            box.append(open_sandbox(task, limits, runtime))
        return box[0].read_file(rel)
    return read, lambda: box and box[0].close()


def grade(task: Task, tree: Path | None = None, *, extra_patch: str | None = None,
          limits: Limits = Limits(cpu_s=60), timeout_s: float = 60, partial_credit: bool = True,
          runtime: dict | None = None) -> Grade:
    """Hidden-test reward of `tree` (default: the task's unmodified starting tree), optionally after
    applying `extra_patch` (the reference patch, to check a task), graded inside a fresh sandbox of
    `runtime` (default inprocess). The tree itself is never modified."""
    sb = open_sandbox(task, limits, runtime, tree=tree)
    base_file, done = _pristine(task, runtime, limits)
    try:
        with sb:
            return _grade_in(task, sb, base_file, extra_patch, timeout_s, partial_credit)
    finally:
        done()


def _grade_in(task: Task, sb: Runtime, base_file, extra_patch, timeout_s, partial_credit) -> Grade:
    if extra_patch:
        r = apply_patch(sb, extra_patch)
        if r.returncode != 0:
            raise ValueError(f"{task.instance_id}: patch does not apply: {(r.stdout + r.stderr).strip()}")
    if task.format == "r2e_gym":  # the hidden tests are in the image; here, the repository's own
        cmd = ["bash", "-c", task.test_cmd] if task.image and task.test_cmd else PYTEST
        r = sb.run(cmd, timeout_s=timeout_s, env={"PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"})
        return expected_output_reward(parse_r2e(r.stdout), task.expected_output or {},
                                      partial_credit=partial_credit, output=r.stdout + r.stderr)
    test_files = sorted({i.split("::")[0] for i in task.graded} | set(patched_paths(task.test_patch)))
    for rel in test_files:  # reset graded test files to the starting tree, then add the hidden tests
        _clear_path(sb, rel)
        text = base_file(rel)
        if text is not None:
            sb.write_file(rel, text)
    if task.test_patch:
        r = apply_patch(sb, task.test_patch)
        if r.returncode != 0:
            raise ValueError(f"{task.instance_id}: test_patch does not apply: "
                             f"{(r.stdout + r.stderr).strip()}")
    targets = [f for f in test_files if _is_file(sb, f)]
    if task.image and task.test_cmd:  # the instance's own test command and log parser (SWE-rebench)
        r = sb.run(["bash", "-c", " ".join([task.test_cmd, *map(shlex.quote, targets)])], timeout_s=timeout_s)
        output = r.stdout + r.stderr + (f"\n[timed out after {timeout_s:.0f}s]" if r.timed_out else "")
        outcomes = parser(task.log_parser)(r.stdout)
    else:
        outcomes, output = run_pytest(sb, targets, timeout_s)
    return swebench_reward(outcomes, task.fail_to_pass, task.pass_to_pass, partial_credit=partial_credit,
                           output=output)


def _is_file(rt: Runtime, rel: str) -> bool:
    try:
        return rt.read_file(rel) is not None
    except (OSError, ValueError):
        return False
