"""Grading and the agent's run_tests run the repository's tests as the repository itself does (issue 38):
its installed pytest plugins, its `filterwarnings` and `addopts` markers, its conftest fixtures and its
own source tree, the same way for both; dataset directories never merge their splits; grading has its
own time limit.

Repositories: small ones made here as SWE-bench rows over real git repositories (an async package whose
tests run under the installed anyio plugin; a package whose pytest config turns warnings into errors and
deselects stress tests), and real projects from their PyPI sdists (click, python-dotenv, cachetools, at
the versions installed in this venv so that their dependencies match), made into a git repository once
per session; those tests skip, naming why, where the sdists cannot be downloaded."""
import json
import os
import shutil
import subprocess
import sys
import tarfile
from importlib import metadata
from pathlib import Path

import pytest
from builders import runtime_params

from rl.envs.swe import grader, repos
from rl.envs.swe.datasets import load_dataset
from rl.envs.swe.env import EnvConfig, SWEEnv
from rl.envs.swe.grading import PASSING, parse_pytest
from rl.envs.swe.runtimes import InprocessRuntime
from rl.envs.swe.sandbox import Limits
from rl.envs.swe.tasks import Task
from rl.envs.swe.tools import Tools

LIMITS = Limits(cpu_s=120)
RUNTIMES = runtime_params(("inprocess", "bubblewrap"))


def _diff(rel: str, old: str | None, new: str) -> str:
    """A git diff writing `rel` from `old` (None: a new file) to `new`, whole-file hunks."""
    a, b = (old or "").splitlines(), new.splitlines()
    head = f"diff --git a/{rel} b/{rel}\n" + ("new file mode 100644\n--- /dev/null\n" if old is None else f"--- a/{rel}\n")
    hunk = f"@@ -{'0,0' if old is None else f'1,{len(a)}'} +1,{len(b)} @@\n"
    return head + f"+++ b/{rel}\n" + hunk + "".join(f"-{x}\n" for x in a) + "".join(f"+{x}\n" for x in b)


def _task(tmp_path: Path, name: str, files: dict[str, str], fix: dict[str, str], tests: dict[str, str],
          f2p: list[str], p2p: list[str]) -> Task:
    """A SWE-bench row over a real git repository holding `files`: patch = `fix`, test_patch = `tests`."""
    base = repos.make_repo(files, tmp_path / name)
    patch = "".join(_diff(r, files.get(r), t) for r, t in fix.items())
    test_patch = "".join(_diff(r, files.get(r), t) for r, t in tests.items())
    return Task(f"local__{name}-1", str(tmp_path / name), base, "fix it", patch, test_patch, f2p, p2p,
                repo_dir=str(tmp_path / name))


def _tree(tmp_path: Path, task: Task, *diffs: str) -> Path:
    """The agent's tree: the starting tree with `diffs` applied as an agent would."""
    d = tmp_path / "agent"
    d.mkdir()
    repos.checkout(task.repo_dir, task.base_commit, d)
    for diff in diffs:
        subprocess.run(["git", "apply", "-"], cwd=d, input=diff.encode(), check=True)
    return d


# -- an async test under an installed plugin ----------------------------------------------------------
ASYNC_FILES = {
    "pyproject.toml": '[project]\nname = "aiocount"\nversion = "0.1"\n\n[tool.pytest.ini_options]\n'
                      'testpaths = ["tests"]\n',
    "src/aiocount/__init__.py": "import anyio\n\n\nasync def count(n):\n    got = 0\n"
                                "    for _ in range(n - 1):\n        await anyio.sleep(0)\n        got += 1\n"
                                "    return got\n",
    "tests/conftest.py": 'import pytest\n\n\n@pytest.fixture(params=["asyncio"])\ndef anyio_backend(request):\n'
                         "    return request.param\n",
    "tests/test_count.py": "import pytest\n\nfrom aiocount import count\n\npytestmark = pytest.mark.anyio\n\n\n"
                           "async def test_zero():\n    assert await count(0) == 0\n",
}
ASYNC_FIXED = ASYNC_FILES["src/aiocount/__init__.py"].replace("range(n - 1)", "range(n)")
ASYNC_WRONG = ASYNC_FILES["src/aiocount/__init__.py"].replace("range(n - 1)", "range(max(n - 1, 0))")
ASYNC_TESTS = ASYNC_FILES["tests/test_count.py"] + "\n\nasync def test_three():\n    assert await count(3) == 3\n"
# what an agent could plant to pass without a fix: a distribution at the tree's root whose pytest11 entry
# point autoloads a plugin that reports every test passed
FORCE = ("import pytest\n\n\n@pytest.hookimpl(hookwrapper=True)\ndef pytest_runtest_makereport(item, call):\n"
         "    out = yield\n    rep = out.get_result()\n    rep.outcome = 'passed'\n")


@pytest.fixture
def async_task(tmp_path):
    return _task(tmp_path, "aiocount", ASYNC_FILES, {"src/aiocount/__init__.py": ASYNC_FIXED},
                 {"tests/test_count.py": ASYNC_TESTS}, ["tests/test_count.py::test_three[asyncio]"],
                 ["tests/test_count.py::test_zero[asyncio]"])


@pytest.mark.parametrize("runtime", RUNTIMES)
def test_async_tests_under_the_installed_plugin_are_graded_by_their_outcome(async_task, runtime):
    """anyio's pytest plugin (installed in this venv, loaded by its entry point) runs the async tests:
    the fix scores 1, the unfixed tree and a wrong fix fail exactly the test they should, and the ids
    keep their [asyncio] parametrization."""
    assert "anyio" in {ep.name for ep in metadata.entry_points(group="pytest11")}
    rt = {"name": runtime}
    ref = grader.grade(async_task, extra_patch=async_task.patch, limits=LIMITS, timeout_s=120, runtime=rt)
    assert ref.reward == 1.0, ref.output[-2000:]
    base = grader.grade(async_task, limits=LIMITS, timeout_s=120, runtime=rt)
    assert base.failed == async_task.fail_to_pass and base.passed == async_task.pass_to_pass, base.output[-2000:]
    wrong = _diff("src/aiocount/__init__.py", ASYNC_FILES["src/aiocount/__init__.py"], ASYNC_WRONG)
    g = grader.grade(async_task, extra_patch=wrong, limits=LIMITS, timeout_s=120, runtime=rt)
    assert g.failed == async_task.fail_to_pass and "assert 2 == 3" in g.output
    assert "not natively supported" not in ref.output + base.output + g.output


def test_a_planted_plugin_distribution_is_not_loaded_by_the_grader(async_task, tmp_path):
    """Autoload is on, so a `*.dist-info` the agent leaves at a source root would register its plugin;
    shown to work under plain pytest, then removed by the grader (and a module shadowing the installed
    anyio plugin with it)."""
    d = _tree(tmp_path, async_task, _diff("tests/test_count.py", ASYNC_FILES["tests/test_count.py"], ASYNC_TESTS))
    (d / "forcepass.py").write_text(FORCE)
    dist = d / "forcepass-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: forcepass\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text("[pytest11]\nforcepass = forcepass\n")
    r = subprocess.run([sys.executable, *grader.PYTEST, "tests/test_count.py"], cwd=d, capture_output=True,
                       text=True, env={"PATH": os.environ["PATH"], "PYTHONPATH": ".:src"}, timeout=300)
    assert parse_pytest(r.stdout, async_task.graded)[async_task.fail_to_pass[0]] == "PASSED", r.stdout[-2000:]  # it would work
    g = grader.grade(async_task, d, limits=LIMITS, timeout_s=120)
    assert g.failed == async_task.fail_to_pass, g.output[-2000:]
    shutil.rmtree(dist)
    (d / "anyio").mkdir()  # an `anyio` package at the root would be imported for anyio's plugin
    (d / "anyio" / "__init__.py").write_text("")
    (d / "anyio" / "pytest_plugin.py").write_text(FORCE)
    g = grader.grade(async_task, d, limits=LIMITS, timeout_s=120)
    assert g.failed == async_task.fail_to_pass, g.output[-2000:]
    assert (d / "anyio").is_dir()  # the agent's tree itself is never modified


# -- the repository's warning rules and markers -------------------------------------------------------
WARN_FILES = {
    "pyproject.toml": '[project]\nname = "halves"\nversion = "0.1"\n\n[tool.pytest.ini_options]\n'
                      'filterwarnings = ["error"]\nmarkers = ["stress: slow"]\naddopts = "-m \'not stress\'"\n',
    "halves.py": "def half(n):\n    return n / 2\n",
    "tests/test_halves.py": "import pytest\n\nfrom halves import half\n\n\ndef test_even():\n    assert half(4) == 2\n\n\n"
                            "@pytest.mark.stress\ndef test_stress():\n    raise SystemExit('stress tests are deselected')\n",
}
WARN_TESTS = WARN_FILES["tests/test_halves.py"] + "\n\ndef test_odd_is_int():\n    assert half(5) == 2\n"
WARN_FIX = "def half(n):\n    return n // 2\n"
WARN_NOISY_FIX = "import warnings\n\n\ndef half(n):\n    warnings.warn('half() floors', DeprecationWarning)\n    return n // 2\n"


@pytest.mark.parametrize("runtime", RUNTIMES)
def test_a_fix_that_warns_fails_where_the_repository_turns_warnings_into_errors(tmp_path, runtime):
    task = _task(tmp_path, "halves", WARN_FILES, {"halves.py": WARN_FIX}, {"tests/test_halves.py": WARN_TESTS},
                 ["tests/test_halves.py::test_odd_is_int"], ["tests/test_halves.py::test_even"])
    rt = {"name": runtime}
    ref = grader.grade(task, extra_patch=task.patch, limits=LIMITS, timeout_s=120, runtime=rt)
    assert ref.reward == 1.0, ref.output[-2000:]
    assert "1 deselected" in ref.output  # addopts' -m 'not stress' holds: the stress test never ran
    noisy = grader.grade(task, extra_patch=_diff("halves.py", WARN_FILES["halves.py"], WARN_NOISY_FIX),
                         limits=LIMITS, timeout_s=120, runtime=rt)
    assert noisy.reward == 0.0 and "DeprecationWarning: half() floors" in noisy.output, noisy.output[-2000:]
    # the agent's run_tests says the same about the same tree
    d = _tree(tmp_path, task, _diff("halves.py", WARN_FILES["halves.py"], WARN_NOISY_FIX),
              _diff("tests/test_halves.py", WARN_FILES["tests/test_halves.py"], WARN_TESTS))
    with InprocessRuntime(d) as sb:
        out = Tools(sb, output_chars=100_000, timeout_s=120, roots=grader.task_roots(task)).call("run_tests", {})
    assert parse_pytest(out) == {"tests/test_halves.py::test_even": "FAILED",
                                 "tests/test_halves.py::test_odd_is_int": "FAILED"}, out[-2000:]


# -- run_tests and the grader agree, test by test, on real projects -----------------------------------
SDISTS = {"click": ("click", "src/click", ["tests/test_basic.py", "tests/test_stream_lifecycle.py"]),
          "python-dotenv": ("dotenv", "src/dotenv", ["tests/test_main.py"]),
          "cachetools": ("cachetools", "src/cachetools", ["tests/test_cached.py", "tests/test_lru.py"])}
PROBE = "def where():\n    return __file__\n"


@pytest.fixture(scope="session")
def sdist_repos(tmp_path_factory):
    """{dist: git repository of its sdist (tests included), at the version installed here}; PKG-INFO and
    *.egg-info left out, as a git checkout has them."""
    root = tmp_path_factory.mktemp("sdists")
    pins = [f"{d}=={metadata.version(d)}" for d in SDISTS]
    try:
        r = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
                            "--disable-pip-version-check", "-q", "-d", str(root / "dl"), *pins],
                           capture_output=True, text=True, timeout=600)
    except subprocess.TimeoutExpired:
        pytest.skip(f"pip download of {', '.join(pins)} timed out (no PyPI here?)")
    if r.returncode != 0:
        pytest.skip(f"cannot download the sdists {', '.join(pins)} from PyPI: {r.stderr.strip()[-300:]}")
    out = {}
    for dist in SDISTS:
        [tgz] = [p for p in (root / "dl").iterdir() if p.name.lower().replace("_", "-").startswith(dist + "-")]
        with tarfile.open(tgz) as tar:
            tar.extractall(root / "x", filter="data")
        [src] = [p for p in (root / "x").iterdir() if p.name.lower().replace("_", "-").startswith(dist + "-")]
        (src / "PKG-INFO").unlink(missing_ok=True)
        for egg in src.rglob("*.egg-info"):
            shutil.rmtree(egg)
        dest = root / dist
        src.rename(dest)
        repos.git("-c", "init.defaultBranch=main", "init", "-q", cwd=dest)
        repos.git("add", "-A", cwd=dest)
        repos.git("-c", "user.name=t", "-c", "user.email=t@t", "-c", "commit.gpgsign=false", "commit", "-q",
                  "--no-verify", "-m", "sdist", cwd=dest)
        out[dist] = dest
    return out


def _sdist_task(dist: str, repo: Path) -> Task:
    """A row over the sdist's repository: the fix adds a module, the hidden test checks that the module
    the tests import is the tree's (not the copy installed in this venv)."""
    pkg, pkg_dir, _ = SDISTS[dist]
    probe = "tests/test_hetrl_probe.py"
    test = (f"from {pkg}._hetrl_probe import where\n\n\ndef test_probe_is_the_trees():\n"
            f"    assert 'site-packages' not in where() and where().endswith('{pkg_dir}/_hetrl_probe.py')\n")
    base = repos.git("rev-parse", "HEAD", cwd=repo).decode().strip()
    return Task(f"{dist}__probe-1", str(repo), base, "add a probe", _diff(f"{pkg_dir}/_hetrl_probe.py", None, PROBE),
                _diff(probe, None, test), [f"{probe}::test_probe_is_the_trees"], [], repo_dir=str(repo))


@pytest.mark.parametrize("dist", list(SDISTS))
def test_run_tests_and_the_grader_agree_test_by_test(sdist_repos, dist, tmp_path):
    """On the tree an agent leaves (the fix and the hidden tests applied), the agent's run_tests on the
    graded files and the grader report every test the same way; the repository's conftest fixtures,
    config and src/ package are in force for both (no collection errors, nothing from site-packages)."""
    task = _sdist_task(dist, sdist_repos[dist])
    files = SDISTS[dist][2] + ["tests/test_hetrl_probe.py"]
    d = _tree(tmp_path, task, task.patch, task.test_patch)
    with InprocessRuntime(d) as sb:
        out = Tools(sb, output_chars=10_000_000, timeout_s=300,
                    roots=grader.task_roots(task)).call("run_tests", {"paths": files})
    seen = parse_pytest(out)
    assert "error" not in out.strip().splitlines()[-1], out[-3000:]  # pytest's last line: no collection errors
    assert seen.get(task.fail_to_pass[0]) == "PASSED", out[-3000:]
    ids = [i for i in seen if i.split("::")[0] in files]
    assert len(ids) >= 20 and not any(seen[i] == "ERROR" for i in ids), out[-3000:]
    graded = Task(**{**task.__dict__, "pass_to_pass": [i for i in ids if i != task.fail_to_pass[0]]})
    g = grader.grade(graded, d, limits=LIMITS, timeout_s=300)
    assert set(g.passed) == {i for i in ids if seen[i] in PASSING}, (set(g.passed) ^ {i for i in ids if seen[i] in PASSING})
    assert set(g.failed) == {i for i in ids if seen[i] not in PASSING}
    if dist == "click":  # the stress tests in test_stream_lifecycle.py stay deselected by addopts
        assert "deselected" in g.output and "deselected" in out


def test_run_tests_on_the_whole_suite_tests_the_trees_code(sdist_repos, tmp_path):
    """run_tests with no paths runs the repository's own discovery (testpaths) on the tree's package:
    click's suite collects and passes with the fix applied, the probe says the code is the tree's."""
    task = _sdist_task("click", sdist_repos["click"])
    d = _tree(tmp_path, task, task.patch, task.test_patch)
    with InprocessRuntime(d) as sb:
        out = Tools(sb, output_chars=10_000_000, timeout_s=300, roots=grader.task_roots(task)).call("run_tests", {})
    seen = parse_pytest(out)
    assert seen[task.fail_to_pass[0]] == "PASSED" and len(seen) > 1000, out[-3000:]
    assert not [i for i, s in seen.items() if s in ("FAILED", "ERROR")], out[-3000:]


# -- dataset splits, R2E-Gym ids ----------------------------------------------------------------------
def _bench_row(iid: str) -> dict:
    return {"instance_id": iid, "repo": "org/proj", "base_commit": "abcd1234", "problem_statement": "p",
            "patch": _diff("m.py", "x = 1\n", "x = 2\n"), "test_patch": _diff("t.py", None, "def test(): pass\n"),
            "FAIL_TO_PASS": json.dumps(["t.py::test"]), "PASS_TO_PASS": "[]"}


def test_a_directory_of_splits_is_refused_without_env_swe_split(tmp_path):
    pq = pytest.importorskip("pyarrow.parquet")
    import pyarrow as pa
    hub = tmp_path / "SWE-bench"  # the hub layout of SWE-bench: data/<split>-<shard>-of-<n>.parquet
    (hub / "data").mkdir(parents=True)
    for split, n in (("dev", 1), ("test", 2), ("train", 3)):
        rows = [_bench_row(f"org__proj-{split}{i}") for i in range(n)]
        pq.write_table(pa.Table.from_pylist(rows), hub / "data" / f"{split}-00000-of-00001.parquet")
    with pytest.raises(ValueError) as e:
        load_dataset(hub)
    assert str(e.value) == f"{hub}: holds the splits dev, test, train: name one (env.swe.split); splits are never merged"
    assert [t.instance_id for t in load_dataset(hub, split="test")] == ["org__proj-test0", "org__proj-test1"]
    with pytest.raises(ValueError, match=r"env.swe.split='valid': no such split \(found: dev, test, train\)"):
        load_dataset(hub, split="valid")
    conv = tmp_path / "converted"  # the hub's parquet conversion: <config>/<split>/<n>.parquet
    for split in ("rl", "sft", "test"):
        (conv / "default" / split).mkdir(parents=True)
        pq.write_table(pa.Table.from_pylist([_bench_row(f"org__proj-{split}")]), conv / "default" / split / "0000.parquet")
    with pytest.raises(ValueError, match="holds the splits default/rl, default/sft, default/test: name one"):
        load_dataset(conv)
    assert [t.instance_id for t in load_dataset(conv, split="default/sft")] == ["org__proj-sft"]
    single = tmp_path / "verified"  # one split: nothing to merge
    (single / "data").mkdir(parents=True)
    pq.write_table(pa.Table.from_pylist([_bench_row("a__b-1")]), single / "data" / "test-00000-of-00001.parquet")
    assert [t.instance_id for t in load_dataset(single)] == ["a__b-1"]


def test_env_swe_split_reaches_the_environment(tmp_path):
    from builders import compose_cfg
    from rl.contract.config import structured
    from rl.envs import make_env
    pq = pytest.importorskip("pyarrow.parquet")
    import pyarrow as pa
    d = tmp_path / "ds"
    (d / "data").mkdir(parents=True)
    builtin = [json.loads(x) for x in Path(repos.__file__).with_name("data").joinpath("builtin_swebench.jsonl")
               .read_text().splitlines()[:3]]
    for split, rows in (("train", builtin[:2]), ("test", builtin[2:])):
        pq.write_table(pa.Table.from_pylist(rows), d / "data" / f"{split}-00000-of-00001.parquet")
    with pytest.raises(ValueError, match="holds the splits test, train: name one"):
        make_env(structured(compose_cfg(tmp_path / "run", "env=swe", f"env.swe.tasks={d}")))
    env = make_env(structured(compose_cfg(tmp_path / "run2", "env=swe", f"env.swe.tasks={d}", "env.swe.split=train",
                                          "env.swe.grade_timeout_s=90", f"env.swe.repos_dir={tmp_path / 'repos'}")))
    assert sorted(env.by_id) == sorted(r["instance_id"] for r in builtin[:2])
    assert env.config.grade_timeout_s == 90


def test_r2e_rows_sharing_a_commit_get_ids_of_their_own(tmp_path):
    def row(issue):
        return {"repo_name": "aiohttp", "commit_hash": "f0d74880deec8fcd982bce639c93c5e130d41198",
                "docker_image": "namanjain12/aiohttp_final:f0d74880deec8fcd982bce639c93c5e130d41198",
                "problem_statement": issue, "expected_output_json": json.dumps({"test_a": "PASSED"})}
    f = tmp_path / "r2e.jsonl"
    f.write_text("".join(json.dumps(r) + "\n" for r in (row("slash dropped"), row("query lost"), row("other"))))
    ids = [t.instance_id for t in load_dataset(f)]
    assert len(set(ids)) == 3 and all(i.startswith("aiohttp__f0d74880deec-") for i in ids)
    assert ids == [t.instance_id for t in load_dataset(f)]  # the same on every load
    f.write_text(json.dumps(row("solo")) + "\n")
    assert [t.instance_id for t in load_dataset(f)] == ["aiohttp__f0d74880deec"]
    f.write_text(json.dumps(row("same")) + "\n" + json.dumps(row("same")) + "\n")
    with pytest.raises(ValueError, match="instance_id: duplicate of row 0"):
        load_dataset(f)


# -- grading's own time limit -------------------------------------------------------------------------
def test_grading_has_its_own_time_limit(tmp_path):
    """A hidden test slower than one tool call may take is graded under env.swe.grade_timeout_s."""
    files = {"m.py": "x = 2\n"}
    slow = "import time\n\nfrom m import x\n\n\ndef test_x():\n    time.sleep(3)\n    assert x == 2\n"
    task = Task("local__slow-1", "local/slow", "", "x", _diff("m.py", "x = 2\n", "x = 3\n"),
                _diff("tests/test_slow.py", None, slow), ["tests/test_slow.py::test_x"], [], files=files)
    cfg = EnvConfig(max_turns=2, tool_timeout_s=1, grade_timeout_s=120)
    assert cfg.grade_limits().cpu_s >= 120
    with SWEEnv([task], cfg).start(task) as ep:
        assert ep.reward() == 1.0
    with SWEEnv([task], EnvConfig(max_turns=2, tool_timeout_s=120, grade_timeout_s=1)).start(task) as ep:
        assert ep.reward() == 0.0
    with pytest.raises(ValueError, match="env.swe.grade_timeout_s=0: must be positive"):
        EnvConfig(grade_timeout_s=0)
