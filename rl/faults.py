"""Named crash points: where a fault trial can make a process die (or its disk fill) on purpose.

The run-directory protocol claims that a process may die at any instruction without losing or doubling
anything. Killing processes at random moments tests that only where the moments happen to fall; the
dangerous places are few and known (between a manifest and its rename, between the two renames of an
overwrite, halfway through a log line, inside a checkpoint or a prune, inside prepare, between a server's
pause and resume), so each has a name here and `benchmarks/fault_trials.py` can aim at it.

A point is armed through the environment, read once per process:

    HETRL_FAULT=<point>[@<role>]:<nth>[:<action>]

`point` is a name passed to `crash_point` (see `POINTS`), `role` limits it to one role's processes (the
role a process announced with `set_role`), `nth` fires on the nth time the point is reached (1 = first),
and `action` is `exit` (default: os._exit with EXIT_FAULT, no cleanup, like SIGKILL at that instruction),
`enospc` (raise OSError(ENOSPC), as a full disk would) or `stall` (sleep there for HETRL_FAULT_STALL_S
seconds, default 120, then go on: a harness kills or cancels the process while it is known to be
inside the point, e.g. scancel during prepare). Unarmed, `crash_point` is one dict lookup.

With `HETRL_FAULT_LOG=<file>` every pass of the armed point (in the armed role) appends one JSON line to
that file (point, role, pid, host, pass number, time, and `fired` with the action on the pass that
fires), and the passes are counted there, across processes and incarnations, instead of per process: a
point armed in a Slurm job's environment, which a requeued incarnation inherits, then fires once in the
whole job, and the harness has the proof that it fired (and in which process) rather than a guess.
No torch: every role and `rl.prepare` call it.
"""
from __future__ import annotations

import errno
import json
import os
import socket
import sys
import time

from rl.contract import safefs

EXIT_FAULT = 97
ENV = "HETRL_FAULT"
LOG_ENV = "HETRL_FAULT_LOG"
STALL_ENV = "HETRL_FAULT_STALL_S"
ACTIONS = ("exit", "enospc", "stall")

POINTS = {
    "commit.before_manifest": "exchange.commit: files written and fsynced, no manifest yet",
    "commit.before_rename": "exchange.commit: manifest written, step not renamed into place",
    "commit.between_renames": "exchange.commit with overwrite: old step moved aside, new one not in place",
    "prune.mid": "exchange.prune: some old steps removed, others not",
    "jsonl.torn": "exchange.append_jsonl: half a record written",
    "checkpoint.save": "trainer: a checkpoint being written (enospc: the disk is full)",
    "weights.publish": "trainer: weights written by every rank, not committed",
    "prepare.mid": "rl.prepare: tmp leftovers cleaned, resume.json not yet written",
    "reload.paused": "orchestrator: servers paused for a weight load, not resumed",
}

_role: str | None = None
_armed: dict | None = None
_seen: dict[str, int] = {}


def set_role(role: str) -> None:
    global _role
    _role = role


def _parse() -> dict:
    spec = os.environ.get(ENV, "")
    if not spec:
        return {}
    parts = spec.split(":")
    point, _, role = parts[0].partition("@")
    if point not in POINTS or len(parts) > 3:
        raise ValueError(f"{ENV}={spec!r}: expected <point>[@<role>]:<nth>[:{'|'.join(ACTIONS)}], point one "
                         f"of {', '.join(POINTS)}")
    action = parts[2] if len(parts) == 3 else "exit"
    if action not in ACTIONS:
        raise ValueError(f"{ENV}={spec!r}: action must be one of {', '.join(ACTIONS)}")
    return {"point": point, "role": role or None, "nth": int(parts[1]) if len(parts) > 1 else 1,
            "action": action, "log": _log_path(os.environ.get(LOG_ENV))}


def _log_path(value: str | None) -> str | None:
    """The harness's log file with its directory resolved once (a link on the way to where the harness
    put it is its own choice); below that, safefs refuses links (a planted one at the file itself)."""
    if not value:
        return None
    return os.path.join(safefs.resolve_run_dir(os.path.dirname(os.path.abspath(value))), os.path.basename(value))


def _next_pass(path: str) -> int:
    """The number (1-based) of this pass of the armed point over every process that logged one so far."""
    try:
        data = safefs.read_bytes(path)
    except FileNotFoundError:
        return 1
    return sum(1 for ln in data.splitlines() if ln.strip()) + 1


def _write_pass(path: str, rec: dict) -> None:
    """One fsynced line, one O_APPEND write through rl.contract.safefs (a link or FIFO planted at the log is
    refused): not rl.exchange's appender, which is itself a crash point."""
    safefs.append_bytes(path, (json.dumps(rec) + "\n").encode())


def read_log(path) -> list[dict]:
    """The passes recorded in a HETRL_FAULT_LOG file (a torn line is skipped)."""
    out = []
    try:
        lines = safefs.read_bytes(path).decode("utf-8", "replace").splitlines()
    except FileNotFoundError:
        return out
    for ln in lines:
        try:
            out.append(json.loads(ln))
        except ValueError:
            continue
    return out


def crash_point(name: str, before_exit=None) -> None:
    """Reached `name`: die here (raise ENOSPC, stall) if this is the armed point's nth time in this process
    (in the whole run with HETRL_FAULT_LOG). `before_exit` runs first (e.g. to leave half a record behind)."""
    global _armed
    if _armed is None:
        _armed = _parse()
    if not _armed or _armed["point"] != name or (_armed["role"] and _armed["role"] != _role):
        return
    _seen[name] = _seen.get(name, 0) + 1
    n = _seen[name]
    if _armed["log"]:  # counted across processes: the nth pass of the whole run, not of this process
        n = _next_pass(_armed["log"])
        fires = n == _armed["nth"]
        _write_pass(_armed["log"], {"point": name, "role": _role, "pid": os.getpid(), "host": socket.gethostname(),
                                    "pass": n, "time": time.time(), "fired": _armed["action"] if fires else None})
    if n != _armed["nth"]:
        return
    print(f"[fault] {name} reached ({n}x, role {_role}): {_armed['action']}", file=sys.stderr,
          flush=True)
    if _armed["action"] == "stall":
        time.sleep(float(os.environ.get(STALL_ENV, "120")))
        return
    if _armed["action"] == "enospc":
        raise OSError(errno.ENOSPC, f"No space left on device (fault {name})")
    if before_exit is not None:
        before_exit()
    os._exit(EXIT_FAULT)


def reset() -> None:
    """Read HETRL_FAULT again and forget the counts (tests)."""
    global _armed
    _armed = None
    _seen.clear()
