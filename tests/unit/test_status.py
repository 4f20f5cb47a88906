"""launch.status on a local run directory: a server whose engine core died is named with its cause."""
from __future__ import annotations

import io

from builders import make_run_dir
from launch.status import render, status


def test_status_names_a_dead_engine_and_its_cause(tmp_path):
    run = tmp_path / "run"
    make_run_dir(run)
    st = status(run)
    assert st["job"]["state"] == "NEVER STARTED" and st["engine_deaths"] == {}
    logs = run / "logs"
    logs.mkdir(exist_ok=True)
    e = "(EngineCore pid=5) ERROR 12-04 18:39:58 [core.py:1512]"
    (logs / "inference_1.vllm.log").write_text(
        f"INFO up\n{e} EngineCore encountered a fatal error.\n{e} Traceback (most recent call last):\n"
        f"{e} RuntimeError: Worker failed with error 'CPU Generator does not use offset'\n")
    (logs / "inference_0.vllm.log").write_text("INFO up\n")
    st = status(run)
    assert list(st["engine_deaths"]) == ["inference_1"]
    assert st["engine_deaths"]["inference_1"].startswith(
        "RuntimeError: Worker failed with error 'CPU Generator does not use offset' (") and \
        st["engine_deaths"]["inference_1"].endswith("inference_1.vllm.log:4)")
    from rich.console import Console
    buf = io.StringIO()
    render(st, Console(file=buf, width=300))
    assert "inference_1 engine" in buf.getvalue() and "CPU Generator does not use offset" in buf.getvalue()


def _metrics(run, steps: int, final_eval: bool, first: int = 0) -> list[dict]:
    """Lines as the trainer writes them: one per trained step, then the final evaluation's own line."""
    import json
    lines = [{"step": s, "loss": 0.5, "reward_mean": round(0.1 + s / 100, 3), "step_time_s": 0.5,
              **({"eval/version": s, "eval/pass@1": 0.25} if s % 2 == 0 else {})} for s in range(first, steps)]
    if final_eval:
        lines.append({"step": steps, "eval/version": steps, "eval/pass@1": 0.75, "eval/tasks": 8})
    with open(run / "metrics.jsonl", "a") as f:
        f.write("".join(json.dumps(m) + "\n" for m in lines))
    return lines


def test_status_of_a_finished_run_shows_the_last_trained_step_and_its_reward(tmp_path):
    """The final evaluation's line (step = max_steps, no loss) is not a step: 40/40, not 41/40."""
    run = tmp_path / "run"
    make_run_dir(run, "trainer.max_steps=40")
    lines = _metrics(run, 40, final_eval=True)
    (run / "DONE").write_text("{}")
    st = status(run)
    assert (st["step"], st["max_steps"]) == (40, 40)
    assert st["reward"] == lines[39]["reward_mean"] and st["last_metrics"]["step"] == 39
    assert st["last_eval"] == {"eval/version": 40, "eval/pass@1": 0.75, "eval/tasks": 8}
    from rich.console import Console
    buf = io.StringIO()
    render(st, Console(file=buf, width=300))
    assert f"40/40  reward {lines[39]['reward_mean']:.3f}" in buf.getvalue(), buf.getvalue()
    assert "policy v40: pass@1 0.750" in buf.getvalue(), buf.getvalue()
    # mid-run (no final evaluation yet): the newest line is a step's
    run2 = tmp_path / "run2"
    make_run_dir(run2, "trainer.max_steps=40")
    _metrics(run2, 7, final_eval=False)
    st = status(run2)
    assert st["step"] == 7 and st["reward"] == 0.16 and st["last_eval"]["eval/version"] == 6


def _role_like(run_dir):
    import subprocess
    import sys
    import time
    p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)", "--run-dir", str(run_dir)])
    time.sleep(0.3)
    return p


def test_status_says_running_while_a_role_outlives_its_launcher(tmp_path):
    """Never ENDED while a role of the run is alive: a launcher that is gone with a role still running
    is RUNNING (its roles stopping, or detached on purpose); ENDED once none is left."""
    import socket
    import time
    from rl.contract.records import LocalLauncher
    run = tmp_path / "run"
    make_run_dir(run)
    role = _role_like(run)
    try:
        for detached, words in ((False, "is gone; its roles are stopping; alive: trainer"),
                                (True, "detached (launch run --detach): the launcher has exited; alive: trainer")):
            LocalLauncher(host=socket.gethostname(), pid=999999, started=time.time(), roles={"trainer": role.pid},
                          detached=detached).write(run)
            job = status(run)["job"]
            assert job["state"] == "RUNNING" and job["reason"].endswith(words), job
    finally:
        role.kill()
        role.wait()
    job = status(run)["job"]
    assert job["state"] == "ENDED", job
    (run / "DONE").write_text("{}")
    assert status(run)["job"]["state"] == "COMPLETED"


def test_a_role_stops_itself_when_its_launcher_is_gone(tmp_path):
    """rl.runtime.LauncherWatch: fires once the launcher's pid is gone, and at once for a pid whose start
    time is not the recorded one (the pid was reused); not while the launcher lives."""
    import subprocess
    import sys
    import threading
    import pytest
    from launch import local
    from rl.contract.procs import start_ticks
    from rl.runtime import LAUNCHER_ENV, LauncherWatch, launcher_identity
    assert local.LAUNCHER_ENV == LAUNCHER_ENV   # the launcher's name for it (launch imports no role code)
    launcher = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        ticks = start_ticks(launcher.pid)
        assert ticks is not None
        stopped = threading.Event()
        w = LauncherWatch("trainer", launcher.pid, ticks, poll_s=0.05, stop=stopped.set)
        assert not stopped.wait(0.5) and not w.fired.is_set()
        reused = threading.Event()
        LauncherWatch("trainer", launcher.pid, ticks + 1, poll_s=0.05, stop=reused.set)
        assert reused.wait(60)
        launcher.kill()
        launcher.wait()
        assert stopped.wait(60) and w.fired.is_set()
    finally:
        launcher.kill()
        launcher.wait()
    with pytest.raises(ValueError, match="HETRL_LAUNCHER='12x:3'"):
        launcher_identity("12x:3")


def test_a_resumed_launcher_prints_only_new_steps_with_elapsed_and_eta(tmp_path, capsys):
    from launch.local import _Progress
    run = tmp_path / "run"
    run.mkdir()
    _metrics(run, 5, final_eval=False)
    progress = _Progress(run, 10, resumed_from=5)
    _metrics(run, 8, final_eval=False, first=5)
    progress.update("")
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "resumed at step 5/10 (checkpoint step 5): showing the steps trained from here on"
    steps = [ln for ln in out if ln.startswith("step ")]
    assert [ln.split()[1] for ln in steps] == ["6/10", "7/10", "8/10"], out
    # before a second step has arrived the ETA is the trainer's step time times the steps left (2 x 0.5 s)
    import re
    assert all(re.search(r"  elapsed \d+s  eta ", ln) for ln in steps), steps
    assert steps[-1].endswith("eta 1s"), steps
    progress.update("")
    assert "step " not in capsys.readouterr().out   # nothing new, nothing printed
