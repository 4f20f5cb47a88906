"""SWE task sources in the public formats (rl/envs/swe/datasets.py, grading.py, repos.py):

- the five row formats (SWE-bench, SWE-Gym, SWE-smith, SWE-rebench, R2E-Gym) load from JSONL, parquet and
  a `datasets.save_to_disk` directory, detected from their columns; bad rows are one-line errors naming
  the file, the row, the instance and the field; rows that need an image are refused for the in-process
  sandbox, naming the runtime they need;
- the log parsers read real pytest output (pytest run in a subprocess on a generated repository);
- the built-in set as SWE-bench rows over real git repositories: every reference patch scores 1, every
  unmodified repository less; the repositories are re-created with the shipped base_commit; an episode
  starts from base_commit without .git or the hidden tests.
"""
from __future__ import annotations

import json
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from rl.envs.swe import repos
from rl.envs.swe.datasets import load_dataset, playable
from rl.envs.swe.env import EnvConfig, SWEEnv
from rl.envs.swe.grading import (expected_output_reward, parse_name_status, parse_pytest, parse_pytest_v2,
                                 parse_pytest_verbose, parse_r2e, swebench_reward)
from rl.envs.swe.grader import grade

SHIPPED = Path(repos.__file__).with_name("data") / "builtin_swebench.jsonl"
ROWS = [json.loads(line) for line in SHIPPED.read_text().splitlines()]
DIFF = "diff --git a/m.py b/m.py\n--- a/m.py\n+++ b/m.py\n@@ -1 +1 @@\n-x = 1\n+x = 2\n"


def _rows() -> dict[str, dict]:
    """One row of each format, with the column types the public files use."""
    bench = dict(ROWS[0])                                           # lists as JSON strings
    gym = {**ROWS[1], "FAIL_TO_PASS": json.loads(ROWS[1]["FAIL_TO_PASS"]),  # SWE-Gym: same columns, lists
           "PASS_TO_PASS": json.loads(ROWS[1]["PASS_TO_PASS"]), "version": "0.1"}
    smith = {"instance_id": "org__proj.abc123.func_pm_op_swap__x1", "repo": "swesmith/org__proj.abc123",
             "patch": DIFF, "FAIL_TO_PASS": ["tests/test_m.py::test_x"], "PASS_TO_PASS": [],
             "image_name": "jyangballin/swesmith.x86_64.org_1776_proj.abc123", "problem_statement": "x is 1",
             "created_at": "2025-01-01"}
    rebench = {**ROWS[2], "docker_image": "swerebench/sweb.eval.x86_64.org_1776_proj-7",
               "install_config": json.dumps({"test_cmd": "pytest --no-header -rA --tb=line --color=no",
                                             "log_parser": "parse_log_pytest", "install": "pip install -e ."})}
    r2e = {"repo_name": "aiohttp", "commit_hash": "f0d74880deec8fcd982bce639c93c5e130d41198",
           "docker_image": "namanjain12/aiohttp_final:f0d74880deec8fcd982bce639c93c5e130d41198",
           "problem_statement": "the router drops the trailing slash",
           "expected_output_json": json.dumps({"TestRouter.test_slash": "PASSED", "test_other": "PASSED"}),
           "num_non_test_files": 3}
    return {"swe_bench": bench, "swe_gym": gym, "swe_smith": smith, "swe_rebench": rebench, "r2e_gym": r2e}


def _write(rows: list[dict], path: Path, form: str) -> Path:
    if form == "jsonl":
        path = path.with_suffix(".jsonl")
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    elif form == "parquet":
        pa, pq = pytest.importorskip("pyarrow"), pytest.importorskip("pyarrow.parquet")
        path = path.with_suffix(".parquet")
        pq.write_table(pa.Table.from_pylist(rows), path)
    else:
        datasets = pytest.importorskip("datasets")
        datasets.Dataset.from_list(rows).save_to_disk(str(path))
    return path


@pytest.mark.parametrize("form", ["jsonl", "parquet", "saved"])
def test_swe_each_format_loads_from_each_file_form(tmp_path, form):
    expect = {"swe_bench": "swe_bench", "swe_gym": "swe_bench", "swe_smith": "swe_smith",
              "swe_rebench": "swe_rebench", "r2e_gym": "r2e_gym"}
    for name, row in _rows().items():
        [t] = load_dataset(_write([row], tmp_path / f"{name}_{form}", form))
        assert t.format == expect[name], name
        if name in ("swe_bench", "swe_gym"):
            src = ROWS[0] if name == "swe_bench" else ROWS[1]
            assert (t.instance_id, t.base_commit, t.patch, t.test_patch) == (
                src["instance_id"], src["base_commit"], src["patch"], src["test_patch"])
            assert t.fail_to_pass == json.loads(src["FAIL_TO_PASS"]) and not t.image
        elif name == "swe_smith":
            assert t.image.startswith("jyangballin/") and t.base_commit == "" and t.test_patch == ""
        elif name == "swe_rebench":
            assert t.test_cmd.startswith("pytest --no-header") and t.log_parser == "parse_log_pytest"
            assert t.image.startswith("swerebench/") and t.fail_to_pass == json.loads(ROWS[2]["FAIL_TO_PASS"])
        else:
            assert t.instance_id == "aiohttp__f0d74880deec" and t.log_parser == "r2e"
            assert t.expected_output == {"TestRouter.test_slash": "PASSED", "test_other": "PASSED"}
            assert t.test_cmd == "bash run_tests.sh"
    # the format can be named instead of detected; a wrong name fails on the first missing column
    both = _write([_rows()["swe_smith"]], tmp_path / "named", "jsonl")
    assert load_dataset(both, "swe_smith")[0].format == "swe_smith"
    with pytest.raises(ValueError, match=r"row 0 \(org__proj.*\): test_patch: missing"):
        load_dataset(both, "swe_bench")


def _mut(name, **changes):
    row = dict(_rows()[name])
    for k, v in changes.items():
        if v is None:
            row.pop(k, None)
        else:
            row[k] = v
    return row


BAD = [
    ("swe_bench", dict(FAIL_TO_PASS=None), "FAIL_TO_PASS: missing"),
    ("swe_bench", dict(FAIL_TO_PASS="[tests/x.py"), "FAIL_TO_PASS: not a JSON list"),
    ("swe_bench", dict(PASS_TO_PASS=json.dumps([1, 2])), "PASS_TO_PASS: must be a list of test ids"),
    ("swe_bench", dict(FAIL_TO_PASS="[]"), "FAIL_TO_PASS: empty"),
    ("swe_bench", dict(base_commit=""), "base_commit: empty"),
    ("swe_bench", dict(patch="just words"), "patch: not a unified diff"),
    ("swe_bench", dict(problem_statement=7), "problem_statement: must be a string"),
    ("swe_rebench", dict(install_config=json.dumps({"log_parser": "parse_log_pytest"})),
     r"install_config.test_cmd: missing"),
    ("swe_rebench", dict(install_config={"test_cmd": "pytest", "log_parser": "parse_log_nope"}),
     r"install_config.log_parser: unknown parser 'parse_log_nope'"),
    ("swe_rebench", dict(install_config="{not json"), "install_config: not a JSON object"),
    ("swe_smith", dict(image_name=""), "image_name: empty"),
    ("r2e_gym", dict(expected_output_json=json.dumps({"t": "GREEN"})), "expected_output_json: test 't'"),
    ("r2e_gym", dict(commit_hash=None), "commit_hash: missing"),
]


@pytest.mark.parametrize("fmt,changes,msg", BAD, ids=[f"{b[0]}-{b[2][:24]}" for b in BAD])
def test_swe_bad_row_is_one_line_error_naming_file_row_and_field(tmp_path, fmt, changes, msg):
    good = _rows()[fmt]
    f = _write([good, _mut(fmt, **changes)], tmp_path / "rows", "jsonl")
    with pytest.raises(ValueError) as e:
        load_dataset(f, {"swe_gym": "swe_bench"}.get(fmt, fmt))
    text = str(e.value)
    assert "\n" not in text and text.startswith(f"{f}: row 1 (") and msg in text.replace("\\", ""), text


def test_swe_file_level_errors(tmp_path):
    rows = _rows()
    f = _write([rows["swe_bench"], rows["swe_bench"]], tmp_path / "dup", "jsonl")
    with pytest.raises(ValueError, match=r"row 1 \(builtin__stats-median-even\): instance_id: duplicate of row 0"):
        load_dataset(f)
    f.write_text(json.dumps(rows["swe_bench"]) + "\n{oops\n")
    with pytest.raises(ValueError, match=r"dup.jsonl: line 2: not JSON"):
        load_dataset(f)
    f.write_text(json.dumps({"instance_id": "a", "text": "b"}) + "\n")
    with pytest.raises(ValueError, match="cannot tell the row format .* set env.swe.format"):
        load_dataset(f)
    datasets = pytest.importorskip("datasets")
    datasets.DatasetDict({"train": datasets.Dataset.from_list([rows["swe_smith"]])}).save_to_disk(str(tmp_path / "dd"))
    with pytest.raises(ValueError, match=r"dd: a saved DatasetDict with splits train: name one \(env.swe.split\)"):
        load_dataset(tmp_path / "dd")
    assert load_dataset(tmp_path / "dd" / "train")[0].format == "swe_smith"
    assert load_dataset(tmp_path / "dd", split="train")[0].format == "swe_smith"
    with pytest.raises(ValueError, match=r"env.swe.split='test': no such split \(found: train\)"):
        load_dataset(tmp_path / "dd", split="test")


def test_swe_rows_that_need_an_image_are_refused_here(tmp_path):
    from rl.envs.swe.env import EnvConfig
    for name, runtime in (("swe_smith", "inprocess"), ("swe_rebench", "bubblewrap"), ("r2e_gym", "inprocess")):
        f = _write([_rows()[name]], tmp_path / name, "jsonl")
        with pytest.raises(ValueError) as e:
            SWEEnv(str(f), EnvConfig(runtime={"name": runtime}), repos_dir=str(tmp_path / "repos"))
        assert "\n" not in str(e.value) and "row 0 (" in str(e.value)
        assert (f"env.swe.runtime={runtime} has no images: it needs a container runtime "
                "(env.swe.runtime=apptainer or podman)") in str(e.value), str(e.value)
    # the image runtimes take them, and refuse rows without an image, naming the row
    assert SWEEnv(str(tmp_path / "swe_smith.jsonl"), EnvConfig(runtime={"name": "podman"})).tasks[0].image
    f = _write([_rows()["swe_bench"]], tmp_path / "plain", "jsonl")
    with pytest.raises(ValueError, match=r"row 0 \(builtin__stats-median-even\): env.swe.runtime=apptainer "
                                         r"runs each task in its image, and this row names none"):
        SWEEnv(str(f), EnvConfig(runtime={"name": "apptainer", "image_cache": "/srv/sif"}))
    # a SWE-bench row whose repository is not here names where it looked
    row = {**_rows()["swe_bench"], "repo": "django/django"}
    f = _write([row], tmp_path / "django", "jsonl")
    with pytest.raises(ValueError, match=rf"row 0 \(builtin__stats-median-even\): repo: .*no git repository at "
                                         rf"{tmp_path}/repos/django/django"):
        SWEEnv(str(f), repos_dir=str(tmp_path / "repos"))


# -- log parsers on real pytest output ----------------------------------------------------------------
_TESTS = '''import pytest

def test_ok():
    assert True

def test_bad():
    assert [1] == [2], "lists differ - really"

@pytest.mark.parametrize("v", ["a b", "c - d"])
def test_param(v):
    assert v != "c - d"

@pytest.mark.skip(reason="later")
def test_skipped():
    pass

@pytest.mark.xfail(reason="known")
def test_known():
    assert False

@pytest.fixture
def broken():
    raise RuntimeError("fixture down")

def test_error(broken):
    pass

class TestGroup:
    def test_inner(self):
        assert 1
'''
_STATUS = {"tests/test_m.py::test_ok": "PASSED", "tests/test_m.py::test_bad": "FAILED",
           "tests/test_m.py::test_param[a b]": "PASSED", "tests/test_m.py::test_param[c - d]": "FAILED",
           "tests/test_m.py::test_known": "XFAIL", "tests/test_m.py::test_error": "ERROR",
           "tests/test_m.py::TestGroup::test_inner": "PASSED"}


@pytest.fixture(scope="module")
def pytest_logs(tmp_path_factory):
    d = tmp_path_factory.mktemp("repo")
    (d / "tests").mkdir()
    (d / "tests" / "test_m.py").write_text(_TESTS)

    def run(*args):
        return subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", *args, "tests"], cwd=d,
                              capture_output=True, text=True, env={"PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1",
                                                                   "PATH": "/usr/bin:/bin"}).stdout
    return {"rA": run("-rA", "--color=no"), "color": run("-rA", "--color=yes"), "v": run("-v", "--color=no")}


def test_swe_log_parsers_read_real_pytest_output(pytest_logs):
    got = parse_pytest(pytest_logs["rA"])
    assert {k: v for k, v in got.items() if k in _STATUS} == _STATUS
    assert "\x1b[" in pytest_logs["color"] and parse_pytest_v2(pytest_logs["color"]) == got
    verbose = parse_pytest_verbose(pytest_logs["v"])
    assert verbose == {**_STATUS, "tests/test_m.py::test_skipped": "SKIPPED"}
    assert parse_r2e(pytest_logs["rA"]) == {"test_ok": "PASSED", "test_bad": "FAILED", "test_param[a b]": "PASSED",
                                            "test_param[c - d]": "FAILED", "test_error": "ERROR",
                                            "TestGroup.test_inner": "PASSED"}
    assert parse_name_status("a.b: ok\nsome noise\nc: FAILED\nd:  error \ne: maybe\n") == {
        "a.b": "PASSED", "c": "FAILED", "d": "ERROR"}


def test_swe_rewards_all_or_nothing_and_partial():
    status = {"f1": "PASSED", "f2": "FAILED", "p1": "XFAIL", "p2": "SKIPPED"}
    g = swebench_reward(status, ["f1", "f2"], ["p1", "p2", "gone"], partial_credit=True)
    assert g.reward == pytest.approx(2 / 5) and g.passed == ["f1", "p1"] and g.failed == ["f2", "p2", "gone"]
    assert swebench_reward(status, ["f1", "f2"], ["p1"], partial_credit=False).reward == 0.0
    assert swebench_reward(status, ["f1"], ["p1", "f1"], partial_credit=False).reward == 1.0
    want = {"a": "PASSED", "b": "FAILED", "c": "PASSED"}
    assert expected_output_reward({"a": "PASSED", "b": "FAILED", "c": "PASSED", "x": "PASSED"}, want,
                                  partial_credit=False).reward == 1.0
    got = {"a": "PASSED", "b - msg": "PASSED", "c": "PASSED"}   # a test expected to fail that passes is wrong
    assert expected_output_reward(got, want, partial_credit=False).reward == 0.0
    assert expected_output_reward(got, want, partial_credit=True).reward == pytest.approx(2 / 3)


# -- the built-in set as SWE-bench rows over git repositories -----------------------------------------
@pytest.fixture(scope="module")
def builtin_tasks(tmp_path_factory):
    return playable(load_dataset(SHIPPED), tmp_path_factory.mktemp("repos"), SHIPPED)


def test_swe_builtin_repos_are_made_with_the_shipped_commits(builtin_tasks, tmp_path):
    assert len(builtin_tasks) == 23 and all(t.format == "swe_bench" and not t.files for t in builtin_tasks)
    t = builtin_tasks[0]
    assert repos.git("rev-parse", "HEAD", cwd=t.repo_dir).decode().strip() == t.base_commit
    # made again elsewhere: the same commit id (fixed names and dates)
    again = repos.ensure_builtin(t.repo, t.base_commit, tmp_path)
    assert repos.git("rev-parse", "HEAD", cwd=again).decode().strip() == t.base_commit
    with pytest.raises(ValueError, match="commit 0{40} not found .* the shipped rows are stale"):
        repos.ensure_builtin(t.repo, "0" * 40, tmp_path)


def _grades(t):
    return grade(t, extra_patch=t.patch, partial_credit=False), grade(t, partial_credit=True)


def test_swe_builtin_swebench_reference_scores_one_unmodified_less(builtin_tasks):
    with ThreadPoolExecutor(2) as pool:
        results = list(pool.map(_grades, builtin_tasks))
    for t, (ref, base) in zip(builtin_tasks, results):
        assert ref.reward == 1.0, (t.instance_id, ref.failed, ref.output[-1500:])
        assert set(base.failed) == set(t.fail_to_pass), t.instance_id   # PASS_TO_PASS kept, FAIL_TO_PASS not
        assert base.reward == pytest.approx(len(t.pass_to_pass) / len(t.graded)) and base.reward < 1.0, \
            t.instance_id


def call(name, **args):
    return f"<tool_call>{json.dumps({'name': name, 'arguments': args})}</tool_call>"


def test_swe_episode_on_a_git_backed_task(builtin_tasks):
    env = SWEEnv(builtin_tasks[:2], EnvConfig(max_turns=5, wall_s=120, partial_credit=False))
    t = env.tasks[0]
    hidden = {p.split("::")[0] for p in t.fail_to_pass}
    with env.start(t) as ep:
        tree = ep.sandbox.tree
        assert not (tree / ".git").exists() and not any((tree / h).exists() for h in hidden)
        listing, _ = ep.step(call("list_files"))
        assert all(h not in listing for h in hidden)
        obs, done = ep.step(call("apply_patch", diff=t.patch))
        assert not obs.startswith("error") and not done, obs
        assert ep.step(call("submit")) == (None, True)
        assert ep.reward() == 1.0
    with env.start(env.tasks[1]) as ep:
        ep.step(call("submit"))
        assert ep.reward() == 0.0


def test_swe_row_with_a_local_repository_path(tmp_path):
    base = repos.make_repo({"m.py": "x = 1\n", "tests/test_m.py": "from m import x\n\ndef test_x():\n"
                            "    assert x == 2\n"}, tmp_path / "proj")
    row = {"instance_id": "local__proj-1", "repo": str(tmp_path / "proj"), "base_commit": base, "patch": DIFF,
           "test_patch": "", "problem_statement": "x should be 2", "FAIL_TO_PASS": ["tests/test_m.py::test_x"],
           "PASS_TO_PASS": []}
    with pytest.raises(ValueError, match="test_patch: empty"):   # SWE-bench rows carry their hidden tests
        load_dataset(_write([row], tmp_path / "rows", "jsonl"))
    row["test_patch"] = ("diff --git a/tests/test_n.py b/tests/test_n.py\nnew file mode 100644\n--- /dev/null\n"
                         "+++ b/tests/test_n.py\n@@ -0,0 +1,2 @@\n+def test_n():\n+    assert 1\n")
    row["PASS_TO_PASS"] = ["tests/test_n.py::test_n"]
    [t] = playable(load_dataset(_write([row], tmp_path / "rows", "jsonl")), None)
    assert t.repo_dir == str(tmp_path / "proj")
    assert grade(t, extra_patch=DIFF).reward == 1.0 and grade(t).reward == 0.5
    with pytest.raises(ValueError, match=r"row 0 \(local__proj-1\): base_commit: 1{40} is not in"):
        playable(load_dataset(_write([{**row, "base_commit": "1" * 40}], tmp_path / "rows", "jsonl")), None)


def test_swe_config_keys(tmp_path):
    from builders import compose_cfg
    from launch.compose import ConfigError
    from rl.envs import make_env
    from rl.contract.config import structured
    cfg = compose_cfg(tmp_path / "run", "+experiment=swe_debug", f"env.swe.repos_dir={tmp_path / 'repos'}",
                      "env.swe.partial_credit=false")
    env = make_env(structured(cfg))
    assert len(env.tasks) == 23 and env.tasks[0].repo_dir.startswith(str(tmp_path / "repos"))
    assert env.config.partial_credit is False
    for bad, key in ((["env.swe.format=swebench"], "env.swe.format"),
                     (["env.swe.tasks=builtin_nope"], "env.swe.tasks")):
        with pytest.raises(ConfigError) as e:
            compose_cfg(tmp_path / "run", "env=swe", *bad)
        assert key in str(e.value) and "\n" not in str(e.value)


def test_swe_r2e_row_without_image_is_graded_here_against_expected_output(tmp_path):
    base = repos.make_repo({"m.py": "x = 1\n", "tests/test_m.py": "from m import x\n\nclass TestX:\n"
                            "    def test_two(self):\n        assert x == 2\n\ndef test_int():\n"
                            "    assert isinstance(x, int)\n"}, tmp_path / "proj")
    # R2E-Gym's commit_hash is the commit that fixed the issue (its new_commit_hash): the episode starts
    # at its parent, never at the fix
    (tmp_path / "proj" / "m.py").write_text("x = 2\n")
    repos.git("-c", "commit.gpgsign=false", "commit", "-q", "-a", "-m", "fix", cwd=tmp_path / "proj")
    fix = repos.git("rev-parse", "HEAD", cwd=tmp_path / "proj").decode().strip()
    row = {"repo_name": str(tmp_path / "proj"), "commit_hash": fix, "problem_statement": "x should be 2",
           "patch": DIFF, "expected_output_json": json.dumps({"TestX.test_two": "PASSED", "test_int": "PASSED"})}
    [t] = playable(load_dataset(_write([row], tmp_path / "r2e", "jsonl")), None)
    assert t.format == "r2e_gym" and not t.image and t.base_commit == base and t.fix_commit == fix
    named = {**row, "parsed_commit_content": json.dumps({"old_commit_hash": base, "new_commit_hash": fix})}
    assert playable(load_dataset(_write([named], tmp_path / "r2e2", "jsonl")), None)[0].base_commit == base
    with pytest.raises(ValueError, match=r"commit_hash: [0-9a-f]+ \(the commit that fixed the issue\) has no parent"):
        playable(load_dataset(_write([{**row, "commit_hash": base}], tmp_path / "r2e3", "jsonl")), None)
    assert grade(t, extra_patch=DIFF, partial_credit=False).reward == 1.0
    g = grade(t, partial_credit=True)
    assert g.reward == 0.5 and g.failed == ["TestX.test_two"]
