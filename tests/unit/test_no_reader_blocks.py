"""No reader of the run directory blocks on a FIFO (issue 49).

Whoever opens a FIFO for reading waits until someone opens it for writing: a FIFO planted at plan.json
blocked `launch status` and the router's event loop, at inference/router.json the orchestrator's start
(past its own timeout), and among the reload reports a weight load while every server was paused. Here a
FIFO is planted at each record or run-directory file a role or `launch status` reads, and its real reader
is called in a thread bounded to 5 s (the router role and `launch status` as subprocesses): each must
return, or raise one line naming the file; none may block. A reader found blocked is released by opening
the FIFO for writing, so a failing test does not leave a thread hung.
"""
from __future__ import annotations

import asyncio
import os
import shutil
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from builders import make_run_dir

from rl.contract import paths

REPO = Path(__file__).resolve().parents[2]
LIMIT_S = 5.0


@pytest.fixture(scope="module")
def base_run(tmp_path_factory):
    run = tmp_path_factory.mktemp("fifo") / "run"
    make_run_dir(run, "cluster=slurm", "inference.host=127.0.0.1", "inference.router=true",
                 "inference.replicas=2", "inference.startup_timeout_s=30", "wandb.mode=disabled")
    return run


@pytest.fixture
def run(base_run, tmp_path):
    dst = tmp_path / "run"
    shutil.copytree(base_run, dst, symlinks=True)
    return dst


def plant_fifo(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    if os.path.lexists(path):
        os.unlink(path)
    os.mkfifo(path)
    return path


def _release(fifo: Path) -> None:
    """Open the FIFO for writing and close it: a reader blocked in open() (then read()) gets EOF."""
    for _ in range(50):
        try:
            os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        except OSError:
            pass
        threading.Event().wait(0.02)


def bounded(read, fifo: Path, *args):
    """Call `read(*args)` in a thread; fail if it is still running after LIMIT_S. Returns what it
    returned, or the exception it raised, whose message must be one line."""
    box: dict = {}

    def target():
        try:
            box["value"] = read(*args)
        except BaseException as e:  # noqa: BLE001  judged below
            box["error"] = e
    t = threading.Thread(target=target, daemon=True)
    t.start()
    t.join(LIMIT_S)
    if t.is_alive():
        _release(fifo)
        t.join(LIMIT_S)
        pytest.fail(f"{read.__name__.strip('_')} blocked on the FIFO at {fifo}")
    if "error" in box:
        msg = str(box["error"]).strip()
        assert "\n" not in msg, msg
        return box["error"]
    return box.get("value")


# -- what each role reads ----------------------------------------------------------------------------------
def _server_record(run, index=0):
    from rl.contract.records import ServerRecord
    ServerRecord(url="http://127.0.0.1:9", version=0, host=socket.gethostname(), pid=os.getpid(),
                 index=index).write(run)


def _plan(run):
    from rl.contract.plan import Plan
    return Plan.read(run)


def _server_view(run):
    from rl.orchestrator.servers import RunDirServers
    return RunDirServers(run).up()


def _router_poll(run):
    """The router's discovery and /metrics poll in run-directory mode (its event loop)."""
    from rl.inference.proxy import Router
    from rl.contract.routing import RouterConfig

    async def case():
        router = Router([], RouterConfig(poll_interval_s=60), run_dir=run, log=lambda m: None)
        await router.start("127.0.0.1", 0)
        await router.stop()
        return sorted(router.backends)
    return asyncio.run(case())


def _wait_for_router(run):
    from rl.orchestrator.client import wait_for_router
    return asyncio.run(wait_for_router(run, timeout=1.0))   # its own timeout, kept with a FIFO there


def _served_versions(run):
    from rl.exchange.retention import served_versions
    return served_versions(run)


def _servers_up(run):
    from rl.contract.elastic import servers_up
    return servers_up(_plan(run), run)


def _service_url(run):
    from rl.envs.swe.runtime_remote import ServicePool
    return ServicePool(str(run), 1, "x" * 64, wait_s=1.0).url(0)


def _collect_reports(run):
    from rl.orchestrator.client import collect_reports
    return collect_reports(run / "inference" / "reloads" / "server_0", 1, "http://x", 1)


def _local_launcher(run):
    from rl.contract.records import LocalLauncher
    return LocalLauncher.read(run)


def _local_job_status(run):
    from launch.local import job_status
    return job_status(run, [])


def _local_cancel(run):
    from launch.local import cancel_command
    return cancel_command(run)


def _resume(run):
    from rl.contract.records import ResumeState
    return ResumeState.read(run)


def _replica_start(run):
    from rl.contract.records import ReplicaStart
    return ReplicaStart.read(run, 0)


def _exit_record(run):
    from rl.contract.records import ExitRecord
    return ExitRecord.read(run)


def _roles(run):
    from rl.contract.records import RoleRecord
    return RoleRecord.read_all(run)


def _metrics(run):
    from rl.metrics import read_metrics
    return read_metrics(run)


def _eval_results(run):
    from rl.metrics import read_eval_results
    return read_eval_results(run)


def _consumed(run):
    from rl.exchange.steps import ConsumedLog
    return ConsumedLog(run, paths.ROLLOUTS, "trainer").steps()


def _given_up(run):
    from rl.contract.elastic import given_up
    return given_up(run)


def _server_indexes(run):
    from rl.contract.elastic import server_indexes
    return server_indexes(_plan(run), run)


def _extra_row(run):
    from rl.contract.elastic import read_row
    return read_row(run, 2)


def _draining(run):
    from rl.contract.elastic import draining
    return draining(run, 2)


def _secret(run):
    from rl.contract.secret import read_secret
    return read_secret(run)


def _config(run):
    from rl.contract.config import load
    return load(run)


def _slurm_job(run):
    from launch.slurm import current_job
    return current_job(run)


def _requeues(run):
    from launch.slurm import requeue_reasons
    return requeue_reasons(run, [])


def _status(run):
    from launch.status import status
    return status(run)


def _with_server_record(run):
    _server_record(run)


# (FIFO path in the run directory, readers, setup before the FIFO is planted)
CASES = {
    "plan": ("plan.json", [_plan, _server_view, _router_poll, _servers_up, _status], None),
    "router": ("inference/router.json", [_wait_for_router], None),
    "server": ("inference/server_0.json",
               [_server_view, _router_poll, _served_versions, _servers_up, _status], None),
    "service": ("sandboxes/service_0.json", [_service_url], None),
    "reload_report": ("inference/reloads/server_0/dp0000-rank0000.json", [_collect_reports, _served_versions],
                      _with_server_record),
    "local": ("local.json", [_local_launcher, _local_job_status, _local_cancel], None),
    "resume": ("resume.json", [_resume, _status], None),
    "replica_start": ("inference/replica_0.start.json", [_replica_start], None),
    "trainer_exit": ("roles/trainer.exit.json", [_exit_record], None),
    "role": ("roles/trainer.json", [_roles, _status], None),
    "metrics": ("metrics.jsonl", [_metrics, _status], None),
    "eval_results": ("eval/results.jsonl", [_eval_results], None),
    "consumed": ("rollouts/consumed.jsonl", [_consumed], None),
    "given_up": ("inference/given_up", [_given_up, _router_poll], None),
    "extra_row": ("inference/extra/replica_2.json", [_extra_row, _server_indexes, _router_poll, _server_view,
                                                        _status], None),
    "drain": ("inference/extra/drain_2", [_draining], None),
    "secret": ("secret", [_secret], None),
    "config": ("config.yaml", [_config], None),
    "slurm_jobs": ("slurm_jobs.jsonl", [_slurm_job, _status], None),
    "requeues": ("logs/requeues.log", [_requeues], None),
}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("case", CASES)
def test_no_reader_blocks_on_a_fifo(run, case):
    rel, readers, setup = CASES[case]
    if setup is not None:
        setup(run)
    fifo = plant_fifo(run / rel)
    for read in readers:
        bounded(read, fifo, run)


def test_a_weight_load_while_the_servers_are_paused_does_not_block_on_a_fifo_among_the_reports(run):
    """The reload reports are read after every worker answered, while the server is paused: a FIFO among
    them fails the reload in one line naming it, and the server is resumed."""
    from test_router_http import FakeServer

    from rl.orchestrator.client import InferenceClient, InferenceError
    reports = run / "inference" / "reloads" / "server_0"

    class Planting(FakeServer):
        async def admin(self, request):
            if request.path == "/collective_rpc":   # the workers wrote their reports; one is a FIFO
                plant_fifo(reports / "dp0000-rank0000.json")
            return await super().admin(request)

    async def case():
        fake = await Planting("inference_0").start()
        try:
            async with InferenceClient(fake.url) as c:
                try:
                    await c.update_weights("/nonexistent", 1, report_dir=reports, workers=1)
                except InferenceError as e:
                    return fake.calls, str(e)
            return fake.calls, None
        finally:
            await fake.runner.cleanup()
    calls, err = bounded(lambda: asyncio.run(case()), reports / "dp0000-rank0000.json")
    assert err is not None and "dp0000-rank0000.json" in err and "a FIFO" in err and "\n" not in err
    assert [c[0] for c in calls] == ["/pause", "/collective_rpc", "/resume"]


def _run_cli(args, fifo: Path, timeout: float = 20.0) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO), "HETRL_UNAUTHENTICATED": "1", "COLUMNS": "400"}
    try:
        return subprocess.run([sys.executable, *args], cwd=REPO, env=env, capture_output=True, text=True,
                              timeout=timeout)
    except subprocess.TimeoutExpired:
        _release(fifo)
        pytest.fail(f"{' '.join(args)} blocked on the FIFO at {fifo}")


@pytest.mark.timeout(120)
def test_launch_status_does_not_block_on_a_fifo_at_plan_json(run):
    fifo = plant_fifo(run / "plan.json")
    r = _run_cli(["-m", "launch", "status", str(run)], fifo)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "plan.json" in r.stdout and "a FIFO" in r.stdout


@pytest.mark.timeout(120)
def test_the_router_role_does_not_block_on_a_fifo_at_plan_json(run):
    fifo = plant_fifo(run / "plan.json")
    r = _run_cli(["-m", "rl.inference.router", "--run-dir", str(run)], fifo)
    assert r.returncode != 0
    last = r.stderr.strip().splitlines()[-1]
    assert "plan.json" in last and "a FIFO" in last, r.stderr[-2000:]
