"""SWE tasks: loading SWE-bench-format JSONL and grading a tree against a task's hidden tests.

A task is one JSONL record with SWE-bench's fields (instance_id, repo, base_commit, problem_statement,
patch = reference solution, test_patch = hidden tests, FAIL_TO_PASS, PASS_TO_PASS; the two lists may be
JSON-encoded strings as in SWE-bench's own files) plus `files`, the repository snapshot as
{path: text}, because there is no git remote to check `base_commit` out from here. The built-in set
(`data/builtin.jsonl`, written by `data/make_builtin.py`) is 20+ tiny Python repositories.

Grading follows SWE-bench: copy the agent's tree into a fresh sandbox, reset the graded test files to the
snapshot (the agent cannot weaken the tests it is graded on), apply test_patch, run pytest on those files,
reward = passed / (FAIL_TO_PASS + PASS_TO_PASS). pytest runs with `--noconftest` and `-o addopts=` so a
conftest.py or ini file the agent wrote cannot reshape the run, and with plugin autoloading off
(which also cuts pytest's start from ~0.8 s to ~0.2 s here, most of the grading time). It still runs in
the same process as the agent's code, so a deliberately adversarial patch could forge results (as in
SWE-bench): the sandbox limits what such code can touch, not what it can print.
"""
from __future__ import annotations

import json
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

from rl.envs.swe.sandbox import Limits, Sandbox

BUILTIN = Path(__file__).with_name("data") / "builtin.jsonl"
PYTEST = [sys.executable, "-m", "pytest", "-q", "-rA", "--noconftest", "-p", "no:cacheprovider",
          "-o", "addopts=", "--no-header", "-W", "ignore"]
PATCH = ["patch", "-p1", "--batch", "--forward", "--fuzz=0", "--no-backup-if-mismatch", "--reject-file=-"]
_RESULT = re.compile(r"^(PASSED|FAILED|ERROR|XPASS|XFAIL) (\S+)", re.M)


@dataclass(frozen=True)
class Task:
    instance_id: str
    repo: str
    base_commit: str
    problem_statement: str
    patch: str
    test_patch: str
    fail_to_pass: list[str]
    pass_to_pass: list[str]
    files: dict[str, str] = field(repr=False)

    @property
    def graded(self) -> list[str]:
        return self.fail_to_pass + self.pass_to_pass

    @classmethod
    def from_record(cls, rec: dict) -> "Task":
        def ids(v):
            return json.loads(v) if isinstance(v, str) else list(v)
        missing = [k for k in ("instance_id", "problem_statement", "patch", "test_patch", "FAIL_TO_PASS",
                               "PASS_TO_PASS", "files") if k not in rec]
        if missing:
            raise ValueError(f"task {rec.get('instance_id', '?')}: missing fields {missing}")
        return cls(rec["instance_id"], rec.get("repo", ""), rec.get("base_commit", ""),
                   rec["problem_statement"], rec["patch"], rec["test_patch"], ids(rec["FAIL_TO_PASS"]),
                   ids(rec["PASS_TO_PASS"]), dict(rec["files"]))


@dataclass(frozen=True)
class Grade:
    reward: float
    passed: list[str]
    failed: list[str]
    output: str


def load_tasks(path: str | Path = BUILTIN) -> list[Task]:
    """Tasks of one SWE-bench-format JSONL file (blank lines skipped)."""
    out = []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            if line.strip():
                try:
                    out.append(Task.from_record(json.loads(line)))
                except (json.JSONDecodeError, ValueError) as e:
                    raise ValueError(f"{path}:{n}: {e}") from None
    return out


def patched_paths(diff: str) -> list[str]:
    """Paths a unified diff writes (its `+++ b/...` lines), for path checks and test-file resets."""
    return [m.group(1) for m in re.finditer(r"^\+\+\+ (?:b/)?(\S+)", diff, re.M) if m.group(1) != "/dev/null"]


def apply_patch(sb: Sandbox, diff: str, timeout_s: float = 30):
    """Apply a -p1 unified diff inside the sandbox (so a diff cannot write through a link out of the
    tree). Returns the Result; returncode 0 means every hunk applied."""
    return sb.run(PATCH, timeout_s=timeout_s, input=diff)


def run_pytest(sb: Sandbox, targets: list[str], timeout_s: float) -> tuple[dict[str, str], str]:
    """Run pytest on targets in the sandbox; returns ({test id: outcome}, combined output)."""
    r = sb.run(PYTEST + targets, timeout_s=timeout_s, env={"PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"})
    out = r.stdout + r.stderr + (f"\n[timed out after {timeout_s:.0f}s]" if r.timed_out else "")
    return {m.group(2): m.group(1) for m in _RESULT.finditer(r.stdout)}, out


def grade(task: Task, tree: Path | None = None, *, extra_patch: str | None = None,
          limits: Limits = Limits(cpu_s=60), timeout_s: float = 60) -> Grade:
    """Hidden-test reward of `tree` (default: the task's unmodified snapshot), optionally after applying
    `extra_patch` (the reference patch, to check a task). The tree itself is never modified."""
    sb = Sandbox(tree, limits) if tree is not None else Sandbox.from_files(task.files, limits)
    with sb:
        if extra_patch:
            r = apply_patch(sb, extra_patch)
            if r.returncode != 0:
                raise ValueError(f"{task.instance_id}: patch does not apply: {(r.stdout + r.stderr).strip()}")
        test_files = sorted({i.split("::")[0] for i in task.graded} | set(patched_paths(task.test_patch)))
        for rel in test_files:  # reset graded test files to the snapshot, then add the hidden tests
            p = sb.tree / rel
            if p.is_symlink() or p.is_file():
                p.unlink()
            if rel in task.files:
                p.parent.mkdir(parents=True, exist_ok=True)
                p.write_text(task.files[rel])
        r = apply_patch(sb, task.test_patch)
        if r.returncode != 0:
            raise ValueError(f"{task.instance_id}: test_patch does not apply: "
                             f"{(r.stdout + r.stderr).strip()}")
        outcomes, output = run_pytest(sb, [f for f in test_files if (sb.tree / f).is_file()], timeout_s)
    passed = [i for i in task.graded if outcomes.get(i) == "PASSED"]
    failed = [i for i in task.graded if outcomes.get(i) != "PASSED"]
    return Grade(len(passed) / max(1, len(task.graded)), passed, failed, output)
