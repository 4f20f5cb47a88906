"""Writes builtin.jsonl, the built-in SWE tasks: `python -m rl.envs.swe.data.make_builtin`.

Each task (a data file of builtin/, read by builtin_tasks.py) is a tiny repository (`files`, with its visible tests), an issue text, the fix as
(path, old, new) replacements, and the hidden tests as new test files. The record's `patch` and
`test_patch` are unified diffs computed from those, and FAIL_TO_PASS / PASS_TO_PASS are measured, not
written by hand: the hidden and visible tests are run in the sandbox on the unmodified and on the fixed
repository; a test failing before and passing after is FAIL_TO_PASS, one passing both is PASS_TO_PASS,
and the script refuses a task whose fix leaves any test failing or fixes nothing.
"""
from __future__ import annotations

import difflib
import json
import sys
from pathlib import Path

from rl.envs.swe.data.builtin_tasks import TASKS
from rl.envs.swe.sandbox import Sandbox
from rl.envs.swe.tasks import BUILTIN, run_pytest


def _diff(old: dict[str, str], new: dict[str, str]) -> str:
    """git-style unified diff (a/ b/ prefixes, -p1) from old to new, for `patch` and `git apply`."""
    out = []
    for path in sorted(set(old) | set(new)):
        a, b = old.get(path), new.get(path)
        if a == b:
            continue
        out.append(f"diff --git a/{path} b/{path}\n")
        if a is None:
            out.append("new file mode 100644\n")
        lines = difflib.unified_diff((a or "").splitlines(True), (b or "").splitlines(True),
                                     "/dev/null" if a is None else f"a/{path}",
                                     "/dev/null" if b is None else f"b/{path}")
        out.extend(lines)
    return "".join(out)


def _fixed(files, fix):
    new = dict(files)
    for path, old, repl in fix:
        if new[path].count(old) != 1:
            raise ValueError(f"fix for {path}: {old!r} must occur exactly once")
        new[path] = new[path].replace(old, repl)
    return new


def _outcomes(files: dict[str, str]) -> dict[str, str]:
    tests = sorted(p for p in files if p.startswith("tests/"))
    with Sandbox.from_files(files) as sb:
        out, text = run_pytest(sb, tests, timeout_s=60)
    if not out:
        raise RuntimeError(f"no test ran: {text[-2000:]}")
    return out


def build(t: dict) -> dict:
    fixed = _fixed(t["files"], t["fix"])
    before = _outcomes({**t["files"], **t["hidden"]})
    after = _outcomes({**fixed, **t["hidden"]})
    bad = [i for i, o in after.items() if o != "PASSED"]
    if bad:
        raise ValueError(f"{t['id']}: the fix leaves tests failing: {bad}")
    f2p = sorted(i for i in after if before.get(i) != "PASSED")
    p2p = sorted(i for i in after if before.get(i) == "PASSED")
    if not f2p:
        raise ValueError(f"{t['id']}: no hidden test fails before the fix")
    return {"instance_id": f"builtin__{t['id']}", "repo": f"builtin/{t['id']}", "base_commit": "",
            "problem_statement": t["issue"], "patch": _diff(t["files"], fixed),
            "test_patch": _diff({}, t["hidden"]), "FAIL_TO_PASS": f2p, "PASS_TO_PASS": p2p,
            "files": t["files"]}


def main(out: Path = BUILTIN):
    ids = [t["id"] for t in TASKS]
    if len(set(ids)) != len(ids):
        raise ValueError("duplicate task ids")
    records = [build(t) for t in TASKS]
    out.write_text("".join(json.dumps(r, sort_keys=True) + "\n" for r in records))
    print(f"wrote {len(records)} tasks to {out}", file=sys.stderr)


if __name__ == "__main__":
    main()
