"""A SWE row whose test_patch (or patch) carries a binary file change git apply will not take is refused
when the rows load, in one line naming the row, the field and the diff's line (issue 49): before, such a
row was accepted and every grading of it raised. The variants are made from a real `git diff --binary`
and each is checked against the real `git apply` outside a repository (as the grader runs it): what
load refuses, git refuses; the untouched diff loads, applies and grades 1.0 with the reference patch.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path

import pytest

from rl.envs.swe.datasets import load_dataset
from rl.envs.swe.grader import grade
from rl.envs.swe.patches import git_env
from rl.envs.swe.runtimes import RuntimeUnavailable, runtime_class
from rl.envs.swe.sandbox import Limits

DATA = bytes(range(256)) * 3 + b"\x00\xff" * 50   # not text: git diff --binary writes it as a literal
TEST = ("from pathlib import Path\n\nfrom m import x\n\n\ndef test_x():\n"
        "    assert Path(__file__).with_name('data.bin').read_bytes()[:3] == bytes([0, 1, 2])\n"
        "    assert x == 2\n")
FIX = "diff --git a/m.py b/m.py\n--- a/m.py\n+++ b/m.py\n@@ -1 +1 @@\n-x = 1\n+x = 2\n"


def _git(cwd, *args, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(["git", *args], cwd=cwd, capture_output=True, check=False,
                          env={**os.environ, "GIT_CONFIG_NOSYSTEM": "1", "GIT_CONFIG_GLOBAL": "/dev/null",
                               "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t",
                               "GIT_COMMITTER_EMAIL": "t@t"}, **kw)


@pytest.fixture(scope="module")
def binary_test_patch(tmp_path_factory) -> str:
    """`git diff --binary` of a test file and a binary data file added to the task's tree."""
    repo = tmp_path_factory.mktemp("repo")
    (repo / "m.py").write_text("x = 1\n")
    assert _git(repo, "init", "-q").returncode == 0
    _git(repo, "add", "m.py")
    assert _git(repo, "commit", "-qm", "base").returncode == 0
    (repo / "tests").mkdir()
    (repo / "tests" / "test_m.py").write_text(TEST)
    (repo / "tests" / "data.bin").write_bytes(DATA)
    _git(repo, "add", "tests")
    out = _git(repo, "diff", "--cached", "--binary", text=True).stdout
    assert "GIT binary patch" in out and re.search(r"index 0{40}\.\.[0-9a-f]{40}", out), out[:400]
    return out


def _data_line(diff: str) -> int:
    lines = diff.split("\n")
    return lines.index("GIT binary patch") + 2   # the literal's first line of base85


def _flip(diff: str) -> str:
    lines = diff.split("\n")
    i = _data_line(diff)
    c = lines[i][5]
    lines[i] = lines[i][:5] + ("0" if c != "0" else "1") + lines[i][6:]
    return "\n".join(lines)


# (variant, how the real diff is damaged, what the refusal says)
VARIANTS = [
    ("abbreviated index", lambda d: re.sub(r"index 0{40}\.\.([0-9a-f]{7})[0-9a-f]{33}", r"index 0000000..\1", d),
     "a binary change without a full index line"),
    ("no data (git diff without --binary)",
     lambda d: re.sub(r"GIT binary patch\nliteral \d+\n(?:.+\n)+\n(?:literal 0\n.+\n\n)?",
                      "Binary files /dev/null and b/tests/data.bin differ\n", d),
     "'Binary files ... differ' carries no data"),
    ("a size that is not the data's", lambda d: re.sub(r"literal (\d+)", lambda m: f"literal {int(m[1]) + 1}", d,
                                                       count=1), "inflates to"),
    ("a base85 character changed", _flip, "tests/data.bin"),
    ("not base85", lambda d: d.replace("\n".join(d.split("\n")[_data_line(d):_data_line(d) + 1]),
                                       "zz\"not base85", 1), "not a line of git's base85 binary data"),
    ("another file's blob id", lambda d: re.sub(r"(index 0{40}\.\.)[0-9a-f]{40}", r"\g<1>" + "1" * 40, d),
     "the index line says 1111111111111111111111111111111111111111"),
]


def _row(test_patch: str) -> dict:
    return {"instance_id": "binary__tp-1", "repo": "builtin/binary", "base_commit": "",
            "problem_statement": "x should be 2", "patch": FIX, "test_patch": test_patch,
            "FAIL_TO_PASS": ["tests/test_m.py::test_x"], "PASS_TO_PASS": [], "files": {"m.py": "x = 1\n"}}


def _git_apply_check(tmp_path: Path, diff: str) -> int:
    """`git apply --check` of `diff` in a tree holding only m.py, outside any repository (the grader's
    own invocation: rl.envs.swe.patches.apply)."""
    tree = tmp_path / "tree"
    tree.mkdir(exist_ok=True)
    (tree / "m.py").write_text("x = 1\n")
    return subprocess.run(["git", "apply", "--check", "-p1", "-"], cwd=tree, input=diff.encode(),
                          env={**os.environ, **git_env(str(tree))}, capture_output=True).returncode


@pytest.mark.parametrize("variant,damage,says", VARIANTS, ids=[v[0] for v in VARIANTS])
def test_a_binary_change_git_apply_refuses_is_refused_at_load(tmp_path, binary_test_patch, variant, damage, says):
    bad = damage(binary_test_patch)
    assert bad != binary_test_patch, variant
    assert _git_apply_check(tmp_path, bad) != 0, f"{variant}: git apply takes it, so must load"
    f = tmp_path / "rows.jsonl"
    f.write_text(json.dumps(_row(bad)) + "\n")
    with pytest.raises(ValueError) as e:
        load_dataset(str(f))
    msg = str(e.value)
    assert "\n" not in msg and f"{f}: row 0 (binary__tp-1): test_patch: " in msg and says in msg, msg
    assert re.search(r"test_patch: .*line \d+", msg), msg
    # the reference patch is held to the same rule
    f.write_text(json.dumps({**_row(binary_test_patch), "patch": FIX + bad}) + "\n")
    with pytest.raises(ValueError, match=r"row 0 \(binary__tp-1\): patch: "):
        load_dataset(str(f))


def test_a_deletion_without_data_and_the_real_diff_load(tmp_path, binary_test_patch):
    """`Binary files a/x and /dev/null differ` with a full index line deletes the file: git applies it
    without data, so it loads; and the untouched `git diff --binary` loads and applies."""
    assert _git_apply_check(tmp_path, binary_test_patch) == 0
    f = tmp_path / "rows.jsonl"
    f.write_text(json.dumps(_row(binary_test_patch)) + "\n")
    (task,) = load_dataset(str(f))
    assert task.test_patch == binary_test_patch
    blob = re.search(r"index 0{40}\.\.([0-9a-f]{40})", binary_test_patch)[1]
    delete = (f"diff --git a/old.bin b/old.bin\ndeleted file mode 100644\nindex {blob}..{'0' * 40}\n"
              f"Binary files a/old.bin and /dev/null differ\n")
    f.write_text(json.dumps(_row(binary_test_patch + delete)) + "\n")
    load_dataset(str(f))


def _why_not(name: str) -> str:
    try:
        runtime_class(name).check()
        return ""
    except RuntimeUnavailable as e:
        return str(e)


@pytest.mark.skipif(bool(_why_not("inprocess")), reason=_why_not("inprocess") or "-")
def test_the_real_binary_test_patch_grades(tmp_path, binary_test_patch):
    f = tmp_path / "rows.jsonl"
    f.write_text(json.dumps(_row(binary_test_patch)) + "\n")
    (task,) = load_dataset(str(f))
    g = grade(task, extra_patch=task.patch, limits=Limits(cpu_s=20, memory_bytes=1 << 30))
    assert g.reward == 1.0, g.output[-2000:]
