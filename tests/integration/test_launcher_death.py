"""The local launcher's lifetime, end to end (`python -m launch run`, real vLLM, real trainer, real signals).

A launcher SIGKILLed or hung up mid-run takes its roles with it: each takes its ordinary stop (the
step, a checkpoint, exit) and none is left running. `--detach` is the opposite on purpose: the launcher
returns, the roles train on, `launch status` says so, `launch cancel` stops them. And `launch status` on
a finished run shows the last trained step out of max_steps with its reward. Every run is the embedded
default with a few steps; every wait polls against a generous deadline.

Start-ups are most of this file's time (about 90 s each here), so the SIGKILL and SIGHUP runs are started
together by one module-scoped fixture and each test then stops its own run: they are separate runs in
separate directories (their derived ports checked apart), so neither test sees the other's signal, and
each run trains on while the other is tested (max_steps is out of reach). The runs skip the supervised
warm start, which only makes the policy better and has nothing to do with a launcher's lifetime.
"""
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from launch.local import recorded_processes
from launch.status import status
from rl.contract import paths
from rl.metrics import read_metrics

REPO = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.slow]
STEPS = 200         # never reached: every run here is stopped after its first steps or its neighbour's test
                    # (and the launcher's unread stdout pipe, ~130 bytes a step, never fills)
DRAIN_S = 5.0       # orchestrator.drain_timeout_s
GONE_S = 240.0      # the roles' stop (checkpoint, vLLM shutdown) on two loaded cores, with room to spare


def _launch(run_dir: Path, *extra: str) -> subprocess.Popen:
    env = {**os.environ, "WANDB_MODE": "offline", "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen([sys.executable, "-m", "launch", "run", *extra, f"run_dir={run_dir}",
                             f"trainer.max_steps={STEPS}", f"orchestrator.drain_timeout_s={DRAIN_S}",
                             "trainer.warm_start.steps=0"],
                            cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)


def _wait_steps(run_dir: Path, n: int, launcher: subprocess.Popen | None) -> None:
    t0 = time.monotonic()
    deadline = t0 + 600
    while len(read_metrics(run_dir)) < n:
        if launcher is not None:
            assert launcher.poll() is None, launcher.communicate()[0][-3000:]
        assert time.monotonic() < deadline, f"run did not reach step {n} in 600 s"
        time.sleep(0.5)
    print(f"step {n} reached after {time.monotonic() - t0:.1f} s")


def _live_roles(run_dir: Path) -> list[str]:
    return [f"{r.what} (pid {r.pid})" for r in recorded_processes(run_dir) if r.what != "launcher" and r.alive()[0]]


def _roles_gone(run_dir: Path) -> None:
    """Every role of the run ends within GONE_S; and while any lives, status never says ENDED (a role
    alive after status answered was alive while it answered)."""
    t0 = time.monotonic()
    deadline = t0 + GONE_S
    while True:
        state = status(run_dir)["job"]["state"]
        live = _live_roles(run_dir)
        assert not (live and state == "ENDED"), (state, live)
        if not live:
            break
        assert time.monotonic() < deadline, f"roles still running {GONE_S:.0f} s after their launcher: {live}"
        time.sleep(0.5)
    print(f"roles gone {time.monotonic() - t0:.1f} s after the launcher's end (or cancel)")
    assert status(run_dir)["job"]["state"] == "ENDED"


def _stopped_with_a_checkpoint(run_dir: Path) -> None:
    """The trainer took its ordinary stop: EXIT_PREEMPTED recorded, a checkpoint at the step it stopped."""
    from rl import exchange
    rec = json.loads(paths.trainer_exit(run_dir).read_text())
    assert rec["rc"] == paths.EXIT_PREEMPTED, rec
    ckpt = exchange.latest_complete(run_dir, "checkpoints", checksums=True)
    assert ckpt is not None and ckpt >= 1 and ckpt == len(read_metrics(run_dir)), (ckpt, len(read_metrics(run_dir)))
    assert not paths.done_file(run_dir).exists()


def _run_dirs(tmp_path_factory, names: tuple[str, ...]) -> dict[str, Path]:
    """A run dir per name whose derived ports (rl.contract.config.resolve_ports) differ from the others':
    runs that share a host at the same time must not share a port."""
    from rl.contract.config import resolve_ports
    out: dict[str, Path] = {}
    taken: set[int] = set()
    for name in names:
        while True:
            d = tmp_path_factory.mktemp(name) / "run"
            c = resolve_ports({"run_dir": str(d), "inference": {}, "trainer": {}})
            ports = {c["inference"]["port"], c["inference"]["router_port"], c["trainer"]["master_port"]}
            if not ports & taken:
                break
        taken |= ports
        out[name] = d
    return out


@pytest.fixture(scope="module")
def started(tmp_path_factory):
    """{"sigkill" | "sighup": (run_dir, launcher)}: two runs launched at once, each for one test to stop.
    A run its test did not stop (the test failed first) is stopped here: launcher SIGKILLed, roles awaited."""
    runs = _run_dirs(tmp_path_factory, ("sigkill", "sighup"))
    procs = {how: _launch(d) for how, d in runs.items()}
    try:
        yield {how: (runs[how], procs[how]) for how in runs}
    finally:
        for how, p in procs.items():
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.communicate()
        deadline = time.monotonic() + GONE_S
        while any(_live_roles(d) for d in runs.values()) and time.monotonic() < deadline:
            time.sleep(0.5)


def test_a_sigkilled_launcher_leaves_no_role_running(started):
    run_dir, p = started["sigkill"]
    _wait_steps(run_dir, 2, p)
    os.killpg(p.pid, signal.SIGKILL)   # the launcher's whole process group, as the issue did; the roles are not in it
    p.wait()
    _roles_gone(run_dir)
    _stopped_with_a_checkpoint(run_dir)
    # told by the kernel's parent-death signal or its own watch, whichever came first
    log = (run_dir / "logs" / "trainer.log").read_text()
    assert "SIGTERM received" in log or "the launcher (pid " in log, log[-3000:]


def test_a_hung_up_launcher_stops_its_roles_and_says_so(started):
    run_dir, p = started["sighup"]
    _wait_steps(run_dir, 2, p)
    os.kill(p.pid, signal.SIGHUP)      # what a closed ssh session sends
    try:
        out, _ = p.communicate(timeout=GONE_S)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        pytest.fail(f"launcher still running {GONE_S:.0f} s after SIGHUP:\n{p.communicate()[0][-3000:]}")
    assert p.returncode == paths.EXIT_PREEMPTED, out[-3000:]
    said = (run_dir / "logs" / "launcher.log").read_text()
    assert "SIGHUP (the terminal is gone" in said and "stopped (SIGHUP); resume with" in said, said
    _roles_gone(run_dir)
    _stopped_with_a_checkpoint(run_dir)


def test_a_detached_run_outlives_its_launcher_until_cancelled(tmp_path):
    run_dir = tmp_path / "run"
    p = _launch(run_dir, "--detach")
    out, _ = p.communicate(timeout=300)
    assert p.returncode == 0 and "detached:" in out, out[-3000:]
    st = status(run_dir)
    assert st["job"]["state"] == "RUNNING" and "detached" in st["job"]["reason"], st["job"]
    _wait_steps(run_dir, 2, None)        # trained with no launcher alive
    st = status(run_dir)
    assert st["job"]["state"] == "RUNNING" and st["step"] >= 2, st["job"]
    assert st["roles"]["trainer"]["state"] == "running", st["roles"]
    r = subprocess.run([sys.executable, "-m", "launch", "cancel", str(run_dir)], cwd=REPO,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "sent SIGTERM to role" in r.stdout, r.stdout + r.stderr
    _roles_gone(run_dir)
    _stopped_with_a_checkpoint(run_dir)


def test_status_of_a_finished_run_shows_its_last_step_and_reward(debug_run):
    """The debug run's last metrics line is the final evaluation's (step = max_steps): status still says
    N/N, with the last trained step's reward."""
    import io
    from rich.console import Console
    from conftest import DEBUG_RUN_STEPS as steps
    from launch.status import render
    run_dir, _ = debug_run
    st = status(run_dir)
    last = read_metrics(run_dir)[-1]
    assert (st["step"], st["max_steps"], st["job"]["state"]) == (steps, steps, "COMPLETED"), st
    assert st["reward"] == last["reward_mean"]
    buf = io.StringIO()
    render(st, Console(file=buf, width=300))
    assert f"{steps}/{steps}  reward {last['reward_mean']:.3f}" in buf.getvalue(), buf.getvalue()
