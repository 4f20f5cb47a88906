"""`launch plan --calibrate RUN_DIR` with a real embedded run as the pilot: the session's embedded default
run (`python -m launch run`: vLLM, the torchtitan trainer and the orchestrator as local processes,
single-turn digits; tests/conftest.py `debug_run`) is accepted as it is, and the printed range holds the
measured steps/h of a second embedded run with another max_off_policy and request concurrency. Nothing
of the second run goes into the prediction; the second run costs about a minute here."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from rl.metrics import read_metrics

REPO = Path(__file__).resolve().parents[2]
TARGET = ["orchestrator.max_off_policy=2", "orchestrator.max_concurrency=32", "trainer.keep_weights=3",
          "trainer.max_steps=12"]


def test_an_embedded_default_run_is_a_pilot(debug_run, tmp_path):
    pytest.importorskip("vllm")
    pilot, _ = debug_run
    p = subprocess.run([sys.executable, "-m", "launch", "plan", *TARGET, f"run_dir={tmp_path / 'plan'}",
                        "--calibrate", str(pilot)], cwd=REPO, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, (p.stdout + p.stderr)[-3000:]
    line = next(x for x in p.stdout.splitlines() if x.startswith("calibrate: calibrated"))
    low, mid, high = map(float, re.search(r"(\d+) / (\d+) / (\d+) steps/h low / mid / high", line).groups())
    assert 0 < low <= mid <= high and "the pilot replayed" in line, line
    run_dir = tmp_path / "target"
    env = {**os.environ, "WANDB_MODE": "offline", "PYTHONUNBUFFERED": "1"}
    r = subprocess.run([sys.executable, "-m", "launch", "run", f"run_dir={run_dir}", *TARGET], cwd=REPO, env=env,
                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-5000:]
    ms = read_metrics(run_dir)
    measured = (len(ms) - 1) / (ms[-1]["time"] - ms[0]["time"]) * 3600
    assert low <= measured <= high, f"measured {measured:.0f} steps/h outside {line}"
