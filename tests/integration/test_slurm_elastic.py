"""A failed part never ends the job (issue 43), and a run gains and drains a server, on the real localhost
Slurm with the real roles.

- vLLM's engine core is SIGKILLed mid-run: the inference role notices, withdraws its server record (the
  router marks the server down at once and holds the requests), exits, and the batch script's supervisor
  starts the same srun step again after its back-off; the restarted server loads the newest weights and
  writes a new record, the router takes it back, and the run finishes in the same incarnation (no
  requeue) with every rollout batch trained exactly once and the trainer never restarted.
- `launch scale +1` adds a server as its own job, the run uses both, `launch scale -1` drains it.
- an inference step cancelled for good (no in-place restart left) leaves the run on the other server.

The first two are one run (`elastic_run`, module scope): each start-up of a Slurm run costs about two
minutes here, and the phases are kept apart in time so each test can tell its own from the other's. The
engine core is killed first; the extra server is added only once the restarted one has its new record
and the trainer's wait for it is in the metrics; every observation a test uses is read from a phase
that ended before the next began (the trainer's waits from steps trained before it was stopped for the
scale-up, the router's lines by server name).
"""
from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest

from test_slurm_rl import FAST, _assert_complete_once, _history, _job_ended, _launch, _wait

from launch import slurm as ls
from rl.contract.records import ServerRecord
from rl.metrics import read_metrics

pytestmark = [pytest.mark.slurm, pytest.mark.slow]


def _children(pid: int) -> list[int]:
    out = []
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for t in tasks:
        try:
            out += [int(x) for x in Path(f"/proc/{pid}/task/{t}/children").read_text().split()]
        except OSError:
            pass
    return out


def _engine_core(server_pid: int) -> int | None:
    """The pid of the vLLM engine core under the API server `server_pid` (its process title names it)."""
    todo, seen = [server_pid], set()
    while todo:
        pid = todo.pop()
        if pid in seen:
            continue
        seen.add(pid)
        try:
            title = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            comm = Path(f"/proc/{pid}/comm").read_text()
        except OSError:
            continue
        if pid != server_pid and "EngineCore" in title + comm:
            return pid
        todo += _children(pid)
    return None


ELASTIC_STEPS = 12   # kill after 2 steps, back after the restart, scale-up, 3 steps on both, drain, finish


def _waits(run_dir: Path) -> list[float]:
    return [m["wait_s"] for m in read_metrics(run_dir) if "wait_s" in m]


@pytest.fixture(scope="module")
def elastic_run(slurm_cluster, tmp_path_factory):
    """One router run on one server, its two phases in sequence: (1) the engine core SIGKILLed after 2
    steps, awaited until the restarted server's record is up and a step after the kill waited for it (or
    the run ended); (2) the trainer held, `launch scale +1`, the extra server's record awaited, the trainer
    let go, 3 steps on both servers, `launch scale -1`, the extra job and then the run awaited to their
    end. Returns what each phase saw; the tests below assert on it."""
    import subprocess
    import sys
    from test_slurm_rl import REPO
    slurm_cluster.cancel_all()
    steps = ELASTIC_STEPS
    run_dir = tmp_path_factory.mktemp("elastic") / "run"
    _launch(f"run_dir={run_dir}", f"trainer.max_steps={steps}", "inference.router=true", *FAST)
    job = ls.current_job(run_dir)
    r = {"run_dir": run_dir, "job": job, "steps": steps}
    try:
        # phase 1: the engine core killed
        _wait(lambda: len(read_metrics(run_dir)) >= 2, 600, "2 trainer steps", run_dir)
        first = ServerRecord.read(run_dir, 0)
        engine = _wait(lambda: _engine_core(first.pid), 60, "the engine core process", run_dir)
        r["first"] = first
        r["killed_at"] = killed_at = len(read_metrics(run_dir))
        os.kill(engine, signal.SIGKILL)

        def back() -> bool:
            rec = ServerRecord.read(run_dir, 0)
            waited = max(_waits(run_dir)[killed_at:], default=0) >= 5
            return (rec is not None and rec.pid != first.pid and waited) \
                or (run_dir / "DONE").exists() or _job_ended(job) is not None
        _wait(back, 900, "the restarted server's record and a trainer step that waited for it", run_dir)
        if (run_dir / "DONE").exists() or _job_ended(job) is not None:   # the tests say what is missing
            r["stopped_at"] = len(read_metrics(run_dir))
            r["state"] = _wait(lambda: _job_ended(job), 900, "the run to finish", run_dir)
            return r

        # phase 2: a server gained and drained. The trainer is held while the extra server starts (vLLM
        # takes 60-90 s here), so the run cannot end before it joins; the orchestrator goes on up to its
        # off-policy bound meanwhile
        trainer = json.loads((run_dir / "roles" / "trainer.json").read_text())["pid"]
        r["stopped_at"] = len(read_metrics(run_dir))   # steps trained before the hold: phase 1's waits
        os.kill(trainer, signal.SIGSTOP)
        try:
            r["scale_up"] = out = subprocess.run(
                [sys.executable, "-m", "launch", "scale", str(run_dir), "--inference", "+1"], cwd=REPO,
                capture_output=True, text=True, timeout=60)
            assert out.returncode == 0, out.stderr + out.stdout
            extra = json.loads((run_dir / "inference" / "extra" / "replica_1.json").read_text())
            r["extra_job"] = extra_job = extra["job"]
            r["job_after_scale"] = ls.current_job(run_dir)
            r["first_version"] = _wait(lambda: ServerRecord.read(run_dir, 1), 600, "the extra server's record",
                                       run_dir).version
        finally:
            os.kill(trainer, signal.SIGCONT)
        joined_at = len(read_metrics(run_dir))
        _wait(lambda: len(read_metrics(run_dir)) >= joined_at + 3, 600, "3 more steps with both servers", run_dir)
        r["scale_down"] = subprocess.run(
            [sys.executable, "-m", "launch", "scale", str(run_dir), "--inference", "-1"], cwd=REPO,
            capture_output=True, text=True, timeout=60)
        r["extra_state"] = _wait(lambda: _job_ended(extra_job), 300, "the extra job to end after draining", run_dir)
        r["state"] = _wait(lambda: _job_ended(job), 900, "the run to finish", run_dir)
    finally:
        slurm_cluster.cancel_all()
    return r


@pytest.mark.timeout(1800)    # the shared run is set up inside whichever of the two runs first
def test_a_killed_engine_core_restarts_in_place_and_the_run_finishes_without_requeue(elastic_run):
    run_dir, job, steps = elastic_run["run_dir"], elastic_run["job"], elastic_run["steps"]
    first, killed_at, stopped_at = elastic_run["first"], elastic_run["killed_at"], elastic_run["stopped_at"]
    st = elastic_run["state"]
    assert st["state"] in ("COMPLETED", "GONE"), st
    _assert_complete_once(run_dir, steps)
    assert killed_at < steps, "the run ended before the kill: nothing was tested"

    # no requeue: one incarnation, the trainer started once, the inference role twice in it
    assert json.loads((run_dir / "resume.json").read_text())["restart"] == 0
    hist = _history(run_dir)
    assert len([h for h in hist if h["role"] == "trainer"]) == 1
    inference = [h for h in hist if h["role"] == "inference_0"]
    assert len(inference) == 2 and {h["slurm_restart_count"] for h in inference} == {0}
    pids = [h["extra"]["vllm_pid"] for h in inference]
    assert pids[0] == first.pid and pids[1] != first.pid
    assert ServerRecord.read(run_dir, 0).pid == pids[1]

    batch_log = (run_dir / "logs" / f"slurm-{job}.out").read_text(errors="replace")
    assert "inference_0 failed (status 1" in batch_log and "restarting inference_0 in place (1 of " in batch_log, \
        batch_log[-3000:]
    assert "requeueing" not in batch_log
    role_log = (run_dir / "logs" / "inference_0.log").read_text(errors="replace")
    # the role sees the death whichever way vLLM goes (each seen in CI runs): its log names the engine core's
    # death, its API server exits after the engine, or the API server's port refuses /health three times
    causes = ("engine core died", "vLLM (inference_0) exited with status", "server dead: its port refused /health")
    assert any(c in role_log for c in causes) and "server record withdrawn" in role_log, role_log[-3000:]
    # by name: the extra server's drain later marks inference_1 down too
    router_lines = (run_dir / "logs" / "router.log").read_text(errors="replace").splitlines()
    zero = [line for line in router_lines if "inference_0" in line]
    assert any("marked down" in line for line in zero) and any("up again" in line for line in zero), \
        "\n".join(router_lines[-40:])
    # the trainer's wait for the restarted server is in its metrics: a step after the kill waited at least
    # the supervisor's back-off (5 s), which no step of a healthy debug run comes near (measured: < 0.1 s).
    # Only steps trained before the scale-up's hold count: a step the hold interrupted waited through it
    waits = _waits(run_dir)
    print(f"trainer wait_s per step: {waits} (engine core killed after step {killed_at - 1}, "
          f"trainer held after step {stopped_at - 1})")
    assert killed_at < stopped_at and max(waits[killed_at:stopped_at]) >= 5, waits


def _step_of(run_dir: Path, role: str) -> str:
    """JOB.STEP of the srun step running `role` (from its process's environment). A step of het group g
    belongs to that component's job id, not the leader's (`scancel LEADER.STEP` cancelled the whole job)."""
    pid = json.loads((run_dir / "roles" / f"{role}.json").read_text())["pid"]
    env = dict(kv.split("=", 1) for kv in Path(f"/proc/{pid}/environ").read_bytes().decode().split("\0") if "=" in kv)
    job = env.get(f"SLURM_JOB_ID_HET_GROUP_{env['HETRL_HET_GROUP']}") or env["SLURM_JOB_ID"]
    return f"{job}.{env['SLURM_STEP_ID']}"


def _server_metrics(run_dir: Path) -> list[tuple[int, float]]:
    return [(m["step"], m["orchestrator/servers_up"]) for m in read_metrics(run_dir) if "orchestrator/servers_up" in m]


def test_an_inference_step_cancelled_for_good_leaves_the_run_on_the_other_server(slurm, tmp_path):
    steps = 6
    run_dir = tmp_path / "run"
    _launch(f"run_dir={run_dir}", f"trainer.max_steps={steps}", "inference.router=true", "inference.replicas=2",
            "cluster.max_role_restarts=0", "cluster.min_inference_fraction=0.5", *FAST)
    job = ls.current_job(run_dir)
    _wait(lambda: len(read_metrics(run_dir)) >= 2, 900, "2 trainer steps", run_dir)
    step = _step_of(run_dir, "inference_1")
    lost_at = len(read_metrics(run_dir))
    slurm.run("scancel", step)          # Slurm ends the step (TERM, then KILL): the server is gone for good
    st = _wait(lambda: _job_ended(job), 900, "the job to finish on the remaining server", run_dir)
    assert st["state"] in ("COMPLETED", "GONE"), st
    _assert_complete_once(run_dir, steps)
    assert lost_at < steps, "the run ended before the step was cancelled: nothing was tested"
    assert json.loads((run_dir / "resume.json").read_text())["restart"] == 0    # no requeue
    batch_log = (run_dir / "logs" / f"slurm-{job}.out").read_text(errors="replace")
    assert "given up; going on with 1 of 2 inference servers" in batch_log, batch_log[-3000:]
    assert ServerRecord.read(run_dir, 1) is None and ServerRecord.read(run_dir, 0) is not None
    ups = _server_metrics(run_dir)
    print(f"servers up per step: {ups} (inference_1 cancelled after step {lost_at - 1})")
    assert ups[0][1] == 2 and ups[-1][1] == 1          # the metrics say so (servers up / planned)
    assert all(m["orchestrator/servers_planned"] == 2 for m in read_metrics(run_dir) if "orchestrator/servers_planned" in m)


@pytest.mark.timeout(1800)
def test_a_run_gains_a_server_with_launch_scale_uses_both_and_finishes_after_it_drains(elastic_run):
    run_dir, job, steps = elastic_run["run_dir"], elastic_run["job"], elastic_run["steps"]
    assert "scale_up" in elastic_run, f"the run ended before the scale-up: nothing was tested: {elastic_run['state']}"
    out, extra_job = elastic_run["scale_up"], elastic_run["extra_job"]
    assert extra_job and extra_job != job and f"job {extra_job}" in out.stdout
    assert elastic_run["job_after_scale"] == job     # the run's own job is still the one status and cancel mean
    out = elastic_run["scale_down"]
    assert out.returncode == 0 and "draining inference_1" in out.stdout, out.stderr + out.stdout
    extra = elastic_run["extra_state"]
    assert extra["state"] in ("COMPLETED", "GONE"), extra
    st = elastic_run["state"]
    assert st["state"] in ("COMPLETED", "GONE"), st
    _assert_complete_once(run_dir, steps)
    # both servers answered requests, and the extra one loaded the versions the others did while it served
    for i in (0, 1):
        vlog = (run_dir / "logs" / f"inference_{i}.vllm.log").read_text(errors="replace")
        assert "POST /inference/v1/generate" in vlog, f"inference_{i} served no request"
    role_log = (run_dir / "logs" / "inference_1.log").read_text(errors="replace")
    assert "server record withdrawn (draining)" in role_log and "drained" in role_log, role_log[-2000:]
    # weight versions in step: the orchestrator loaded new versions into the extra server as into the others
    first_version = elastic_run["first_version"]
    reports = [json.loads(p.read_text()) for p in (run_dir / "inference" / "reloads" / "server_1").glob("*.json")]
    print(f"extra server's last reload reports: {reports}")
    assert reports and all("error" not in r and r["version"] > first_version for r in reports), reports
    ups = _server_metrics(run_dir)
    print(f"servers up per step: {ups}")
    assert max(u for _, u in ups) == 2 and ups[-1][1] == 1
