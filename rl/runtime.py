"""What every role shares at run time: the frozen config, stop signals, resume info, role records.

Each role is `python -m rl.<role> --run-dir DIR`. It reads `DIR/config.yaml` (frozen at first submit)
through the typed schema (rl.contract.config.load), `DIR/plan.json` (rl.contract.plan.Plan) and
`DIR/resume.json` (written by `python -m rl.prepare` before the roles start: which checkpoint this
incarnation resumes from), records where it runs in `DIR/roles/<role>.json`, and watches for SIGTERM
(preemption) and SIGUSR1 (Slurm's time-limit warning): both ask the role to stop at the next step
boundary. No torch here.

A role of a local run also stops when its launcher is gone (`LauncherWatch`): the launcher starts the
roles in sessions of their own, so a SIGKILLed launcher or a closed terminal would otherwise leave them
training with nobody watching. The launcher arms the kernel's parent-death signal on the processes it
starts; this watch is the second half, for every process of a role (a torchrun rank, whose parent is the
agent, not the launcher): it polls the launcher's pid and /proc start time, passed in HETRL_LAUNCHER, and
on a mismatch sends this process SIGTERM, so the role drains the way a stop always does (finish the
step, checkpoint, exit). The launcher's pid and start time come in the environment rather than from
local.json because local.json is written after the roles start, and the start time makes a reused pid
count as gone. `launch run --detach` and the Slurm batch script do not set it: there the roles outlive
whoever started them on purpose.
"""
from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from pathlib import Path

from omegaconf import DictConfig

from rl import faults
from rl.contract import config as _config
from rl.contract import paths, safefs
from rl.contract.procs import start_ticks
from rl.contract.plan import Plan
from rl.contract.records import RecordError, ResumeState, RoleRecord
from rl.contract.atomic import atomic_write_json
from rl.contract.safefs import UnsafePath, resolve_run_dir
from rl.exchange import check_fence, fence

EXIT_PREEMPTED = paths.EXIT_PREEMPTED


def parse_role_args(role: str, argv=None, extra=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog=f"python -m rl.{role}")
    p.add_argument("--run-dir", required=True, type=Path)
    for args, kwargs in (extra or []):
        p.add_argument(*args, **kwargs)
    ns = p.parse_args(argv)
    # resolved once, here: a run under a symlinked path works; below it every reader and writer refuses
    # links (rl.contract.safefs, docs/run-directory-safety.md)
    ns.run_dir = resolve_run_dir(ns.run_dir)
    if not paths.config_file(ns.run_dir).is_file():
        p.error(f"{paths.config_file(ns.run_dir)} not found: is --run-dir a run directory made by `python -m launch`?")
    # the trust boundary (docs/run-directory-safety.md): what this role and its children create is the
    # user's alone, and a run directory someone else owns or can write is refused before anything is read
    safefs.private_umask()
    try:
        safefs.check_run_dir_private(ns.run_dir, paths.PRIVATE_DIRS)
    except UnsafePath as e:
        p.error(str(e))
    start_watchdog(role, load_config(ns.run_dir).cluster.stall_timeout_s)
    try:
        watch_launcher(role)
    except ValueError as e:
        p.error(str(e))
    faults.set_role(role)
    _one_line_refusals(role)
    return ns


def _one_line_refusals(role: str) -> None:
    """A role that stops on a planted link or FIFO (UnsafePath) or a record that fails its schema
    (RecordError) says so in one line naming the path, not in a traceback: the message is the whole
    story, and `launch status` shows a log's last line."""
    previous = sys.excepthook

    def hook(kind, value, tb):
        if isinstance(value, (UnsafePath, RecordError)):
            print(f"rl.{role}: refused: {value}", file=sys.stderr, flush=True)
            return
        previous(kind, value, tb)
    sys.excepthook = hook


def load_config(run_dir: str | os.PathLike) -> DictConfig:
    """The run's frozen config on the schema: typed, with the schema's defaults (read-only)."""
    return _config.load(run_dir)


def load_plan(run_dir: str | os.PathLike) -> Plan:
    return Plan.read(run_dir)


def resume_state(run_dir: str | os.PathLike) -> ResumeState:
    return ResumeState.read(run_dir)


class StopFlag:
    """Set by SIGTERM / SIGUSR1 (and SIGINT): the role finishes its step, checkpoints, exits."""

    def __init__(self, install: bool = True):
        self.reason: str | None = None
        if install:
            for sig in (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT):
                signal.signal(sig, self._handler)

    def _handler(self, signum, frame):
        if self.reason is None:
            self.reason = signal.Signals(signum).name
            print(f"[{os.getpid()}] {self.reason} received: stopping at the next step boundary", flush=True)
        elif signum == signal.SIGINT:
            raise KeyboardInterrupt

    def set(self, reason: str = "requested") -> None:
        self.reason = self.reason or reason

    def is_set(self) -> bool:
        return self.reason is not None


EPOCH_ENV = "HETRL_EPOCH"


def own_epoch(run_dir: str | os.PathLike) -> int:
    """The incarnation this process was launched for: HETRL_EPOCH, which the launcher (the local one, or
    the batch script) sets from resume.json right after rl.prepare and before it starts any role. Read
    from resume.json only where no launcher set it (a role started by hand, in-process tests). Not
    resume.json at the role's own start: a role stopped before it got that far (SIGSTOP, a node frozen)
    and continued after the next incarnation's prepare would read the newer epoch and take it for its
    own (a fault trial caught a stopped trainer doing exactly that, and its metrics doubled).
    A value that is not a non-negative integer is refused in one line (ValueError naming it), as a
    malformed resume.json is (rl.contract.records.RecordError)."""
    env = os.environ.get(EPOCH_ENV)
    if env in (None, ""):
        return resume_state(run_dir).restart
    if not (env.isascii() and env.isdigit()):
        raise ValueError(f"{EPOCH_ENV}={env!r}: not a non-negative integer (the launcher sets it from "
                         f"{paths.resume_file(run_dir)})")
    return int(env)


def record_role(run_dir: str | os.PathLike, role: str, **extra) -> None:
    """Where this role runs: host, pid, Slurm ids (rl.contract.records.RoleRecord). Also fences this
    process's publishing to the incarnation it was launched for (own_epoch, rl.exchange.fence), and
    refuses to start at all if a newer one has started since."""
    fence(run_dir, own_epoch(run_dir))
    check_fence(run_dir, f"starting {role}")
    RoleRecord.here(role, **extra).write(run_dir)


def is_done(run_dir: str | os.PathLike) -> bool:
    return paths.done_file(run_dir).exists()


def mark_done(run_dir: str | os.PathLike, **info) -> None:
    atomic_write_json(paths.done_file(run_dir), {"time": time.time(), **info})


def log(role: str, msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')} {role}] {msg}", flush=True)


EXIT_STALLED = paths.EXIT_STALLED


class Watchdog:
    """Ends this role when it has waited too long for its input without any progress.

    A role whose producer is stuck (a trainer that hangs in a collective, an orchestrator whose servers
    stopped answering, weights that never come) would otherwise hold its whole allocation until the time
    limit, and then be requeued into the same hang. Every wait of a role for another role's output is
    announced here (`waiting(what)`), every step of progress clears it (`progress()`); a daemon thread
    ends the process with EXIT_STALLED and one line naming what it waited for once a wait exceeds
    `cluster.stall_timeout_s`. The exit is a failure, not a stop, so the batch script ends the job without
    requeueing it. os._exit, because the main thread is the stuck one: a trainer's pending publish is left
    as a tmp directory, which the next prepare removes; a vLLM child goes with its parent (PDEATHSIG).
    """

    def __init__(self, role: str, timeout_s: float, poll_s: float = 1.0, exit=os._exit):
        import threading
        self.role, self.timeout_s, self.poll_s, self._exit = role, float(timeout_s), poll_s, exit
        self.what: str | None = None
        self.since = time.monotonic()
        self._lock = threading.Lock()
        if self.timeout_s > 0:
            threading.Thread(target=self._watch, name=f"{role}-watchdog", daemon=True).start()

    def waiting(self, what: str) -> None:
        """This role now waits for `what` (the same `what` again keeps the original start)."""
        with self._lock:
            if what != self.what:
                self.what, self.since = what, time.monotonic()

    def progress(self) -> None:
        with self._lock:
            self.what = None

    def stalled_for(self) -> float:
        with self._lock:
            return 0.0 if self.what is None else time.monotonic() - self.since

    def _watch(self) -> None:
        while True:
            time.sleep(self.poll_s)
            with self._lock:
                what, waited = self.what, time.monotonic() - self.since
            if what is not None and waited > self.timeout_s:
                log(self.role, f"STALLED: no progress for {waited:.0f} s while waiting for {what} "
                               f"(cluster.stall_timeout_s={self.timeout_s:g}); ending the role")
                self._exit(EXIT_STALLED)
                return


_WATCHDOG: Watchdog | None = None


def start_watchdog(role: str, timeout_s: float) -> Watchdog:
    """The process's watchdog (one per role process)."""
    global _WATCHDOG
    _WATCHDOG = Watchdog(role, timeout_s)
    return _WATCHDOG


def waiting(what: str) -> None:
    if _WATCHDOG is not None:
        _WATCHDOG.waiting(what)


def progress() -> None:
    if _WATCHDOG is not None:
        _WATCHDOG.progress()


class waiting_for:
    """`with waiting_for(what):` the block is a wait for another role's output; however it ends (the
    output came, a stop, an error), the wait is over: a role shutting down after it is not stalled."""

    def __init__(self, what: str):
        self.what = what

    def __enter__(self):
        waiting(self.what)
        return self

    def __exit__(self, *exc):
        progress()
        return False


LAUNCHER_ENV = "HETRL_LAUNCHER"   # "PID:START_TICKS" of the local launcher a role stops without


def launcher_identity(value: str) -> tuple[int, int]:
    """(pid, start ticks) from HETRL_LAUNCHER's value; anything else is a ValueError naming it."""
    pid, _, ticks = value.partition(":")
    if not (pid.isascii() and pid.isdigit() and ticks.isascii() and ticks.isdigit()):
        raise ValueError(f"{LAUNCHER_ENV}={value!r}: not PID:START_TICKS (the local launcher sets it)")
    return int(pid), int(ticks)


class LauncherWatch:
    """A daemon thread that calls `stop` once the launcher named by (pid, start ticks) is gone."""

    def __init__(self, role: str, pid: int, ticks: int, poll_s: float = 1.0, stop=None):
        import threading
        self.role, self.pid, self.ticks, self.poll_s = role, pid, ticks, poll_s
        self._stop = stop or (lambda: os.kill(os.getpid(), signal.SIGTERM))
        self.fired = threading.Event()
        threading.Thread(target=self._watch, name=f"{role}-launcher-watch", daemon=True).start()

    def _watch(self) -> None:
        while start_ticks(self.pid) == self.ticks:
            time.sleep(self.poll_s)
        log(self.role, f"the launcher (pid {self.pid}) is gone: stopping at the next step boundary "
                       f"(python -m launch run --detach runs roles that outlive their launcher)")
        self.fired.set()
        self._stop()


def watch_launcher(role: str) -> LauncherWatch | None:
    """Start the launcher watch when the local launcher asked for one (HETRL_LAUNCHER set)."""
    value = os.environ.get(LAUNCHER_ENV)
    if not value:
        return None
    pid, ticks = launcher_identity(value)
    return LauncherWatch(role, pid, ticks)
