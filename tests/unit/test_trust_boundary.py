"""The trust boundary of a run directory (docs/run-directory-safety.md): a file another user owns or can
write is never obeyed, a hard-linked file is never written through, and every entry point refuses a run
directory someone else owns or can write, in one line, before it reads anything there.

The tests run as root, so "another user" is uid 65534 (chown) and "someone else can write it" a group or
other write bit (chmod).
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from builders import make_run_dir
from rl.contract import paths, safefs

REPO = Path(__file__).resolve().parents[2]
NOBODY = 65534


def _one_line(text: str) -> str:
    lines = [ln for ln in text.strip().splitlines() if ln.strip()]
    assert len(lines) == 1, text
    assert "Traceback" not in text
    return lines[0]


def test_a_file_another_user_owns_is_refused_for_reading_and_writing(tmp_path):
    f = tmp_path / "server_0.json"
    f.write_text('{"url": "http://127.0.0.1:1"}')
    os.chown(f, NOBODY, NOBODY)
    with pytest.raises(safefs.UnsafePath, match=f"owned by uid {NOBODY}") as e:
        safefs.read_bytes(f)
    assert "\n" not in str(e.value)
    with pytest.raises(safefs.UnsafePath, match="owned by uid"):
        safefs.append_bytes(f, b"x")
    with pytest.raises(safefs.UnsafePath, match="owned by uid"):
        safefs.write_atomic(f, b"{}")
    assert f.read_text() == '{"url": "http://127.0.0.1:1"}'
    # data the user named from elsewhere on purpose is read, never written
    assert safefs.read_bytes(f, foreign=True).startswith(b"{")


@pytest.mark.parametrize("mode", [0o664, 0o646, 0o666])
def test_a_file_others_can_write_is_refused(tmp_path, mode):
    f = tmp_path / "router.json"
    f.write_text("{}")
    os.chmod(f, mode)
    with pytest.raises(safefs.UnsafePath, match=f"mode {mode:04o}, writable by group or others"):
        safefs.read_text(f)
    os.chmod(f, 0o644)
    assert safefs.read_text(f) == "{}"


def test_a_hard_linked_file_is_never_appended_to(tmp_path):
    victim = tmp_path / "victim"
    victim.write_text("mine\n")
    run = tmp_path / "run"
    run.mkdir()
    os.link(victim, run / "metrics.jsonl")
    with pytest.raises(safefs.UnsafePath, match="2 hard links"):
        safefs.append_bytes(run / "metrics.jsonl", b'{"step": 1}\n')
    assert victim.read_text() == "mine\n"
    # replacing it (a new inode renamed over the name) is fine: the other name keeps its content
    safefs.write_atomic(run / "metrics.jsonl", b"new\n")
    assert victim.read_text() == "mine\n"


def test_private_umask_makes_new_files_writable_by_the_user_alone(tmp_path):
    old = os.umask(0o002)
    try:
        safefs.private_umask()
        assert os.umask(0o022) & 0o022 == 0o022
        os.umask(0o002)
        code = "from rl.contract import safefs; safefs.private_umask(); open('f', 'w').close(); import os; os.mkdir('d')"
        subprocess.run([sys.executable, "-c", code], cwd=tmp_path, check=True, env={**os.environ, "PYTHONPATH": str(REPO)})
    finally:
        os.umask(old)
    assert (tmp_path / "f").stat().st_mode & 0o022 == 0
    assert (tmp_path / "d").stat().st_mode & 0o022 == 0


@pytest.mark.parametrize("how", ["group-writable run dir", "world-writable rollouts", "run dir of another user",
                                 "inference dir of another user"])
def test_check_run_dir_private_refuses_in_one_line(tmp_path, how):
    run = tmp_path / "run"
    for sub in ("rollouts", "inference"):
        (run / sub).mkdir(parents=True)
    target = {"group-writable run dir": run, "world-writable rollouts": run / "rollouts",
              "run dir of another user": run, "inference dir of another user": run / "inference"}[how]
    if "another user" in how:
        os.chown(target, NOBODY, NOBODY)
    else:
        os.chmod(target, 0o777 if "world" in how else 0o775)
    with pytest.raises(safefs.UnsafePath) as e:
        safefs.check_run_dir_private(run, paths.PRIVATE_DIRS)
    assert str(target) in str(e.value) and "\n" not in str(e.value)
    assert "a run directory must be its user's alone" in str(e.value)


def _run(*argv, cwd=REPO, timeout=120):
    return subprocess.run([sys.executable, *argv], cwd=cwd, capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def frozen_run(tmp_path_factory):
    run = tmp_path_factory.mktemp("trust") / "run"
    make_run_dir(run)
    return run


@pytest.mark.parametrize("argv", [
    ["-m", "launch", "status", "{run}"],
    ["-m", "launch", "cancel", "{run}"],
    ["-m", "launch", "resume", "{run}"],
    ["-m", "launch", "run", "run_dir={run}"],
    ["-m", "rl.orchestrator", "--run-dir", "{run}"],
    ["-m", "rl.inference", "--run-dir", "{run}", "--index", "0"],
    ["-m", "rl.requeue", "--run-dir", "{run}"],
])
def test_every_entry_point_refuses_a_run_dir_others_can_write(frozen_run, argv):
    """Nothing is read, started or written: the refusal comes before the first record is opened."""
    before = sorted(p.name for p in frozen_run.iterdir())
    os.chmod(frozen_run, 0o777)
    try:
        r = _run(*[a.format(run=frozen_run) for a in argv])
    finally:
        os.chmod(frozen_run, 0o755)
    assert r.returncode != 0, r.stdout + r.stderr
    out = r.stdout + r.stderr
    assert "writable by group or others" in out and "Traceback" not in out, out
    assert sorted(p.name for p in frozen_run.iterdir()) == before


def test_a_plan_of_another_user_is_refused_by_every_reader(frozen_run):
    from rl.contract.plan import Plan, PlanFormatError
    plan = paths.plan_file(frozen_run)
    assert Plan.read(frozen_run).run_dir
    os.chown(plan, NOBODY, NOBODY)
    try:
        with pytest.raises(PlanFormatError, match="owned by uid"):
            Plan.read(frozen_run)
        r = _run("-m", "launch", "status", str(frozen_run))   # shows what it could not read, and why
        assert "owned by uid 65534" in " ".join((r.stdout + r.stderr).split()), r.stdout + r.stderr
        assert "Traceback" not in r.stderr, r.stderr
    finally:
        os.chown(plan, 0, 0)
