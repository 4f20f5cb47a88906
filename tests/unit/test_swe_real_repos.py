"""Grading rows built from real commits of public projects (tests/fixtures/swe_real/, rebuilt from the
real history by its build.py; docs/swe.md, "Real repositories"): the reference patch scores 1, the
starting tree and a wrong patch score below 1 with exactly the expected tests failing, under every
runtime that works here (inprocess, bubblewrap).

Cases: a test_patch that adds, renames and deletes data files (tomli), binary files in it (GIT binary
patch: tomli's NUL-byte files) and non-UTF-8 files of the base tree it renames (tomli's bad-utf8
files), the repository's conftest.py fixtures (pluggy's `pm`, packaging's autouse fixture), src/
packages also installed in the venv, which pytest itself imports (pluggy, packaging) or not (tomli),
unittest classes with subtests (tomli), and, constructed on packaging's real row: ids with spaces,
brackets and "::" inside, xfail, a binary data file, a deleted test function and a deleted test file."""
import base64
import json
import os
import subprocess
from builders import runtime_params
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from rl.envs.swe import grader
from rl.envs.swe.grading import parse_pytest
from rl.envs.swe.sandbox import Limits
from rl.envs.swe.tasks import Task

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "swe_real"
NAMES = ["pluggy-646", "packaging-1341", "packaging-edge", "tomli-200"]
LIMITS = Limits(cpu_s=60)
_ENV = {"GIT_CONFIG_NOSYSTEM": "1", "GIT_CONFIG_GLOBAL": os.devnull, "GIT_AUTHOR_NAME": "f",
        "GIT_AUTHOR_EMAIL": "f@f", "GIT_COMMITTER_NAME": "f", "GIT_COMMITTER_EMAIL": "f@f",
        "GIT_AUTHOR_DATE": "2024-01-01T00:00:00+0000", "GIT_COMMITTER_DATE": "2024-01-01T00:00:00+0000"}


RUNTIMES = runtime_params(("inprocess", "bubblewrap"))


def _row(name):
    row = json.loads((FIXTURES / f"{name}.json").read_text())
    if "files_from" in row:
        row["files"] = json.loads((FIXTURES / f"{row['files_from']}.json").read_text())["files"]
    return row


def _files(row) -> dict[str, tuple[bytes, int]]:
    return {rel: (e["text"].encode() if "text" in e else base64.b64decode(e["b64"]), int(e.get("mode", "0o644"), 8))
            for rel, e in row["files"].items()}


def _git(d, *args):
    return subprocess.run(["git", *args], cwd=d, check=True, capture_output=True,
                          env={**os.environ, **_ENV}).stdout.decode().strip()


def _write(root: Path, files):
    for rel, (data, mode) in files.items():
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(data)
        p.chmod(mode)


@pytest.fixture(scope="module")
def tasks(tmp_path_factory):
    """{name: (Task over a real git repository made from the fixture, row)}."""
    out = {}
    for name in NAMES:
        row = _row(name)
        d = tmp_path_factory.mktemp(name)
        _write(d, _files(row))
        _git(d, "-c", "init.defaultBranch=main", "init", "-q")
        _git(d, "add", "-A")
        _git(d, "-c", "commit.gpgsign=false", "commit", "-q", "-m", "base")
        t = Task(row["instance_id"], row["repo"], _git(d, "rev-parse", "HEAD"), "fix it", row["patch"],
                 row["test_patch"], row["FAIL_TO_PASS"], row["PASS_TO_PASS"], repo_dir=str(d))
        out[name] = (t, row)
    return out


def _tree(tmp_path, task, patch=None) -> Path:
    """The agent's tree: the starting tree, with `patch` applied as an agent would (git apply)."""
    d = tmp_path / "agent"
    d.mkdir()
    _git(task.repo_dir, "archive", "-o", str(tmp_path / "t.tar"), task.base_commit)
    subprocess.run(["tar", "-xf", str(tmp_path / "t.tar"), "-C", str(d)], check=True)
    if patch:
        subprocess.run(["git", "apply", "-"], cwd=d, input=patch.encode(), check=True)
    return d


@pytest.mark.parametrize("runtime", RUNTIMES)
@pytest.mark.parametrize("name", NAMES)
def test_real_rows_reference_one_base_and_wrong_below_one(tasks, runtime, name, tmp_path):
    task, row = tasks[name]
    rt = {"name": runtime}
    graded = set(task.graded)
    with ThreadPoolExecutor(2) as pool:
        ref, base, wrong = pool.map(lambda kw: grader.grade(task, limits=LIMITS, timeout_s=120, runtime=rt, **kw),
                                    [{"extra_patch": task.patch}, {}, {"extra_patch": row["wrong_patch"]}])
    assert ref.reward == 1.0, (name, ref.failed, ref.output[-3000:])
    assert set(ref.passed) == graded
    assert base.reward < 1.0 and set(base.failed) == set(task.fail_to_pass), (name, base.failed, base.output[-2000:])
    assert wrong.reward < 1.0 and set(wrong.failed) == set(row["wrong_fails"]), (name, wrong.failed)
    # the agent's tree as the episode leaves it (the fix applied in place) grades the same
    assert grader.grade(task, _tree(tmp_path, task, task.patch), limits=LIMITS, timeout_s=120,
                        runtime=rt).reward == 1.0


def test_installed_copy_does_not_shadow_the_checkout(tasks):
    """pluggy, packaging and tomli are installed in this venv (pytest imports the first two), in versions
    that already hold these fixes: run the way the old grader ran (no source root on the path), the
    unfixed tree would pass. The grader tests the tree's src/ instead; an edit there changes the result."""
    import importlib.metadata as md
    for name, dist in (("pluggy-646", "pluggy"), ("packaging-1341", "packaging"), ("tomli-200", "tomli")):
        assert md.version(dist)  # installed on the node
        task, _ = tasks[name]
        g = grader.grade(task, limits=LIMITS, timeout_s=120)
        assert set(g.failed) == set(task.fail_to_pass), (name, g.output[-1500:])
    task, _ = tasks["pluggy-646"]
    g = grader.grade(task, limits=LIMITS, timeout_s=120)
    assert "src/pluggy" in g.output or g.failed  # the failure is raised from the tree's code


def test_unrooted_run_would_grade_the_installed_copy(tasks, tmp_path):
    """The bug this grader fixes, shown directly: pytest without the source root imports the venv's
    pluggy, where the unfixed tree's failing test passes."""
    task, row = tasks["pluggy-646"]
    d = _tree(tmp_path, task)
    subprocess.run(["git", "apply", "-"], cwd=d, input=task.test_patch.encode(), check=True)
    import sys
    r = subprocess.run([sys.executable, *grader.PYTEST, "testing/test_pluginmanager.py"], cwd=d,
                       capture_output=True, text=True, env={"PATH": os.environ["PATH"],
                                                            "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"})
    assert parse_pytest(r.stdout)[task.fail_to_pass[0]] == "PASSED"


def test_agent_cannot_reshape_the_run(tasks, tmp_path):
    """On pluggy's real row: a planted conftest.py that forces passes, an edited repository conftest and
    tox.ini, a sitecustomize.py in src/, an edited hidden test file and a .git are all undone."""
    task, _ = tasks["pluggy-646"]
    d = _tree(tmp_path, task)
    force = ("import pytest\n@pytest.hookimpl(hookwrapper=True)\ndef pytest_runtest_makereport(item, call):\n"
             "    out = yield\n    out.get_result().outcome = 'passed'\n")
    (d / "conftest.py").write_text(force)
    (d / "testing" / "sub").mkdir()
    (d / "testing" / "sub" / "conftest.py").write_text(force)
    (d / "testing" / "conftest.py").write_text((d / "testing" / "conftest.py").read_text() + "\n" + force)
    (d / "tox.ini").write_text("[pytest]\naddopts = -p no:python\n")
    (d / "pytest.ini").write_text("[pytest]\npython_files = nothing.py\n")
    (d / "src" / "sitecustomize.py").write_text("import os\nos._exit(0)\n")
    (d / "testing" / "test_pluginmanager.py").write_text("def test_get_hookcallers_no_duplicates():\n    pass\n")
    (d / ".git").mkdir()
    (d / ".git" / "config").write_text("[apply]\nwhitespace = error-all\n")
    g = grader.grade(task, d, limits=LIMITS, timeout_s=120)
    assert set(g.failed) == set(task.fail_to_pass), (g.failed, g.output[-2000:])
    assert (d / "conftest.py").exists()  # the agent's tree itself is never modified


def test_edge_ids_xfail_and_deleted_tests(tasks):
    task, row = tasks["packaging-edge"]
    g = grader.grade(task, extra_patch=task.patch, limits=LIMITS, timeout_s=120)
    assert g.reward == 1.0
    ids = set(task.graded)
    for frag in ("[a::b]", "[foo bar]", "[x - y]", "[unbalanced]]", "[sp ace::[x]]", "[[nested]]", "[newline::tail]"):
        assert any(i.endswith(frag) for i in ids), frag
    assert "XFAIL tests/test_edge_ids.py::TestEdgeIds::test_xfail_known_gap" in g.output
    assert "test_canonicalize_name_invalid" not in g.output and "test_errors" not in g.output


def test_patch_paths_and_bytes(tasks):
    """The tomli row's test_patch as git ships it: binary adds, deletes and renames, and the base tree's
    non-UTF-8 files read as bytes."""
    from rl.envs.swe import patches
    task, row = tasks["tomli-200"]
    ch = patches.changes(task.test_patch)
    assert any(c.binary and c.old is None for c in ch) and any(c.binary and c.new is None for c in ch)
    assert any(c.old and c.new and c.old != c.new for c in ch)
    enc = [c.old for c in ch if c.old and "/encoding/bad-utf8" in c.old]
    base = grader.git_tree(task.repo_dir, task.base_commit)
    data, _ = base.read(enc[0])
    with pytest.raises(UnicodeDecodeError):
        data.decode()
    assert grader.show_bytes(task.repo_dir, task.base_commit, enc[0]) == data
