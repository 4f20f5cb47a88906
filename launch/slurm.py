"""The Slurm backend: the only module that calls sbatch, squeue, scontrol and scancel.

`launch_slurm(cfg, run_dir)` plans the run (`launch.plan`), renders the heterogeneous batch script from
`sbatch/job.sbatch.j2`, freezes the run directory (`launch.rundir.freeze_run_dir`: config.yaml,
plan.json, job.sbatch, submissions.jsonl; a resume whose config differs in a frozen key is refused) and
submits with `sbatch --parsable`, returning at once with the job id. `status(run_dir)` reads the job
state from squeue / `scontrol show job` (never sacct: without accounting it fails) and the progress from
the run directory (launch.status). The job id of a run is the last line of `RUN_DIR/slurm_jobs.jsonl`.

submitit is not used for the run itself: it cannot express heterogeneous jobs (no `hetjob` separator,
one srun line), so the batch script is our own template.
"""
from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import time
import uuid
from pathlib import Path

from rl.contract.config import ClusterConfig, ConfigError, typed
from launch.plan import REPO, make_plan
from rl.contract import paths, safefs
from rl.contract.plan import Plan

TEMPLATE_DIR = REPO / "sbatch"
JOBS_FILE = paths.SLURM_JOBS
_VAR = re.compile(r"(\$\{HETRL_[A-Z0-9_]+\})")
# A job id as sbatch --parsable prints it for our (non-array) jobs. Anything else read back from
# slurm_jobs.jsonl is refused: it reaches scancel/scontrol argv, where "--user=..." would be an option.
_JOB_ID = re.compile(r"[0-9]+")
# A value of an #SBATCH line: sbatch splits the line at whitespace and reads quotes itself, so a space,
# quote or backslash in a value would add or change options (and a newline would end the header).
_SBATCH_UNSAFE = re.compile(r"[\s'\"\\]")


class SlurmError(RuntimeError):
    """A Slurm command failed; the message carries its stderr (one line)."""


# -- rendering ---------------------------------------------------------------------------------------
def shell_word(arg) -> str:
    """Quote one argument for bash, leaving `${HETRL_...}` references for the batch shell to expand."""
    parts = _VAR.split(str(arg))
    out = "".join(f'"{p}"' if _VAR.fullmatch(p) else shlex.quote(p) for p in parts if p)
    return out or "''"


def job_id_arg(job_id, where: str = "job id") -> str:
    """`job_id` as an argument for scancel/scontrol/squeue: digits only, else SlurmError naming it."""
    s = str(job_id)
    if not _JOB_ID.fullmatch(s):
        raise SlurmError(f"{where}={s!r}: not a Slurm job id (digits only)")
    return s


def _sbatch_value(key: str, value) -> None:
    if value is not None and _SBATCH_UNSAFE.search(str(value)):
        raise ConfigError(f"{key}={str(value)!r}: cannot go into an #SBATCH line (no whitespace, quotes or "
                          f"backslashes)")


def _check_sbatch_header(plan: Plan, cluster: ClusterConfig, job_name: str) -> None:
    """Every value the template puts into an #SBATCH line (or the comment header) is one safe word."""
    _sbatch_value("run_dir", plan.run_dir)  # --output=RUN_DIR/logs/...
    _sbatch_value("cluster.job_name", job_name)
    _sbatch_value("cluster.time", cluster.time)
    _sbatch_value("experiment", plan.experiment)
    for g in plan.groups:
        for k in ("account", "partition", "qos", "constraint", "gres"):
            key = (f"cluster.sandbox_{k}" if g.het_group == 2 and k in ("account", "partition")
                   else f"cluster.{k}")
            _sbatch_value(key, g.sbatch[k] if k in g.sbatch else getattr(cluster, k))
    for n, line in enumerate(cluster.extra_sbatch):
        if any(c in str(line) for c in "\r\n"):  # the user's own options: only one line each
            raise ConfigError(f"cluster.extra_sbatch[{n}]={str(line)!r}: must be one line")


def render_script(plan: Plan, cfg, template: str = "job.sbatch.j2", **extra) -> str:
    """The batch script of `plan` with the cluster settings of `cfg` (a composed config, read as the typed
    Config: the schema has every default), without submitting. A value that cannot be put into an #SBATCH
    line safely is a ConfigError naming its key."""
    import jinja2
    env = jinja2.Environment(loader=jinja2.FileSystemLoader(str(TEMPLATE_DIR)), trim_blocks=True,
                             lstrip_blocks=True, keep_trailing_newline=True, undefined=jinja2.StrictUndefined,
                             comment_start_string="<#", comment_end_string="#>")  # bash uses ${#x}
    env.filters["q"] = lambda s: shlex.quote(str(s))
    env.filters["shjoin"] = lambda args: " ".join(shell_word(a) for a in args)
    env.filters["envjoin"] = lambda d: " ".join(f"{k}={shlex.quote(str(v))}" for k, v in d.items())
    cluster = typed(cfg).cluster
    job_name = cluster.job_name or f"hetrl-{plan.experiment}"
    _check_sbatch_header(plan, cluster, job_name)
    return env.get_template(template).render(plan=plan, cluster=cluster, job_name=job_name, **extra)


# -- Slurm commands ----------------------------------------------------------------------------------
def _run(*args: str, check: bool = True, timeout: float = 60) -> subprocess.CompletedProcess:
    try:
        r = subprocess.run(list(args), capture_output=True, text=True, timeout=timeout)
    except FileNotFoundError:
        raise SlurmError(f"{args[0]}: not found (is this a Slurm login node?)") from None
    except subprocess.TimeoutExpired:
        raise SlurmError(f"{' '.join(args[:2])}: no answer within {timeout:.0f} s (is slurmctld up?)") from None
    if check and r.returncode != 0:
        msg = " ".join((r.stderr or r.stdout).split()) or f"exit status {r.returncode}"
        raise SlurmError(f"{' '.join(args[:2])}: {msg}")
    return r


def submit(run_dir: str | os.PathLike, script: str | os.PathLike, hold: bool = False) -> str:
    """sbatch SCRIPT from RUN_DIR (held with `hold`); returns the job id and appends it to
    RUN_DIR/slurm_jobs.jsonl."""
    run_dir = Path(run_dir)
    safefs.makedirs(run_dir / "logs")  # Slurm opens --output there itself: a linked logs/ is refused first
    r = _run("sbatch", "--parsable", *(["--hold"] if hold else []), f"--chdir={run_dir}", str(script))
    job_id = job_id_arg(r.stdout.strip().split(";")[0].split("+")[0], "sbatch --parsable printed job id")
    try:
        record_job(run_dir, job_id)
    except OSError:
        cancel(job_id)  # an unrecorded job could never be found again (status, cancel, resume)
        raise
    return job_id


def record_job(run_dir: str | os.PathLike, job_id: str) -> None:
    """Append the job to RUN_DIR/slurm_jobs.jsonl through rl.contract.safefs (a link or FIFO planted in its
    place is refused: UnsafePath)."""
    safefs.append_bytes(Path(run_dir) / JOBS_FILE,
                        (json.dumps({"job_id": job_id_arg(job_id), "time": time.time()}) + "\n").encode())


def job_state(job_id: str) -> dict:
    """{'state', 'reason', 'restarts', 'nodes'} from `scontrol show job` (squeue as a fallback).

    A job Slurm has forgotten (MinJobAge passed) reads as state 'GONE'."""
    job_id = job_id_arg(job_id)
    r = _run("scontrol", "-o", "show", "job", job_id, check=False)
    if r.returncode == 0 and r.stdout.strip():
        comps = []
        for line in r.stdout.strip().splitlines():
            comps.append(dict(kv.split("=", 1) for kv in line.split() if "=" in kv))
        lead = comps[0]
        return {"state": lead.get("JobState", "UNKNOWN"), "reason": lead.get("Reason", ""),
                "restarts": int(lead.get("Restarts", "0") or 0),
                "nodes": [c.get("NodeList", "") for c in comps], "exit_code": lead.get("ExitCode", "")}
    r = _run("squeue", "-h", "-o", "%T|%r", "-j", job_id, check=False)
    if r.returncode == 0 and r.stdout.strip():
        state, _, reason = r.stdout.strip().splitlines()[0].partition("|")
        return {"state": state, "reason": reason, "restarts": None, "nodes": [], "exit_code": ""}
    return {"state": "GONE", "reason": "", "restarts": None, "nodes": [], "exit_code": ""}


def cancel(job_id: str, signal: str | None = None, batch: bool = False) -> None:
    """scancel the job, or only send it SIGNAL (to the batch script too with batch=True)."""
    job_id = job_id_arg(job_id)
    args = ["scancel"]
    if signal:
        args.append(f"--signal={signal}")
        if batch:
            args.append("--batch")
    _run(*args, "--", job_id)  # job ids are digits (job_id_arg); `--` ends the options regardless


def requeue(job_id: str) -> None:
    _run("scontrol", "requeue", job_id_arg(job_id))


# -- what the CLI calls ------------------------------------------------------------------------------
def prepare_run(cfg: dict, run_dir: str | os.PathLike) -> tuple[Plan, str]:
    """(plan, script) for cfg with its run_dir set; raises PlanError/ConfigError naming the key."""
    cfg = dict(cfg, run_dir=str(Path(run_dir).absolute()))
    plan = make_plan(cfg)
    return plan, render_script(plan, cfg)


def launch_slurm(cfg: dict, run_dir: str | os.PathLike) -> str:
    """Submit the run and freeze its run dir (config, plan, script; a resume is checked first). Returns
    the job id.

    The frozen files are written only once Slurm has accepted the job, so a submission Slurm refuses (a
    wrong partition, account or limit) leaves the run directory as it was and the same command, corrected,
    can be run again. The job is submitted held and released after the files are in place: it cannot start
    and read a run directory that is not written yet. If freezing fails, the held job is cancelled."""
    from launch.rundir import check_resume, check_run_dir_choice, freeze_run_dir
    run_dir = check_run_dir_choice(Path(run_dir).absolute())
    cfg = dict(cfg, run_dir=str(run_dir))
    cfg.pop("_overrides", None)
    old = current_job(run_dir)
    if old and job_state(old)["state"] in ACTIVE:
        raise ConfigError(f"run_dir={str(run_dir)!r}: job {old} of this run is still active "
                          f"(python -m launch cancel {run_dir})")
    plan, script = prepare_run(cfg, run_dir)
    check_resume(cfg, run_dir)
    pending = run_dir / f".{paths.JOB_SCRIPT}.pending-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        safefs.makedirs(run_dir / "logs")
        fd = safefs.open_write(pending, exclusive=True)  # a fresh name: nothing planted is written through
        try:
            os.write(fd, script.encode())
        finally:
            os.close(fd)
    except safefs.UnsafePath as e:
        raise ConfigError(f"run_dir={str(run_dir)!r}: {e}") from None
    except OSError as e:
        raise ConfigError(f"run_dir={str(run_dir)!r}: cannot be written ({e.strerror or e})") from None
    try:
        job_id = submit(run_dir, pending, hold=True)
    finally:
        safefs.remove(pending)
    try:
        freeze_run_dir(cfg, run_dir, plan, script)
    except BaseException:
        cancel(job_id)
        raise
    _run("scontrol", "release", job_id_arg(job_id))
    return job_id


def resume_slurm(run_dir: str | os.PathLike, max_steps: int | None = None) -> str:
    """Resubmit a run whose job ended, from its frozen config (optionally with more steps)."""
    import yaml
    run_dir = Path(run_dir).absolute()
    p = paths.config_file(run_dir)
    try:
        cfg = yaml.safe_load(safefs.read_text(p, limit=16 << 20))
    except FileNotFoundError:
        raise ConfigError(f"run_dir={str(run_dir)!r}: no config.yaml, not a run directory") from None
    if max_steps is not None:
        cfg["trainer"]["max_steps"] = int(max_steps)
    return launch_slurm(cfg, run_dir)


ACTIVE = ("PENDING", "RUNNING", "CONFIGURING", "COMPLETING", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED",
          "RESIZING", "SUSPENDED", "SIGNALING", "STAGE_OUT", "STOPPED")


def current_job(run_dir: str | os.PathLike) -> str | None:
    p = Path(run_dir) / JOBS_FILE
    try:  # safefs: a link or FIFO in the record's place is UnsafePath, never followed or blocked on
        text = safefs.read_bytes(p, limit=64 << 20).decode("utf-8", "replace")
    except FileNotFoundError:
        return None
    lines = [ln for ln in text.splitlines() if ln.strip()]
    if not lines:
        return None
    try:
        job = json.loads(lines[-1])["job_id"]
    except (json.JSONDecodeError, TypeError, KeyError):
        raise ConfigError(f"{p}: last line is not a record with a job_id: {lines[-1][:80]!r}") from None
    if not _JOB_ID.fullmatch(str(job)):
        raise ConfigError(f"{p}: job_id={str(job)!r} is not a Slurm job id (digits only)")
    return str(job)


def cancel_run(run_dir: str | os.PathLike, signal: str | None = None) -> str:
    """Cancel (or signal, e.g. USR1 = checkpoint and requeue) the run's current job; returns its id."""
    job = current_job(run_dir)
    if job is None:
        raise ConfigError(f"run_dir={str(run_dir)!r}: no Slurm job recorded ({JOBS_FILE} missing)")
    cancel(job, signal=signal, batch=bool(signal))
    return job


def log_path(run_dir: str | os.PathLike, role: str) -> Path:
    """RUN_DIR/logs/<role>.log (role names as in plan.json: trainer, inference_0, orchestrator, router,
    prepare, or 'job' for the batch script's own log of the current job)."""
    run_dir = Path(run_dir)
    if role == "job":
        job = current_job(run_dir)
        return run_dir / "logs" / f"slurm-{job}.out"
    return run_dir / "logs" / f"{role}.log"


# -- the executor interface (launch/backends.py) ---------------------------------------------------------
def submit_run(cfg: dict, plan: Plan) -> tuple[int, str]:
    """Submit the composed config and return at once: (0, the job id)."""
    job_id = launch_slurm(cfg, cfg["run_dir"])
    print(f"submitted job {job_id}: {cfg['run_dir']}", flush=True)
    return 0, job_id


# Slurm's states of a job that has ended (`scontrol show job`), and GONE (job_state: forgotten).
_ENDED = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED",
          "BOOT_FAIL", "DEADLINE", "GONE"}


def scale_jobs(run_dir) -> tuple[dict[str, list[str]], list[str]]:
    """({job id: [server names]} of the Slurm jobs `launch scale` submitted for this run, read from the
    extra replica rows (rl.contract.elastic); one-line complaints about rows whose job is not a Slurm job
    id). A local backend's row names processes ("local:<pids>"), not a job: not listed."""
    from rl.contract import elastic
    jobs: dict[str, list[str]] = {}
    bad = []
    for i in elastic.extra_indexes(run_dir):
        job = elastic.row_job(run_dir, i)
        if job is None or str(job).startswith("local:"):
            continue
        if not _JOB_ID.fullmatch(str(job)):
            bad.append(f"{elastic.row_file(run_dir, i)}: job={str(job)[:40]!r} is not a Slurm job id (digits only)")
            continue
        jobs.setdefault(str(job), []).append(f"inference_{i}")
    return jobs, bad


def cancel_command(run_dir) -> int:
    """`launch cancel`: scancel the run's current job, then the jobs `launch scale` added to it (their
    servers would otherwise serve a stopped run until their time limit), naming each."""
    import sys
    rc = 0
    try:
        print(f"cancelled job {cancel_run(run_dir)} of {run_dir}")
    except SlurmError as e:  # already ended: its scale jobs are still cancelled below
        print(f"launch cancel: the run's job: {e}", file=sys.stderr)
        rc = 1
    jobs, bad = scale_jobs(run_dir)
    for line in bad:
        print(f"launch cancel: {line}; not cancelled", file=sys.stderr)
        rc = 1
    for job, names in jobs.items():
        what = f"scale job {job} ({', '.join(names)})"
        state = job_state(job)["state"]
        if state in _ENDED:
            print(f"{what}: already ended ({state})")
            continue
        try:
            cancel(job)
            print(f"cancelled {what}")
        except SlurmError as e:
            print(f"launch cancel: {what}: {e}", file=sys.stderr)
            rc = 1
    return rc


def job_status(run_dir, unreadable: list[str]) -> dict:
    """The run's "job" for `launch status`: its id and the scheduler's state (squeue / scontrol)."""
    try:
        job = current_job(run_dir)
    except (ConfigError, OSError) as e:  # a malformed or planted submissions record
        unreadable.append(str(e))
        return {"id": None, "state": "UNKNOWN", "reason": "the job record could not be read"}
    return {"id": job, **(job_state(job) if job else {"state": "NOT SUBMITTED", "reason": ""}),
            "requeues": requeue_reasons(run_dir, unreadable)}


def requeue_reasons(run_dir, unreadable: list[str], last: int = 5) -> list[str]:
    """The newest lines of logs/requeues.log: each stop that asked for a requeue, why (a signal, a role's
    crash, too few inference servers) and what rl.requeue decided (written by the batch script)."""
    try:
        text = safefs.read_text(Path(run_dir) / "logs" / "requeues.log", limit=1 << 20)
    except FileNotFoundError:
        return []
    except OSError as e:
        unreadable.append(f"logs/requeues.log: {e}")
        return []
    return [line for line in text.splitlines() if line.strip()][-last:]


def plan_text(plan: Plan, cfg: dict) -> str:
    """The batch script `launch run` would submit."""
    return render_script(plan, cfg)
