"""Commands come from the plan the launcher wrote, never from a row alone (issue 49), and no reader blocks.

Tests run as root, so a row someone else planted is a file chowned to uid 65534, and one edited by hand
is the user's own file with other contents (or a mode others can write). An extra replica row
(`inference/extra/replica_<I>.json`, rl.contract.elastic) carries data only: whatever a planted or edited
one says, `replica_row` gives the plan's command or refuses in one line, and the inference role started
on it runs nothing. `launch scale` answers every bad argument in one line (exit 2) and writes nothing;
the batch scripts' reading step ends at once, in one line, on a FIFO where they read resume.json.
"""
from __future__ import annotations

import dataclasses
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from builders import make_run_dir

from rl.contract import elastic
from rl.contract.plan import Plan, PlanFormatError

REPO = Path(__file__).resolve().parents[2]
NOBODY = 65534


def _run_dir(tmp_path, *overrides):
    run_dir = tmp_path / "run"
    make_run_dir(run_dir, "cluster=slurm", "inference.host=127.0.0.1", "inference.router=true", *overrides)
    return run_dir


def _evil_row(run_dir, index, marker) -> Path:
    """A row of the earlier format (the whole replica) whose commands touch `marker`: what a planted or
    edited row would carry to make `python -m rl.inference --index I` run something else."""
    plan = Plan.read(run_dir)
    base = plan.replica(0)
    row = elastic.extra_row(base, index, base.port + index)
    d = {**dataclasses.asdict(row), "vllm_command": ["touch", str(marker)],
         "command": ["touch", str(marker), "--index", str(index)], "env": {"X": "1"}, "job": None}
    path = elastic.row_file(run_dir, index)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(d))
    return path


def _one_line(text: str) -> str:
    lines = [ln for ln in text.splitlines() if ln.strip()]
    assert len(lines) == 1 and "Traceback" not in text, text
    return lines[0]


def _row(run_dir, index, **d) -> Path:
    """A row of the current format as JSON: what `launch scale` writes (elastic.write_row)."""
    path = elastic.row_file(run_dir, index)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"template": 0, "index": index, "port": 19000 + index, "job": None, **d}))
    return path


def test_a_planted_or_edited_extra_row_gives_no_command_but_the_plans(tmp_path):
    run_dir = _run_dir(tmp_path)
    plan = Plan.read(run_dir)
    marker = tmp_path / "ran"
    # edited: the user's own file carrying another command
    _evil_row(run_dir, 2, marker)
    with pytest.raises(PlanFormatError, match=r"replica_2.json: an extra replica row of an earlier hetrl .* "
                                              r"re-run `launch scale`") as e:
        elastic.replica_row(plan, run_dir, 2)
    assert "\n" not in str(e.value)
    # planted: a row someone else wrote; and one others can write
    os.chown(_row(run_dir, 1), NOBODY, NOBODY)
    with pytest.raises(PlanFormatError, match=r"replica_1.json: owned by uid 65534"):
        elastic.replica_row(plan, run_dir, 1)
    os.chmod(_row(run_dir, 3), 0o666)
    with pytest.raises(PlanFormatError, match=r"replica_3.json: mode 0666, writable by group or others"):
        elastic.replica_row(plan, run_dir, 3)
    # none of them names a server: the router and the orchestrator look for none of these indexes
    assert elastic.server_indexes(plan, run_dir) == [0]
    # a row the user wrote, edited to another port: still the plan's command, only the port differs
    _row(run_dir, 4, port=19444)
    got = elastic.replica_row(plan, run_dir, 4)
    assert got == elastic.extra_row(plan.replica(0), 4, 19444)
    assert got.command[:3] == plan.replica(0).command[:3]
    assert str(marker) not in json.dumps(dataclasses.asdict(got))
    assert elastic.server_indexes(plan, run_dir) == [0, 4]
    assert not marker.exists()


def test_a_drain_marker_someone_else_planted_drains_nothing(tmp_path):
    run_dir = _run_dir(tmp_path)
    plan = Plan.read(run_dir)
    _row(run_dir, 1)
    elastic.request_drain(run_dir, 1)
    assert elastic.draining(run_dir, 1) and elastic.server_indexes(plan, run_dir) == [0]
    os.chown(elastic.drain_file(run_dir, 1), NOBODY, NOBODY)
    assert not elastic.draining(run_dir, 1) and elastic.server_indexes(plan, run_dir) == [0, 1]


def test_the_rows_launch_scale_writes_hold_data_only(tmp_path):
    """`launch scale +2` on the local backend (the plan's server command replaced by a short sleep, the
    user's own plan.json): the rows name the template, index, port and the processes, and no command."""
    run_dir = tmp_path / "run"
    make_run_dir(run_dir, "inference.router=true")
    d = json.loads((run_dir / "plan.json").read_text())
    for r in d["inference"]["replicas"]:
        r["command"] = ["sleep", "0.1", "--index", str(r["index"])]
    (run_dir / "plan.json").write_text(json.dumps(d))
    r = _scale(str(run_dir), "--inference", "+2", "--max-servers", "2")
    assert r.returncode == 0, r.stdout + r.stderr
    port = d["inference"]["replicas"][0]["port"]
    for i in (1, 2):
        row = json.loads(elastic.row_file(run_dir, i).read_text())
        assert set(row) == {"template", "index", "port", "job"}, row
        assert (row["template"], row["index"], row["port"]) == (0, i, port + i)
        assert re.fullmatch(r"local:\d+,\d+", row["job"])
    r = _scale(str(run_dir), "--inference", "+1", "--max-servers", "2")
    assert r.returncode == 2 and "2 extra server(s) serve now and at most 2" in _one_line(r.stderr + r.stdout)
    r = _scale(str(run_dir), "--inference", "-1")
    assert r.returncode == 0 and "draining inference_2" in r.stdout, r.stdout + r.stderr


@pytest.mark.timeout(180)
def test_the_inference_role_on_a_refused_row_runs_nothing_and_says_so_in_one_line(tmp_path):
    run_dir = _run_dir(tmp_path)
    marker = tmp_path / "ran"
    planted = _evil_row(run_dir, 1, marker)
    os.chown(planted, NOBODY, NOBODY)
    _evil_row(run_dir, 2, marker)   # edited by the user's own hand: the user's file, the earlier format
    for index, why in ((1, "owned by uid 65534"), (2, "re-run `launch scale`")):
        r = subprocess.run([sys.executable, "-m", "rl.inference", "--run-dir", str(run_dir),
                            "--index", str(index)], cwd=REPO, capture_output=True, text=True, timeout=60)
        assert r.returncode != 0
        line = _one_line(r.stderr + r.stdout)
        assert f"replica_{index}.json" in line and why in line, line
    assert not marker.exists()


def _scale(*args, timeout=60):
    return subprocess.run([sys.executable, "-m", "launch", "scale", *args], cwd=REPO, capture_output=True,
                          text=True, timeout=timeout)


def test_launch_scale_answers_every_bad_argument_in_one_line_and_writes_nothing(tmp_path):
    run_dir = _run_dir(tmp_path)
    empty, other = tmp_path / "empty", tmp_path / "other"
    empty.mkdir()
    (empty / "notes.txt").write_text("mine")
    cases = [
        ([str(run_dir), "--inference", "+0"], "--inference='+0'"),
        ([str(run_dir), "--inference", "0"], "--inference='0'"),
        ([str(run_dir), "--inference", "+x"], "--inference='+x'"),
        ([str(run_dir), "--inference", "+1.5"], "--inference='+1.5'"),
        ([str(run_dir), "--inference", "+1", "--max-servers", "0"], "--max-servers: '0'"),
        ([str(run_dir), "--inference", "+1", "surplus"], "unrecognized arguments: surplus"),
        ([str(run_dir)], "required: --inference"),
        (["--inference", "+1"], "required: run_dir"),
        ([str(tmp_path / "missing"), "--inference", "+1"], "missing: no such directory"),
        ([str(tmp_path / "missing"), "--inference", "-1"], "missing: no such directory"),
        ([str(empty), "--inference", "+1"], "empty: not a run directory (no config.yaml)"),
        ([str(empty / "notes.txt"), "--inference", "+1"], "notes.txt: a regular file, not a directory"),
        ([str(run_dir), "--inference", "+5"], "at most 4 may (--max-servers, by default 4 x the plan's 1"),
    ]
    for args, expected in cases:
        r = _scale(*args)
        line = _one_line(r.stderr + r.stdout)
        assert r.returncode == 2 and expected in line, (args, r.returncode, line)
    assert elastic.extra_indexes(run_dir) == [] and not elastic.extra_dir(run_dir).exists()
    assert (empty / "notes.txt").read_text() == "mine" and sorted(os.listdir(empty)) == ["notes.txt"]
    assert not (tmp_path / "missing").exists()
    # a run directory someone else owns: refused before anything is read
    make_run_dir(other, "cluster=slurm", "inference.host=127.0.0.1", "inference.router=true")
    os.chown(other, NOBODY, NOBODY)
    r = _scale(str(other), "--inference", "+1")
    line = _one_line(r.stderr + r.stdout)
    assert r.returncode == 2 and "owned by uid 65534" in line, line
    assert elastic.extra_indexes(other) == []


def test_scale_on_the_local_backend_is_bounded(tmp_path):
    """+200 on the local backend would be 200 processes here. The plan's server command is replaced by
    `true` (the user's own plan.json): code without the bound starts 200 harmless processes, not servers."""
    run_dir = tmp_path / "run"
    make_run_dir(run_dir, "inference.router=true")
    plan_file = run_dir / "plan.json"
    d = json.loads(plan_file.read_text())
    assert d["backend"] == "local"
    for r in d["inference"]["replicas"]:
        r["command"] = ["true", "--index", str(r["index"])]
    plan_file.write_text(json.dumps(d))
    r = _scale(str(run_dir), "--inference", "+200")
    line = _one_line(r.stderr + r.stdout)
    assert r.returncode == 2 and "--inference=+200: 0 extra server(s) serve now and at most" in line, line
    assert elastic.extra_indexes(run_dir) == [] and not (run_dir / "logs" / "inference_1.log").exists()
    # a flag above the CPU count does not lift the local bound
    r = _scale(str(run_dir), "--inference", "+200", "--max-servers", "100000")
    line = _one_line(r.stderr + r.stdout)
    assert r.returncode == 2 and f"at most this machine's {os.cpu_count()} CPUs" in line, line
    assert elastic.extra_indexes(run_dir) == []


# -- the batch scripts' reading step ---------------------------------------------------------------
def _bash(script: str, env: dict, timeout: float = 5) -> subprocess.CompletedProcess:
    """Run bash on `script`; must end within `timeout` seconds (a reader blocked on a FIFO would not)."""
    return subprocess.run(["bash", "-c", script], env={**os.environ, **env}, capture_output=True, text=True,
                          timeout=timeout)


def _plant(path: Path, kind: str) -> None:
    path.unlink(missing_ok=True)
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "link":
        path.symlink_to("/etc/hostname")
    else:
        path.write_text('{"restart": 7}')
        if kind == "foreign":
            os.chown(path, NOBODY, NOBODY)
        elif kind == "writable":
            os.chmod(path, 0o666)


KINDS = {"fifo": "not a regular file", "link": "a symlink", "foreign": "owned by another user",
         "writable": "writable by others"}


def test_the_scale_jobs_script_ends_in_one_line_on_a_fifo_or_foreign_resume_json(tmp_path):
    """The whole rendered scale script, run by bash: it reads resume.json before it starts anything."""
    from launch import scale
    run_dir = _run_dir(tmp_path)
    plan = Plan.read(run_dir)
    base = scale.template_row(plan)
    script = scale.scale_script(run_dir, plan, base, [elastic.extra_row(base, 1, base.port + 1)])
    for kind, why in KINDS.items():
        _plant(run_dir / "resume.json", kind)
        r = _bash(script, {"SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": "n1"})
        line = _one_line(r.stdout + r.stderr)
        assert r.returncode == 1 and f"refusing {run_dir}/resume.json" in line and why in line, (kind, line)


def _job_script_block(script: str) -> str:
    """The job script's `log` and `own_file` functions and its step that reads resume.json, as they are
    rendered (the whole script needs Slurm's commands and rl.prepare before it gets there)."""
    lines = script.splitlines()
    log = next(ln for ln in lines if ln.startswith("log() {"))
    start = next(i for i, ln in enumerate(lines) if ln.startswith("own_file() {"))
    own = lines[start:lines.index("}", start) + 1]
    start = next(i for i, ln in enumerate(lines) if ln.startswith("# The epoch prepare just took"))
    read = lines[start:lines.index("fi", start) + 1]
    assert any('$(<"$RUN_DIR/resume.json")' in ln for ln in read)
    return "\n".join([log, *own, *read, 'echo "epoch $HETRL_EPOCH"'])


def test_the_job_scripts_read_of_resume_json_ends_in_one_line_on_a_fifo(tmp_path):
    from launch import slurm as ls
    from launch.compose import compose_points
    run_dir = tmp_path / "run"
    (cfg,) = compose_points(["cluster=slurm", f"run_dir={run_dir}"], multirun=False)
    block = _job_script_block(ls.prepare_run(cfg, run_dir)[1])
    run_dir.mkdir(exist_ok=True)
    env = {"RUN_DIR": str(run_dir), "SLURM_JOB_ID": "7"}
    for kind, why in KINDS.items():
        _plant(run_dir / "resume.json", kind)
        r = _bash(block, env)
        line = _one_line(r.stdout + r.stderr)
        assert r.returncode == 1 and f"refusing {run_dir}/resume.json" in line and why in line, (kind, line)
    _plant(run_dir / "resume.json", "own")
    r = _bash(block, env)
    assert r.returncode == 0 and r.stdout.strip() == "epoch 7", r.stdout + r.stderr
