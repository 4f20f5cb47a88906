"""The sandbox's promises, each tried from inside and checked from outside: no network (to a server this
test runs on the host's loopback, or to a public address), no writes outside the tree, nothing alive
after the wall-clock limit, memory / CPU / process limits enforced."""
import json
import os
import socket
import sys
import time
import uuid
from pathlib import Path

import pytest

from rl.envs.swe.sandbox import Limits, Sandbox

CAPS = Sandbox.capabilities()
namespaced = pytest.mark.skipif(CAPS["mode"] == "none",
                                reason=f"no namespace isolation on this machine: {CAPS['unavailable_modes']}")


@pytest.fixture
def sb():
    with Sandbox(None, Limits(cpu_s=10, memory_bytes=1 << 30, nproc=16)) as s:
        yield s


def _py(sb, code, timeout_s=20, **kw):
    return sb.run([sys.executable, "-c", code], timeout_s=timeout_s, **kw)


def test_sandbox_runs_in_its_tree_and_cleans_up():
    with Sandbox.from_files({"pkg/a.py": "X = 41\n"}) as s:
        r = _py(s, "import os, pkg.a; open('out.txt', 'w').write(str(pkg.a.X + 1)); print(os.getcwd())",
                input="ignored")
        assert r.returncode == 0 and not r.timed_out, r.stderr
        assert r.stdout.strip() == str(s.tree)
        assert (s.tree / "out.txt").read_text() == "42"
        root = s.tree.parent
    assert not root.exists()


def test_sandbox_stdin_and_exit_codes(sb):
    r = _py(sb, "import sys; print(sys.stdin.read().upper()); sys.exit(3)", input="hello")
    assert (r.returncode, r.stdout.strip()) == (3, "HELLO")
    r = _py(sb, "import os, signal; os.kill(os.getpid(), signal.SIGTERM)")
    assert r.returncode == -15


@namespaced
def test_sandbox_cannot_connect_to_host_loopback(sb):
    srv = socket.create_server(("127.0.0.1", 0))
    port = srv.getsockname()[1]
    r = _py(sb, f"import socket\ntry:\n    socket.create_connection(('127.0.0.1', {port}), timeout=2)\n"
                "    print('CONNECTED')\nexcept OSError as e:\n    print('FAILED', e)")
    srv.setblocking(False)  # a completed connection would wait in the backlog: nothing must be there
    with pytest.raises(BlockingIOError):
        srv.accept()
    srv.close()
    assert r.stdout.startswith("FAILED"), r.stdout + r.stderr


@namespaced
@pytest.mark.parametrize("addr", [("1.1.1.1", 80), ("8.8.8.8", 53), ("example.com", 443)])
def test_sandbox_cannot_reach_public_network(sb, addr):
    r = _py(sb, f"import socket\ntry:\n    socket.create_connection({addr!r}, timeout=2)\n"
                "    print('CONNECTED')\nexcept OSError as e:\n    print('FAILED', e)")
    assert r.stdout.startswith("FAILED"), r.stdout + r.stderr
    assert r.seconds < 5


@namespaced
def test_sandbox_cannot_write_outside_its_tree(sb, tmp_path):
    mark = uuid.uuid4().hex
    repo = Path(__file__).resolve().parents[2]
    targets = [tmp_path / f"host-tmp-{mark}", repo / f"repo-{mark}", Path.home() / f"home-{mark}",
               Path("/etc") / f"etc-{mark}", Path("/var/tmp").resolve().parent / f"var-{mark}",
               Path(sys.prefix) / f"venv-{mark}"]
    (sb.tree / "escape").symlink_to(tmp_path)  # a link out of the tree does not help either
    targets.append(sb.tree / "escape" / f"via-link-{mark}")
    code = ("import json, sys\nres = {}\nfor p in sys.argv[1:]:\n    try:\n        open(p, 'w').write('x')\n"
            "        res[p] = 'WROTE'\n    except OSError as e:\n        res[p] = str(e)\n"
            "open('inside.txt', 'w').write('ok')\nprint(json.dumps(res))")
    r = sb.run([sys.executable, "-c", code, *map(str, targets)], timeout_s=20)
    assert r.returncode == 0, r.stderr
    res = json.loads(r.stdout)
    assert (sb.tree / "inside.txt").read_text() == "ok"  # writing is possible, just not outside
    for p in targets:
        assert res[str(p)] != "WROTE", p
        assert not p.exists(), p
    r = sb.run(["sh", "-c", "mount -o remount,rw / ; mount -t tmpfs x /etc; touch /etc/x-" + mark],
               timeout_s=10)
    assert not Path("/etc/x-" + mark).exists() and r.returncode != 0


@namespaced
def test_sandbox_hides_home_and_checkout(sb):
    repo = Path(__file__).resolve().parents[2]
    r = sb.run(["sh", "-c", f"ls -A {repo}; ls -A {Path.home()}"], timeout_s=10)
    assert "rl" not in r.stdout.split() and "tests" not in r.stdout.split()


@namespaced
def test_sandbox_cannot_outlive_its_time_limit(sb):
    mark = f"{time.time_ns() % 10**6}.{os.getpid()}"  # a distinctive sleep argument to find survivors
    script = (f"setsid sh -c 'sleep 3{mark}' & (trap '' TERM HUP; sleep 4{mark}) & "
              f"python -c 'import os; os.fork(); os.setsid(); import time; time.sleep(999)' & sleep 5{mark}")
    r = sb.run(["sh", "-c", script], timeout_s=1)
    assert r.timed_out and r.returncode == -9
    assert r.seconds < 3
    deadline = time.monotonic() + 2
    while (alive := _procs_with(mark)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not alive, alive


def _procs_with(mark):
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if mark in cmd and "pytest" not in cmd:
            found.append((pid, cmd))
    return found


def test_sandbox_memory_limit_enforced():
    with Sandbox(None, Limits(memory_bytes=256 << 20)) as s:
        r = _py(s, "b = bytearray(512 << 20); print('ALLOCATED')")
    assert r.returncode != 0 and "ALLOCATED" not in r.stdout
    assert "MemoryError" in r.stderr


def test_sandbox_cpu_limit_enforced():
    with Sandbox(None, Limits(cpu_s=1)) as s:
        r = _py(s, "while True: pass", timeout_s=30)
    assert not r.timed_out and r.returncode in (-24, -9)  # SIGXCPU, then SIGKILL at the hard limit


@pytest.mark.skipif(CAPS["mode"] != "root", reason="a per-sandbox process limit needs a uid of its own")
def test_sandbox_process_limit_enforced():
    with Sandbox(None, Limits(nproc=8)) as s:
        r = _py(s, "import os, time\nn = 0\ntry:\n    for _ in range(100):\n        if os.fork() == 0:\n"
                   "            time.sleep(5); os._exit(0)\n        n += 1\nexcept OSError as e:\n"
                   "    print('LIMIT', n, e.errno)", timeout_s=10)
    assert r.stdout.startswith("LIMIT"), r.stdout + r.stderr
    assert int(r.stdout.split()[1]) < 8


def test_sandbox_file_size_limit_enforced():
    with Sandbox(None, Limits(fsize_bytes=1 << 20)) as s:
        r = _py(s, "open('big', 'wb').write(b'x' * (4 << 20))")
        assert r.returncode == -25 or "File too large" in r.stderr  # SIGXFSZ
        assert (s.tree / "big").stat().st_size <= 1 << 20
