"""Is a process still there, and which one is it: the two looks at a pid that every side needs.

`alive(pid)` asks the kernel with signal 0, which delivers nothing: no such process is "gone", another
user's process (EPERM) is "there". A pid that could not name one process (0 and negatives address
process groups to kill(2), a bool, a number past the C int) is not alive, so a record holding one never
makes its owner look present. A pid alone names a process only until it exits and the number is reused,
so what must not be fooled by reuse also compares `start_ticks(pid)`: field 22 of /proc/<pid>/stat, the
clock ticks since boot at which the process started, exact, so (pid, ticks) names one process for the
machine's uptime; `start_time(pid)` is the same moment as Unix time (plus /proc/stat's boot time) for
comparing with a record's wall-clock time.

They live in the contract, torch-free and standard library only, because both sides use them and rl
must not import the launcher: the launcher's checks of recorded processes (launch.procs, used by
`launch cancel` and `status`), a local role's watch on its launcher (rl.runtime.LauncherWatch, which
compares the ticks the launcher passed it), and the roles' cleanup of what dead predecessors left
(server records, node-local model directories, spill directories, stale router records). Linux only:
without /proc no process has a start time, which errs on the side of signalling nothing.
"""
from __future__ import annotations

import os
from pathlib import Path


def is_pid(value) -> bool:
    """Whether `value` could name one process: a positive int (not a bool) within kill(2)'s C int."""
    return isinstance(value, int) and not isinstance(value, bool) and 0 < value < 2 ** 31


def alive(pid) -> bool:
    """Whether a process with this pid exists (someone else's included)."""
    if not is_pid(pid):
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's live process
        return True
    return True


def start_ticks(pid: int) -> int | None:
    """When process `pid` started, in clock ticks since boot (/proc/<pid>/stat field 22). None if there
    is no such process, it has exited (a zombie), or there is no /proc."""
    try:
        stat = Path(f"/proc/{int(pid)}/stat").read_text()
    except (OSError, ValueError):
        return None
    # the command name (field 2) may contain spaces and parentheses: fields count from the last ')'
    fields = stat[stat.rindex(")") + 2:].split()
    if fields[0] in ("Z", "X"):  # exited, not yet reaped (a container's init may never reap orphans)
        return None
    return int(fields[19])


def boot_time() -> float | None:
    """Unix time of the last boot (/proc/stat `btime`), or None without /proc."""
    try:
        return next(float(ln.split()[1]) for ln in Path("/proc/stat").read_text().splitlines()
                    if ln.startswith("btime "))
    except (OSError, StopIteration, ValueError, IndexError):
        return None


def start_time(pid: int) -> float | None:
    """Unix time at which process `pid` started (whole ticks), or None if there is no such process (or no
    /proc)."""
    ticks = start_ticks(pid)
    boot = boot_time()
    return None if ticks is None or boot is None else boot + ticks / os.sysconf("SC_CLK_TCK")
