"""Built-in SWE tasks: the reference solution of every task scores 1, every unmodified repo below 1,
and SWE-bench-format records load."""
import json
from concurrent.futures import ThreadPoolExecutor

import pytest

from rl.envs.swe.grader import grade
from rl.envs.swe.datasets import load_tasks
from rl.envs.swe.tasks import BUILTIN, Task

TASKS = load_tasks()


def test_swe_builtin_set_is_large_and_varied():
    assert len(TASKS) >= 20
    assert len({t.instance_id for t in TASKS}) == len(TASKS)
    for t in TASKS:
        assert t.fail_to_pass and t.problem_statement and t.patch.startswith("diff --git")
        assert not any(p in t.files for p in (i.split("::")[0] for i in t.fail_to_pass)), \
            f"{t.instance_id}: hidden tests leak into the snapshot"


def _grades(t):
    return grade(t, extra_patch=t.patch), grade(t)


def test_swe_reference_solutions_score_one_and_unmodified_below_one():
    with ThreadPoolExecutor(2) as pool:  # each grade is two sandboxed processes; two at a time here
        results = list(pool.map(_grades, TASKS))
    for t, (ref, base) in zip(TASKS, results):
        assert ref.reward == 1.0, (t.instance_id, ref.failed, ref.output[-1500:])
        assert base.reward < 1.0, t.instance_id
        assert set(t.fail_to_pass) <= set(base.failed), t.instance_id


def test_swe_grading_resets_tests_the_agent_edited(tmp_path):
    t = TASKS[0]
    for rel, text in t.files.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    hidden = t.fail_to_pass[0].split("::")[0]
    (tmp_path / hidden).write_text("def test_nothing():\n    pass\n")  # a planted hidden-test file
    (tmp_path / "conftest.py").write_text("import pytest\n@pytest.hookimpl(hookwrapper=True)\n"
                                           "def pytest_runtest_makereport(item, call):\n"
                                           "    out = yield\n    out.get_result().outcome = 'passed'\n")
    g = grade(t, tmp_path)
    assert g.reward < 1.0 and set(t.fail_to_pass) <= set(g.failed)


def test_swe_load_swebench_record_with_json_string_lists(tmp_path):
    rec = json.loads(BUILTIN.read_text().splitlines()[0])
    rec["FAIL_TO_PASS"] = json.dumps(rec["FAIL_TO_PASS"])
    rec["PASS_TO_PASS"] = json.dumps(rec["PASS_TO_PASS"])
    f = tmp_path / "t.jsonl"
    f.write_text(json.dumps(rec) + "\n\n")
    [t] = load_tasks(f)
    assert isinstance(t, Task) and t.fail_to_pass == TASKS[0].fail_to_pass
    del rec["files"]
    f.write_text(json.dumps(rec) + "\n")
    with pytest.raises(ValueError, match=r"row 0 \(builtin__stats-median-even\): base_commit: empty"):
        load_tasks(f)
