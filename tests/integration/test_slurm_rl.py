"""The debug experiment as ONE heterogeneous job on the real localhost Slurm, with the real roles.

- `python -m launch run +experiment=debug cluster=slurm` returns at once; the job runs the trainer on
  het group 0's node and vLLM + the orchestrator on group 1's node, and is asked to stop mid-run with
  `scancel --signal=USR1 --batch` (what Slurm sends before the time limit): the roles checkpoint, the
  script requeues the job, the second incarnation (SLURM_RESTART_COUNT=1) resumes and finishes with every
  rollout batch trained exactly once.
- partition preemption by a job in the higher-priority partition: the same outcome.
- a 2-point sweep submits two jobs and returns before they finish; both complete in their own run dirs.
"""
from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from launch import slurm as ls
from rl import exchange
from rl.metrics import read_metrics

pytestmark = [pytest.mark.slurm, pytest.mark.slow]
REPO = Path(__file__).resolve().parents[2]
FAST = ["trainer.warm_start.steps=30", "trainer.checkpoint_every=2", "cluster.signal_grace_s=30",
        "cluster.time=00:30:00"]


def _launch(*args: str, timeout: float = 60) -> str:
    t0 = time.monotonic()
    out = subprocess.run([sys.executable, "-m", "launch", "run", "+experiment=debug", "cluster=slurm", *args],
                         cwd=REPO, capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0, out.stderr + out.stdout
    assert time.monotonic() - t0 < 30, "submitting must not wait for the job"
    return out.stdout


def _wait(cond, timeout: float, what: str, run_dir: Path | None = None):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        v = cond()
        if v:
            return v
        time.sleep(0.5)
    logs = ""
    if run_dir is not None:
        for p in sorted((run_dir / "logs").glob("*.out")) + sorted((run_dir / "logs").glob("*.log")):
            logs += f"\n--- {p.name}\n" + "\n".join(p.read_text(errors="replace").splitlines()[-15:])
    raise AssertionError(f"timed out after {timeout} s waiting for {what}{logs}")


def _job_ended(job: str):
    st = ls.job_state(job)
    return st if st["state"] in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "GONE") else None


def _history(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "roles" / "history.jsonl").read_text().splitlines()]


def _assert_complete_once(run_dir: Path, steps: int) -> None:
    assert (run_dir / "DONE").exists()
    ck = exchange.latest_complete(run_dir, "checkpoints", checksums=True)
    state = json.loads((exchange.step_dir(run_dir, "checkpoints", ck) / "trainer_state.json").read_text())
    assert state["consumed"] == list(range(steps))
    assert [m["step"] for m in read_metrics(run_dir)] == list(range(steps))
    assert exchange.latest_complete(run_dir, "weights") == steps


def _assert_placement(run_dir: Path) -> None:
    hist = _history(run_dir)
    trainer = [h for h in hist if h["role"] == "trainer"]
    others = [h for h in hist if h["role"] in ("orchestrator", "inference_0")]
    assert trainer and others
    assert {h["slurm_het_group"] for h in trainer} == {"0"}
    assert {h["slurm_het_group"] for h in others} == {"1"}
    for t in trainer:  # within one incarnation, group 0's node is not group 1's
        same = [o for o in others if o["slurm_restart_count"] == t["slurm_restart_count"]]
        assert same and all(o["slurm_nodename"] != t["slurm_nodename"] for o in same)


def test_debug_on_slurm_checkpoints_on_usr1_requeues_and_completes(usr1_requeued_run):
    from conftest import USR1_RUN_STEPS as steps
    run_dir, job, out, st = (usr1_requeued_run[k] for k in ("run_dir", "job", "out", "state"))
    assert job and job in out and str(run_dir) in out
    assert st["state"] in ("COMPLETED", "GONE"), st
    _assert_complete_once(run_dir, steps)
    _assert_placement(run_dir)
    restarts = {h["slurm_restart_count"] for h in _history(run_dir) if h["role"] == "trainer"}
    assert restarts == {0, 1}
    resume = json.loads((run_dir / "resume.json").read_text())
    assert resume["restart"] == 1 and resume["checkpoint_step"] >= 2
    # the wandb run continues: one id, kept in the run dir
    assert len(list((run_dir / "wandb").glob("offline-run-*"))) >= 2
    assert len({p.name.rsplit("-", 1)[-1] for p in (run_dir / "wandb").glob("offline-run-*")}) == 1


def test_partition_preemption_requeues_and_completes(slurm, tmp_path):
    steps = 6
    run_dir = tmp_path / "run"
    _launch(f"run_dir={run_dir}", f"trainer.max_steps={steps}", "cluster.partition=debug", *FAST)
    job = ls.current_job(run_dir)
    _wait(lambda: len(read_metrics(run_dir)) >= 2, 600, "2 trainer steps", run_dir)
    # a higher-priority job wanting every node preempts ours (PreemptMode=REQUEUE)
    slurm.run("sbatch", "-p", "high", "-N4", f"--output={tmp_path}/high.out", "--wrap", "sleep 3")
    st = _wait(lambda: _job_ended(job), 900, "the preempted job to finish", run_dir)
    assert st["state"] in ("COMPLETED", "GONE"), st
    _assert_complete_once(run_dir, steps)
    assert {h["slurm_restart_count"] for h in _history(run_dir) if h["role"] == "trainer"} >= {0, 1}


def test_two_point_sweep_submits_two_jobs_and_returns(slurm, tmp_path):
    sweep = tmp_path / "sweep"
    t0 = time.monotonic()
    out = _launch("-m", f"run_dir={sweep}", "seed=1,2", "trainer.max_steps=2",
                  "trainer.warm_start.steps=10", "trainer.checkpoint_every=2", "cluster.time=00:30:00")
    assert time.monotonic() - t0 < 30
    dirs = [sweep / "0", sweep / "1"]
    jobs = [ls.current_job(d) for d in dirs]
    assert all(jobs) and len(set(jobs)) == 2
    assert "sweep: 2 points" in out
    assert any(ls.job_state(j)["state"] in ("PENDING", "RUNNING", "CONFIGURING") for j in jobs)
    for j, d in zip(jobs, dirs):
        st = _wait(lambda: _job_ended(j), 900, f"sweep job {j}", d)
        assert st["state"] in ("COMPLETED", "GONE"), st
        _assert_complete_once(d, 2)
    import yaml
    seeds = [yaml.safe_load((d / "config.yaml").read_text())["seed"]
             for d in dirs]
    assert seeds == [1, 2]
