"""Outcomes from pytest's structured report, the tree installed before its tests, no silent zeros
(issue 51), on a real repository built from its PyPI sdist.

The repository: pytest-repeat 0.9.4 (a pytest plugin; its own tests need its `pytest11` entry point
registered, and it builds with hatch-vcs), made into a git repository as test_swe_parity.py makes its
sdists (PKG-INFO left out), with a constructed base commit on top, as a user's row could have it:
- pyproject: addopts `--color=yes -p no:cacheprovider -q --doctest-modules`, and hatch-vcs writing
  `_repeat_version.py` (not in the tree: a build generates it), which pytest_repeat.py imports;
- pytest_repeat.py: a `progress_id` helper with a doctest and an off-by-one (the bug).
The row: patch = the fix of progress_id; test_patch = a new test file reading the distribution's version
with importlib.metadata, a unittest `self.subTest` test and a pytest `subtests` test (keyword subtests
that fail on the base while the test's own line passes); FAIL_TO_PASS includes the doctest id inside the
source module (`pytest_repeat.py::pytest_repeat.progress_id`), PASS_TO_PASS two of the plugin's own
pytester tests (they need the plugin registered: `--count`)."""
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
from builders import runtime_params

from rl.envs.swe import grader, install, pytest_report, repos
from rl.envs.swe.grading import parse_pytest
from rl.envs.swe.runtimes import InprocessRuntime
from rl.envs.swe.sandbox import Limits
from rl.envs.swe.tasks import Task
from rl.envs.swe.tools import Tools

LIMITS = Limits(cpu_s=120)
RUNTIMES = runtime_params(("inprocess", "bubblewrap"))
PIN = "pytest-repeat==0.9.4"
CONFIG = ('\n[tool.hatch.build.hooks.vcs]\nversion-file = "_repeat_version.py"\n\n[tool.pytest.ini_options]\n'
          'addopts = "--color=yes -p no:cacheprovider -q --doctest-modules"\n')
HELPER = ('\n\ndef progress_id(i, n):\n    """The id of the i-th of n repeats.\n\n    >>> progress_id(0, 3)\n'
          "    '1-3'\n    \"\"\"\n    return f'{i}-{n}'\n")
FIXED = HELPER.replace("return f'{i}-{n}'", "return f'{i + 1}-{n}'")
WRONG = HELPER.replace("return f'{i}-{n}'", "return f'{i + 1}-{n}' if i else f'{i}-{n}'")
EXTRA = '''import importlib.metadata
import unittest

import pytest_repeat


def test_version_is_the_distributions():
    assert importlib.metadata.version("pytest-repeat") == pytest_repeat.__version__


class TestIds(unittest.TestCase):
    def test_ids(self):
        for i in range(3):
            with self.subTest(i=i):
                self.assertEqual(pytest_repeat.progress_id(i, 3), f"{i + 1}-3")


def test_ids_subtests(subtests):
    for i in range(3):
        with subtests.test(msg="id", i=i):
            assert pytest_repeat.progress_id(i, 3) == f"{i + 1}-3"
'''
F2P = ["pytest_repeat.py::pytest_repeat.progress_id", "test_extra.py::TestIds::test_ids",
       "test_extra.py::test_ids_subtests"]
P2P = ["test_extra.py::test_version_is_the_distributions", "test_repeat.py::TestRepeat::test_no_repeat",
       "test_repeat.py::TestRepeat::test_can_repeat"]


def _diff(rel: str, old: str | None, new: str) -> str:
    a, b = (old or "").splitlines(), new.splitlines()
    head = f"diff --git a/{rel} b/{rel}\n" + ("new file mode 100644\n--- /dev/null\n" if old is None else f"--- a/{rel}\n")
    hunk = f"@@ -{'0,0' if old is None else f'1,{len(a)}'} +1,{len(b)} @@\n"
    return head + f"+++ b/{rel}\n" + hunk + "".join(f"-{x}\n" for x in a) + "".join(f"+{x}\n" for x in b)


@pytest.fixture(scope="session")
def repeat_repo(tmp_path_factory):
    """(git repository of pytest-repeat's sdist plus the constructed base commit, base plugin text)."""
    root = tmp_path_factory.mktemp("repeat")
    try:
        r = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
                            "--disable-pip-version-check", "-q", "-d", str(root / "dl"), PIN],
                           capture_output=True, text=True, timeout=600)
    except subprocess.TimeoutExpired:
        pytest.skip(f"pip download of {PIN} timed out (no PyPI here?)")
    if r.returncode != 0:
        pytest.skip(f"cannot download the sdist {PIN} from PyPI: {r.stderr.strip()[-300:]}")
    [tgz] = list((root / "dl").iterdir())
    with tarfile.open(tgz) as tar:
        tar.extractall(root / "x", filter="data")
    [src] = list((root / "x").iterdir())
    (src / "PKG-INFO").unlink(missing_ok=True)
    dest = root / "pytest-repeat"
    src.rename(dest)
    (dest / "pyproject.toml").write_text((dest / "pyproject.toml").read_text() + CONFIG)
    plugin = (dest / "pytest_repeat.py").read_text()
    plugin = plugin.replace("import pytest\n", "import pytest\n\nfrom _repeat_version import version as __version__\n", 1)
    plugin = plugin.replace("            return f'{i + 1}-{n}'", "            return progress_id(i, n)") + HELPER
    assert "progress_id(i, n)" in plugin
    (dest / "pytest_repeat.py").write_text(plugin)
    repos.git("-c", "init.defaultBranch=main", "init", "-q", cwd=dest)
    repos.git("add", "-A", cwd=dest)
    repos.git("-c", "user.name=t", "-c", "user.email=t@t", "-c", "commit.gpgsign=false", "commit", "-q",
              "--no-verify", "-m", "sdist + base", cwd=dest)
    return dest, plugin


@pytest.fixture
def task(repeat_repo):
    repo, plugin = repeat_repo
    base = repos.git("rev-parse", "HEAD", cwd=repo).decode().strip()
    return Task("pytest-repeat__ids-1", str(repo), base, "progress ids start at 0", _diff(
        "pytest_repeat.py", plugin, plugin.replace(HELPER, FIXED)), _diff("test_extra.py", None, EXTRA),
        F2P, P2P, repo_dir=str(repo), version="0.9")


@pytest.mark.parametrize("runtime", RUNTIMES)
def test_reference_scores_one_and_the_base_fails_exactly_its_fail_to_pass(task, repeat_repo, runtime):
    """Colour and `-p no:` in addopts, keyword subtests, a doctest id in the source module, the plugin's
    own entry point, its importlib.metadata version and a hatch-vcs `_version.py`: all graded right."""
    rt = {"name": runtime}
    ref = grader.grade(task, extra_patch=task.patch, limits=LIMITS, timeout_s=300, runtime=rt)
    assert ref.reward == 1.0 and not ref.grading_error, ref.output[-3000:]
    assert "\x1b[" in ref.output  # --color=yes was in force: the terminal text is coloured
    assert not [i for i, s in parse_pytest(ref.output, task.graded).items() if s == "PASSED"]  # unreadable as text
    base = grader.grade(task, limits=LIMITS, timeout_s=300, runtime=rt)
    assert sorted(base.failed) == sorted(F2P) and sorted(base.passed) == sorted(P2P), base.output[-3000:]
    assert not base.grading_error
    plugin = repeat_repo[1]
    wrong = grader.grade(task, extra_patch=_diff("pytest_repeat.py", plugin, plugin.replace(HELPER, WRONG)),
                         limits=LIMITS, timeout_s=300, runtime=rt)
    assert 0 < wrong.reward < 1 and sorted(wrong.failed) == sorted(F2P), wrong.output[-3000:]


def test_without_the_install_nothing_imports_and_it_is_a_grading_error(task, monkeypatch):
    """What the install step makes up for: without it the package cannot be imported (its generated
    `_repeat_version.py` is missing): a grading error with the reason, not a silent 0."""
    monkeypatch.setattr(install, "spec", lambda task, base: ({}, 0.0))
    g = grader.grade(task, extra_patch=task.patch, limits=LIMITS, timeout_s=300)
    assert g.reward == 0.0 and g.grading_error.startswith("none of the 6 graded tests ran"), g.grading_error
    assert "_repeat_version" in g.grading_error


def test_install_spec_of_the_plugin_repository(task):
    spec = grader.run_tests_install(task, {"name": "inprocess"})
    [dist] = spec["dists"]
    assert dist["name"] == "pytest-repeat" and "[pytest11]\nrepeat = pytest_repeat\n" in dist["entry_points"]
    [vf] = spec["version_files"]
    assert vf["path"] == "_repeat_version.py" and f"version = {dist['version']!r}" in vf["text"]


def test_a_test_id_found_nowhere_is_a_grading_error(task):
    t = Task(**{**task.__dict__, "fail_to_pass": F2P + ["test_extra.py::test_not_there"]})
    g = grader.grade(t, extra_patch=t.patch, limits=LIMITS, timeout_s=300)
    assert g.grading_error == "1 graded test ids found nowhere: test_extra.py::test_not_there"
    assert g.failed == ["test_extra.py::test_not_there"]


def test_run_tests_shows_the_outcomes_the_grader_uses(task, tmp_path):
    """The agent's run_tests on the base tree with the hidden tests: the failing subtests' tests are
    FAILED in its outcome lines (the terminal says PASSED for them), like the grader's."""
    d = tmp_path / "agent"
    d.mkdir()
    repos.checkout(task.repo_dir, task.base_commit, d)
    subprocess.run(["git", "apply", "-"], cwd=d, input=task.test_patch.encode(), check=True)
    with InprocessRuntime(d) as sb:
        tools = Tools(sb, output_chars=200_000, timeout_s=300, roots=grader.task_roots(task),
                      install=grader.run_tests_install(task, {"name": "inprocess"}))
        out = tools.call("run_tests", {"paths": ["test_extra.py", "pytest_repeat.py"]})
    assert "\x1b[" not in out
    tail = out[out.index("[outcomes, as graded:"):]
    for tid in F2P:
        assert f"FAILED {tid}" in tail, tail
    assert "test_version_is_the_distributions" not in tail
    assert not list(d.glob(".hetrl-pytest-*"))  # the results file is gone


def test_fold_subtests_xfail_and_phases():
    lines = [
        '{"ev": "start"}',
        '{"ev": "test", "id": "t.py::a", "when": "setup", "outcome": "passed"}',
        '{"ev": "test", "id": "t.py::a", "when": "call", "outcome": "failed", "sub": true, "msg": "E x"}',
        '{"ev": "test", "id": "t.py::a", "when": "call", "outcome": "passed"}',
        '{"ev": "test", "id": "t.py::b", "when": "call", "outcome": "skipped", "xfail": true}',
        '{"ev": "test", "id": "t.py::c", "when": "call", "outcome": "passed"}',
        '{"ev": "test", "id": "t.py::c", "when": "teardown", "outcome": "failed", "msg": "E td"}',
        '{"ev": "test", "id": "t.py::d", "when": "setup", "outcome": "failed"}',
        '{"ev": "test", "id": "t.py::e", "when": "call", "outcome": "passed", "xfail": true}',
        '{"ev": "finish", "exit": 1}', '{"ev": "te',
    ]
    rep = pytest_report.fold(lines)
    assert rep.outcomes == {"t.py::a": "FAILED", "t.py::b": "XFAIL", "t.py::c": "ERROR", "t.py::d": "ERROR",
                            "t.py::e": "XPASS"}
    assert rep.finished and rep.exit == 1
    assert pytest_report.is_doctest("pkg/mod.py::pkg.mod.f") and pytest_report.is_doctest("README.rst::README.rst")
    assert not pytest_report.is_doctest("t.py::C::test_a") and not pytest_report.is_doctest("t.py::test[a.b]")


def test_setuptools_scm_version_file_and_setup_cfg_entry_points():
    files = {"pyproject.toml": b'[build-system]\nrequires = ["setuptools>=64", "setuptools_scm>=8"]\n'
                               b'[project]\nname = "demo"\ndynamic = ["version"]\n'
                               b'[tool.setuptools_scm]\nversion_file = "src/demo/_version.py"\n'
                               b'fallback_version = "2.1.0"\n',
             "setup.cfg": b"[options.entry_points]\npytest11 =\n    demo = demo.plugin\n",
             "src/demo/__init__.py": b"from ._version import version\n"}
    spec = install.metadata(set(files), files.get)
    assert spec["dists"] == [{"name": "demo", "version": "2.1.0", "entry_points": "[pytest11]\ndemo = demo.plugin\n\n"}]
    [vf] = spec["version_files"]
    ns: dict = {}
    exec(vf["text"], ns)
    assert vf["path"] == "src/demo/_version.py" and ns["version"] == "2.1.0" and ns["version_tuple"] == (2, 1, 0)
