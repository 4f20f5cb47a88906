"""Is a recorded process still the one that was recorded? (local runs: cancel, a second launcher)

Run directories record the pid of the launcher and of every role. A pid alone names nothing for long:
after a reboot, or on another host sharing the filesystem, or once the process ended and the kernel
reused its number, signalling it hits an unrelated process. So a record counts as a live process only
if it was written on this host and the process with that pid started no later than the record was
written (a reused pid started after the record existed). The start time comes from /proc/<pid>/stat
(field 22, clock ticks since boot) plus the boot time from /proc/stat, so it needs Linux; elsewhere no
record is ever taken for alive, which errs on the side of signalling nothing.

A record is data anyone with write access to the run directory can craft (a shared filesystem, a copied
run directory), and its own time can say anything. So the process itself must also show it belongs to
this run, as read from /proc and never from the record: a role's command line carries
`--run-dir RUN_DIR` (the planned command of every role), a launcher holds `RUN_DIR/launcher.lock` open
for its whole life. A pid that shows neither is another process, whatever the record says.
"""
from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from pathlib import Path

# A record is written a moment after its process starts; the clock-tick start time is rounded to ticks.
_SLACK_S = 2.0


def process_start_time(pid: int) -> float | None:
    """Unix time at which process `pid` started, or None if there is no such process (or no /proc)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        boot = next(float(ln.split()[1]) for ln in Path("/proc/stat").read_text().splitlines()
                    if ln.startswith("btime "))
    except (OSError, StopIteration, ValueError):
        return None
    # the command name (field 2) may contain spaces and parentheses: fields count from the last ')'
    fields = stat[stat.rindex(")") + 2:].split()
    if fields[0] in ("Z", "X"):  # exited, not yet reaped (a container's init may never reap orphans)
        return None
    return boot + int(fields[19]) / os.sysconf("SC_CLK_TCK")


LOCK = "launcher.lock"   # held open by a local launcher for its whole life (launch.local)


def _same_path(a: str, b: Path) -> bool:
    return os.path.realpath(a) == os.path.realpath(b)


def runs_for(pid: int, what: str, run_dir: Path) -> tuple[bool, str]:
    """Does process `pid` show, in /proc, that it belongs to the run in `run_dir`? A launcher holds the
    run's lock file open; a role was started with `--run-dir RUN_DIR`."""
    if what == "launcher":
        lock = run_dir / LOCK
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
            if any(_same_path(os.readlink(f"/proc/{pid}/fd/{fd}"), lock) for fd in fds if fd.isdigit()):
                return True, ""
        except OSError:  # gone, or another user's process: not ours to signal
            pass
        return False, f"pid {pid} does not hold {lock} (not this run's launcher)"
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        argv = []
    for i, a in enumerate(argv):
        value = argv[i + 1] if a == "--run-dir" and i + 1 < len(argv) else a.partition("--run-dir=")[2]
        if value and _same_path(value, run_dir):
            return True, ""
    return False, f"pid {pid} was not started with --run-dir {run_dir} (not a role of this run)"


@dataclass
class Recorded:
    """One recorded process: what a run directory says about it."""
    what: str          # e.g. "role trainer", "launcher"
    host: str
    pid: int
    recorded_at: float  # when the record was written (the process existed by then)
    run_dir: Path      # the run the record came from: the process must show it belongs to it

    def alive(self) -> tuple[bool, str]:
        """(is it that process?, why not)."""
        here = socket.gethostname()
        if self.host != here:
            return False, f"recorded on host {self.host}, this is {here}"
        if not isinstance(self.pid, int) or isinstance(self.pid, bool) or self.pid <= 1:
            return False, f"pid {self.pid!r} is not a process a run could own"
        if not isinstance(self.recorded_at, (int, float)) or isinstance(self.recorded_at, bool):
            return False, f"record time {self.recorded_at!r} is not a time"
        started = process_start_time(self.pid)
        if started is None:
            return False, f"pid {self.pid} is gone"
        if started > self.recorded_at + _SLACK_S:
            return False, f"pid {self.pid} now belongs to a process started after the record (reused)"
        return runs_for(self.pid, "launcher" if self.what == "launcher" else "role", self.run_dir)


def signal_recorded(procs: list[Recorded], signum: int) -> tuple[list[Recorded], list[tuple[Recorded, str]]]:
    """Send `signum` to every recorded process that is still the one recorded.
    Returns (signalled, [(skipped, why)])."""
    done, skipped = [], []
    for r in procs:
        ok, why = r.alive()
        if not ok:
            skipped.append((r, why))
            continue
        try:
            os.kill(r.pid, signum)
            done.append(r)
        except ProcessLookupError:
            skipped.append((r, f"pid {r.pid} ended just now"))
    return done, skipped
