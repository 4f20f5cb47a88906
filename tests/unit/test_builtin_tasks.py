"""The built-in SWE tasks' data files (rl/envs/swe/data/builtin/*.yaml) and the shipped builtin.jsonl agree:
everything make_builtin derives without running tests (diffs, files, issue) is recomputed here."""
import json

import pytest

from rl.envs.swe.data import builtin_tasks
from rl.envs.swe.data.make_builtin import _diff, _fixed
from rl.envs.swe.tasks import BUILTIN


def test_the_shipped_jsonl_is_made_from_the_data_files():
    rows = [json.loads(line) for line in BUILTIN.read_text().splitlines()]
    tasks = builtin_tasks.load()
    assert [r["instance_id"] for r in rows] == [f"builtin__{t['id']}" for t in tasks]
    for r, t in zip(rows, tasks):
        assert r["problem_statement"] == t["issue"] and r["files"] == t["files"]
        assert r["patch"] == _diff(t["files"], _fixed(t["files"], t["fix"]))
        assert r["test_patch"] == _diff({}, t["hidden"])


def test_a_bad_task_file_is_refused_naming_it(tmp_path):
    good = sorted(builtin_tasks.DIR.glob("*.yaml"))[0]
    first = builtin_tasks.load()[0]["id"]
    (tmp_path / good.name).write_text(good.read_text())
    assert [t["id"] for t in builtin_tasks.load(tmp_path)] == [first]
    renamed = tmp_path / "02-other.yaml"        # the same task under another name
    renamed.write_text(good.read_text())
    with pytest.raises(ValueError, match=r"02-other.yaml: the file name must end with the task's id"):
        builtin_tasks.load(tmp_path)
    renamed.unlink()
    broken = tmp_path / "02-broken.yaml"        # a fix that edits a file the task does not have
    broken.write_text(good.read_text().replace(f"id: {first}", "id: broken", 1)
                      .replace("fix:\n- path: ", "fix:\n- path: missing/", 1))
    with pytest.raises(ValueError, match=r"02-broken.yaml: fix\[0\] edits 'missing/"):
        builtin_tasks.load(tmp_path)
