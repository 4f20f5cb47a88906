"""Writes builtin_swebench.jsonl, the built-in SWE tasks as SWE-bench rows over real git repositories:
`python -m rl.envs.swe.data.make_swebench`.

Each built-in task (builtin.jsonl's snapshot) becomes a git repository with one deterministic commit
(repos.make_repo: fixed names and dates, so base_commit is the same on every machine and the loader can
re-create the repository from the snapshot and find that very commit). The row carries SWE-bench's
columns: base_commit, patch (the reference fix), test_patch (the hidden tests as a diff), and
FAIL_TO_PASS / PASS_TO_PASS measured here, not copied: the repository is checked out at base_commit in
the sandbox, test_patch applied, every test file run before and after the fix (through the same
pytest runner and log parser that grade episodes); a test failing before and passing after is
FAIL_TO_PASS, one passing both is PASS_TO_PASS; a fix that leaves a test failing is refused. The two
lists are stored as JSON strings, as SWE-bench's own files store them. No repository is shipped: the
rows are small and the repositories are made on first load under env.swe.repos_dir.
"""
from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

from rl.envs.swe import repos
from rl.envs.swe.sandbox import Sandbox
from rl.envs.swe.tasks import BUILTIN, Task, apply_patch, open_sandbox, run_pytest

OUT = BUILTIN.with_name("builtin_swebench.jsonl")


def _outcomes(task: Task, fix: str | None) -> dict[str, str]:
    with open_sandbox(task) as sb:
        for diff in filter(None, (task.test_patch, fix)):
            r = apply_patch(sb, diff)
            if r.returncode != 0:
                raise ValueError(f"{task.instance_id}: a diff does not apply: "
                                 f"{(r.stdout + r.stderr).strip()}")
        tests = sorted(str(p.relative_to(sb.tree)) for p in (sb.tree / "tests").rglob("test_*.py"))
        out, text = run_pytest(sb, tests, timeout_s=60)
    if not out:
        raise RuntimeError(f"{task.instance_id}: no test ran: {text[-2000:]}")
    return out


def build(rec: dict, workdir: Path) -> dict:
    """The SWE-bench row of one builtin.jsonl record, its repository made under workdir."""
    repo_dir = workdir / rec["repo"]
    base = repos.make_repo(rec["files"], repo_dir)
    task = Task(rec["instance_id"], rec["repo"], base, rec["problem_statement"], rec["patch"],
                rec["test_patch"], [], [], repo_dir=str(repo_dir))
    before, after = _outcomes(task, None), _outcomes(task, rec["patch"])
    bad = [i for i, o in after.items() if o != "PASSED"]
    if bad:
        raise ValueError(f"{rec['instance_id']}: the fix leaves tests failing: {bad}")
    f2p = sorted(i for i in after if before.get(i) != "PASSED")
    p2p = sorted(i for i in after if before.get(i) == "PASSED")
    if not f2p:
        raise ValueError(f"{rec['instance_id']}: no test fails before the fix")
    return {"instance_id": rec["instance_id"], "repo": rec["repo"], "base_commit": base,
            "environment_setup_commit": base, "version": "1.0", "problem_statement": rec["problem_statement"],
            "patch": rec["patch"], "test_patch": rec["test_patch"], "FAIL_TO_PASS": json.dumps(f2p),
            "PASS_TO_PASS": json.dumps(p2p)}


def main(out: Path = OUT, source: Path = BUILTIN):
    recs = [json.loads(line) for line in source.read_text().splitlines() if line.strip()]
    with tempfile.TemporaryDirectory() as d:
        rows = [build(r, Path(d)) for r in recs]
    out.write_text("".join(json.dumps(r, sort_keys=True) + "\n" for r in rows))
    print(f"wrote {len(rows)} rows to {out} (sandbox mode {Sandbox.capabilities()['mode']})", file=sys.stderr)


if __name__ == "__main__":
    main()
