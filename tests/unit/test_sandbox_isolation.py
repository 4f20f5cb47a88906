"""What an agent can reach from inside the namespace runtimes (inprocess, bubblewrap) when the run's files
live where a cluster puts them, not under $HOME or the checkout: a run directory (config, secret), the
task rows (reference patch, hidden tests), the repositories' clones (whose history holds the fix), a
world-writable unix socket outside /run; and whether the process limit holds for a non-root launcher.

Everything is placed in a fresh directory under /srv (or /opt, /mnt, /var/lib: the first writable one),
outside $HOME, the checkout, /tmp, /var/tmp and /run, and tried from inside a real sandbox. The non-root
cases run the launcher as a throwaway unprivileged user (`hetrltest`, made if missing) through
`runuser`; they need root to do that and skip otherwise, saying so.
"""
import os
import pwd
import shutil
import socket
import subprocess
import sys
import sysconfig
import tempfile
from builders import runtime_params
from pathlib import Path

import pytest

from rl.envs.swe import repos
from rl.envs.swe.runtimes import open_runtime
from rl.envs.swe.sandbox import Limits

REPO = Path(__file__).resolve().parents[2]
LIMITS = Limits(cpu_s=10, memory_bytes=1 << 30, nproc=32)
USER = "hetrltest"


PARAMS = runtime_params(("inprocess", "bubblewrap"))


@pytest.fixture(params=PARAMS)
def runtime(request):
    return request.param


def _under(path, root):
    return path == root or path.startswith(str(root).rstrip("/") + "/")


@pytest.fixture
def outside():
    """A world-readable directory like /scratch/<run> on a cluster: outside $HOME, the checkout, the
    temporary directories and /run."""
    for base in ("/srv", "/opt", "/mnt", "/var/lib"):
        if any(_under(base, str(p)) for p in (Path.home(), REPO)):
            continue
        try:
            d = tempfile.mkdtemp(prefix="hetrl-test-", dir=base)
        except OSError:
            continue
        os.chmod(d, 0o755)
        try:
            yield Path(d)
        finally:
            shutil.rmtree(d, ignore_errors=True)
        return
    pytest.skip("no writable directory outside $HOME, the checkout and the temporary directories")


def _py(rt, code, *args, timeout_s=30):
    return rt.run([sys.executable, "-c", code, *map(str, args)], timeout_s=timeout_s)


TRY_OPEN = ("import os, sys\nfor p in sys.argv[1:]:\n    try:\n"
            "        print(p, 'READ', open(p).read()[:20])\n"
            "    except OSError as e:\n        print(p, 'FAILED', e)\n"
            "print('EXISTS', [p for p in sys.argv[1:] if os.path.lexists(p)])")


def _run_dir_rows_and_clone(outside: Path):
    run = outside / "run"
    run.mkdir()
    (run / "config.yaml").write_text("env:\n  swe:\n    runtime: inprocess\n")
    secret = run / "secret"
    secret.write_text("run-token")
    secret.chmod(0o600)
    rows = outside / "rows.jsonl"
    rows.write_text('{"instance_id": "x", "patch": "REFERENCE PATCH", "test_patch": "HIDDEN TESTS"}\n')
    clone = outside / "repos" / "owner" / "name"
    repos.make_repo({"a.py": "x = 1\n"}, clone)
    return [run / "config.yaml", secret, rows, clone / ".git" / "HEAD", clone / "a.py"]


def test_run_dir_rows_and_clones_outside_home_are_absent(runtime, outside):
    paths = _run_dir_rows_and_clone(outside)
    with open_runtime(runtime, None, LIMITS) as rt:
        r = _py(rt, TRY_OPEN, *paths)
        ls = rt.run(["ls", "-A", str(outside), str(outside / "run")], timeout_s=10)
    assert "READ" not in r.stdout and r.stdout.count("FAILED") == len(paths), r.stdout + r.stderr
    assert "EXISTS []" in r.stdout, r.stdout  # absent, not merely unreadable
    assert not set(ls.stdout.split()) & {"run", "rows.jsonl", "repos", "config.yaml", "secret"}, ls.stdout


def test_world_writable_socket_outside_run_unreachable(runtime, outside):
    path = outside / "agent.sock"
    server = socket.socket(socket.AF_UNIX)
    server.bind(str(path))
    os.chmod(path, 0o777)  # world-writable, like a job scheduler's or a database's socket
    server.listen()
    code = ("import socket, sys\ns = socket.socket(socket.AF_UNIX)\ntry:\n    s.connect(sys.argv[1]); "
            "print('CONNECTED')\nexcept OSError as e:\n    print('FAILED', e)")
    try:
        with open_runtime(runtime, None, LIMITS) as rt:
            r = _py(rt, code, path)
    finally:
        server.close()
    assert r.stdout.startswith("FAILED") and "CONNECTED" not in r.stdout, r.stdout + r.stderr


FIND_FIX = """import os, sys, zlib
clone, fix = sys.argv[1], sys.argv[2]
try:  # the fix commit as a loose object of the clone, read without git
    print('FIX-OBJECT', zlib.decompress(open(f'{clone}/.git/objects/{fix[:2]}/{fix[2:]}', 'rb').read())[:30])
except OSError as e:
    print('NO-OBJECT', e)
for d, dirs, files in os.walk('.'):
    for name in dirs + files:
        if name == '.git':
            print('GIT-IN-TREE', d)
        elif name in files and b'FIX-MARKER' in open(os.path.join(d, name), 'rb').read():
            print('FIX-IN-TREE', name)
"""


def test_fix_commit_unreachable_from_the_checkout_and_the_clone(runtime, outside):
    clone = outside / "clone"
    base = repos.make_repo({"calc.py": "def add(a, b):\n    return a - b\n"}, clone)
    (clone / "calc.py").write_text("def add(a, b):\n    return a + b  # FIX-MARKER\n")
    repos.git("-c", "commit.gpgsign=false", "commit", "-q", "--no-verify", "-am", "fix", cwd=clone)
    fix = repos.git("rev-parse", "HEAD", cwd=clone).decode().strip()
    with open_runtime(runtime, None, LIMITS) as rt:
        repos.checkout(clone, base, rt.tree)  # as tasks.open_sandbox makes an episode's tree
        r = _py(rt, FIND_FIX, clone, fix)
        log = rt.run(["git", "-c", "safe.directory=*", "log", "--all", "--format=%H"], timeout_s=10)
        other = rt.run(["git", "-c", "safe.directory=*", "-C", str(clone), "log", "--all", "--format=%H"],
                       timeout_s=10)
        assert "a - b" in (rt.read_file("calc.py") or "")  # the checkout is base_commit's tree
    assert "NO-OBJECT" in r.stdout and "FIX-OBJECT" not in r.stdout, r.stdout + r.stderr
    assert "GIT-IN-TREE" not in r.stdout and "FIX-IN-TREE" not in r.stdout, r.stdout
    assert r.returncode == 0, r.stderr
    assert log.returncode != 0 and fix not in log.stdout, log.stdout + log.stderr
    assert other.returncode != 0 and fix not in other.stdout, other.stdout + other.stderr


# -- a non-root launcher ------------------------------------------------------------------------------
def _user_python() -> list[str]:
    """How the unprivileged user runs this checkout's code: this Python if the user can reach it (a venv
    under root's 0700 home cannot be), else the system Python of the same version with this
    environment's site-packages on PYTHONPATH. Skips (with the reason) if neither works."""
    if os.geteuid() != 0:
        pytest.skip("needs root to run the launcher as a throwaway unprivileged user")
    if shutil.which("runuser") is None:
        pytest.skip("runuser (util-linux) not found")
    try:
        pwd.getpwnam(USER)
    except KeyError:
        if shutil.which("useradd") is None:
            pytest.skip(f"no user {USER} and no useradd to make one")
        subprocess.run(["useradd", "-m", USER], check=True, capture_output=True)
    path = os.pathsep.join([str(REPO), sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]])
    tried = []
    for exe in (sys.executable, f"/usr/bin/python{sys.version_info.major}.{sys.version_info.minor}"):
        cmd = ["runuser", "-u", USER, "--", "env", "-i", "PATH=/usr/local/bin:/usr/bin:/bin",
               f"PYTHONPATH={path}", "HOME=/tmp", exe]
        r = subprocess.run(cmd + ["-c", "import rl.envs.swe.runtimes"], capture_output=True, text=True,
                           cwd="/", timeout=60)
        if r.returncode == 0:
            return cmd
        tried.append(f"{exe}: {(r.stderr.strip().splitlines() or ['?'])[-1]}")
    pytest.skip(f"user {USER} cannot import this checkout: {'; '.join(tried)}")


def _as_user(code: str, *args) -> subprocess.CompletedProcess:
    return subprocess.run(_user_python() + ["-c", code, *map(str, args)], capture_output=True, text=True,
                          cwd="/", timeout=240)


LAUNCH = """import subprocess, sys
from rl.envs.swe.runtimes import RuntimeUnavailable, open_runtime
from rl.envs.swe.sandbox import Limits
name, code, args = sys.argv[1], sys.argv[2], sys.argv[3:]
# the launcher's uid is busy (a trainer's or an orchestrator's is): its own processes are not the sandbox's
busy = [subprocess.Popen(['sleep', '120']) for _ in range(24)]
try:
    try:
        rt = open_runtime(name, None, Limits(nproc=16))
    except RuntimeUnavailable as e:
        print('REFUSED', e)
        sys.exit(0)
    with rt:
        r = rt.run([sys.executable, '-c', code, *args], timeout_s=30)
    print(r.stdout, r.stderr)
finally:
    for p in busy:
        p.kill()
        p.wait()
"""

BOMB = """import os, time
n = 0
try:
    for _ in range(300):
        if os.fork() == 0:
            time.sleep(30)
            os._exit(0)
        n += 1
except OSError as e:
    pass
print('FORKS', n)
"""


def test_process_limit_holds_for_a_non_root_launcher(runtime):
    r = _as_user(LAUNCH, runtime, BOMB)
    assert r.returncode == 0, r.stdout + r.stderr
    out = r.stdout.strip()
    if out.startswith("REFUSED"):  # a runtime that cannot enforce the limit must say so, in one line
        assert "\n" not in out and f"runtime {runtime}" in out, out
        return
    assert "FORKS" in out, out + r.stderr
    n = int(out.split("FORKS")[1].split()[0])
    assert n < 16, out  # the limit holds
    assert n >= 10, out  # and counts the sandbox's processes, not the launcher's 24 others


def test_run_secret_of_a_non_root_launcher_unreadable(runtime, outside):
    _user_python()
    uid = pwd.getpwnam(USER).pw_uid
    run = outside / "run"
    run.mkdir()
    secret = run / "secret"
    secret.write_text("run-token")
    secret.chmod(0o600)  # the launcher's own file: as non-root the agent would share its uid
    for p in (run, secret):
        os.chown(p, uid, uid)
    r = _as_user(LAUNCH, runtime, TRY_OPEN, secret, run / "config.yaml")
    assert r.returncode == 0, r.stdout + r.stderr
    if r.stdout.startswith("REFUSED"):
        pytest.skip(r.stdout.strip())
    assert "READ" not in r.stdout and "run-token" not in r.stdout and "EXISTS []" in r.stdout, r.stdout


def test_limits_probe_refuses_a_limit_that_does_not_hold_per_sandbox():
    """The start-up verdict on the probe's output (the probe itself runs in every test above, at each
    runtime's first start): a process limit nothing enforces, or one shared with the launcher's other
    processes, or a limit missing inside, each refuses in one line; the limits this kernel gives pass."""
    from rl.envs.swe.sandbox import PROBE_LIMITS, Result, limits_verdict
    lim = PROBE_LIMITS
    ok = f"{lim.memory_bytes} {lim.fsize_bytes} {lim.nofile} {lim.nproc}"

    def verdict(out, code=0):
        return limits_verdict(Result(code, out, "Traceback...\nOSError: mount: Operation not permitted\n",
                                     False, 0.1))
    assert verdict(f"PROBE {lim.nproc - 2} {ok}\n") == ""
    for out, code, words in [(f"PROBE {8 * lim.nproc} {ok}", 0, "does not hold"),
                             (f"PROBE 0 {ok}", 0, "shared with processes outside"),
                             (f"PROBE 5 {ok.rsplit(' ', 1)[0]} -1", 0, "not in force"),
                             ("", 1, "Operation not permitted")]:
        why = verdict(out, code)
        assert words in why and "\n" not in why, why
