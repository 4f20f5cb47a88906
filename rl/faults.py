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
and `action` is `exit` (default: os._exit with EXIT_FAULT, no cleanup, like SIGKILL at that instruction)
or `enospc` (raise OSError(ENOSPC), as a full disk would). Unarmed, `crash_point` is one dict lookup.
No torch: every role and `rl.prepare` call it.
"""
from __future__ import annotations

import errno
import os
import sys

EXIT_FAULT = 97
ENV = "HETRL_FAULT"

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
        raise ValueError(f"{ENV}={spec!r}: expected <point>[@<role>]:<nth>[:exit|enospc], point one of "
                         f"{', '.join(POINTS)}")
    action = parts[2] if len(parts) == 3 else "exit"
    if action not in ("exit", "enospc"):
        raise ValueError(f"{ENV}={spec!r}: action must be exit or enospc")
    return {"point": point, "role": role or None, "nth": int(parts[1]) if len(parts) > 1 else 1,
            "action": action}


def crash_point(name: str, before_exit=None) -> None:
    """Reached `name`: die here (or raise ENOSPC) if this is the armed point's nth time in this process.
    `before_exit` runs first (e.g. to leave half a record behind)."""
    global _armed
    if _armed is None:
        _armed = _parse()
    if not _armed or _armed["point"] != name or (_armed["role"] and _armed["role"] != _role):
        return
    _seen[name] = _seen.get(name, 0) + 1
    if _seen[name] != _armed["nth"]:
        return
    print(f"[fault] {name} reached ({_seen[name]}x, role {_role}): {_armed['action']}", file=sys.stderr,
          flush=True)
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
