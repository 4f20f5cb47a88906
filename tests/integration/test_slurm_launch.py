"""launch.slurm against the localhost cluster: submit / status / cancel / resume checks, and the test
cluster itself stopping without leaving a process behind. The RL end to end lives with the roles."""
from __future__ import annotations

import io
import os
import time
from pathlib import Path

import pytest

from launch import slurm as ls
from launch.compose import compose_points
from rl.contract.config import ConfigError

pytestmark = pytest.mark.slurm


def _cfg(run_dir: Path, *extra: str) -> dict:
    (cfg,) = compose_points(["cluster=slurm", f"run_dir={run_dir}", *extra], multirun=False)
    # held back an hour: the job stays PENDING, so no role starts (this test is about the plumbing)
    cfg["cluster"]["extra_sbatch"] = ["--begin=now+3600"]
    return cfg


def test_launch_status_cancel_resume(slurm, tmp_path):
    run_dir = tmp_path / "run"
    job = ls.launch_slurm(_cfg(run_dir), run_dir)
    for f in ("config.yaml", "plan.json", "job.sbatch", "submissions.jsonl", "slurm_jobs.jsonl"):
        assert (run_dir / f).exists(), f
    from launch.status import render, status
    st = status(run_dir)
    assert st["job"]["id"] == job and st["job"]["state"] == "PENDING" and st["latest_checkpoints"] is None
    from rich.console import Console
    buf = io.StringIO()
    render(st, Console(file=buf, width=120))
    assert job in buf.getvalue() and "PENDING" in buf.getvalue()
    with pytest.raises(ConfigError, match="still active"):
        ls.launch_slurm(_cfg(run_dir), run_dir)
    ls.cancel_run(run_dir)
    deadline = time.monotonic() + 20
    while ls.job_state(job)["state"] != "CANCELLED":
        assert time.monotonic() < deadline, ls.job_state(job)
        time.sleep(0.3)
    with pytest.raises(ConfigError, match="^trainer.lr: differs from the frozen config"):
        ls.launch_slurm(_cfg(run_dir, "trainer.lr=0.1"), run_dir)
    job2 = ls.resume_slurm(run_dir, max_steps=40)
    assert job2 != job and ls.current_job(run_dir) == job2
    assert ls.log_path(run_dir, "job").name == f"slurm-{job2}.out"


def test_a_refused_submission_freezes_nothing_and_can_be_corrected(slurm, tmp_path):
    import subprocess
    import sys
    run_dir = tmp_path / "run"
    bad = ["cluster=slurm", f"run_dir={run_dir}", "cluster.partition=nosuchpartition",
           "cluster.extra_sbatch=['--begin=now+3600']"]
    r = subprocess.run([sys.executable, "-m", "launch", "run", *bad], capture_output=True, text=True, timeout=120)
    assert r.returncode == 1 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert r.stderr.startswith("error: sbatch --parsable") and "partition" in r.stderr.lower(), r.stderr
    assert not (run_dir / "config.yaml").exists() and not (run_dir / "secret").exists()
    assert not [p for p in run_dir.iterdir() if p.name.startswith(".job.sbatch")]
    # corrected, with another learning rate too: it is a first submission, not a resume
    job = ls.launch_slurm(_cfg(run_dir, "trainer.lr=0.1"), run_dir)
    assert ls.job_state(job)["state"] == "PENDING" and ls.job_state(job)["reason"] != "JobHeldUser"
    assert "lr: 0.1" in (run_dir / "config.yaml").read_text()
    ls.cancel_run(run_dir)


def test_a_forged_job_id_never_reaches_scancel_as_an_option(slurm, tmp_path):
    # slurm_jobs.jsonl is a file in the run directory; a job id "--user=root" would have made
    # `launch cancel` run `scancel --user=root`, cancelling every job of the user (here: `other`).
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    other = slurm.run("sbatch", "--parsable", "--hold", f"--output={tmp_path}/o", "--wrap", "true").stdout.strip()
    (run_dir / ls.JOBS_FILE).write_text('{"job_id": "--user=root"}\n')
    with pytest.raises(ConfigError, match=r"slurm_jobs\.jsonl: job_id='--user=root' is not a Slurm job id"):
        ls.cancel_run(run_dir)
    assert ls.job_state(other)["state"] == "PENDING"
    ls.cancel(other)  # a real id still works (scancel -- ID)
    deadline = time.monotonic() + 20
    while ls.job_state(other)["state"] != "CANCELLED":
        assert time.monotonic() < deadline, ls.job_state(other)
        time.sleep(0.3)


def test_a_run_dir_with_a_space_is_refused_before_anything_is_submitted(slurm, tmp_path):
    # `#SBATCH --output=RUN_DIR/logs/...` would have read "--partition=high/logs/slurm-%j.out" as an option
    run_dir = tmp_path / "r --partition=high"
    before = slurm.job_ids()
    with pytest.raises(ConfigError, match=r"^run_dir=.*cannot go into an #SBATCH line"):
        ls.launch_slurm(_cfg(tmp_path / "placeholder"), run_dir)  # the argument is the run dir
    assert not run_dir.exists() and slurm.job_ids() == before


def test_cluster_stop_leaves_no_process(tmp_path):
    from slurm_cluster import SlurmCluster, missing_binaries
    if missing_binaries() and not os.environ.get("CI"):
        pytest.skip("Slurm not installed")
    c = SlurmCluster(nodes=2)
    try:
        c.start()
        c.run("sbatch", "-N2", f"--output={tmp_path}/o", "--wrap", "srun sleep 300")
        deadline = time.monotonic() + 20
        while "R" not in c.run("squeue", "-h", "-o", "%t").stdout:
            assert time.monotonic() < deadline
            time.sleep(0.2)
        marker = str(c.dir).encode()
    finally:
        c.stop()
    left = []
    for p in Path("/proc").iterdir():
        if not p.name.isdigit():
            continue
        try:
            if (p / "stat").read_text().split(")")[-1].split()[0] == "Z":
                continue  # exited; this container's init does not reap orphans
            if marker in (p / "cmdline").read_bytes() or marker in (p / "environ").read_bytes():
                left.append((p.name, (p / "cmdline").read_bytes()[:80]))
        except OSError:
            continue
    assert not left, left
