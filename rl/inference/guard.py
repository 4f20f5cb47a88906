"""`python -m rl.inference.guard -- ARGV...`: runs the vLLM server ARGV and takes all of it down with itself.

The inference role starts vLLM through this small process rather than directly. The reason is a role that
dies without stopping its server (SIGKILL, the OOM killer): the kernel then sends the server the signal
its parent-death setting names, SIGTERM, and nothing else. Measured here (vLLM 0.32, the SIGKILL test of
tests/integration/test_local_run.py): an API server SIGTERMed with 22 requests in flight stopped its
engine core and then hung in its HTTP server's shutdown for more than 15 minutes, holding its port and
650 MB, until the machine was cleaned by hand. The role's own `stop_child` escalates (SIGTERM, then
SIGINT, uvicorn's force quit, then SIGKILL to the server's process group), but a dead role escalates
nothing. This guard is that escalation in a process that outlives the role: it gets SIGTERM when the role
dies (PR_SET_PDEATHSIG) or stops it, and then runs `stop_child` on the server, whose process group
(API server, engine core, workers) is gone at the latest 2 x GRACE seconds later. It imports nothing but
the standard library, so it starts in milliseconds and cannot itself hang on a GPU or a model.

The guard exits with the server's status (128 + N for a signal N). Its one child is the server, so the
role finds the server's pid as the guard's child (`server_pid`) and records that one.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

GRACE_S = 5.0
PARENT_ENV = "HETRL_GUARD_PARENT"   # the role's pid: a guard whose role died before it started stops at once


def die_with_parent() -> None:
    """In a child before exec: SIGTERM it when its parent dies, even by SIGKILL (Linux prctl)."""
    import ctypes
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, int(signal.SIGTERM))  # 1 = PR_SET_PDEATHSIG


def stop_child(proc: subprocess.Popen, grace: float = GRACE_S) -> int | None:
    """SIGTERM; then SIGINT, uvicorn's force quit (after the first signal it waits for background tasks,
    measured: sometimes until killed); then SIGKILL to the child's whole process group (it is a session
    leader: the engine core and workers go with it), each after `grace` seconds."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(grace)
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(grace)
            except subprocess.TimeoutExpired:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                proc.wait()
    return proc.returncode


def server_pid(guard_pid: int, timeout: float = 10.0) -> int | None:
    """The pid of the guard's one child (the server), read from /proc; None if it has none by `timeout`."""
    children = Path(f"/proc/{guard_pid}/task/{guard_pid}/children")
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            pids = children.read_text().split()
        except OSError:
            return None   # the guard is gone
        if pids:
            return int(pids[0])
        time.sleep(0.01)
    return None


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--"]:
        argv = argv[1:]
    if not argv:
        print("usage: python -m rl.inference.guard -- COMMAND...", file=sys.stderr)
        return 2
    stop = threading.Event()
    for s in (signal.SIGTERM, signal.SIGINT):
        signal.signal(s, lambda *_: stop.set())
    parent = os.environ.pop(PARENT_ENV, None)
    if parent is not None and os.getppid() != int(parent):
        return 128 + signal.SIGTERM   # the role died before the death signal was armed
    # the server's own parent-death signal covers a guard that is itself SIGKILLed
    proc = subprocess.Popen(argv, start_new_session=True, preexec_fn=die_with_parent)
    while proc.poll() is None and not stop.is_set():
        stop.wait(0.5)
    rc = stop_child(proc)
    try:   # what the server left in its group when it exited on its own (an engine core, a worker)
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    return rc if rc is not None and rc >= 0 else 128 - (rc or 0)


if __name__ == "__main__":
    sys.exit(main())
