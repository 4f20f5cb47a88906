"""Is a recorded process still the one that was recorded? (local runs: cancel, a second launcher)

Run directories record the pid of the launcher and of every role. A pid alone names nothing for long:
after a reboot, or on another host sharing the filesystem, or once the process ended and the kernel
reused its number, signalling it hits an unrelated process. So a record counts as a live process only
if it was written on this host and the process with that pid started no later than the record was
written (a reused pid started after the record existed). The start time comes from /proc/<pid>/stat
(field 22, clock ticks since boot) plus the boot time from /proc/stat (rl.contract.procs, which the roles
use too), so it needs Linux; elsewhere no record is ever taken for alive, which errs on the side of
signalling nothing.

A record is data anyone with write access to the run directory can craft (a shared filesystem, a copied
run directory), and its own time can say anything. So the process itself must also show it belongs to
this run, as read from /proc and never from the record: a role's command line carries
`--run-dir RUN_DIR` (the planned command of every role), a launcher holds `RUN_DIR/launcher.lock` open
for its whole life. A pid that shows neither is another process, whatever the record says.

The lock is itself a name in the run directory, so it proves nothing until it is checked: it must be a
regular file reached without following a link (rl.contract.safefs: `launcher.lock -> /dev/null` would
make every daemon holding /dev/null "this run's launcher", `-> ../other_run/launcher.lock` another run's
launcher) with a single hard link (a hard link to another run's lock is the same trick). The process
holds it when one of its open files is that very file: same st_dev and st_ino as the lock, compared on
the files themselves, never on path strings. A role's `--run-dir` is compared the same way, relative to
the role's own working directory. When a record carries the process's own start time (`proc_started`)
it must match /proc's within the rounding slack.
"""
from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from pathlib import Path

from rl.contract import safefs
# process_start_time: the name benchmarks/_fault_inject.py imports from here
from rl.contract.procs import start_time as process_start_time

# A record is written a moment after its process starts; the clock-tick start time is rounded to ticks.
_SLACK_S = 2.0


LOCK = "launcher.lock"   # held open by a local launcher for its whole life (launch.local)


def lock_file(run_dir: Path) -> tuple[os.stat_result | None, str]:
    """(stat of RUN_DIR/launcher.lock, "") when it is a regular file of this run directory, reached
    without a link and with one hard link; (None, why not) otherwise."""
    lock = safefs.resolve_run_dir(run_dir) / LOCK
    try:
        fd = safefs.open_read(lock)  # no link followed on the way or as the lock; a FIFO refused
    except FileNotFoundError:
        return None, f"{lock} is missing"
    except OSError as e:  # UnsafePath names the path and what it is
        return None, str(e) if isinstance(e, safefs.UnsafePath) else f"{lock}: {e.strerror or e}"
    try:
        st = os.fstat(fd)
    finally:
        os.close(fd)
    if st.st_nlink != 1:
        return None, f"{lock}: has {st.st_nlink} hard links (a launcher's lock has one; another run's linked in?)"
    return st, ""


def _same_file(a: os.stat_result, b: os.stat_result) -> bool:
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)


def holds_open(pid: int, target: os.stat_result) -> bool:
    """Does process `pid` have the file `target` (a stat result) open? Read from /proc/<pid>/fd, whose
    entries stat as the open files themselves (a renamed or unlinked path still matches)."""
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:  # gone, or another user's process: not ours to signal
        return False
    for fd in fds:
        try:
            if fd.isdigit() and _same_file(os.stat(f"/proc/{pid}/fd/{fd}"), target):
                return True
        except OSError:  # closed meanwhile
            continue
    return False


def _run_dir_args(argv: list[str]) -> list[str]:
    out = []
    for i, a in enumerate(argv):
        value = argv[i + 1] if a == "--run-dir" and i + 1 < len(argv) else a.partition("--run-dir=")[2]
        if value:
            out.append(value)
    return out


def runs_for(pid: int, what: str, run_dir: Path) -> tuple[bool, str]:
    """Does process `pid` show, in /proc, that it belongs to the run in `run_dir`? A launcher holds the
    run's lock file open (checked first: `lock_file`); a role was started with `--run-dir RUN_DIR`."""
    if what == "launcher":
        lock, why = lock_file(run_dir)
        if lock is None:
            return False, f"{why}: not this run's launcher, nothing signalled"
        if holds_open(pid, lock):
            return True, ""
        return False, f"pid {pid} does not hold {Path(run_dir) / LOCK} open (not this run's launcher)"
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
        here = os.stat(run_dir)
    except OSError:
        argv = []
    for value in _run_dir_args(argv):
        try:  # a relative --run-dir is relative to the role's own working directory
            st = os.stat(value if os.path.isabs(value) else f"/proc/{pid}/cwd/{value}")
        except OSError:
            continue
        if _same_file(st, here):
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
    proc_started: float | None = None  # the process's own start time, when its record keeps it

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
        if self.proc_started is not None:
            if not isinstance(self.proc_started, (int, float)) or isinstance(self.proc_started, bool):
                return False, f"recorded start time {self.proc_started!r} is not a time"
            if abs(started - self.proc_started) > _SLACK_S:
                return False, (f"pid {self.pid} started at {started:.2f}, its record says {self.proc_started:.2f} "
                               f"(another process)")
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


def cancel_local(procs: list[Recorded], signum: int) -> tuple[list[Recorded], list[tuple[Recorded, str]]]:
    """`launch cancel` of a local run: signal the launcher when it is still this run's (it stops its roles
    itself), else the roles that are still this run's. Returns (signalled, [(skipped, why)]), the
    launcher's reason included when it was passed over for the roles, so every process the records
    name but that is not signalled gets its one line."""
    launchers = [r for r in procs if r.what == "launcher"]
    checked = [(r, *r.alive()) for r in launchers]
    live = [r for r, ok, _ in checked if ok]
    if live:
        return signal_recorded(live, signum)
    done, skipped = signal_recorded([r for r in procs if r.what != "launcher"], signum)
    return done, [(r, why) for r, _, why in checked] + skipped
