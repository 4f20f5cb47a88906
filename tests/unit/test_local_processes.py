"""Local runs: a pid in a run directory is signalled only while it is the recorded process, and a second
launcher on a run directory whose launcher or roles still run is refused before it writes anything."""
from __future__ import annotations

import signal
import socket
import subprocess
import sys
import time

from launch.procs import Recorded, signal_recorded
from rl.contract.procs import start_time as process_start_time
from rl.contract.records import LocalLauncher

LAUNCH = [sys.executable, "-m", "launch"]


def _sleeper(run_dir=None):
    """A process that looks like a role of `run_dir` in /proc (its planned command carries --run-dir)."""
    args = ["--run-dir", str(run_dir)] if run_dir is not None else []
    p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", *args])
    time.sleep(0.2)
    return p


def test_a_record_names_its_process_only_on_its_host_and_before_pid_reuse(tmp_path):
    p = _sleeper(tmp_path)
    try:
        started = process_start_time(p.pid)
        assert started is not None and abs(started - time.time()) < 30
        assert Recorded("role x", socket.gethostname(), p.pid, time.time(), tmp_path).alive()[0]
        ok, why = Recorded("role x", "elsewhere", p.pid, time.time(), tmp_path).alive()
        assert not ok and "host elsewhere" in why
        ok, why = Recorded("role x", socket.gethostname(), p.pid, started - 60, tmp_path).alive()  # before it started
        assert not ok and "reused" in why
        done, skipped = signal_recorded([Recorded("role x", socket.gethostname(), p.pid, started - 60, tmp_path)],
                                        signal.SIGTERM)
        assert not done and p.poll() is None  # the unrelated process was left alone
        done, _ = signal_recorded([Recorded("role x", socket.gethostname(), p.pid, time.time(), tmp_path)],
                                  signal.SIGTERM)
        assert done and p.wait(10) == -signal.SIGTERM
    finally:
        p.kill()
    assert not Recorded("role x", socket.gethostname(), p.pid, time.time(), tmp_path).alive()[0]


def test_a_crafted_record_never_signals_a_process_of_another_run(tmp_path):
    """A record's own time can say anything: a crafted local.json dated far in the future naming any pid
    (another user's shell, another run's role) is not taken for this run's process. Only what /proc shows
    counts: a role's `--run-dir`, a launcher's open lock file."""
    run, other = tmp_path / "run", tmp_path / "other"
    run.mkdir()
    other.mkdir()
    foreign, other_role = _sleeper(), _sleeper(other)
    try:
        future = time.time() + 10 ** 6
        LocalLauncher(host=socket.gethostname(), pid=foreign.pid, started=future,
                      roles={"trainer": foreign.pid, "orchestrator": other_role.pid}).write(run)
        from launch.local import recorded_processes
        procs = recorded_processes(run)
        assert sorted(p.what for p in procs) == ["launcher", "role orchestrator", "role trainer"]
        done, skipped = signal_recorded(procs, signal.SIGTERM)
        assert not done
        whys = {r.what: why for r, why in skipped}
        assert "not this run's launcher" in whys["launcher"], whys
        assert "not a role of this run" in whys["role trainer"] and "not a role of this run" in whys["role orchestrator"]
        time.sleep(0.3)
        assert foreign.poll() is None and other_role.poll() is None
        # non-integer pids and times from a crafted record are refused, never compared or signalled
        assert not Recorded("role x", socket.gethostname(), "1", time.time(), run).alive()[0]
        assert not Recorded("role x", socket.gethostname(), foreign.pid, "soon", run).alive()[0]
        assert not Recorded("role x", socket.gethostname(), 1, future, run).alive()[0]
    finally:
        foreign.kill()
        other_role.kill()


def test_a_launcher_is_recognised_by_the_lock_it_holds(tmp_path):
    code = ("import fcntl, sys, time; f = open(sys.argv[1], 'a+'); fcntl.flock(f, fcntl.LOCK_EX); "
            "print('locked', flush=True); time.sleep(60)")
    p = subprocess.Popen([sys.executable, "-c", code, str(tmp_path / "launcher.lock")], stdout=subprocess.PIPE,
                         text=True)
    try:
        assert p.stdout.readline().strip() == "locked"
        assert Recorded("launcher", socket.gethostname(), p.pid, time.time(), tmp_path).alive() == (True, "")
        ok, why = Recorded("launcher", socket.gethostname(), p.pid, time.time(), tmp_path / "x").alive()
        assert not ok and "not this run's launcher" in why
    finally:
        p.kill()


def test_an_exited_unreaped_process_is_not_alive():
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    time.sleep(1.0)  # exited; not waited for, so a zombie until we reap it
    assert open(f"/proc/{p.pid}/stat").read().split(") ")[1][0] == "Z"
    assert process_start_time(p.pid) is None
    p.wait()


def test_a_second_launcher_is_refused_and_writes_nothing(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    import fcntl
    with open(run / "launcher.lock", "a+") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        r = subprocess.run([*LAUNCH, "run", f"run_dir={run}"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "another launcher holds launcher.lock" in r.stderr, r.stderr
    assert not (run / "config.yaml").exists()
    # the lock is free, but a role of the earlier launch still runs: refused too
    p = _sleeper(run)
    try:
        LocalLauncher(host=socket.gethostname(), pid=999999, started=time.time(), roles={"trainer": p.pid}).write(run)
        r = subprocess.run([*LAUNCH, "run", f"run_dir={run}"], capture_output=True, text=True, timeout=60)
        assert r.returncode == 2 and f"role trainer (pid {p.pid})" in r.stderr, r.stderr
        assert len(r.stderr.strip().splitlines()) == 1
        assert not (run / "config.yaml").exists()
    finally:
        p.kill()


def test_cancel_signals_recorded_roles_only_while_they_are_theirs(tmp_path):
    from builders import make_run_dir
    run = tmp_path / "run"
    make_run_dir(run)
    live, reused = _sleeper(run), _sleeper(run)
    try:
        LocalLauncher(host=socket.gethostname(), pid=999999, started=time.time(),
                      roles={"trainer": live.pid}).write(run)
        # a role recorded long ago whose pid now belongs to a younger process
        (run / "roles").mkdir(exist_ok=True)
        import json
        (run / "roles" / "orchestrator.json").write_text(json.dumps(
            {"role": "orchestrator", "host": socket.gethostname(), "pid": reused.pid, "time": time.time() - 3600}))
        r = subprocess.run([*LAUNCH, "cancel", str(run)], capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stderr
        assert live.wait(10) == -signal.SIGTERM
        assert reused.poll() is None and "reused" in r.stdout, r.stdout
    finally:
        live.kill()
        reused.kill()


def _local_plan(tmp_path, *overrides):
    from builders import compose_cfg
    from launch.plan import make_plan
    return make_plan(compose_cfg(tmp_path / "run", *overrides))


def test_cpu_split_gives_servers_and_trainer_their_own_cores(tmp_path):
    """A local run divides the host's cores (launch.local.cpu_split): the servers' OpenMP threads bound to
    the first half, the trainer's thread count the rest, one thread for the orchestrator; a user's own
    setting wins. What vLLM made of the binding is checked on a real server in test_local_run."""
    from launch.local import cpu_split
    plan = _local_plan(tmp_path)
    env, said = cpu_split(plan, [0, 1], {})
    assert env["inference_0"] == {"VLLM_CPU_OMP_THREADS_BIND": "0"}
    assert env["trainer"] == {"OMP_NUM_THREADS": "1"} and env["orchestrator"] == {"OMP_NUM_THREADS": "1"}
    assert said == "cpus (2): inference on cpu 0, trainer 1 thread(s) per rank"
    env, _ = cpu_split(plan, list(range(4, 12)), {})          # 8 cores of an affinity mask
    assert env["inference_0"]["VLLM_CPU_OMP_THREADS_BIND"] == "4,5,6,7" and env["trainer"]["OMP_NUM_THREADS"] == "4"
    env, _ = cpu_split(plan, [3], {})                         # one core: everything time-shares it
    assert env["inference_0"]["VLLM_CPU_OMP_THREADS_BIND"] == "3" and env["trainer"]["OMP_NUM_THREADS"] == "1"
    env, said = cpu_split(plan, [0, 1], {"OMP_NUM_THREADS": "2", "VLLM_CPU_OMP_THREADS_BIND": "1"})
    assert all(not e for e in env.values()) and said == ""
    two = _local_plan(tmp_path, "inference.replicas=2")
    env, _ = cpu_split(two, list(range(8)), {})
    assert [env[f"inference_{i}"]["VLLM_CPU_OMP_THREADS_BIND"] for i in (0, 1)] == ["0,1", "2,3"]


def test_a_dead_engine_core_is_named_with_its_cause(tmp_path):
    """A dead vLLM engine answers HTTP 500 to the orchestrator, which fails first; the launcher names the
    cause from the server's log (lines in vLLM 0.32's format, as a CPU engine died in CI)."""
    from rl.contract.vllm_log import engine_deaths
    w, e = "(Worker pid=7) ERROR 12-04 18:39:58 [multiproc_executor.py:1063]", "(EngineCore pid=5) ERROR 12-04 18:39:58 [core.py:1512]"
    (tmp_path / "inference_0.vllm.log").write_text("\n".join([
        "INFO:     127.0.0.1:1 - \"POST /inference/v1/generate HTTP/1.1\" 200 OK",
        f"{w} Traceback (most recent call last):", f"{w} RuntimeError: CPU Generator does not use offset",
        f"{e} EngineCore encountered a fatal error.", f"{e} Traceback (most recent call last):",
        f"{e}     raise RuntimeError(",
        f"{e} RuntimeError: Worker failed with error 'CPU Generator does not use offset', please check",
        "(APIServer pid=3) ERROR 12-04 18:39:58 [async_llm.py:906] vllm.v1.engine.exceptions.EngineDeadError: x",
    ]) + "\n")
    (tmp_path / "inference_1.vllm.log").write_text("INFO all well\n")
    ((server, line),) = engine_deaths(tmp_path).items()
    assert server == "inference_0"
    assert line.startswith("RuntimeError: Worker failed with error 'CPU Generator does not use offset'") \
        and line.endswith("inference_0.vllm.log:7)")
