"""Shared pytest fixtures. The Slurm part (a real localhost cluster) lives in tests/slurm_cluster.py.

tests/ itself, the repository root and benchmarks/ are on sys.path through setup.cfg's `pythonpath`
(shared helpers: tests/helpers)."""
import sys
from pathlib import Path

import pytest

from slurm_cluster import slurm, slurm_cluster  # noqa: F401  (fixtures)


@pytest.fixture(scope="session")
def twin(tmp_path_factory):
    """twin(family) -> the path of that family's tiny random HF checkpoint (rl.tiny_models.twins), made once."""
    made = {}

    def get(family: str) -> Path:
        if family not in made:
            from rl.tiny_models.twins import write_twin
            made[family] = write_twin(tmp_path_factory.mktemp(f"twin_{family}"), family)
        return made[family]
    return get


DEBUG_RUN_STEPS = 16


@pytest.fixture(scope="session")
def debug_run(tmp_path_factory):
    """(run_dir, launcher output) of the embedded default run to DEBUG_RUN_STEPS steps (`python -m launch
    run`, real vLLM and trainer), made once per session and shared by the tests that only read a finished
    run (tests/integration/test_local_run.py, test_report.py): each run costs about a minute here."""
    import os
    import subprocess
    pytest.importorskip("vllm")
    run_dir = tmp_path_factory.mktemp("debug_run") / "run"
    env = {**os.environ, "WANDB_MODE": "offline", "PYTHONUNBUFFERED": "1"}
    r = subprocess.run([sys.executable, "-m", "launch", "run", f"run_dir={run_dir}",
                        f"trainer.max_steps={DEBUG_RUN_STEPS}"], cwd=Path(__file__).resolve().parents[1],
                       env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-5000:]
    return run_dir, r.stdout


USR1_RUN_STEPS = 6


@pytest.fixture(scope="session")
def usr1_requeued_run(slurm_cluster, tmp_path_factory):
    """The debug config on the localhost Slurm cluster to USR1_RUN_STEPS steps, its batch shell sent USR1
    after 2 steps (the roles checkpoint, the job requeues), awaited until it ended:
    {run_dir, job, out, state}. Made once per session and only read by its users
    (tests/integration/test_slurm_rl.py, test_report.py): each such run costs about two minutes here."""
    # its users are tests/integration's, so pytest has put that directory on sys.path (rootdir-less
    # test directories are, in its default import mode) and imported test_slurm_rl under this name
    from test_slurm_rl import FAST, _job_ended, _launch, _wait

    from launch import slurm as ls
    from rl.metrics import read_metrics
    slurm_cluster.cancel_all()
    run_dir = tmp_path_factory.mktemp("usr1") / "run"
    out = _launch(f"run_dir={run_dir}", f"trainer.max_steps={USR1_RUN_STEPS}", *FAST)
    job = ls.current_job(run_dir)
    _wait(lambda: len(read_metrics(run_dir)) >= 2, 600, "2 trainer steps", run_dir)
    slurm_cluster.run("scancel", "--signal=USR1", "--batch", job)
    state = _wait(lambda: _job_ended(job), 900, "the job to finish after requeue", run_dir)
    return {"run_dir": run_dir, "job": job, "out": out, "state": state}
