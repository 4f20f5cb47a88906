"""`python -m rl.envs.swe.check DATASET` (issue 51): every row's verdict in one table, the reason for each
unplayable one, exit non-zero if any."""
import json
import subprocess
import sys
from pathlib import Path

from rl.envs.swe import repos

ROOT = Path(__file__).resolve().parents[2]
SWEBENCH = Path(repos.__file__).with_name("data") / "builtin_swebench.jsonl"


def _check(*args, cwd=ROOT):
    return subprocess.run([sys.executable, "-m", "rl.envs.swe.check", *map(str, args)], cwd=cwd,
                          capture_output=True, text=True, timeout=1200)


def test_the_builtin_dataset_is_playable_row_by_row(tmp_path):
    r = _check("builtin_swebench", "--repos-dir", tmp_path / "repos", "--timeout", 120)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    rows = [json.loads(x)["instance_id"] for x in SWEBENCH.read_text().splitlines() if x.strip()]
    lines = r.stdout.splitlines()
    assert lines[0].split()[:4] == ["row", "playable", "reference", "base"]
    for iid in rows:
        [line] = [x for x in lines if x.split()[:1] == [iid]]
        assert line.split()[1:3] == ["yes", "1.00"], line
    assert f"{len(rows)} rows: {len(rows)} playable, 0 unplayable" in r.stdout


def test_unplayable_rows_are_listed_with_why_and_fail_the_check(tmp_path):
    first = json.loads(SWEBENCH.read_text().splitlines()[0])
    nowhere = {**first, "instance_id": first["instance_id"] + "-nowhere",
               "FAIL_TO_PASS": json.dumps(json.loads(first["FAIL_TO_PASS"]) + ["tests/test_nope.py::test_gone"])}
    p2p = json.loads(first["PASS_TO_PASS"])  # a "fix" whose tests already pass on the base
    solved = {**first, "instance_id": first["instance_id"] + "-solved", "FAIL_TO_PASS": json.dumps(p2p[:1]),
              "PASS_TO_PASS": json.dumps(p2p[1:])}
    f = tmp_path / "rows.jsonl"
    f.write_text("".join(json.dumps(r) + "\n" for r in (first, nowhere, solved)))
    r = _check(f, "--repos-dir", tmp_path / "repos", "--timeout", 120)
    assert r.returncode == 1, r.stdout + r.stderr
    by = {x.split()[0]: x for x in r.stdout.splitlines()[2:] if x.strip() and not x.startswith("3 rows")}
    assert by[first["instance_id"]].split()[1] == "yes"
    assert by[nowhere["instance_id"]].split()[1] == "NO"
    assert "grading error: 1 graded test ids found nowhere: tests/test_nope.py::test_gone" in by[nowhere["instance_id"]]
    assert "the base tree already scores 1.0: nothing to fix" in by[solved["instance_id"]]
    assert "3 rows: 1 playable, 2 unplayable" in r.stdout
