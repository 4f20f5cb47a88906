"""What every role shares at run time: the frozen config, stop signals, resume info, role records.

Each role is `python -m rl.<role> --run-dir DIR`. It reads `DIR/config.yaml` (frozen at first submit)
through the typed schema (rl.contract.config.load), `DIR/plan.json` (rl.contract.plan.Plan) and
`DIR/resume.json` (written by `python -m rl.prepare` before the roles start: which checkpoint this
incarnation resumes from), records where it runs in `DIR/roles/<role>.json`, and watches for SIGTERM
(preemption) and SIGUSR1 (Slurm's time-limit warning): both ask the role to stop at the next step
boundary. No torch here.
"""
from __future__ import annotations

import argparse
import os
import signal
import time
from pathlib import Path

from omegaconf import DictConfig

from rl.contract import config as _config
from rl.contract import paths
from rl.contract.plan import Plan
from rl.contract.records import ResumeState, RoleRecord
from rl.exchange import atomic_write_json, fence

EXIT_PREEMPTED = paths.EXIT_PREEMPTED


def parse_role_args(role: str, argv=None, extra=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog=f"python -m rl.{role}")
    p.add_argument("--run-dir", required=True, type=Path)
    for args, kwargs in (extra or []):
        p.add_argument(*args, **kwargs)
    ns = p.parse_args(argv)
    if not paths.config_file(ns.run_dir).is_file():
        p.error(f"{paths.config_file(ns.run_dir)} not found: is --run-dir a run directory made by `python -m launch`?")
    return ns


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


def record_role(run_dir: str | os.PathLike, role: str, **extra) -> None:
    """Where this role runs: host, pid, Slurm ids (rl.contract.records.RoleRecord). Also fences this
    process's publishing to the incarnation rl.prepare started (rl.exchange.fence)."""
    fence(run_dir, resume_state(run_dir).restart)
    RoleRecord.here(role, **extra).write(run_dir)


def is_done(run_dir: str | os.PathLike) -> bool:
    return paths.done_file(run_dir).exists()


def mark_done(run_dir: str | os.PathLike, **info) -> None:
    atomic_write_json(paths.done_file(run_dir), {"time": time.time(), **info})


def log(role: str, msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')} {role}] {msg}", flush=True)
