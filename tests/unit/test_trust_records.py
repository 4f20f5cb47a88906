"""Every record that names a command, an address, a pid or a grade is obeyed only if this run's user
wrote it (issue 49, docs/run-directory-safety.md): a record planted by someone else (owned by another uid)
or edited through a mode others can write (chmod 666) is refused by its real reader, in one line naming
the file and why, and nothing it names is contacted, signalled, loaded or run.

The address records are pointed at a plain TCP listener (it accepts and records whatever bytes arrive):
the router's server poll, the orchestrator's server view (which pauses servers and loads weights into
them), the orchestrator's wait for the router and the sandbox pool's service lookup must never connect to
it, so the run's secret never reaches it; a record that passes, pointed at a second listener, does get the
secret (the control: the same reader, the same run). Tests run as root, so "planted" is a chown to
nobody (65534) and "edited" a chmod 666 of a record the run wrote.
"""
from __future__ import annotations

import asyncio
import os
import shutil
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest

from builders import make_run_dir

from rl.contract import paths
from rl.contract.records import (LocalLauncher, RecordError, ReplicaStart, ResumeState, RoleRecord,
                                 RouterRecord, SandboxServiceRecord, ServerRecord)
from rl.contract.secret import read_secret

NOBODY = 65534
# how a record is spoiled -> what its refusal says
HOWS = {"planted": f"owned by uid {NOBODY}", "edited": "mode 0666, writable by group or others"}


def spoil(path, how: str) -> None:
    """Make the record at `path` someone else's (planted) or writable by others (edited)."""
    if how == "planted":
        os.chown(path, NOBODY, NOBODY)
    else:
        os.chmod(path, 0o666)


def one_line_naming(text: str, name: str, how: str) -> None:
    assert "\n" not in text.strip() and name in text and HOWS[how] in text, text


class Listener:
    """A plain TCP listener standing for the address a planted record names: it accepts every connection
    and records the bytes that arrive (a connection is closed after 0.3 s of silence, unanswered)."""

    def __init__(self):
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.connections, self.data, self._lock = 0, b"", threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            with self._lock:
                self.connections += 1
            threading.Thread(target=self._read, args=(conn,), daemon=True).start()

    def _read(self, conn) -> None:
        conn.settimeout(0.3)
        with conn:
            while True:
                try:
                    b = conn.recv(65536)
                except OSError:
                    return
                if not b:
                    return
                with self._lock:
                    self.data += b

    def received(self, needle: bytes, timeout: float = 5.0) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self._lock:
                if needle in self.data:
                    return True
            time.sleep(0.05)
        return False

    def close(self) -> None:
        try:
            self.sock.shutdown(socket.SHUT_RDWR)   # wakes the accept
        except OSError:
            pass
        self.sock.close()


@pytest.fixture
def listener():
    made = []

    def make() -> Listener:
        made.append(Listener())
        return made[-1]
    yield make
    for x in made:
        x.close()


@pytest.fixture(scope="module")
def base_runs(tmp_path_factory):
    """Frozen run directories, made once: a Slurm plan with the router and two servers, and a local run."""
    root = tmp_path_factory.mktemp("trust")
    make_run_dir(root / "slurm", "cluster=slurm", "inference.host=127.0.0.1", "inference.router=true",
                 "inference.replicas=2", "inference.startup_timeout_s=30", "wandb.mode=disabled")
    make_run_dir(root / "local", "wandb.mode=disabled")
    return root


@pytest.fixture
def run(base_runs, tmp_path):
    dst = tmp_path / "run"
    shutil.copytree(base_runs / "slurm", dst, symlinks=True)
    return dst


@pytest.fixture
def local_run(base_runs, tmp_path):
    dst = tmp_path / "local"
    shutil.copytree(base_runs / "local", dst, symlinks=True)
    return dst


def _server(run_dir, index: int, url: str) -> None:
    ServerRecord(url=url, version=0, host=socket.gethostname(), pid=os.getpid(), index=index).write(run_dir)


# -- addresses: the run's secret goes only where a record that passes points ---------------------------
@pytest.mark.parametrize("how", HOWS)
def test_the_router_polls_only_servers_whose_record_passes(run, listener, how):
    """A planted server_<i>.json got the run's secret on the router's first /metrics poll and its share
    of the generation; now it is absent, said once however often the router looks."""
    from rl.inference.proxy import Router
    from rl.contract.routing import RouterConfig
    secret = read_secret(run)
    good, bad = listener(), listener()
    _server(run, 0, good.url)
    _server(run, 1, bad.url)
    spoil(paths.server_record(run, 1), how)
    lines: list[str] = []

    async def case():
        router = Router([], RouterConfig(poll_interval_s=60), secret=secret, run_dir=run, log=lines.append)
        await router.start("127.0.0.1", 0)   # discovers the servers and polls them once
        try:
            await router.poll_once()
        finally:
            await router.stop()
        return router
    router = asyncio.run(case())
    assert sorted(router.backends) == ["inference_0"]
    assert good.received(f"Bearer {secret}".encode())   # the control: a record that passes is polled
    assert bad.connections == 0 and secret.encode() not in bad.data
    said = [ln for ln in lines if "server_1.json" in ln]
    assert len(said) == 1, lines
    one_line_naming(said[0], "inference/server_1.json", how)


@pytest.mark.parametrize("how", HOWS)
def test_the_orchestrator_pauses_and_loads_weights_only_into_servers_whose_record_passes(run, listener,
                                                                                      capsys, how):
    """The orchestrator's server view added planted servers to those it pauses and loads weights into."""
    from rl.contract.config import load as load_config
    from rl.orchestrator.client import InferenceError
    from rl.orchestrator.loop import Orchestrator
    secret = read_secret(run)
    good, bad = listener(), listener()
    _server(run, 0, good.url)
    _server(run, 1, bad.url)
    spoil(paths.server_record(run, 1), how)
    orch = Orchestrator(run, load_config(run))
    assert {i: c.url for i, c in orch._up_clients().items()} == {0: good.url}
    with pytest.raises(InferenceError):   # the listener answers nothing: the load fails, on server 0 only
        asyncio.run(orch._update_to(1))
    assert good.received(b"POST /pause") and good.received(f"Bearer {secret}".encode())   # the control
    assert bad.connections == 0 and secret.encode() not in bad.data
    said = [ln for ln in capsys.readouterr().out.splitlines() if "server_1.json" in ln]
    assert len(said) == 1   # read at every look, said once
    one_line_naming(said[0], "inference/server_1.json", how)


@pytest.mark.parametrize("how", HOWS)
def test_the_orchestrator_never_takes_a_router_record_it_did_not_write(run, listener, capsys, how):
    """A planted router.json (another host, pid 1) passed the stale check and got all generation with the
    secret; now the wait refuses it, says so once and ends at its own timeout naming the refusal."""
    from rl.orchestrator.client import wait_for_router
    bad = listener()
    RouterRecord(url=bad.url, host="elsewhere", port=int(bad.url.rsplit(":", 1)[1]), pid=1).write(run)
    spoil(paths.router_record(run), how)
    t0 = time.monotonic()
    with pytest.raises(TimeoutError) as e:
        asyncio.run(wait_for_router(run, timeout=1.5))
    assert time.monotonic() - t0 < 5
    one_line_naming(str(e.value), "inference/router.json", how)
    said = [ln for ln in capsys.readouterr().out.splitlines() if "router.json" in ln]
    assert len(said) == 1   # ~4 reads, one line
    one_line_naming(said[0], "inference/router.json", how)
    assert bad.connections == 0
    # the same record written by the run's user is taken (the control)
    os.unlink(paths.router_record(run))
    RouterRecord(url=bad.url, host="elsewhere", port=1, pid=1).write(run)
    assert asyncio.run(wait_for_router(run, timeout=5)) == bad.url


@pytest.mark.parametrize("how", HOWS)
def test_the_sandbox_pool_sends_the_secret_and_takes_grades_only_from_services_whose_record_passes(
        run, listener, capsys, how):
    """A planted sandboxes/service_<i>.json got the secret and set an episode's reward: now the pool finds
    no usable record for that service (one line, naming it) and connects to nothing."""
    from rl.envs.swe.runtime_remote import ServicePool
    from rl.envs.swe.sandbox import SandboxError
    secret = read_secret(run)
    good, bad = listener(), listener()
    for i, url in enumerate((bad.url, good.url)):
        SandboxServiceRecord(url=url, host=socket.gethostname(), node="n", pid=os.getpid(), index=i,
                             runtime="local").write(run)
    spoil(paths.sandbox_service_record(run, 0), how)
    pool = ServicePool(str(run), 2, secret, wait_s=1.0)
    try:
        with pytest.raises(SandboxError) as e:
            pool.open("task-1")   # the least loaded service is 0, the refused one
        one_line_naming(str(e.value), "sandboxes/service_0.json", how)
        # the control: service 1's record passes and gets the secret (the listener answers nothing)
        with pytest.raises(httpx.HTTPError):
            pool.request(1, "POST", "/sandboxes", timeout_s=1.0, json={"instance_id": "task-1"})
        assert good.received(f"Bearer {secret}".encode())
    finally:
        pool.close()
    assert bad.connections == 0 and secret.encode() not in bad.data
    said = [ln for ln in capsys.readouterr().out.splitlines() if "service_0.json" in ln]
    assert len(said) == 1
    one_line_naming(said[0], "sandboxes/service_0.json", how)


# -- pids: nothing a refused record names is signalled ---------------------------------------------------
@pytest.fixture
def sleeper():
    p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    yield p
    p.kill()
    p.wait()


@pytest.mark.parametrize("how", HOWS)
def test_cancel_signals_nothing_a_refused_local_record_names(local_run, sleeper, capsys, how):
    from launch.local import cancel_command, recorded_processes
    LocalLauncher(host=socket.gethostname(), pid=sleeper.pid, started=time.time() - 5,
                  roles={"trainer": sleeper.pid}).write(local_run)
    spoil(paths.p(local_run, paths.LOCAL_PIDS), how)
    assert cancel_command(local_run) == 1
    err = capsys.readouterr().err
    one_line_naming(err, "local.json", how)
    assert "nothing signalled" in err
    time.sleep(0.2)
    assert sleeper.poll() is None
    with pytest.raises(RecordError):
        recorded_processes(local_run)


@pytest.mark.parametrize("how", HOWS)
def test_status_names_a_refused_role_record_and_cancel_does_not_take_it(local_run, sleeper, capsys, how):
    from launch.local import recorded_processes
    from launch.status import status
    RoleRecord(role="trainer", host=socket.gethostname(), pid=sleeper.pid,
               time=time.time() - 5).write(local_run)
    spoil(paths.role_record(local_run, "trainer"), how)
    st = status(local_run)
    assert "trainer" not in st["roles"]
    said = [ln for ln in st["unreadable"] if "trainer.json" in ln]
    assert len(said) == 1
    one_line_naming(said[0], "roles/trainer.json", how)
    capsys.readouterr()
    assert sleeper.pid not in [r.pid for r in recorded_processes(local_run)]
    err = [ln for ln in capsys.readouterr().err.splitlines() if "trainer.json" in ln]
    assert len(err) == 1 and "not counted as one of this run's processes" in err[0], err
    one_line_naming(err[0], "roles/trainer.json", how)


# -- versions, epochs and what a replica's nodes load ------------------------------------------------------
@pytest.mark.parametrize("how", HOWS)
def test_a_replica_node_never_loads_what_a_refused_start_record_names(run, capsys, how):
    from rl.inference import server
    from rl.runtime import StopFlag
    ReplicaStart(version=7, fp8=True, restart=0, job=os.environ.get("SLURM_JOB_ID")).write(run, 0)
    spoil(paths.replica_start_record(run, 0), how)
    with pytest.raises(RecordError) as e:
        ReplicaStart.read(run, 0)
    one_line_naming(str(e.value), "inference/replica_0.start.json", how)
    stop = StopFlag(install=False)
    threading.Timer(1.0, stop.set).start()
    assert server._wait_start(run, 0, stop) is None   # waited for a record of its own, never took this one
    said = [ln for ln in capsys.readouterr().out.splitlines() if "replica_0.start.json" in ln and "refused" in ln]
    assert len(said) == 1, said   # said once, not at every poll
    one_line_naming(said[0], "inference/replica_0.start.json", how)


@pytest.mark.parametrize("how", HOWS)
def test_a_refused_resume_record_is_the_answer_not_the_epoch(local_run, how):
    from launch.status import status
    from rl.runtime import resume_state
    ResumeState(checkpoint_step=3, restart=9).write(local_run)
    spoil(paths.resume_file(local_run), how)
    for read in (resume_state, status):
        with pytest.raises(RecordError) as e:
            read(local_run)
        one_line_naming(str(e.value), "resume.json", how)


@pytest.mark.parametrize("how", HOWS)
def test_a_refused_reload_report_fails_the_reload_naming_it(tmp_path, how):
    from rl.inference.worker_ext import write_report
    from rl.orchestrator.client import InferenceError, collect_reports
    write_report(tmp_path, 0, 0, {"version": 4, "previous_version": 3, "loaded": True, "in_flight": {}})
    spoil(tmp_path / "dp0000-rank0000.json", how)
    with pytest.raises(InferenceError) as e:
        collect_reports(tmp_path, 1, "http://x", 4)
    one_line_naming(str(e.value), "dp0000-rank0000.json", how)


def test_a_weight_load_never_removes_reports_through_a_planted_reloads_link(run, tmp_path):
    """The reload emptied `inference/reloads/server_<i>` with shutil.rmtree before safefs was asked: through
    a planted `inference/reloads` link that removed a directory elsewhere. Now it is refused (one line) and
    the servers are resumed."""
    from test_router_http import FakeServer

    from rl.contract.safefs import UnsafePath
    from rl.orchestrator.client import InferenceClient
    victim, reports = tmp_path / "victim", run / "inference" / "reloads" / "server_0"
    (victim / "server_0").mkdir(parents=True)
    (victim / "server_0" / "precious").write_text("keep")
    os.symlink(victim, run / "inference" / "reloads")

    async def case():
        fake = await FakeServer("inference_0").start()
        try:
            async with InferenceClient(fake.url) as c:
                with pytest.raises(UnsafePath) as e:
                    await c.update_weights("/nonexistent", 1, report_dir=reports, workers=1)
            return fake.calls, str(e.value)
        finally:
            await fake.runner.cleanup()
    calls, err = asyncio.run(case())
    assert (victim / "server_0" / "precious").read_text() == "keep"
    assert "\n" not in err and "reloads: a symlink" in err
    assert [c[0] for c in calls] == ["/pause", "/resume"]


# -- commands: the plan -----------------------------------------------------------------------------------
@pytest.mark.parametrize("how", HOWS)
def test_a_refused_plan_runs_nothing(run, how):
    from rl.contract.plan import Plan, PlanFormatError
    spoil(paths.plan_file(run), how)
    with pytest.raises(PlanFormatError) as e:
        Plan.read(run)
    one_line_naming(str(e.value), "plan.json", how)


def test_the_router_refuses_a_run_directory_others_can_write_in_one_line(run, capsys):
    """The router is an entry point of its own (not rl.runtime.parse_role_args): the same check."""
    from rl.inference.router import _parse
    os.chmod(run, 0o777)
    try:
        with pytest.raises(SystemExit) as e:
            _parse(["--run-dir", str(run)])
    finally:
        os.chmod(run, 0o755)
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert "mode 0777, writable by group or others" in err[-1] and str(run) in err[-1]
