"""What every role shares at run time: the frozen config, stop signals, resume info, role records.

Each role is `python -m rl.<role> --run-dir DIR`. It reads `DIR/config.yaml` (frozen at first submit)
and `DIR/resume.json` (written by `python -m rl.prepare` before the roles start: which checkpoint this
incarnation resumes from), records where it runs in `DIR/roles/<role>.json`, and watches for SIGTERM
(preemption) and SIGUSR1 (Slurm's time-limit warning): both ask the role to stop at the next step
boundary. No torch here.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import sys
import time
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from rl.exchange import atomic_write_json

DONE_FILE = "DONE"
# Exit status of a role that stopped early because it was asked to (preemption / time limit): the
# batch script tells this apart from a crash and requeues.
EXIT_PREEMPTED = 3


def parse_role_args(role: str, argv=None, extra=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog=f"python -m rl.{role}")
    p.add_argument("--run-dir", required=True, type=Path)
    for args, kwargs in (extra or []):
        p.add_argument(*args, **kwargs)
    ns = p.parse_args(argv)
    if not (ns.run_dir / "config.yaml").is_file():
        p.error(f"{ns.run_dir}/config.yaml not found: is --run-dir a run directory made by `python -m launch`?")
    return ns


def load_config(run_dir: str | os.PathLike) -> DictConfig:
    return OmegaConf.load(Path(run_dir) / "config.yaml")


def load_plan(run_dir: str | os.PathLike) -> dict:
    p = Path(run_dir) / "plan.json"
    return json.loads(p.read_text()) if p.exists() else {}


def resume_state(run_dir: str | os.PathLike) -> dict:
    """{'checkpoint_step': int|None, 'restart': int}; defaults when prepare has not run (tests)."""
    p = Path(run_dir) / "resume.json"
    if p.exists():
        return json.loads(p.read_text())
    return {"checkpoint_step": None, "restart": 0}


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
    """Where this role runs: host, pid, Slurm ids. Tests and `launch status` read it."""
    info = {
        "role": role, "host": socket.gethostname(), "pid": os.getpid(), "time": time.time(),
        "slurm_job_id": os.environ.get("SLURM_JOB_ID"),
        "slurm_nodename": os.environ.get("SLURMD_NODENAME"),
        "slurm_het_group": os.environ.get("HETRL_HET_GROUP"),
        "slurm_restart_count": int(os.environ.get("SLURM_RESTART_COUNT", "0") or 0),
        "argv": sys.argv, **extra,
    }
    atomic_write_json(Path(run_dir) / "roles" / f"{role}.json", info)
    with open(Path(run_dir) / "roles" / "history.jsonl", "a") as f:
        f.write(json.dumps(info) + "\n")


def is_done(run_dir: str | os.PathLike) -> bool:
    return (Path(run_dir) / DONE_FILE).exists()


def mark_done(run_dir: str | os.PathLike, **info) -> None:
    atomic_write_json(Path(run_dir) / DONE_FILE, {"time": time.time(), **info})


def log(role: str, msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')} {role}] {msg}", flush=True)
