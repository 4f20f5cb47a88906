"""`python -m rl.trainer --run-dir D` as a process: warm start on the real env, SIGTERM, resume."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from omegaconf import OmegaConf

from helpers.trainer import publish_batches, tiny_cfg
from rl import exchange
from rl.metrics import read_metrics
from rl.runtime import EXIT_PREEMPTED, is_done

ROOT = Path(__file__).resolve().parents[2]


def _start(run_dir):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.Popen([sys.executable, "-m", "rl.trainer", "--run-dir", str(run_dir)], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def test_trainer_process_stops_on_sigterm_and_resumes(tmp_path):
    cfg = tiny_cfg(tmp_path, max_steps=2, warm_start={"steps": 3, "batch_size": 4})
    OmegaConf.save(cfg, tmp_path / "config.yaml")
    p = _start(tmp_path)
    deadline = time.monotonic() + 120
    while not exchange.step_dir(tmp_path, "checkpoints", 0).exists():  # warm start done, waiting for rollouts
        assert p.poll() is None and time.monotonic() < deadline, p.communicate()[0]
        time.sleep(0.1)
    p.send_signal(signal.SIGTERM)
    out = p.communicate(timeout=60)[0]
    assert p.returncode == EXIT_PREEMPTED, out
    assert "warm start 3/3" in out
    assert exchange.list_steps(tmp_path, "weights") == [0]
    assert exchange.list_steps(tmp_path, "assets") == [0]

    publish_batches(tmp_path, range(2))
    p = _start(tmp_path)
    out = p.communicate(timeout=120)[0]
    assert p.returncode == 0, out
    assert "resumed from checkpoints/step_000000" in out and "warm start" not in out
    assert is_done(tmp_path)
    assert [m["step"] for m in read_metrics(tmp_path)] == [0, 1]
    assert exchange.list_steps(tmp_path, "weights") == [0, 1, 2]
    assert (tmp_path / "roles" / "trainer.json").exists()
