"""The batch script template on a real (localhost, 4-node) Slurm, with dummy roles instead of RL.

The plan of the debug experiment (1 trainer node, 2 inference nodes) is rendered with every role's
command replaced by this file run as a script (`dummy_role` below), which records where it ran and then
behaves as told: finish, crash, or wait for a stop signal and exit with EXIT_PREEMPTED (3) like a role
that checkpointed. This proves the template itself: het groups on distinct nodes, per-role logs, a crash
releasing the allocation, USR1 to the batch script leading to `scontrol requeue`, partition preemption.
"""
from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

import pytest

from launch import slurm as ls
from launch.plan import make_plan
from rl.contract.plan import Plan

pytestmark = pytest.mark.slurm
THIS = str(Path(__file__).resolve())


def dummy_role(name: str, mode: str) -> int:
    got = []
    for sig in (signal.SIGTERM, signal.SIGUSR1):
        signal.signal(sig, lambda s, f: got.append(signal.Signals(s).name))
    run_dir = Path(os.environ["HETRL_RUN_DIR"])
    restart = int(os.environ.get("SLURM_RESTART_COUNT", "0") or 0)
    rec = {k: os.environ.get(k) for k in ("SLURMD_NODENAME", "HETRL_HET_GROUP", "HETRL_ROLE", "SLURM_JOB_ID",
                                          "HETRL_TRAINER_ADDR", "HETRL_ROLE_ADDR", "SLURM_PROCID",
                                          "HETRL_INCARNATION")}
    rec.update(name=name, restart=restart, pid=os.getpid())
    (run_dir / "roles").mkdir(exist_ok=True)
    (run_dir / "roles" / f"{name}.{restart}.{rec['SLURM_PROCID']}.json").write_text(json.dumps(rec))
    print(f"{name} running on {rec['SLURMD_NODENAME']} (restart {restart})", flush=True)
    if mode in ("wait", "terminated", "crash_on_stop") and restart > 0:
        mode = "ok"
    if mode == "terminated":  # what srun reports for a step slurmstepd cancelled on preemption: 143
        time.sleep(1)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGTERM)
    if mode == "ok":
        time.sleep(1)
        return 0
    if mode == "crash":
        time.sleep(1)
        print(f"{name}: simulated crash", flush=True)
        return 7
    deadline = time.monotonic() + 120  # mode "wait": until asked to stop
    while not got and time.monotonic() < deadline:
        time.sleep(0.1)
    (run_dir / f"signalled.{name}").write_text(",".join(got))
    print(f"{name}: {got} received, checkpointing", flush=True)
    time.sleep(0.5)
    if mode == "crash_on_stop":
        print(f"{name}: simulated crash while checkpointing", flush=True)
        return 7
    if name == "trainer":  # a real checkpoint step, for the real rl.requeue in the batch script
        from rl import exchange
        exchange.publish(run_dir, "checkpoints", 1 + restart, lambda d: (d / "state").write_text(name),
                         producer=name)
    (run_dir / f"checkpointed.{name}").write_text("ok")
    return 3


def dummy_plan(run_dir: Path, modes: dict[str, str], **cluster) -> tuple[dict, dict]:
    from launch.compose import compose
    cfg = compose(["cluster=slurm", "inference.nodes=2", "inference.replicas=2", f"run_dir={run_dir}",
                   "cluster.signal_grace_s=15", "cluster.time=00:05:00"])
    cfg["cluster"].update(cluster)
    plan = make_plan(cfg).to_dict()   # plan.json's form: the commands are rewritten below
    for r in plan["roles"]:
        r["command"] = [sys.executable, THIS, r["name"], modes.get(r["name"], "ok")]
        r["env"]["PYTHONPATH"] = plan["workdir"]
    # prepare's contract with the batch script: resume.json with the incarnation's restart count
    plan["prepare"]["command"] = ["bash", "-c", f"echo prepared >> {run_dir}/prepared && "
                                  f"echo '{{\"restart\": 0}}' > {run_dir}/resume.json"]
    return cfg, plan


def submit(run_dir: Path, modes: dict[str, str], **cluster) -> str:
    import yaml
    cfg, plan = dummy_plan(run_dir, modes, **cluster)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(yaml.safe_dump({k: v for k, v in cfg.items() if k != "_overrides"}))
    (run_dir / "plan.json").write_text(json.dumps(plan))
    (run_dir / "job.sbatch").write_text(ls.render_script(Plan.from_dict(plan), cfg))
    return ls.submit(run_dir, run_dir / "job.sbatch")


def wait_state(job: str, states: tuple[str, ...], timeout: float) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        st = ls.job_state(job)
        if st["state"] in states:
            return st
        time.sleep(0.3)
    raise AssertionError(f"job {job} not in {states} after {timeout}s: {ls.job_state(job)}")


def wait_file(path: Path, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert time.monotonic() < deadline, f"{path} did not appear in {timeout}s"
        time.sleep(0.2)


def records(run_dir: Path) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted((run_dir / "roles").glob("*.json"))]


def batch_log(run_dir: Path, job: str) -> str:
    p = run_dir / "logs" / f"slurm-{job}.out"
    return p.read_text() if p.exists() else ""


def test_hetjob_groups_on_distinct_nodes_and_logs(slurm, tmp_path):
    run_dir = tmp_path / "run"
    job = submit(run_dir, {})
    st = wait_state(job, ("COMPLETED", "FAILED", "CANCELLED"), 60)
    assert st["state"] == "COMPLETED", batch_log(run_dir, job)
    recs = {r["name"]: r for r in records(run_dir)}
    assert set(recs) == {"trainer", "inference_0", "inference_1", "orchestrator"}
    assert recs["trainer"]["HETRL_HET_GROUP"] == "0" and recs["orchestrator"]["HETRL_HET_GROUP"] == "1"
    trainer_node = recs["trainer"]["SLURMD_NODENAME"]
    inf_nodes = {recs["inference_0"]["SLURMD_NODENAME"], recs["inference_1"]["SLURMD_NODENAME"]}
    assert len(inf_nodes) == 2 and trainer_node not in inf_nodes
    assert recs["orchestrator"]["SLURMD_NODENAME"] == recs["inference_0"]["SLURMD_NODENAME"]
    assert recs["trainer"]["HETRL_TRAINER_ADDR"] == trainer_node
    assert recs["inference_1"]["HETRL_ROLE_ADDR"] == recs["inference_1"]["SLURMD_NODENAME"]
    for name in recs:
        assert f"{name} running on" in (run_dir / "logs" / f"{name}.log").read_text()
    assert (run_dir / "prepared").read_text() == "prepared\n"
    assert "all roles exited" in batch_log(run_dir, job)


def test_crashed_role_releases_the_allocation(slurm, tmp_path):
    """A trainer that crashes before any checkpoint ends the job at once and frees every node (a crashed
    inference role is restarted in place instead: tests/unit/test_batch_supervisor.py, test_slurm_elastic)."""
    run_dir = tmp_path / "run"
    t0 = time.monotonic()
    job = submit(run_dir, {"trainer": "crash", "inference_0": "wait", "orchestrator": "wait",
                           "inference_1": "wait"})
    st = wait_state(job, ("COMPLETED", "FAILED", "CANCELLED"), 60)
    assert st["state"] == "FAILED", batch_log(run_dir, job)
    assert time.monotonic() - t0 < 30
    log = batch_log(run_dir, job)
    assert "trainer crashed (status 7" in log and "not requeueing: this incarnation" in log, log
    assert "simulated crash" in (run_dir / "logs" / "trainer.log").read_text()
    # every node is free again
    deadline = time.monotonic() + 20
    while slurm.run("sinfo", "-h", "-p", "debug", "-t", "idle", "-o", "%D").stdout.strip() != "4":
        assert time.monotonic() < deadline, slurm.run("sinfo").stdout
        time.sleep(0.3)


def _assert_requeued_and_completed(slurm, run_dir: Path, job: str, expect_signal: str | None) -> None:
    st = wait_state(job, ("COMPLETED", "FAILED", "CANCELLED"), 120)
    log = batch_log(run_dir, job)
    assert st["state"] == "COMPLETED", log
    assert st["restarts"] >= 1, st
    assert "requeueing job" in log, log
    recs = records(run_dir)
    restarts = {r["restart"] for r in recs}
    assert 0 in restarts and 1 in restarts, recs
    for name in ("trainer", "orchestrator", "inference_0", "inference_1"):
        assert (run_dir / f"checkpointed.{name}").exists(), name  # not killed while "checkpointing"
        sig = (run_dir / f"signalled.{name}").read_text()
        if expect_signal:
            assert expect_signal in sig, (name, sig)
        else:
            assert sig, name


def test_usr1_to_batch_script_checkpoints_and_requeues(slurm, tmp_path):
    run_dir = tmp_path / "run"
    modes = {n: "wait" for n in ("trainer", "inference_0", "inference_1", "orchestrator")}
    job = submit(run_dir, modes)
    wait_state(job, ("RUNNING",), 30)
    for name in modes:
        wait_file(run_dir / "roles" / f"{name}.0.0.json", 30)
    ls.cancel(job, signal="USR1", batch=True)
    _assert_requeued_and_completed(slurm, run_dir, job, "SIGUSR1")
    assert "SIGUSR1: asking the roles" in batch_log(run_dir, job)


def test_partition_preemption_requeues(slurm, tmp_path):
    run_dir = tmp_path / "run"
    modes = {n: "wait" for n in ("trainer", "inference_0", "inference_1", "orchestrator")}
    job = submit(run_dir, modes)
    wait_state(job, ("RUNNING",), 30)
    for name in modes:
        wait_file(run_dir / "roles" / f"{name}.0.0.json", 30)
    high = slurm.run("sbatch", "--parsable", "-p", "high", "-N", "4", "--exclusive",
                     f"--output={tmp_path}/high.out", "--wrap", "sleep 2").stdout.strip()
    _assert_requeued_and_completed(slurm, run_dir, job, "SIGTERM")
    assert ls.job_state(high)["state"] == "COMPLETED"


def test_a_role_failing_while_it_stops_is_not_requeued(slurm, tmp_path):
    run_dir = tmp_path / "run"
    modes = {"trainer": "crash_on_stop", "inference_0": "wait", "inference_1": "wait", "orchestrator": "wait"}
    job = submit(run_dir, modes)
    wait_state(job, ("RUNNING",), 30)
    for name in modes:
        wait_file(run_dir / "roles" / f"{name}.0.0.json", 30)
    ls.cancel(job, signal="USR1", batch=True)
    st = wait_state(job, ("COMPLETED", "FAILED", "CANCELLED"), 120)
    log = batch_log(run_dir, job)
    assert st["state"] == "FAILED" and st["restarts"] == 0, log
    assert "trainer (status 7) failed while stopping: not requeueing" in log, log
    assert "requeueing job" not in log


def test_max_restarts_zero_stops_after_the_checkpoint_without_requeue(slurm, tmp_path):
    run_dir = tmp_path / "run"
    modes = {n: "wait" for n in ("trainer", "inference_0", "inference_1", "orchestrator")}
    job = submit(run_dir, modes, max_restarts=0)
    wait_state(job, ("RUNNING",), 30)
    for name in modes:
        wait_file(run_dir / "roles" / f"{name}.0.0.json", 30)
    ls.cancel(job, signal="USR1", batch=True)
    st = wait_state(job, ("COMPLETED", "FAILED", "CANCELLED"), 120)
    log = batch_log(run_dir, job)
    assert st["restarts"] == 0 and "requeueing job" not in log, log
    assert "not requeueing: this was restart 0 and cluster.max_restarts=0" in log, log
    assert (run_dir / "checkpoints" / "step_000001").is_dir()


def test_step_terminated_by_slurm_before_the_batch_shell_is_signalled_requeues(slurm, tmp_path):
    # On preemption slurmstepd cancels the steps; an srun can report "Terminated" (status 143) before the
    # batch shell gets its signal. That is a stop, not a crash: the job must requeue, not fail.
    run_dir = tmp_path / "run"
    modes = {"trainer": "wait", "inference_0": "wait", "inference_1": "wait", "orchestrator": "terminated"}
    job = submit(run_dir, modes)
    st = wait_state(job, ("COMPLETED", "FAILED", "CANCELLED"), 120)
    log = batch_log(run_dir, job)
    assert st["state"] == "COMPLETED" and st["restarts"] >= 1, log
    assert "orchestrator exited with status 143" in log and "requeueing job" in log, log
    for name in ("trainer", "inference_0", "inference_1"):
        assert (run_dir / f"checkpointed.{name}").exists(), name
    assert {r["restart"] for r in records(run_dir) if r["name"] == "orchestrator"} == {0, 1}


WRITER = """
import os, sys, time
dirs, stop = sys.argv[2:], sys.argv[1]
i = 0
while not os.path.exists(stop):  # new names all the time: an rm -rf keeps finding fresh entries
    for d in dirs:
        try:  # into the directory while it exists (a removed one is not made again)
            if not os.path.isdir(d + "/sub"):
                os.mkdir(d + "/sub")
            open(f"{d}/sub/f{i % 20000}", "w").close()
        except OSError:
            pass
    i += 1
"""


def test_node_local_cleanup_races_a_live_writer_and_never_fails_the_job(slurm, tmp_path):
    # The nodes of this cluster share one disk, like two het groups on one host; a process of an earlier
    # incarnation is still writing into each node's old node-local directory while the job starts. The
    # old template removed and recreated the run's one node-local directory from every node at once:
    # `rm` failed ("Directory not empty", "Is a directory") and the job ended FAILED.
    import subprocess
    from rl.contract import paths
    run_dir, base = tmp_path / "run", tmp_path / "node_local"
    local = Path(paths.node_local_dir(str(base), run_dir.absolute()))
    nodes = [f"n{i}" for i in range(1, 5)]
    busy = [local / f"{n}.j0.r0" for n in nodes]        # an earlier incarnation, still writing (Slurm
    # job ids start at 1: no job of this cluster has incarnation j0)
    dead = [local / f"{n}.j0.r1" for n in nodes]        # an earlier incarnation, gone
    for d in dead:
        (d / "model0").mkdir(parents=True)
        (d / "model0" / "config.json").write_text("{}")
    stop = tmp_path / "stop-writer"
    writer = subprocess.Popen([sys.executable, "-c", WRITER, str(stop), *map(str, busy)])
    try:
        time.sleep(1)
        job = submit(run_dir, {}, node_local_dir=str(base))
        st = wait_state(job, ("COMPLETED", "FAILED", "CANCELLED"), 90)
        log = batch_log(run_dir, job)
        assert st["state"] == "COMPLETED", log
        assert "all roles exited" in log, log
    finally:
        stop.touch()
        writer.wait(timeout=30)
    recs = records(run_dir)
    ran_on = {r["SLURMD_NODENAME"] for r in recs}
    assert len(ran_on) == 3, recs
    for r in recs:  # every role found its node's directory of this incarnation, made by the batch script
        assert r["HETRL_INCARNATION"] == paths.incarnation(job, 0), r
        env = {"SLURMD_NODENAME": r["SLURMD_NODENAME"], paths.INCARNATION_VAR: r["HETRL_INCARNATION"]}
        assert Path(paths.node_dir_from_env(str(local), env)).is_dir(), r
    for n in ran_on:
        i = nodes.index(n)
        assert not dead[i].exists(), f"{dead[i]}: an earlier incarnation's directory was not removed"
        # the live one: removed by a retry once the writer lost the race, or left with a warning
        assert not busy[i].exists() or f"warning: {n}: could not remove {busy[i]}" in log, log
    for n in set(nodes) - ran_on:  # a node not in the job: nobody touched its directories
        assert dead[nodes.index(n)].exists()


if __name__ == "__main__":  # a dummy role: python test_slurm_hetjob.py NAME MODE
    sys.exit(dummy_role(sys.argv[1], sys.argv[2]))
