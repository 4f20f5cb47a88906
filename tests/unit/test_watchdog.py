"""The no-progress watchdog: a role waiting past cluster.stall_timeout_s for another role's output ends
with EXIT_STALLED and one line naming what it waited for (a hung job must not hold its nodes)."""
from __future__ import annotations

import subprocess
import sys
import time

from builders import make_run_dir
from rl.contract.paths import EXIT_STALLED
from rl.runtime import Watchdog


def test_the_watchdog_fires_only_on_a_wait_without_progress():
    fired = []
    w = Watchdog("trainer", 0.5, poll_s=0.05, exit=fired.append)
    w.waiting("rollouts/step_000003 from the orchestrator")
    for _ in range(10):  # progress keeps arriving: never fires
        time.sleep(0.1)
        w.progress()
        w.waiting("rollouts/step_000004 from the orchestrator")
    assert not fired
    w.waiting("rollouts/step_000004 from the orchestrator")  # the same wait keeps its start
    time.sleep(1.0)
    assert fired == [EXIT_STALLED]
    assert Watchdog("x", 0).stalled_for() == 0.0  # 0 = no watchdog thread at all


def test_an_inference_role_without_a_trainer_ends_as_stalled(tmp_path):
    run = tmp_path / "run"
    make_run_dir(run, "cluster.stall_timeout_s=2")
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, "-m", "rl.inference", "--run-dir", str(run), "--index", "0"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == EXIT_STALLED, r.stdout + r.stderr
    stalled = [ln for ln in r.stdout.splitlines() if "STALLED" in ln]
    assert len(stalled) == 1 and "assets/step_000000 and a complete weights/step_*" in stalled[0], r.stdout
    assert "cluster.stall_timeout_s=2" in stalled[0]
    assert time.monotonic() - t0 < 60
