"""What may be a run directory, and the run's secret (docs/run-directory-safety.md).

run_dir must be a new directory or an existing run directory: `/`, system directories, $HOME itself, a
path with `%` (Slurm expands it in --output/--chdir), the current directory when it is not a run and a
non-empty directory that is not a run are refused in one line naming the value, before anything is
written; a run dir under a symlinked path is named by its real path. The secret must be the user's own
file with mode 0600, or servers refuse it (one line: chmod 600)."""
from __future__ import annotations

import os
import stat
import sys
from pathlib import Path

import pytest

from launch.compose import compose_points
from launch.rundir import freeze_run_dir
from rl.contract.config import ConfigError
from rl.contract.secret import MIN_CHARS, SecretError, create_secret, read_secret


def _tree(p: Path) -> list[str]:
    return sorted(str(x.relative_to(p)) for x in p.rglob("*")) if p.exists() else []


def check_run_dir_choice(value):
    from launch.rundir import check_run_dir_choice as check
    return check(value)


def _refused(value, *expect: str) -> str:
    with pytest.raises(ConfigError) as e:
        check_run_dir_choice(value)
    msg = str(e.value)
    assert msg.startswith("run_dir=") and "\n" not in msg, msg
    for x in expect:
        assert x in msg, msg
    return msg


@pytest.mark.parametrize("value", ["/", "/etc", "/etc/hetrl-run", "/usr/local/run", "/proc/self", "/dev",
                                   "/var", "/var/lib/run", "/sys/x", "/boot", "/bin", "/lib"])
def test_system_paths_are_refused(value):
    _refused(value, "system directory")


def test_home_and_percent_are_refused(tmp_path, monkeypatch):
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    _refused("~", "home directory")
    _refused(str(home), "home directory")
    for value in (tmp_path / "run_%j", tmp_path / "a%u" / "b"):
        _refused(str(value), "'%'", "Slurm")
        assert not value.exists()
    # below $HOME and under /var/tmp a run is fine
    assert check_run_dir_choice(home / "runs" / "r1") == home / "runs" / "r1"
    assert check_run_dir_choice("/var/tmp/hetrl-test-never-made") == Path("/var/tmp/hetrl-test-never-made")


def test_a_non_empty_directory_that_is_not_a_run_is_refused_but_runs_are_taken(tmp_path):
    project = tmp_path / "project"
    project.mkdir()
    (project / "notes.txt").write_text("mine")
    before = _tree(project)
    _refused(project, "non-empty directory that is not a run directory", str(project))
    assert _tree(project) == before
    # a new path, an empty directory, a frozen run, and a first launch that stopped before config.yaml
    # (only names hetrl makes, temp files included) are run directories
    assert check_run_dir_choice(tmp_path / "new" / "run") == tmp_path / "new" / "run"
    assert not (tmp_path / "new").exists()
    (tmp_path / "empty").mkdir()
    check_run_dir_choice(tmp_path / "empty")
    run = tmp_path / "run"
    (run / "logs").mkdir(parents=True)
    (run / "secret").write_text("x")
    (run / ".config.yaml.tmp-0123abcd").write_text("")
    (run / "slurm_jobs.jsonl").write_text("")
    check_run_dir_choice(run)
    (run / "thesis.tex").write_text("")
    _refused(run, "not a run directory")
    (run / "config.yaml").write_text("{}")
    check_run_dir_choice(run)
    # a file is no directory
    (tmp_path / "file").write_text("")
    _refused(tmp_path / "file", "not a directory")


def test_the_current_directory_is_refused_unless_it_is_a_run(tmp_path, monkeypatch):
    here = tmp_path / "here"
    here.mkdir()
    (here / "setup.py").write_text("")
    monkeypatch.chdir(here)
    _refused(".", "current directory")
    (here / "setup.py").unlink()
    (here / "config.yaml").write_text("{}")
    assert check_run_dir_choice(".") == here


def test_a_run_dir_under_a_symlinked_path_is_named_by_its_real_path(tmp_path):
    (tmp_path / "lustre" / "scratch").mkdir(parents=True)
    (tmp_path / "scratch").symlink_to(tmp_path / "lustre" / "scratch")
    (cfg,) = compose_points([f"run_dir={tmp_path / 'scratch' / 'r1'}"], multirun=False)
    assert cfg["run_dir"] == str(tmp_path / "lustre" / "scratch" / "r1")
    # a link planted below the (resolved) run directory is refused, not followed
    run = tmp_path / "lustre" / "scratch" / "r2"
    run.mkdir()
    (tmp_path / "elsewhere").mkdir()
    (run / "logs").symlink_to(tmp_path / "elsewhere")
    _refused(run, "symlink")


def test_the_launcher_refuses_in_one_line_before_writing_anything(tmp_path, capsys):
    from launch.__main__ import main
    project = tmp_path / "project"
    project.mkdir()
    (project / "data.csv").write_text("1,2\n")
    for cmd in ("run", "plan"):
        assert main([cmd, f"run_dir={project}"]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("error: run_dir=") and "\n" not in err and "not a run directory" in err, err
    assert main(["run", "run_dir=/etc"]) == 2
    assert "system directory" in capsys.readouterr().err
    assert _tree(project) == ["data.csv"]


def test_freeze_refuses_a_directory_that_is_not_a_run(tmp_path):
    from builders import compose_cfg
    from launch.plan import make_plan
    cfg = compose_cfg(tmp_path / "run")
    project = tmp_path / "project"
    project.mkdir()
    (project / "notes.txt").write_text("mine")
    with pytest.raises(ConfigError, match="not a run directory"):
        freeze_run_dir(dict(cfg, run_dir=str(project)), project, make_plan(cfg))
    assert _tree(project) == ["notes.txt"]


# -- the run's secret ----------------------------------------------------------------------------------
def test_a_secret_readable_by_others_is_refused(tmp_path):
    sf = tmp_path / "secret"
    sf.write_text("s" * MIN_CHARS)
    for mode in (0o644, 0o640, 0o604, 0o660, 0o602):
        sf.chmod(mode)
        with pytest.raises(SecretError) as e:
            read_secret(tmp_path)
        msg = str(e.value)
        assert f"mode {mode:04o}" in msg and "chmod 600" in msg and str(sf) in msg and "\n" not in msg, msg
        # create_secret keeps neither silently: the user decides (chmod 600, or a new one)
        with pytest.raises(SecretError, match="chmod 600"):
            create_secret(tmp_path)
        assert sf.read_text() == "s" * MIN_CHARS and stat.S_IMODE(sf.stat().st_mode) == mode
    sf.chmod(0o600)
    assert read_secret(tmp_path) == "s" * MIN_CHARS and create_secret(tmp_path) is False


def test_a_new_secret_is_0600_whatever_the_umask(tmp_path):
    old = os.umask(0)
    try:
        assert create_secret(tmp_path) is True
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "secret").stat().st_mode) == 0o600
    assert len(read_secret(tmp_path)) >= MIN_CHARS


@pytest.mark.skipif(sys.platform != "linux", reason="FIFOs and O_NOFOLLOW semantics of Linux")
def test_a_secret_planted_as_a_link_or_fifo_is_refused_not_replaced(tmp_path):
    victim = tmp_path / "victim"
    victim.write_text("s" * MIN_CHARS)
    victim.chmod(0o600)
    run = tmp_path / "run"
    run.mkdir()
    (run / "secret").symlink_to(victim)
    for f in (read_secret, create_secret):
        with pytest.raises(SecretError, match="symlink"):
            f(run)
    assert (run / "secret").is_symlink() and victim.read_text() == "s" * MIN_CHARS
    (run / "secret").unlink()
    os.mkfifo(run / "secret")
    for f in (read_secret, create_secret):
        with pytest.raises(SecretError, match="FIFO"):
            f(run)


def test_a_role_stopped_by_a_planted_link_says_so_in_one_line(tmp_path):
    """A role's own writer meeting a planted link ends the role with one line naming it, no traceback."""
    import subprocess
    import sys as _sys
    from builders import make_run_dir
    run = tmp_path / "run"
    make_run_dir(run)
    victim = tmp_path / "victim"
    victim.write_text("keep\n")
    (run / "rollouts").mkdir(exist_ok=True)
    (run / "rollouts" / "groups.jsonl").symlink_to(victim)
    code = ("import sys\nfrom rl.runtime import parse_role_args\nfrom rl.exchange import append_jsonl\n"
            "ns = parse_role_args('orchestrator', ['--run-dir', sys.argv[1]])\n"
            "append_jsonl(ns.run_dir / 'rollouts' / 'groups.jsonl', {'group': 0})\n")
    p = subprocess.run([_sys.executable, "-c", code, str(run)], capture_output=True, text=True, timeout=120)
    assert p.returncode == 1, p.stderr
    lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
    assert "Traceback" not in p.stderr and len(lines) == 1, p.stderr
    assert lines[0].startswith("rl.orchestrator: refused: ") and "groups.jsonl: a symlink" in lines[0]
    assert victim.read_text() == "keep\n"
