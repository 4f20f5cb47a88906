"""Escape tests under every sandbox runtime that works on this machine, each tried from inside and
checked from outside (network, writes outside the tree, symlinks planted for the host side, host unix
sockets, the run's secret, another task's tree, fork bombs, memory, wall time, disk), plus the parts of
the runtimes that need no working runtime: start rate limiting, config validation, the one-line
errors of a runtime that cannot run, podman's and apptainer's argv and apptainer's SIF cache.

Runtimes that cannot run here are skipped with the runtime's own one-line reason: podman (rootful
Podman fails on this container's hybrid cgroups, rootless Podman cannot enforce limits on cgroup v1)
and apptainer (not packaged in Debian 12); see docs/sandboxes.md."""
import json
import os
import socket
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest

from rl.envs.swe import runtime_apptainer as apt
from rl.envs.swe.runtime_podman import podman_argv
from rl.envs.swe.runtimes import (RUNTIMES, RuntimeUnavailable, StartLimiter, open_runtime, runtime_class,
                                  set_start_rate)
from rl.envs.swe.sandbox import Limits

REPO = Path(__file__).resolve().parents[2]


def _why_not(name):
    try:
        runtime_class(name).check()
    except RuntimeUnavailable as e:
        return str(e)
    return "" if name in ("inprocess", "bubblewrap") else f"runtime {name}: runs images; tested by argv only"


PARAMS = [pytest.param(n, marks=pytest.mark.skipif(bool(_why_not(n)), reason=_why_not(n) or "-"))
          for n in RUNTIMES]
LIMITS = Limits(cpu_s=10, memory_bytes=1 << 30, nproc=32)


@pytest.fixture(params=PARAMS)
def runtime(request):
    return request.param


def _py(rt, code, *args, timeout_s=20, **kw):
    return rt.run([sys.executable, "-c", code, *map(str, args)], timeout_s=timeout_s, **kw)


TRY_OPEN = ("import sys\nfor p in sys.argv[1:]:\n    try:\n        print(p, 'READ', open(p).read()[:20])\n"
            "    except OSError as e:\n        print(p, 'FAILED', e)")


def test_runs_in_its_tree_with_stdin_and_exit_codes(runtime):
    with open_runtime(runtime, None, LIMITS) as rt:
        rt.write_file("pkg/a.py", "X = 41\n")
        r = _py(rt, "import os, sys, pkg.a; open('out', 'w').write(str(pkg.a.X + 1) + sys.stdin.read());"
                    "print(os.getcwd()); sys.exit(3)", input="!")
        assert (r.returncode, r.stdout.strip()) == (3, str(rt.tree)), r.stderr
        assert rt.read_file("out") == "42!"
        assert _py(rt, "import os, signal; os.kill(os.getpid(), signal.SIGTERM)").returncode == -15
        root = rt.tree.parent
    assert not root.exists()


def test_no_network_tcp_or_abstract_unix(runtime):
    srv = socket.create_server(("127.0.0.1", 0))
    abstract = socket.socket(socket.AF_UNIX)
    name = f"\0hetrl-test-{uuid.uuid4().hex}"
    abstract.bind(name)
    abstract.listen()
    code = ("import socket, sys\ntry:\n    socket.create_connection(('127.0.0.1', int(sys.argv[1])), timeout=2)\n"
            "    print('TCP CONNECTED')\nexcept OSError as e:\n    print('TCP FAILED', e)\n"
            "s = socket.socket(socket.AF_UNIX)\ntry:\n    s.connect(sys.argv[2].replace('@', chr(0)))\n"
            "    print('UNIX CONNECTED')\nexcept OSError as e:\n    print('UNIX FAILED', e)")
    with open_runtime(runtime, None, LIMITS) as rt:
        r = _py(rt, code, srv.getsockname()[1], name.replace("\0", "@"))
    for s in (srv, abstract):  # a completed connection would wait in the backlog: nothing may be there
        s.setblocking(False)
        with pytest.raises(BlockingIOError):
            s.accept()
        s.close()
    assert "TCP FAILED" in r.stdout and "UNIX FAILED" in r.stdout, r.stdout + r.stderr


def test_no_writes_outside_the_tree(runtime, tmp_path):
    mark = uuid.uuid4().hex
    targets = [tmp_path / f"host-{mark}", REPO / f"repo-{mark}", Path("/etc") / f"etc-{mark}",
               Path(sys.prefix) / f"venv-{mark}", Path("/var/tmp").resolve().parent / f"var-{mark}"]
    code = ("import json, sys\nres = {}\nfor p in sys.argv[1:]:\n    try:\n        open(p, 'w').write('x')\n"
            "        res[p] = 'WROTE'\n    except OSError as e:\n        res[p] = str(e)\nprint(json.dumps(res))")
    with open_runtime(runtime, None, LIMITS) as rt:
        os.symlink(tmp_path, rt.tree / "escape")  # a link out of the tree does not help either
        targets.append(rt.tree / "escape" / f"via-link-{mark}")
        r = _py(rt, code, *targets)
        assert r.returncode == 0, r.stderr
        res = json.loads(r.stdout)
        for p in targets:
            assert res[str(p)] != "WROTE" and not p.exists(), p


def test_planted_symlinks_do_not_reach_host_files(runtime, tmp_path):
    """The agent's code plants links to host paths; the host side (grading's file resets, copy-out)
    must neither write nor read through them."""
    host = tmp_path / "host.txt"
    host.write_text("host secret")
    (tmp_path / "hostdir").mkdir()
    with open_runtime(runtime, None, LIMITS) as rt:
        r = rt.run(["sh", "-c", f"ln -s {host} victim.txt; ln -s {tmp_path / 'hostdir'} tests; "
                                f"ln -s {host} tests_link.py"], timeout_s=10)
        assert r.returncode == 0, r.stderr
        rt.write_file("victim.txt", "pwned")  # replaces the link, never writes through it
        assert host.read_text() == "host secret"
        assert rt.read_file("victim.txt") == "pwned" and not (rt.tree / "victim.txt").is_symlink()
        with pytest.raises(OSError):
            rt.write_file("tests/test_hidden.py", "x")  # a linked directory on the path is refused
        assert list((tmp_path / "hostdir").iterdir()) == []
        with pytest.raises(OSError):
            rt.read_file("tests_link.py")  # would read the host file
        with pytest.raises(ValueError):
            rt.write_file("../outside.txt", "x")
        out = rt.copy_out(tmp_path / "copy")
        assert (out / "tests_link.py").is_symlink() and host.read_text() == "host secret"


def test_host_unix_sockets_unreachable(runtime, tmp_path):
    paths = [tmp_path / "host.sock", Path("/run") / f"hetrl-test-{uuid.uuid4().hex[:8]}.sock"]
    servers = []
    for p in paths:
        s = socket.socket(socket.AF_UNIX)
        s.bind(str(p))
        os.chmod(p, 0o777)  # world-writable, like dbus's or a container engine's socket
        s.listen()
        servers.append(s)
    code = ("import socket, sys\nfor p in sys.argv[1:]:\n    s = socket.socket(socket.AF_UNIX)\n    try:\n"
            "        s.connect(p); print(p, 'CONNECTED')\n    except OSError as e:\n        print(p, 'FAILED', e)")
    try:
        with open_runtime(runtime, None, LIMITS) as rt:
            r = _py(rt, code, *paths)
    finally:
        for s, p in zip(servers, paths):
            s.close()
            p.unlink()
    assert r.stdout.count("FAILED") == 2 and "CONNECTED" not in r.stdout, r.stdout + r.stderr


def test_run_secret_and_other_task_tree_unreadable(runtime, tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    secret = run_dir / "secret"
    secret.write_text("run-token")
    secret.chmod(0o600)
    with open_runtime(runtime, None, LIMITS) as other, open_runtime(runtime, None, LIMITS) as rt:
        other.write_file("hidden.py", "other task")
        other.run(["true"], timeout_s=10)  # the other sandbox has handed its tree to its own uid
        r = _py(rt, TRY_OPEN, secret, run_dir / "config.yaml", other.tree / "hidden.py")
        ls = rt.run(["ls", "-A", str(other.tree), str(run_dir)], timeout_s=10)
    assert "READ" not in r.stdout and r.stdout.count("FAILED") == 3, r.stdout + r.stderr
    assert "hidden.py" not in ls.stdout and "secret" not in ls.stdout


def test_fork_bomb_is_contained(runtime):
    mark = f"{time.time_ns() % 10**6}.{os.getpid()}"
    bomb = ("import os, time\nn = 0\ntry:\n    for _ in range(500):\n        if os.fork() == 0:\n"
            f"            os.execvp('sleep', ['sleep', '3{mark}'])\n        n += 1\nexcept OSError as e:\n"
            "    print('LIMIT', n, e.errno)")
    with open_runtime(runtime, None, Limits(nproc=16)) as rt:
        r = _py(rt, bomb, timeout_s=10)
    if os.geteuid() == 0:  # a per-sandbox process limit needs a uid of its own
        assert r.stdout.startswith("LIMIT") and int(r.stdout.split()[1]) < 16, r.stdout + r.stderr
    deadline = time.monotonic() + 2  # and nothing it started outlives it
    while (alive := _procs_with(mark)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not alive, alive


def test_memory_limit(runtime):
    with open_runtime(runtime, None, Limits(memory_bytes=256 << 20)) as rt:
        r = _py(rt, "b = bytearray(512 << 20); print('ALLOCATED')")
    assert r.returncode != 0 and "ALLOCATED" not in r.stdout and "MemoryError" in r.stderr


def test_wall_time_kills_everything(runtime):
    mark = f"{time.time_ns() % 10**6}.{os.getpid()}"
    script = (f"setsid sh -c 'sleep 3{mark}' & (trap '' TERM HUP; sleep 4{mark}) & "
              f"python -c 'import os; os.fork(); os.setsid(); import time; time.sleep(999)' & sleep 5{mark}")
    with open_runtime(runtime, None, LIMITS) as rt:
        r = rt.run(["sh", "-c", script], timeout_s=1)
    assert r.timed_out and r.returncode == -9 and r.seconds < 3
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


@pytest.mark.skipif(bool(_why_not("bubblewrap")), reason=_why_not("bubblewrap") or "-")
def test_bubblewrap_disk_limit_and_private_tmp():
    with open_runtime("bubblewrap", None, Limits(disk_bytes=2 << 20, tmp_bytes=1 << 20)) as rt:
        r = rt.run(["sh", "-c", "head -c 2000000 /dev/zero > /tmp/big; echo tmp=$?"], timeout_s=10)
        assert "tmp=1" in r.stdout or "No space" in r.stderr, r.stdout + r.stderr
        r = rt.run(["sh", "-c", "for i in 1 2 3; do head -c 1000000 /dev/zero > f$i; done"], timeout_s=10)
        assert "disk limit" in r.stderr and r.returncode != 0
        r = rt.run(["true"], timeout_s=10)
        assert r.returncode == -25 and "over its disk limit" in r.stderr


def test_bubblewrap_argv_binds_only_the_toolchain_and_the_tree():
    from rl.envs.swe.runtime_bwrap import bwrap_argv, toolchain
    tree = "/tmp/hetrl-bubblewrap-x/tree"
    for as_root in (True, False):
        a = bwrap_argv(tree, toolchain(), 1 << 20, as_root)
        writable = [a[i + 1] for i, w in enumerate(a) if w in ("--bind", "--bind-try", "--dev-bind")]
        assert writable == [tree]
        sources = {a[i + 1] for i, w in enumerate(a) if w in ("--ro-bind", "--ro-bind-try")}
        for p in sources - set(toolchain()):  # this Python's prefixes, wherever they are
            assert not p.startswith(("/run", "/var/run", str(Path.home()) + "/.", "/tmp")), p
            assert not p.startswith(str(REPO)), p
        assert ("--unshare-net" in a) if as_root else ("--unshare-all" in a)


# -- no working runtime needed ----------------------------------------------------------------------
def test_start_rate_is_limited():
    lim = StartLimiter(20, burst=2)
    t0 = time.monotonic()
    threads = [threading.Thread(target=lambda: [lim.acquire() for _ in range(3)]) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert 0.45 <= time.monotonic() - t0 < 2  # 12 starts, 2 at once, then 20/s: 10 / 20 s
    set_start_rate(4)  # open_runtime takes a token: 4 at once, then 4/s
    try:
        t0 = time.monotonic()
        sbs = [open_runtime("inprocess", None, LIMITS) for _ in range(6)]
        assert time.monotonic() - t0 >= 0.45
        for sb in sbs:
            sb.close()
    finally:
        set_start_rate(8)
    with pytest.raises(ValueError, match="max_sandbox_starts_per_s"):
        StartLimiter(0)


def test_runtime_config_keys_validated():
    from rl.contract.config import ConfigError, structured
    from rl.contract.validation import validate
    from rl.envs.swe.runtimes import from_config
    cases = [({"runtime": "docker"}, "env.swe.runtime='docker': must be"),
             ({"runtime": "apptainer"}, "env.swe.image_cache=None: must be set"),
             ({"runtime": "apptainer", "image_cache": "/tmp/sifs"}, "env.swe.image_cache='/tmp/sifs': node-local"),
             ({"image_cache": "sifs"}, "env.swe.image_cache='sifs': must be an absolute path"),
             ({"max_sandbox_starts_per_s": 0}, "env.swe.max_sandbox_starts_per_s=0.0: must be positive")]
    for swe, msg in cases:
        with pytest.raises(ConfigError) as e:
            validate(structured({"run_dir": "/work/r", "env": {"swe": swe}}))
        assert str(e.value).startswith(msg) and "\n" not in str(e.value), e.value
    cfg = structured({"run_dir": "/work/r", "env": {"swe": {"runtime": "apptainer", "image_cache": "/work/sifs",
                                                              "max_sandbox_starts_per_s": 3}}})
    validate(cfg)
    assert from_config(cfg.env.swe) == {"name": "apptainer", "image_cache": "/work/sifs"}
    set_start_rate(8)


def test_unavailable_runtimes_say_which_and_why(monkeypatch):
    from rl.envs.swe import runtime_bwrap, runtime_podman
    monkeypatch.setenv("PATH", "/nonexistent")
    assert runtime_bwrap._probe() == "bwrap not found (Debian package bubblewrap)"
    assert runtime_podman._probe() == "podman not found (Debian package podman)"
    with pytest.raises(RuntimeUnavailable, match=r"^runtime apptainer: neither apptainer nor singularity"):
        open_runtime("apptainer", None, LIMITS, image="x", image_cache="/work/sifs")
    monkeypatch.setattr(runtime_bwrap, "_CHECKED", "bwrap not found (Debian package bubblewrap)")
    with pytest.raises(RuntimeUnavailable, match=r"^runtime bubblewrap: bwrap not found"):
        open_runtime("bubblewrap")
    with pytest.raises(ValueError, match="env.swe.runtime='docker'"):
        open_runtime("docker")


def test_podman_argv_isolates():
    a = podman_argv("podman", "hetrl-x", "swebench/sweb.eval.x86_64.a:latest", "/t/tree", "/testbed",
                    Limits(nproc=32, memory_bytes=1 << 30), {"K": "v"}, ["pytest", "-q"])
    for opt in ("--network=none", "--read-only", "--cap-drop=all", "--security-opt=no-new-privileges",
                "--userns=keep-id", "--pids-limit=32", f"--memory={1 << 30}", "--volume=/t/tree:/testbed:rw",
                "--workdir=/testbed", "--env=K=v", "--rm"):
        assert opt in a, opt
    assert a[-3:] == ["swebench/sweb.eval.x86_64.a:latest", "pytest", "-q"]
    assert sum(w.startswith("--volume") for w in a) == 1


def test_apptainer_argv_isolates():
    a = apt.apptainer_argv("/usr/bin/apptainer", "/c/x.sif", "/t/tree", "/testbed",
                           Limits(cpu_s=7, memory_bytes=1 << 30), {"K": "v"}, ["pytest"], nproc=True)
    cut = a.index("--")
    assert {"--cpu=7:8", f"--as={1 << 30}", "--core=0", f"--nproc={Limits().nproc}"} <= set(a[:cut])
    ex = a[cut + 1:]
    assert ex[:2] == ["/usr/bin/apptainer", "exec"]
    for opt in ("--containall", "--no-privs", "--no-home"):
        assert opt in ex
    assert ex[ex.index("--net") + 1: ex.index("--net") + 3] == ["--network", "none"]
    assert ex[ex.index("--bind") + 1] == "/t/tree:/testbed:rw" and ex.count("--bind") == 1
    assert ex[-2:] == ["/c/x.sif", "pytest"] and "K=v" in ex


STANDIN = """#!/bin/sh
# stand-in for apptainer (not packaged in Debian 12): records the call, builds a fake SIF slowly
echo "$@" >> "$(dirname "$0")/calls"
[ "$1" = build ] || exit 2
case "$3" in *fail*) echo "FATAL: no such image" >&2; exit 255;; esac
sleep 0.3; echo SIF > "$2"
"""


def test_apptainer_builds_each_sif_once_under_a_lock(tmp_path, monkeypatch):
    exe = tmp_path / "bin" / "apptainer"
    exe.parent.mkdir()
    exe.write_text(STANDIN)
    exe.chmod(0o755)
    cache = tmp_path / "sifs"
    with pytest.raises(ValueError, match=r"env.swe.image_cache='/tmp/.*': must be an absolute path on the shared"):
        apt.sif_for("python:3.11", cache, str(exe))
    monkeypatch.setattr(apt, "_SCRATCH", ())  # the test's cache lives under /tmp: allow it here only
    got = []
    threads = [threading.Thread(target=lambda: got.append(apt.sif_for("python:3.11", cache, str(exe))))
               for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(set(got)) == 1 and got[0].read_text() == "SIF\n"
    assert got[0] == apt.sif_path("python:3.11", cache) and got[0].parent == cache
    calls = (exe.parent / "calls").read_text().splitlines()
    assert len(calls) == 1 and calls[0].endswith("docker://python:3.11")
    assert apt.sif_for("python:3.11", cache, str(exe)) == got[0]  # cached: no second build
    assert len((exe.parent / "calls").read_text().splitlines()) == 1
    with pytest.raises(Exception, match=r"building 'fail:1' .* failed: FATAL: no such image"):
        apt.sif_for("fail:1", cache, str(exe))
    assert not [p for p in cache.iterdir() if ".tmp-" in p.name]
    assert apt.build_source("docker://a/b") == "docker://a/b"
    assert apt.sif_path("a/b:1", cache) != apt.sif_path("a_b:1", cache)


def test_grading_scores_reference_1_and_unmodified_less(runtime):
    """grader.grade under the runtime (the env passes env.swe.runtime on): a fresh sandbox of that runtime,
    test files reset with its write_file, test_patch and pytest inside. Two built-in tasks, one snapshot
    row and one SWE-bench row over a git repository."""
    from rl.envs.swe.env import playable_under
    from rl.envs.swe.grader import grade
    from rl.envs.swe.datasets import load_tasks
    tasks = [load_tasks()[0], playable_under(load_tasks("builtin_swebench")[1:2], runtime, None, "t")[0]]
    for task in tasks:
        ref = grade(task, extra_patch=task.patch, limits=LIMITS, runtime={"name": runtime})
        base = grade(task, limits=LIMITS, runtime={"name": runtime})
        assert ref.reward == 1 and base.reward < 1, (task.instance_id, ref.output[-800:])


def test_grading_never_writes_through_a_planted_directory_link(runtime, tmp_path):
    """The agent replaces the graded tests' directory with a link to a host directory (`tests ->
    /host/dir`, as its own code run in the sandbox can): grading removes the link from its copy and
    writes the test files inside the tree; the host directory is untouched (it used to be written, and
    its hidden-test namesake deleted, through Path.write_text / unlink on the host side)."""
    from rl.envs.swe.grader import grade
    from rl.envs.swe.datasets import load_tasks
    task = load_tasks()[0]
    tree, host = tmp_path / "tree", tmp_path / "host"
    for rel, text in task.files.items():
        (tree / rel).parent.mkdir(parents=True, exist_ok=True)
        (tree / rel).write_text(text)
    graded = sorted({i.split("::")[0] for i in task.graded})
    top = Path(graded[0]).parts[0]
    assert len(Path(graded[0]).parts) > 1 and all(Path(g).parts[0] == top for g in graded)
    host.mkdir()
    for g in graded:
        (host / Path(g).name).write_text("HOST\n")
    import shutil
    shutil.rmtree(tree / top)
    (tree / top).symlink_to(host, target_is_directory=True)
    before = {p.name: p.read_text() for p in host.iterdir()}
    base = grade(task, tree, limits=LIMITS, runtime={"name": runtime})
    ref = grade(task, tree, extra_patch=task.patch, limits=LIMITS, runtime={"name": runtime})
    assert {p.name: p.read_text() for p in host.iterdir()} == before
    assert (tree / top).is_symlink()  # the agent's tree itself is never modified
    assert base.reward < 1 and ref.reward == 1, ref.output[-800:]
