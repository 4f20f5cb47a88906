"""Small records in the run directory, as typed structs both writer and readers import.

Each record is one JSON object written atomically; `read` refuses a file whose keys are not the
record's (a half-migrated run directory fails loudly, not with a KeyError deep in a role), and a record
that declares field checks (`_checks`: resume.json, whose restart count fences publishing) also one whose
values have the wrong type, in one line naming the file, key and value. A record that is not a regular
file (a FIFO would block the reader) is refused without being opened. Torch-free.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import socket
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, TypeVar

from rl.contract import paths, safefs
from rl.contract.atomic import atomic_write_json

T = TypeVar("T")
_MAX_RECORD = 16 << 20   # a record is a few KiB; a huge file in its place is refused, not read into memory


class RecordError(ValueError):
    """A record file that does not parse as its record type; the message names the file."""


def _write(path: Path, obj) -> None:
    atomic_write_json(path, dataclasses.asdict(obj))


def _read_bytes(path: Path) -> bytes:
    # no link followed on the way, a FIFO or device in a record's place refused without blocking
    try:
        return safefs.read_bytes(path, limit=_MAX_RECORD)
    except safefs.UnsafePath as e:
        raise RecordError(str(e)) from None


def _read(cls: type[T], path: Path) -> T:
    try:
        data = json.loads(_read_bytes(Path(path)))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise RecordError(f"{path}: not JSON ({e})") from None
    names = {f.name for f in dataclasses.fields(cls)}
    if isinstance(data, dict) and (unknown := set(data) - names):
        raise RecordError(f"{path}: not a {cls.__name__} record (unknown keys {sorted(unknown)})")
    required = {f.name for f in dataclasses.fields(cls)
                if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING}
    if not isinstance(data, dict) or (missing := required - set(data)):
        raise RecordError(f"{path}: not a {cls.__name__} record (missing {sorted(missing) if isinstance(data, dict) else 'all'})")
    for key, (ok, expected) in getattr(cls, "_checks", {}).items():
        if key in data and not ok(data[key]):
            raise RecordError(f"{path}: {key}={data[key]!r} is not {expected}")
    return cls(**data)


def _count(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def _opt_count(v) -> bool:
    return v is None or _count(v)


def _time(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v >= 0


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

    # The restart count is the epoch every publish is fenced with: a value of the wrong type must be
    # refused here, in one line, not turn into a TypeError inside a fence check. (`cleaned_tmp` is the
    # count rl.prepare removed, an int, in every resume.json written so far; a list is accepted as typed.)
    _checks = {
        "checkpoint_step": (_opt_count, "a step number or null"),
        "restart": (_count, "a non-negative integer"),
        "discarded": (lambda v: isinstance(v, dict) and all(
            isinstance(k, str) and isinstance(s, list) and all(_count(n) for n in s) for k, s in v.items()),
            "an object of step lists ({kind: [step, ...]})"),
        "cleaned_tmp": (lambda v: _count(v) or isinstance(v, list), "a count"),
        "time": (_time, "a non-negative time in seconds"),
        "slurm_job_id": (lambda v: v is None or isinstance(v, str), "a string or null"),
    }

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
        safefs.append_bytes(paths.role_history(run_dir), (json.dumps(dataclasses.asdict(self)) + "\n").encode())

    @classmethod
    def read_all(cls, run_dir, refused: list | None = None) -> list["RoleRecord"]:
        """Every role record that can be believed; each one that cannot (an older layout, or refused by the
        trust rule: another user's, writable by others, not a regular file) is left out and, with
        `refused`, its one-line reason appended there for the caller to say."""
        out = []
        for f in sorted(paths.roles_dir(run_dir).glob("*.json")):
            if f.name == paths.trainer_exit(run_dir).name:
                continue
            try:
                out.append(_read(cls, f))
            except (RecordError, OSError) as e:
                if refused is not None:
                    refused.append(" ".join(str(e).split()) or f"{f}: {type(e).__name__}")
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
class ReplicaStart:
    """`inference/replica_<i>.start.json`: the version and load mode the head of multi-node replica i
    chose, for its other nodes (they must load the same weights), tagged with the incarnation that wrote
    it (prepare's restart count and the Slurm job) so a record of an earlier incarnation is never taken."""
    version: int
    fp8: bool
    restart: int
    job: Optional[str] = None

    _checks = {
        "version": (_count, "a policy version"),
        "fp8": (lambda v: isinstance(v, bool), "a boolean"),
        "restart": (_count, "a non-negative integer"),
        "job": (lambda v: v is None or isinstance(v, str), "a string or null"),
    }

    def write(self, run_dir, index: int) -> None:
        _write(paths.replica_start_record(run_dir, index), self)

    @classmethod
    def read(cls, run_dir, index: int) -> Optional["ReplicaStart"]:
        return read_optional(cls, paths.replica_start_record(run_dir, index))


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
    proc_started: Optional[float] = None        # the launcher's start time as /proc gives it (cancel checks it)
    detached: bool = False                      # `launch run --detach`: the roles outlive the launcher on purpose

    # cancel signals what this record names: a value of the wrong type is refused in one line here, not
    # a TypeError inside the liveness check
    _checks = {
        "host": (lambda v: isinstance(v, str), "a host name"),
        "pid": (lambda v: _count(v) and v > 1, "a process id"),
        "started": (_time, "a time in seconds"),
        "roles": (lambda v: isinstance(v, dict) and all(isinstance(k, str) and _count(p) and p > 1
                                                         for k, p in v.items()), "an object of role -> pid"),
        "proc_started": (lambda v: v is None or _time(v), "a time in seconds or null"),
        "detached": (lambda v: isinstance(v, bool), "true or false"),
    }

    def write(self, run_dir) -> None:
        _write(paths.p(run_dir, paths.LOCAL_PIDS), self)

    @classmethod
    def read(cls, run_dir) -> Optional["LocalLauncher"]:
        return read_optional(cls, paths.p(run_dir, paths.LOCAL_PIDS))
