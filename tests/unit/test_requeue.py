"""rl.requeue: a stopped job requeues only with a checkpoint newer than its start, at most max_restarts times."""
from __future__ import annotations

import subprocess
import sys

from builders import make_run_dir
from rl import exchange
from rl.contract.records import ResumeState
from rl.requeue import decide


def _checkpoint(run_dir, step):
    exchange.publish(run_dir, "checkpoints", step, lambda d: (d / "state").write_text(str(step)),
                     producer="trainer")


def test_requeue_needs_a_checkpoint_newer_than_the_incarnations_start(tmp_path):
    run = tmp_path / "run"
    make_run_dir(run, "cluster.max_restarts=3")
    ok, why = decide(run, restart=0)
    assert not ok and "wrote no newer checkpoint" in why and "resumed from scratch" in why
    _checkpoint(run, 2)
    assert decide(run, restart=0)[0]
    ResumeState(checkpoint_step=2, restart=1).write(run)  # the next incarnation resumed from step 2
    ok, why = decide(run)
    assert not ok and "resumed from checkpoint step 2" in why
    _checkpoint(run, 4)
    ok, why = decide(run)
    assert ok and "checkpoint step 4 written since step 2" in why
    ok, why = decide(run, restart=3)
    assert not ok and "cluster.max_restarts=3" in why and f"launch resume {run}" in why


def test_requeue_ignores_a_corrupt_newest_checkpoint_and_speaks_through_its_exit_status(tmp_path):
    run = tmp_path / "run"
    make_run_dir(run)
    _checkpoint(run, 1)
    (exchange.step_dir(run, "checkpoints", 1) / "state").write_text("truncated?")  # size differs
    r = subprocess.run([sys.executable, "-m", "rl.requeue", "--run-dir", str(run)], capture_output=True, text=True,
                       env={"SLURM_RESTART_COUNT": "0", "PATH": "/usr/bin:/bin"})
    assert r.returncode == 1, r.stderr
    assert r.stdout.strip().splitlines()[-1].startswith("not requeueing: this incarnation (restart 0")


def test_max_restarts_is_validated():
    import pytest
    from builders import compose_cfg
    from rl.contract.config import ConfigError
    with pytest.raises(ConfigError, match="cluster.max_restarts"):
        compose_cfg("/tmp/x", "cluster.max_restarts=-1")
