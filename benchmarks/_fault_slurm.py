"""Slurm-level fault kinds for benchmarks/fault_trials.py, on the localhost Slurm of tests/slurm_cluster.py.

A Slurm trial is `python -m launch run cluster=slurm ...` (one heterogeneous job rendered from
sbatch/job.sbatch.j2: the trainer on het group 0's node, vLLM and the orchestrator on group 1's), with
one fault at the Slurm level; the run must then end DONE through Slurm's own requeue or through
`python -m launch resume RUN_DIR`, as a user would run it. Kinds:

  slurm_kill_batch      SIGKILL to the batch shell (slurm_script) while the roles run: the job ends,
                        Slurm kills its steps; the harness resumes the run.
  slurm_kill_step       one role's step killed: `scancel --signal=KILL <job>.<step>` or SIGKILL to the
                        step's task (the role's process); the batch script ends the job; resume.
  slurm_cancel_prepare  scancel while rl.prepare is inside `prepare.mid` (armed with the `stall` action
                        and HETRL_FAULT_LOG, so the harness knows it is in there and which pid), either
                        the first incarnation's prepare or, after `scontrol requeue` of a job that has
                        trained some steps, the second one's; resume.
  slurm_requeue_dying   SIGTERM to one role's step task (it starts checkpointing and exiting), frozen there
                        with SIGSTOP until `scontrol requeue` has returned (so it is provably still alive,
                        dying, when the requeue lands), then SIGCONT: Slurm kills everything and
                        starts the job again (SLURM_RESTART_COUNT=1), which must finish the run.
The elastic kinds (inference.router=true; the job must absorb them without a requeue or a resume):
  slurm_kill_engine     SIGKILL to inference_0's vLLM engine core: the batch script restarts the role in
                        place and the restarted server (a new pid in its record) serves the rest.
  slurm_lose_server     2 servers, cluster.max_role_restarts=0: inference_1's step cancelled by scancel
                        (gone for good); the job goes on with inference_0 (the batch log says so).
  slurm_scale           `launch scale +1` (the trainer held with SIGSTOP until the extra server's record is
                        there, at most SCALE_HOLD_S, so the run cannot end first; cluster.exclusive=false so
                        the scale job finds a node beside a concurrent trial), one more step,
                        `launch scale -1`: the extra server served requests, drained, and its job ended.

Each records its proof that the fault landed (`trial.proof`) or why it did not (`trial.not_landed`).

One cluster serves every Slurm trial of a harness run (`Cluster`: the running one named by SLURM_CONF /
--slurm-conf if it answers, else a fresh SlurmCluster started here and stopped at the end). Thread counts
as the local reference run's: OMP_NUM_THREADS=1 (the trainer of a local run pinned to one core gets 1
thread; Slurm's default would be one per core, which gave different weights: measured) and vLLM bound to
the trial's core, both exported to the job by sbatch's default --export=ALL.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# Elastic inference (issue 43): faults the job must absorb in the same incarnation, with the router on.
ELASTIC_KINDS = ("slurm_kill_engine", "slurm_lose_server", "slurm_scale")
KINDS = ("slurm_kill_batch", "slurm_kill_step", "slurm_cancel_prepare", "slurm_requeue_dying", *ELASTIC_KINDS)
ELASTIC_EXTRA = {
    "slurm_kill_engine": ["inference.router=true"],
    "slurm_lose_server": ["inference.router=true", "inference.replicas=2", "cluster.max_role_restarts=0",
                          "cluster.min_inference_fraction=0.5"],
    # not exclusive: the scale job's node comes from the 4 the concurrent trials share; with whole nodes
    # per job two trials fill them, the extra server waited in the queue while the trainer was held, and
    # the orchestrator's stall watchdog (300 s) ended the run (two trials, measured)
    "slurm_scale": ["inference.router=true", "cluster.exclusive=false"],
}
# The longest the scale trial holds the trainer (SIGSTOP) for the extra server to come up: under the
# orchestrator's stall watchdog (cluster.stall_timeout_s=300 in every trial), which a held trainer trips.
SCALE_HOLD_S = 240
ACTIVE = ("PENDING", "RUNNING", "CONFIGURING", "COMPLETING", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED",
          "RESIZING", "SUSPENDED", "SIGNALING", "STAGE_OUT", "STOPPED")
ROLE_MODULES = {"rl.trainer": "trainer", "rl.orchestrator": "orchestrator", "rl.inference": "inference"}
SLURM_EXTRA = ["cluster=slurm", "cluster.signal_grace_s=20", "cluster.time=00:30:00"]


class Cluster:
    """The localhost Slurm shared by every Slurm trial of one harness run."""

    def __init__(self, base: Path, conf: str | None = None):
        self.own = None
        conf = conf or os.environ.get("SLURM_CONF")
        if conf and self._answers(conf):
            self.conf = conf
        else:
            sys.path.insert(0, str(REPO / "tests"))
            from slurm_cluster import SlurmCluster, missing_binaries
            if missing := missing_binaries():
                raise SystemExit(f"Slurm trials: binaries missing ({', '.join(missing)}); "
                                 f"install with .ci/install_slurm.sh or leave the slurm_* kinds out")
            if os.geteuid() != 0:
                raise SystemExit("Slurm trials: the local Slurm cluster needs root (slurmd runs jobs as their users)")
            base.mkdir(parents=True, exist_ok=True)
            self.own = SlurmCluster(base=str(base)).start()
            self.conf = str(self.own.conf)
        self.env = {**os.environ, "SLURM_CONF": self.conf}

    @staticmethod
    def _answers(conf: str) -> bool:
        try:
            r = subprocess.run(["sinfo", "-h", "-o", "%D"], env={**os.environ, "SLURM_CONF": conf},
                               capture_output=True, text=True, timeout=10)
        except (OSError, subprocess.TimeoutExpired):
            return False
        return r.returncode == 0 and bool(r.stdout.strip())

    def run(self, *args: str, check: bool = False, timeout: float = 30) -> subprocess.CompletedProcess:
        return subprocess.run(list(args), env=self.env, capture_output=True, text=True, check=check,
                              timeout=timeout)

    def stop(self) -> None:
        if self.own is not None:
            self.own.stop()


# -- the job and its processes -------------------------------------------------------------------------
def job_state(cluster: Cluster, job: str) -> dict:
    r = cluster.run("scontrol", "-o", "show", "job", str(job))
    if r.returncode == 0 and r.stdout.strip():
        lead = dict(kv.split("=", 1) for kv in r.stdout.strip().splitlines()[0].split() if "=" in kv)
        return {"state": lead.get("JobState", "UNKNOWN"), "restarts": int(lead.get("Restarts", "0") or 0),
                "exit_code": lead.get("ExitCode", "")}
    return {"state": "GONE", "restarts": None, "exit_code": ""}


def current_job(run_dir: Path) -> str | None:
    try:
        lines = [ln for ln in (run_dir / "slurm_jobs.jsonl").read_text().splitlines() if ln.strip()]
    except OSError:
        return None
    return json.loads(lines[-1])["job_id"] if lines else None


def _environ(pid: int) -> dict[str, str]:
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return {}
    return dict(kv.split("=", 1) for kv in raw.decode(errors="replace").split("\0") if "=" in kv)


def _cmdline(pid: int) -> list[str]:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        return []


def alive(pid: int) -> bool:
    """A live, non-zombie process."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2] not in "ZX"


def role_tasks(run_dir: Path) -> dict[str, dict]:
    """{role: {pid, job, step}} of the role processes (the step's task, `python -m rl.<role>`) of this run
    that run under Slurm now."""
    out = {}
    tag = str(run_dir)
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        cmd = _cmdline(int(d.name))
        if len(cmd) < 3 or cmd[1] != "-m" or cmd[2] not in ROLE_MODULES or tag not in cmd:
            continue
        env = _environ(int(d.name))
        if env.get("HETRL_RUN_DIR") != tag or "SLURM_STEP_ID" not in env or not alive(int(d.name)):
            continue
        role = ROLE_MODULES[cmd[2]]
        if role == "inference":
            role = f"inference_{env.get('HETRL_INFERENCE_INDEX', '0')}"
        # a step of het group g belongs to that component's job id (squeue -s: 22.3), not the leader's
        job = env.get(f"SLURM_JOB_ID_HET_GROUP_{env.get('HETRL_HET_GROUP', '0')}") or env.get("SLURM_JOB_ID")
        out[role] = {"pid": int(d.name), "job": job, "step": env.get("SLURM_STEP_ID")}
    return out


def batch_shell(job: str) -> int | None:
    """The batch script's shell of `job` (slurmstepd runs it as .../job<id>/slurm_script)."""
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        cmd = _cmdline(int(d.name))
        if any(c.endswith("/slurm_script") for c in cmd) and _environ(int(d.name)).get("SLURM_JOB_ID") == str(job) \
                and alive(int(d.name)):
            return int(d.name)
    return None


def job_env(trial, cluster: Cluster) -> dict:
    env = {**cluster.env, "PYTHONUNBUFFERED": "1", "WANDB_MODE": "disabled", "OMP_NUM_THREADS": "1"}
    for k in ("HETRL_FAULT", "HETRL_FAULT_LOG", "HETRL_FAULT_STALL_S"):
        env.pop(k, None)
    cpus = trial.cpus or sorted(os.sched_getaffinity(0))
    # the local split (launch.local.cpu_split) for this many cores: vLLM on the first half, >= 1
    inf = min(len(cpus) - 1, max(1, len(cpus) // 2)) if len(cpus) >= 2 else 1
    env["VLLM_CPU_OMP_THREADS_BIND"] = ",".join(map(str, cpus[:inf]))
    return env


def launch_cmd(trial, env: dict, *args: str) -> subprocess.CompletedProcess:
    log = open(trial.run_dir.parent / f"{trial.run_dir.name}.launcher.log", "ab")
    r = subprocess.run([sys.executable, "-m", "launch", *args], cwd=REPO, env=env, stdout=subprocess.PIPE,
                       stderr=subprocess.STDOUT, text=True, timeout=120)
    log.write(r.stdout.encode())
    log.close()
    return r


def resume_restart(run_dir: Path) -> int | None:
    try:
        return int(json.loads((run_dir / "resume.json").read_text())["restart"])
    except (OSError, ValueError, KeyError):
        return None


def wait_until(pred, timeout: float, poll: float = 0.2) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(poll)
    return False


def wait_job_end(cluster: Cluster, job: str, timeout: float) -> dict:
    """Until the job leaves every active state (a requeued job stays active: REQUEUED, PENDING, RUNNING).
    The timeout grows by one incarnation per restart Slurm made."""
    t0, restarts = time.monotonic(), 0
    while True:
        st = job_state(cluster, job)
        restarts = max(restarts, st["restarts"] or 0)
        if st["state"] not in ACTIVE:
            return st
        if time.monotonic() - t0 > timeout * (1 + restarts):
            return {**st, "hang": True}
        time.sleep(1)


# -- a trial -------------------------------------------------------------------------------------------
def run_slurm_trial(trial, rng, timeout: float, cluster: Cluster, h) -> None:
    """Run `trial` (kind slurm_*) on `cluster` up to DONE; `h` is benchmarks/_fault_trial (steps_done,
    Trial.overrides). Fills trial.incarnations, detail, proof / not_landed and failures (not the checks
    of the finished run dir, which the caller runs)."""
    run_dir, kind = trial.run_dir, trial.kind
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    env = job_env(trial, cluster)
    fault_log = run_dir.parent / f"{run_dir.name}.faults.jsonl"
    first_env = dict(env)
    nth = None
    trial.extra += [x for x in ELASTIC_EXTRA.get(kind, []) if x not in trial.extra]
    if kind == "slurm_cancel_prepare":
        nth = rng.choice([1, 2])
        first_env.update(HETRL_FAULT=f"prepare.mid@prepare:{nth}:stall", HETRL_FAULT_LOG=str(fault_log),
                         HETRL_FAULT_STALL_S="300")
        trial.detail += f" prepare.mid pass {nth}"
    r = launch_cmd(trial, first_env, "run", *SLURM_EXTRA, *trial.overrides())
    job = current_job(run_dir)
    if r.returncode != 0 or job is None:
        trial.failures.append(f"launch run cluster=slurm exited {r.returncode}: {r.stdout.strip()[-300:]}")
        return
    trial.detail += f" job {job}"
    try:
        _inject(trial, rng, cluster, job, nth, fault_log, h)
    except Exception as e:  # noqa: BLE001 - a harness error is this trial's failure, not the run's
        trial.failures.append(f"injecting {kind}: {type(e).__name__}: {e}")
    _finish(trial, cluster, env, timeout)
    if kind in ELASTIC_KINDS and (len(trial.incarnations) != 1 or "rq" in trial.incarnations[0]
                                  or resume_restart(run_dir) != 0):
        trial.failures.append(f"{kind} must be absorbed by the running job, but the run took {trial.incarnations} "
                              f"(resume.json restart {resume_restart(run_dir)})")


def _moment(trial, rng, cluster: Cluster, job: str, h, timeout: float = 400) -> bool:
    k = trial.at if trial.at is not None else rng.randint(0, trial.steps - 2)
    trial.detail += f" after step {k}"

    def ready():
        return len(role_tasks(trial.run_dir)) >= 3 and h.steps_done(trial.run_dir) >= k
    ok = wait_until(lambda: ready() or job_state(cluster, job)["state"] not in ACTIVE, timeout, poll=0.5)
    time.sleep(rng.uniform(0, 2))
    return ok and ready() and not (trial.run_dir / "DONE").exists()


def _inject(trial, rng, cluster: Cluster, job: str, nth: int | None, fault_log: Path, h) -> None:
    run_dir, kind = trial.run_dir, trial.kind
    from rl.faults import read_log
    if kind == "slurm_cancel_prepare":
        if nth == 2:  # a first incarnation that trained some steps, requeued by hand: prepare #2 stalls
            if not _moment(trial, rng, cluster, job, h):
                trial.not_landed = "the run ended before the moment of the requeue"
                return
            cluster.run("scontrol", "requeue", job)
            trial.detail += "; scontrol requeue"
        fired = []
        wait_until(lambda: bool(fired.extend(e for e in read_log(fault_log) if e.get("fired")) or fired), 300, 0.3)
        if not fired:
            trial.not_landed = f"prepare.mid pass {nth} never fired"
            return
        pid = fired[0]["pid"]
        restart_before = resume_restart(run_dir)
        if not alive(pid):
            trial.not_landed = f"prepare (pid {pid}) was gone before the cancel"
            return
        cluster.run("scancel", job)
        still = alive(pid)
        wait_until(lambda: not alive(pid), 30)
        trial.detail += f"; scancel while prepare pid {pid} stalls in prepare.mid"
        if resume_restart(run_dir) != restart_before:
            trial.not_landed = "prepare wrote resume.json before the cancel"
            return
        trial.proof.append(f"prepare.mid fired (pass {fired[0]['pass']}, pid {pid}), pid alive at scancel "
                           f"({'still alive right after' if still else 'gone right after'}), resume.json untouched")
        return
    if not _moment(trial, rng, cluster, job, h):
        trial.not_landed = "the run ended (or never got its roles up) before the moment"
        return
    tasks = role_tasks(run_dir)
    done_before = h.steps_done(run_dir)
    if kind in ELASTIC_KINDS:
        _inject_elastic(trial, cluster, job, tasks, done_before, h)
        return
    if kind == "slurm_kill_batch":
        pid = batch_shell(job)
        if pid is None:
            trial.not_landed = "no batch shell found"
            return
        os.kill(pid, signal.SIGKILL)
        gone = wait_until(lambda: not alive(pid), 10)
        trial.detail += f": SIGKILL batch shell pid {pid} at step {done_before}"
        if gone:
            trial.proof.append(f"batch shell {pid} alive, killed (gone after SIGKILL) with roles "
                               f"{sorted(tasks)} running, {done_before} step(s) done, no DONE")
        else:
            trial.not_landed = f"batch shell {pid} still alive 10 s after SIGKILL"
    elif kind == "slurm_kill_step":
        role = rng.choice(sorted(tasks))
        t = tasks[role]
        how = rng.choice(["scancel", "task"])
        if how == "scancel":
            r = cluster.run("scancel", "--signal=KILL", f"{t['job']}.{t['step']}")
            what = f"scancel --signal=KILL {t['job']}.{t['step']} ({role})"
            if r.returncode != 0:
                trial.failures.append(f"{what}: {r.stderr.strip()}")
        else:
            os.kill(t["pid"], signal.SIGKILL)
            what = f"SIGKILL {role}'s task pid {t['pid']} (step {t['job']}.{t['step']})"
        gone = wait_until(lambda: not alive(t["pid"]), 15)
        trial.detail += f": {what} at step {done_before}"
        if gone and (run_dir / "DONE").exists():
            trial.not_landed = f"{role} gone, but the run was DONE by then (it may have exited on its own)"
        elif gone:
            trial.proof.append(f"{role} pid {t['pid']} alive before, gone after; {done_before} step(s) done")
        else:
            trial.not_landed = f"{role} pid {t['pid']} still alive 15 s after the kill"
    elif kind == "slurm_requeue_dying":
        role = rng.choice(sorted(tasks))
        t = tasks[role]
        # The step's task starts checkpointing and exiting (dying) and is frozen there (SIGSTOP) until the
        # requeue has returned: a role with little to save exited before `scontrol requeue` came back (a
        # trainer at step 0, measured: the fault did not land). Slurm's own kill (SIGCONT, SIGTERM, then
        # SIGKILL after KillWait) or our SIGCONT below lets it go on dying beside the requeue.
        os.kill(t["pid"], signal.SIGTERM)
        try:
            os.kill(t["pid"], signal.SIGSTOP)
        except ProcessLookupError:
            pass
        try:
            r = cluster.run("scontrol", "requeue", job)
            dying = alive(t["pid"])
        finally:
            try:
                os.kill(t["pid"], signal.SIGCONT)
            except ProcessLookupError:
                pass
        trial.detail += (f": SIGTERM to {role} (task of step {t['job']}.{t['step']}), scontrol requeue at step "
                         f"{done_before}")
        if r.returncode != 0:
            trial.failures.append(f"scontrol requeue {job}: {r.stderr.strip()}")
        if dying:
            trial.proof.append(f"{role} pid {t['pid']} still alive (dying) when the requeue returned")
        else:
            trial.not_landed = f"{role} pid {t['pid']} had exited before the requeue returned"


def _children(pid: int) -> list[int]:
    try:
        return [int(x) for t in os.listdir(f"/proc/{pid}/task")
                for x in Path(f"/proc/{pid}/task/{t}/children").read_text().split()]
    except OSError:
        return []


def engine_core(server_pid: int) -> int | None:
    """The vLLM engine core process under the API server `server_pid` (its title names it)."""
    todo, seen = list(_children(server_pid)), set()
    while todo:
        pid = todo.pop()
        if pid in seen:
            continue
        seen.add(pid)
        try:
            comm = Path(f"/proc/{pid}/comm").read_text(errors="replace")
        except OSError:
            continue
        if "EngineCore" in " ".join(_cmdline(pid)) + comm:
            return pid
        todo += _children(pid)
    return None


def _server_pid(run_dir: Path, index: int) -> int | None:
    try:
        return int(json.loads((run_dir / "inference" / f"server_{index}.json").read_text())["pid"])
    except (OSError, ValueError, KeyError):
        return None


def _inject_elastic(trial, cluster: Cluster, job: str, tasks: dict, done_before: int, h) -> None:
    run_dir, kind = trial.run_dir, trial.kind
    batch_log = run_dir / "logs" / f"slurm-{job}.out"
    if kind == "slurm_kill_engine":
        # the moment may come before the server is up (step 0): the engine core must exist to be killed
        wait_until(lambda: (_server_pid(run_dir, 0) and engine_core(_server_pid(run_dir, 0)))
                   or (run_dir / "DONE").exists(), 600, 1)
        done_before = h.steps_done(run_dir)
        server = _server_pid(run_dir, 0)
        engine = engine_core(server) if server else None
        if engine is None or not alive(engine):
            trial.not_landed = f"no live engine core under inference_0's server (pid {server})"
            return
        os.kill(engine, signal.SIGKILL)
        gone = wait_until(lambda: not alive(engine), 10)
        trial.detail += f": SIGKILL engine core pid {engine} (server {server}) at step {done_before}"
        back = wait_until(lambda: _server_pid(run_dir, 0) not in (None, server) or (run_dir / "DONE").exists(), 600, 1)
        new = _server_pid(run_dir, 0)
        if gone and back and new not in (None, server):
            trial.proof.append(f"engine core {engine} alive, killed; inference_0 restarted in place "
                               f"(server pid {server} -> {new}) in job {job}; {done_before} step(s) done")
        else:
            trial.not_landed = f"engine core {engine} gone: {gone}; restarted server: {new} (was {server})"
    elif kind == "slurm_lose_server":
        t = tasks.get("inference_1")
        if t is None:
            trial.not_landed = "no inference_1 step running"
            return
        r = cluster.run("scancel", f"{t['job']}.{t['step']}")
        if r.returncode != 0:
            trial.failures.append(f"scancel {t['job']}.{t['step']}: {r.stderr.strip()}")
        gone = wait_until(lambda: not alive(t["pid"]), 60)
        trial.detail += f": scancel {t['job']}.{t['step']} (inference_1) at step {done_before}"

        def given_up():
            try:
                return "given up; going on with 1 of 2 inference servers" in batch_log.read_text(errors="replace")
            except OSError:
                return False
        if gone and wait_until(given_up, 60):
            trial.proof.append(f"inference_1 pid {t['pid']} alive before, gone after; the batch script gave it up "
                               f"and went on with 1 of 2 servers; {done_before} step(s) done")
        else:
            trial.not_landed = f"inference_1 gone: {gone}; given up in the batch log: {given_up()}"
    elif kind == "slurm_scale":
        trainer = tasks.get("trainer", {}).get("pid")
        env = job_env(trial, cluster)
        # held only once it has published weights and trained a step: the extra server needs the weights
        # (holding the trainer before its first publication stalled every server: a trial measured it)
        if not wait_until(lambda: h.steps_done(run_dir) >= 1 and _server_pid(run_dir, 0) is not None
                          or (run_dir / "DONE").exists(), 900, 1) or (run_dir / "DONE").exists():
            trial.not_landed = "the run ended (or never trained a step) before the moment of the scale-up"
            return
        done_before = h.steps_done(run_dir)
        if trainer:
            os.kill(trainer, signal.SIGSTOP)   # the run cannot end before the extra server is up
        try:
            r = launch_cmd(trial, env, "scale", str(run_dir), "--inference", "+1")
            if r.returncode != 0:
                trial.failures.append(f"launch scale +1 exited {r.returncode}: {r.stdout.strip()[-300:]}")
                return
            up = wait_until(lambda: _server_pid(run_dir, 1) is not None, SCALE_HOLD_S, 1)
        finally:
            if trainer:
                try:
                    os.kill(trainer, signal.SIGCONT)
                except ProcessLookupError:   # the run ended it meanwhile: the checks below say how
                    trial.failures.append(f"the held trainer (pid {trainer}) was gone when released")
        # not up while held: it may still come up before the run ends (else: not landed, never passed)
        up = up or wait_until(lambda: _server_pid(run_dir, 1) is not None or (run_dir / "DONE").exists(), 360, 1) \
            and _server_pid(run_dir, 1) is not None
        extra_job = json.loads((run_dir / "inference" / "extra" / "replica_1.json").read_text()).get("job")
        def has_served() -> bool:
            try:
                return "POST /inference/v1/generate" in (run_dir / "logs" / "inference_1.vllm.log").read_text(
                    errors="replace")
            except OSError:
                return False
        # drained once it has served (the router's affinity may keep a short run's sessions elsewhere a while)
        wait_until(lambda: has_served() or (run_dir / "DONE").exists(), 300, 1)
        r = launch_cmd(trial, env, "scale", str(run_dir), "--inference", "-1")
        ended = wait_until(lambda: job_state(cluster, extra_job)["state"] not in ACTIVE, 300, 1)
        served = has_served()
        trial.detail += f": launch scale +1 (job {extra_job}) at step {done_before}, -1 at step {h.steps_done(run_dir)}"
        if up and served and r.returncode == 0 and ended:
            trial.proof.append(f"extra server inference_1 (job {extra_job}) up, served requests, drained; its job ended")
        else:
            trial.not_landed = (f"extra server up: {up}, served: {served}, drain exit {r.returncode}, "
                                f"its job ended: {ended}")


def _finish(trial, cluster: Cluster, env: dict, timeout: float) -> None:
    """Wait for each job to end; while the run is not DONE, `launch resume` it (at most 4 jobs)."""
    run_dir = trial.run_dir
    for attempt in range(4):
        job = current_job(run_dir)
        st = wait_job_end(cluster, job, timeout)
        trial.incarnations.append(f"{job}:{st['state']}" + (f"+{st['restarts']}rq" if st.get("restarts") else ""))
        if st.get("hang"):
            trial.failures.append(f"job {job} still {st['state']} after {timeout:.0f} s per incarnation (hang)")
            cluster.run("scancel", job)
            wait_until(lambda: job_state(cluster, job)["state"] not in ACTIVE, 60, 1)
            return
        if (run_dir / "DONE").exists():
            if st["state"] != "COMPLETED":
                trial.failures.append(f"DONE, but job {job} ended {st['state']} (exit {st['exit_code']})")
            return
        r = launch_cmd(trial, env, "resume", str(run_dir))
        if r.returncode != 0:
            trial.failures.append(f"launch resume exited {r.returncode}: {r.stdout.strip()[-300:]}")
            return
    trial.failures.append(f"not DONE after 4 jobs ({trial.incarnations})")


def second_incarnation(run_dir: Path, incarnations: list[str]) -> str | None:
    """Why we know a later incarnation ran, or None: a second job (`launch resume`), or a restart Slurm
    made (a requeue keeps the job id; scontrol's Restarts counts it). resume.json's restart count alone
    would miss a first incarnation cancelled inside prepare, which never wrote it."""
    try:
        jobs = [json.loads(ln)["job_id"] for ln in (run_dir / "slurm_jobs.jsonl").read_text().splitlines() if ln.strip()]
    except (OSError, ValueError, KeyError):
        jobs = []
    requeues = sum(int(i.rsplit("+", 1)[1][:-2]) for i in incarnations if "+" in i and i.endswith("rq"))
    if len(jobs) >= 2 or requeues >= 1:
        return f"jobs {', '.join(jobs)}, {requeues} Slurm restart(s), resume.json restart {resume_restart(run_dir)}"
    return None
