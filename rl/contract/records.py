"""Small records in the run directory, as typed structs both writer and readers import.

Each record is one JSON object written atomically; `read` refuses a file whose keys are not the
record's (a half-migrated run directory fails loudly, not with a KeyError deep in a role). Torch-free.
"""
from __future__ import annotations

import dataclasses
import json
import os
import socket
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, TypeVar

from rl.contract import paths

T = TypeVar("T")


class RecordError(ValueError):
    """A record file that does not parse as its record type; the message names the file."""


def _write(path: Path, obj) -> None:
    from rl.exchange import atomic_write_json
    atomic_write_json(path, dataclasses.asdict(obj))


def _read(cls: type[T], path: Path) -> T:
    try:
        data = json.loads(Path(path).read_text())
    except json.JSONDecodeError as e:
        raise RecordError(f"{path}: not JSON ({e})") from None
    names = {f.name for f in dataclasses.fields(cls)}
    required = {f.name for f in dataclasses.fields(cls)
                if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING}
    if not isinstance(data, dict) or (missing := required - set(data)):
        raise RecordError(f"{path}: not a {cls.__name__} record (missing {sorted(missing) if isinstance(data, dict) else 'all'})")
    return cls(**{k: v for k, v in data.items() if k in names})


def read_optional(cls: type[T], path: Path) -> Optional[T]:
    """The record at `path`, or None if there is none (or it is being replaced right now)."""
    try:
        return _read(cls, path)
    except FileNotFoundError:
        return None


@dataclass
class ResumeState:
    """`resume.json`, written by `python -m rl.prepare` before the roles of an incarnation start."""
    checkpoint_step: Optional[int] = None
    restart: int = 0
    discarded: dict = field(default_factory=dict)
    cleaned_tmp: list = field(default_factory=list)
    time: float = 0.0          # when prepare started this incarnation (steps of older ones after it are stale)
    slurm_job_id: Optional[str] = None  # the job running it (with `restart`, the epoch's two parts)

    @classmethod
    def read(cls, run_dir) -> "ResumeState":
        """The state prepare wrote; the first-start state when prepare has not run (in-process tests)."""
        return read_optional(cls, paths.resume_file(run_dir)) or cls()

    def write(self, run_dir) -> None:
        _write(paths.resume_file(run_dir), self)


@dataclass
class RoleRecord:
    """`roles/<role>.json` (and a line of roles/history.jsonl): where a role runs."""
    role: str
    host: str
    pid: int
    time: float
    slurm_job_id: Optional[str] = None
    slurm_nodename: Optional[str] = None
    slurm_het_group: Optional[str] = None
    slurm_restart_count: int = 0
    argv: list = field(default_factory=list)
    extra: dict = field(default_factory=dict)

    @classmethod
    def here(cls, role: str, **extra) -> "RoleRecord":
        return cls(role=role, host=socket.gethostname(), pid=os.getpid(), time=time.time(),
                   slurm_job_id=os.environ.get("SLURM_JOB_ID"),
                   slurm_nodename=os.environ.get("SLURMD_NODENAME"),
                   slurm_het_group=os.environ.get("HETRL_HET_GROUP"),
                   slurm_restart_count=int(os.environ.get("SLURM_RESTART_COUNT", "0") or 0),
                   argv=list(sys.argv), extra=extra)

    def write(self, run_dir) -> None:
        _write(paths.role_record(run_dir, self.role), self)
        with open(paths.role_history(run_dir), "a") as f:
            f.write(json.dumps(dataclasses.asdict(self)) + "\n")

    @classmethod
    def read_all(cls, run_dir) -> list["RoleRecord"]:
        out = []
        for f in sorted(paths.roles_dir(run_dir).glob("*.json")):
            if f.name == paths.trainer_exit(run_dir).name:
                continue
            try:
                out.append(_read(cls, f))
            except (RecordError, OSError):
                continue  # a record of an older layout: status shows the others
        return out


@dataclass
class ServerRecord:
    """`inference/server_<i>.json`: replica i's head is up and serves `url` at policy `version`."""
    url: str
    version: int
    host: str
    pid: int
    index: int
    fp8: bool = False
    log: str = ""
    nodes: int = 1

    def write(self, run_dir) -> None:
        _write(paths.server_record(run_dir, self.index), self)

    @classmethod
    def read(cls, run_dir, index: int) -> Optional["ServerRecord"]:
        return read_optional(cls, paths.server_record(run_dir, index))


@dataclass
class RouterRecord:
    """`inference/router.json`: the router is up at `url`."""
    url: str
    host: str
    port: int
    pid: int
    policy: str = "kv"
    backends: list = field(default_factory=list)

    def write(self, run_dir) -> None:
        _write(paths.router_record(run_dir), self)

    @classmethod
    def read(cls, run_dir) -> Optional["RouterRecord"]:
        return read_optional(cls, paths.router_record(run_dir))


@dataclass
class SandboxServiceRecord:
    """`sandboxes/service_<i>.json`: sandbox service i (rl.envs.swe.service) serves `url`, on `node`
    (Slurm's node name where it runs, else the host name)."""
    url: str
    host: str
    node: str
    pid: int
    index: int
    runtime: str
    time: float = 0.0
    slurm_job_id: Optional[str] = None
    slurm_restart_count: int = 0

    def write(self, run_dir) -> None:
        _write(paths.sandbox_service_record(run_dir, self.index), self)

    @classmethod
    def read(cls, run_dir, index: int) -> Optional["SandboxServiceRecord"]:
        return read_optional(cls, paths.sandbox_service_record(run_dir, index))


@dataclass
class ExitRecord:
    """`roles/trainer.exit.json`: the trainer's status as rank 0 returned it (rl.trainer.torchrun)."""
    rc: int
    reason: Optional[str] = None

    def write(self, run_dir) -> None:
        _write(paths.trainer_exit(run_dir), self)

    @classmethod
    def read(cls, run_dir) -> Optional["ExitRecord"]:
        return read_optional(cls, paths.trainer_exit(run_dir))


@dataclass
class LocalLauncher:
    """`local.json`: the local backend's launcher process (so status and cancel can find it)."""
    host: str
    pid: int
    started: float
    roles: dict = field(default_factory=dict)   # role -> pid

    def write(self, run_dir) -> None:
        _write(paths.p(run_dir, paths.LOCAL_PIDS), self)

    @classmethod
    def read(cls, run_dir) -> Optional["LocalLauncher"]:
        return read_optional(cls, paths.p(run_dir, paths.LOCAL_PIDS))
