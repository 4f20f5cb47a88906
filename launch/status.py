"""`python -m launch status RUN_DIR`: where a run stands, read from its run directory (and Slurm).

Works on every run, local or Slurm, running or finished: the job state (Slurm: squeue / scontrol, never
sacct; local: whether the launcher process recorded in `local.json` is alive), the step and reward of
the newest metrics line, the newest complete rollouts / weights / checkpoint, and every role's record
(where it ran, whether its process is alive when it ran on this host), and every vLLM server whose
engine core died, with its exception and log line. Records of another layout or a
half-written file are skipped, never a traceback. Torch-free.
"""
from __future__ import annotations

import json
import os
import socket
from pathlib import Path

from rl.contract import paths
from rl.contract.config import ConfigError
from rl.contract.records import LocalLauncher, ResumeState, RoleRecord, read_optional


def _alive(host: str, pid: int) -> str:
    if host != socket.gethostname():
        return f"on {host}"
    try:
        os.kill(pid, 0)
        return "running"
    except ProcessLookupError:
        return "exited"
    except PermissionError:
        return "running"


def _last_metrics(run_dir: Path) -> dict | None:
    try:
        with open(paths.metrics_file(run_dir), "rb") as f:
            f.seek(0, 2)
            f.seek(max(0, f.tell() - 65536))
            lines = [ln for ln in f.read().decode(errors="replace").splitlines() if ln.strip()]
        for ln in reversed(lines):
            try:
                return json.loads(ln)
            except ValueError:
                continue  # a line being appended right now
    except OSError:
        pass
    return None


def status(run_dir: str | os.PathLike) -> dict:
    """Everything `launch status` prints, as a JSON-able dict."""
    import yaml
    from rl import exchange
    run_dir = Path(run_dir).absolute()
    cfg_file = paths.config_file(run_dir)
    if not cfg_file.is_file():
        raise ConfigError(f"{cfg_file}: not found (is {run_dir} a run directory?)")
    cfg = yaml.safe_load(cfg_file.read_text())
    backend = cfg["cluster"]["backend"]
    out: dict = {"run_dir": str(run_dir), "experiment": cfg.get("experiment"), "backend": backend,
                 "max_steps": cfg["trainer"]["max_steps"], "done": paths.done_file(run_dir).exists()}
    if backend == "slurm":
        from launch.slurm import current_job, job_state
        job = current_job(run_dir)
        st = job_state(job) if job else {"state": "NOT SUBMITTED", "reason": ""}
        out["job"] = {"id": job, **st}
    else:
        rec = LocalLauncher.read(run_dir)
        state = "NEVER STARTED" if rec is None else {"running": "RUNNING", "exited": "ENDED"}.get(
            _alive(rec.host, rec.pid), f"ON {rec.host}")
        out["job"] = {"id": None if rec is None else f"local pid {rec.pid}", "state": state, "reason": ""}
    if out["done"] and out["job"]["state"] in ("ENDED", "GONE"):
        out["job"]["state"] = "COMPLETED"
    for kind in (paths.ROLLOUTS, paths.WEIGHTS, paths.CHECKPOINTS):
        steps = exchange.list_steps(run_dir, kind)
        out[f"latest_{kind}"] = steps[-1] if steps else None
    resume = read_optional(ResumeState, paths.resume_file(run_dir))
    out["restart"] = resume.restart if resume else None
    out["roles"] = {r.role: {"host": r.host, "pid": r.pid, "state": _alive(r.host, r.pid),
                             "restart": r.slurm_restart_count} for r in RoleRecord.read_all(run_dir)}
    from rl.contract.vllm_log import engine_deaths  # standard library only
    out["engine_deaths"] = engine_deaths(paths.logs_dir(run_dir))
    m = _last_metrics(run_dir)
    out["step"] = m["step"] + 1 if m and "step" in m else 0
    out["reward"] = m.get("reward_mean") if m else None
    out["last_metrics"] = m
    return out


def render(st: dict, console=None) -> None:
    """Print `status()` as a rich table."""
    from rich.console import Console
    from rich.table import Table
    console = console or Console()
    t = Table(title=f"hetrl run {st['run_dir']}", show_header=False)
    job = st["job"]
    t.add_row("experiment", f"{st['experiment']} ({st['backend']})")
    t.add_row("job", f"{job.get('id') or '-'}  {job['state']}"
              + (f" ({job['reason']})" if job.get("reason") not in (None, "", "None") else ""))
    if job.get("nodes"):
        t.add_row("nodes", "  |  ".join(f"group {i}: {n}" for i, n in enumerate(job["nodes"])))
    t.add_row("restarts", str(st.get("restart")))
    reward = st.get("reward")
    t.add_row("step", f"{st['step']}/{st['max_steps']}" + (f"  reward {reward:.3f}" if reward is not None else ""))
    for kind in (paths.ROLLOUTS, paths.WEIGHTS, paths.CHECKPOINTS):
        t.add_row(f"newest {kind}", str(st.get(f"latest_{kind}")))
    for role, r in sorted(st["roles"].items()):
        t.add_row(f"role {role}", f"{r['state']} (pid {r['pid']} on {r['host']})")
    for server, death in sorted(st.get("engine_deaths", {}).items()):
        t.add_row(f"{server} engine", f"died: {death}")
    m = st.get("last_metrics")
    if m:
        t.add_row("last metrics", "  ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                                            for k, v in list(m.items())[:8]))
    t.add_row("done", "yes" if st["done"] else "no")
    console.print(t)
