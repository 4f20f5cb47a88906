"""rl.inference.guard: a role killed with SIGKILL leaves no vLLM server behind. The server here is a plain
Python process that behaves like the hung one measured (it ignores SIGTERM) and has a child in its
process group (like vLLM's engine core); the role is a real process started as rl.inference.server starts
its server, then SIGKILLed."""
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

SERVER = r'''
import signal, subprocess, sys, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)   # as a server stuck in its HTTP shutdown
c = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
print(c.pid, flush=True)
time.sleep(600)
'''

ROLE = r'''
import os, subprocess, sys, time
from rl.inference import guard
p = subprocess.Popen([sys.executable, "-m", "rl.inference.guard", "--", sys.executable, "-c", sys.argv[1]],
                     env={**os.environ, guard.PARENT_ENV: str(os.getpid())}, start_new_session=True,
                     preexec_fn=guard.die_with_parent, stdout=open(sys.argv[2], "w"))
print(p.pid, guard.server_pid(p.pid), flush=True)
time.sleep(600)
'''


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] not in ("Z", "X")
    except FileNotFoundError:
        return False


def test_a_role_killed_with_sigkill_takes_its_whole_server_down(tmp_path):
    out = tmp_path / "server.out"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    role = subprocess.Popen([sys.executable, "-c", ROLE, SERVER, str(out)], stdout=subprocess.PIPE, text=True,
                            env=env)
    guard_pid, server = map(int, role.stdout.readline().split())
    deadline = time.monotonic() + 30
    while not out.read_text().strip():
        assert time.monotonic() < deadline, "the server never started"
        time.sleep(0.05)
    engine = int(out.read_text().split()[0])
    assert server != guard_pid and all(map(_alive, (guard_pid, server, engine)))
    role.kill()
    role.wait()
    t0 = time.monotonic()
    while any(map(_alive, (guard_pid, server, engine))) and time.monotonic() - t0 < 30:
        time.sleep(0.1)
    assert not any(map(_alive, (guard_pid, server, engine))), "a process of the killed role's server survived"
    # SIGTERM is ignored, SIGINT ends it: gone one grace period after the role died
    assert time.monotonic() - t0 < 15


def test_a_guard_whose_role_is_already_gone_starts_nothing(tmp_path):
    from rl.inference import guard
    marker = tmp_path / "started"
    r = subprocess.run([sys.executable, "-m", "rl.inference.guard", "--", sys.executable, "-c",
                        f"open({str(marker)!r}, 'w')"], env={**os.environ, "PYTHONPATH": str(REPO),
                                                            guard.PARENT_ENV: "1"}, timeout=60)
    assert r.returncode == 128 + 15 and not marker.exists()
