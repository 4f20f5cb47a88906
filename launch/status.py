"""`python -m launch status RUN_DIR`: where a run stands, read from its run directory (and Slurm).

Works on every run, local or Slurm, running or finished: the job state (Slurm: squeue / scontrol, never
sacct; local: RUNNING while the launcher recorded in `local.json` or any role of the run is alive, so a
run never reads ENDED while a role trains on), the newest trained step and its reward (a finished run's
last metrics line is the final evaluation's, one step past the last trained one, so it is not the step),
the newest evaluation, the newest complete rollouts / weights / checkpoint, every role's record (where it
ran, whether its process is alive when it ran on this host), and every vLLM server whose engine core
died, with its exception and log line. Torch-free.

Status is what a user runs when something went wrong, so it must work on a run directory in any state,
written by anyone: each record is read on its own (through rl.contract.safefs: no link followed, a FIFO
refused instead of blocked on, a record another user owns or can write refused), and one that does not
parse, has a field of the wrong type (a pid that is a string, a metrics line that is a list or `NaN`), or
sits where a record should not be, is left out and named in one line under `unreadable`, which `render`
prints at the end; the rest of the status is still shown. What is printed goes through rich with markup escaped: a host name like `[/x]` in a record
is text, not a markup error. Two records are the answer instead, in one line: a config.yaml that cannot
be read (not a run directory) and a malformed resume.json (the run's epoch: it cannot start again from it).
"""
from __future__ import annotations

import json
import math
import os
import socket
from pathlib import Path

from launch.backends import executor
from launch.procs import Recorded
from rl.contract import backends, paths, safefs
from rl.contract.config import ConfigError
from rl.contract.records import RecordError, ResumeState, RoleRecord, read_optional

_TAIL = 65536          # bytes of metrics.jsonl read from its end
_CONFIG_LIMIT = 16 << 20


def _is_pid(pid) -> bool:
    return isinstance(pid, int) and not isinstance(pid, bool) and pid > 0


def alive(host, pid) -> str:
    """Whether process `pid` recorded on `host` runs: running, exited, on <host>, or not a pid."""
    if not _is_pid(pid):
        return f"not a pid ({str(pid)[:40]!r})"
    if host != socket.gethostname():
        return f"on {str(host)[:80]}"
    try:
        os.kill(pid, 0)
        return "running"
    except ProcessLookupError:
        return "exited"
    except PermissionError:
        return "running"
    except OverflowError:  # a pid past the C int range
        return f"not a pid ({pid})"


def _last_metrics(run_dir: Path, unreadable: list[str]) -> tuple[dict | None, dict | None]:
    """(the newest training step's line, the newest line with an evaluation) among the complete lines of
    metrics.jsonl that are objects with a step number. A finished run's last line is the final
    evaluation's (`step` = max_steps, no loss: rl.metrics.is_eval_only), so the step trained and its
    reward come from the line before it."""
    path = paths.metrics_file(run_dir)
    try:
        fd = safefs.open_read(path)
    except FileNotFoundError:
        return None, None
    except OSError as e:
        unreadable.append(str(e) if isinstance(e, safefs.UnsafePath) else f"{path}: {e.strerror or e}")
        return None, None
    try:
        size = os.fstat(fd).st_size
        data = os.pread(fd, _TAIL, max(0, size - _TAIL))
    finally:
        os.close(fd)
    step = evaluation = None
    for ln in reversed([ln for ln in data.decode(errors="replace").splitlines() if ln.strip()]):
        try:
            m = json.loads(ln)
        except ValueError:
            continue  # a line being appended right now, or the cut-off first line of the tail
        if not isinstance(m, dict) or ("step" in m and not _is_step(m["step"])):
            continue
        if evaluation is None and "eval/version" in m:
            evaluation = m
        if step is None and not ("eval/version" in m and "loss" not in m):
            step = m
        if step is not None and evaluation is not None:
            break
    return step, evaluation


def _is_step(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def _number(v) -> float | None:
    if not isinstance(v, (int, float)) or isinstance(v, bool):
        return None
    try:
        v = float(v)
    except OverflowError:
        return None
    return v if math.isfinite(v) else None


def _config(run_dir: Path) -> dict:
    import yaml
    cfg_file = paths.config_file(run_dir)
    try:
        text = safefs.read_text(cfg_file, limit=_CONFIG_LIMIT)
    except FileNotFoundError:
        raise ConfigError(f"{cfg_file}: not found (is {run_dir} a run directory?)") from None
    except UnicodeDecodeError:
        raise ConfigError(f"{cfg_file}: not UTF-8 text") from None
    try:
        cfg = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise ConfigError(f"{cfg_file}: not YAML ({' '.join(str(e).split())[:200]})") from None
    backend = cfg.get("cluster", {}).get("backend") if isinstance(cfg, dict) and isinstance(
        cfg.get("cluster"), dict) else None
    if backend not in backends.BY_NAME:
        raise ConfigError(f"{cfg_file}: cluster.backend={str(backend)[:40]!r} is not one of "
                          f"{', '.join(backends.NAMES)} (not a config.yaml the launcher wrote)")
    return cfg


def _role_records(run_dir: Path, unreadable: list[str]) -> list[RoleRecord]:
    """Every `roles/<role>.json` that reads as a RoleRecord. Each is read through safefs (records): one
    another user owns or can write (its pid would be signalled by `launch cancel`), a link or a FIFO, is
    refused without blocking and named under `unreadable` with the others that do not parse."""
    roles = paths.roles_dir(run_dir)
    try:
        names = sorted(n for n, _ in safefs.scandir(roles))
    except OSError as e:   # RUN/roles is a link or not a directory
        unreadable.append(str(e))
        return []
    out = []
    for name in names:
        if not name.endswith(".json") or name.startswith(".") or name == paths.trainer_exit(run_dir).name:
            continue
        try:
            if (r := read_optional(RoleRecord, roles / name)) is not None:
                out.append(r)
        except (RecordError, OSError) as e:
            unreadable.append(str(e))
    return out


def _roles(run_dir: Path, unreadable: list[str]) -> dict:
    out = {}
    for r in _role_records(run_dir, unreadable):
        if not (isinstance(r.role, str) and isinstance(r.host, str) and _is_pid(r.pid)):
            unreadable.append(f"{paths.roles_dir(run_dir)}: a record of role {str(r.role)[:40]!r} has "
                              f"host={str(r.host)[:40]!r} pid={str(r.pid)[:20]!r} (not a host and pid)")
            continue
        state = alive(r.host, r.pid)
        if state == "running":   # and still that role: not a reused pid (launch.procs.Recorded)
            state = "running" if Recorded(f"role {r.role}", r.host, r.pid, r.time, run_dir).alive()[0] else "exited"
        out[r.role] = {"host": r.host, "pid": r.pid, "state": state, "restart": r.slurm_restart_count}
    return out


def _engine_deaths(logs: Path, unreadable: list[str]) -> dict[str, str]:
    """rl.contract.vllm_log's reading of every `*.vllm.log`, for the regular files only: a FIFO planted
    as a log would block its reader, and a link would read someone else's file. The directory is listed
    through safefs too: `logs/` planted as a link is named, not listed."""
    from rl.contract.vllm_log import describe  # standard library only
    try:
        names = sorted(n for n, _ in safefs.scandir(logs) if n.endswith(".vllm.log"))
    except OSError as e:
        unreadable.append(str(e) if isinstance(e, safefs.UnsafePath) else f"{logs}: {e.strerror or e}")
        return {}
    out = {}
    for name in names:
        try:
            safefs.check_path(logs / name, kind="file")
        except safefs.UnsafePath as e:
            unreadable.append(str(e))
            continue
        if (d := describe(logs / name)) is not None:
            out[name.split(".")[0]] = d
    return out


def status(run_dir: str | os.PathLike) -> dict:
    """Everything `launch status` prints, as a JSON-able dict. Records that could not be used are named
    under "unreadable", one line each."""
    from rl import exchange
    run_dir = safefs.resolve_run_dir(run_dir)
    cfg = _config(run_dir)
    unreadable: list[str] = []
    backend = cfg["cluster"]["backend"]
    trainer = cfg.get("trainer") if isinstance(cfg.get("trainer"), dict) else {}
    out: dict = {"run_dir": str(run_dir), "experiment": cfg.get("experiment"), "backend": backend,
                 "max_steps": trainer.get("max_steps"), "done": os.path.lexists(paths.done_file(run_dir))}
    out["job"] = executor(backend).job_status(run_dir, unreadable)
    if out["done"] and out["job"]["state"] in ("ENDED", "GONE"):
        out["job"]["state"] = "COMPLETED"
    for kind in (paths.ROLLOUTS, paths.WEIGHTS, paths.CHECKPOINTS):
        try:
            steps = exchange.list_steps(run_dir, kind)
        except OSError as e:  # RUN/<kind> is a link or not a directory
            unreadable.append(str(e))
            steps = []
        out[f"latest_{kind}"] = steps[-1] if steps else None
    # resume.json is the run's epoch: a run cannot start again from a malformed one, so that is the
    # answer (RecordError, one line naming the file and key), not a row among the others
    resume = read_optional(ResumeState, paths.resume_file(run_dir))
    out["restart"] = resume.restart if resume else None
    out["roles"] = _roles(run_dir, unreadable)
    out["engine_deaths"] = _engine_deaths(paths.logs_dir(run_dir), unreadable)
    try:   # inference servers up / planned, and those `launch scale` added (launch/scale.py)
        from launch.scale import servers_status
        out["servers"] = servers_status(run_dir)
    except Exception as e:  # noqa: BLE001  a run dir without a readable plan
        unreadable.append(f"inference servers: {e}")
    m, evaluation = _last_metrics(run_dir, unreadable)
    out["step"] = m["step"] + 1 if m and "step" in m else 0   # steps trained (line `step` is 0-based)
    out["reward"] = _number(m.get("reward_mean")) if m else None
    out["last_metrics"] = m
    out["last_eval"] = ({k: v for k, v in evaluation.items() if k == "eval/version" or k.startswith("eval/pass@")
                         or k in ("eval/reward_mean", "eval/tasks", "eval/error")} if evaluation else None)
    out["unreadable"] = unreadable
    return out


def _cell(v, limit: int = 120) -> str:
    text = str(v)
    return text if len(text) <= limit else text[:limit] + "..."


def render(st: dict, console=None) -> None:
    """Print `status()` as a rich table (every value escaped: records are data, not markup)."""
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table
    console = console or Console()

    def row(k, v) -> None:
        t.add_row(escape(_cell(k, 60)), escape(_cell(v, 300)))

    t = Table(title=escape(f"hetrl run {st['run_dir']}"), show_header=False)
    job = st["job"]
    row("experiment", f"{st['experiment']} ({st['backend']})")
    row("job", f"{job.get('id') or '-'}  {job['state']}"
        + (f" ({job['reason']})" if job.get("reason") not in (None, "", "None") else ""))
    if job.get("nodes"):
        row("nodes", "  |  ".join(f"group {i}: {n}" for i, n in enumerate(job["nodes"])))
    row("restarts", st.get("restart"))
    for line in job.get("requeues") or []:   # each stop that asked for a requeue, and why (launch/slurm.py)
        row("requeue", line)
    reward = st.get("reward")
    row("step", f"{st['step']}/{st['max_steps']}" + (f"  reward {reward:.3f}" if reward is not None else ""))
    ev = st.get("last_eval")
    if ev:
        row("evaluation", f"policy v{ev.get('eval/version')}: " + (f"failed: {ev['eval/error']}" if "eval/error" in ev
            else "  ".join(f"{k[5:]} {v:.3f}" if isinstance(v, float) else f"{k[5:]} {v}"
                           for k, v in ev.items() if k not in ("eval/version", "eval/error"))))
    for kind in (paths.ROLLOUTS, paths.WEIGHTS, paths.CHECKPOINTS):
        row(f"newest {kind}", st.get(f"latest_{kind}"))
    for role, r in sorted(st["roles"].items()):
        row(f"role {role}", f"{r['state']} (pid {r['pid']} on {r['host']})")
    if sv := st.get("servers"):
        row("inference servers", f"{sv['up']} up / {sv['planned']} planned" + "".join(
            f"  |  inference_{x['index']} (job {x['job']}): " + ("drained" if x["drained"] else "up" if x["up"] else "starting")
            for x in sv["extra"]))
    for server, death in sorted(st.get("engine_deaths", {}).items()):
        row(f"{server} engine", f"died: {death}")
    m = st.get("last_metrics")
    if m:
        row("last metrics", "  ".join(f"{_cell(k, 40)}={v:.4g}" if isinstance(v, float) else
                                      f"{_cell(k, 40)}={_cell(v, 40)}" for k, v in list(m.items())[:8]))
    row("done", "yes" if st["done"] else "no")
    for line in st.get("unreadable", [])[:20]:
        row("not read", line)
    if len(st.get("unreadable", [])) > 20:
        row("not read", f"... and {len(st['unreadable']) - 20} more")
    console.print(t)
