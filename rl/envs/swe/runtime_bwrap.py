"""The `bubblewrap` runtime: no image, the task's tree and the node's toolchain, nothing else.

bwrap (Debian's `bubblewrap`) builds each command's filesystem from an empty tmpfs root, so isolation is
by absence rather than by masking: the sandbox sees /usr and the top-level links into it (/bin, /lib,
...), a few files of /etc the toolchain reads (the loader cache, passwd/group, certificates), this
Python's installation (read-only), a fresh /proc and /dev, size-limited private tmpfs on /tmp and
/var/tmp, and the tree read-write at its own host path. The run directory and its secret, $HOME, the
hetrl checkout (hidden tests), /run and /var/run (host sockets: dbus, container engines) and every other
episode's tree are simply not there. `--unshare-all` gives new user, mount, pid, ipc, uts, cgroup and
network namespaces; the network namespace has only a loopback that is down, so no connection is
possible and the host's abstract unix sockets (which live per network namespace) are out of reach.

Under root, every sandbox runs as a uid of its own (random, like the inprocess runtime's root mode):
`setpriv` drops to it with no capabilities and no_new_privs before bwrap starts unprivileged inside a
user namespace, so RLIMIT_NPROC counts that sandbox's processes alone and a fork bomb stops there.
As an ordinary user, bwrap runs as the caller inside its own user namespace (user namespaces must be
allowed), and RLIMIT_NPROC is set inside it, by `prlimit` in front of the command: the kernel (>= 5.14)
counts processes per (user namespace, uid), so the count is the sandbox's alone. Set outside, before
bwrap, it would instead count every process of the caller's uid (a busy launcher could not fork at
all) and the namespace would inherit it as its ceiling. The first start in a process runs a probe
sandbox that forks until refused (`sandbox.limits_verdict`); where the limits would not hold (an older
kernel), the runtime refuses to start, one line saying so.

Limits: rlimits set by `prlimit` before bwrap (CPU seconds, address space, file size, open files, no
core dumps; processes under root, inside the sandbox otherwise), tmpfs sizes for /tmp and /var/tmp,
memory for the whole sandbox (a cgroup of its own, or the PSS watch: rl/envs/swe/sandbox_limits.py; the
launcher enters it before bwrap starts), the tree's disk use measured while each command runs and after
it (`Runtime.run`: past `disk_bytes` the command is killed and the sandbox refuses further commands),
and the wall clock: the launcher is SIGKILLed, `--die-with-parent` then kills the
sandbox's pid 1, and with it every process of its pid namespace. bwrap reports a command's status on
`--json-status-fd`, which tells a failed setup (no exit-code) from a command's own failure; a command
killed by signal N is reported by bwrap as exit 128+N and returned as -N, the way the inprocess runtime
reports it.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

from rl.envs.swe.runtimes import STATUS_FD, Runtime, RuntimeUnavailable
from rl.envs.swe.sandbox import (PROBE_LIMITS, SYSTEM_ETC, Result, SandboxError, limits_verdict, probe_argv,
                                 toolchain)

_TOP_LINKS = ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
_ETC = SYSTEM_ETC  # the same /etc allowlist as the inprocess runtime's

_CHECKED: str | None = None  # the probe's verdict, once per process: "" = works, else why not
__all__ = ["BubblewrapRuntime", "bwrap_argv", "drop_to", "toolchain"]


class BubblewrapRuntime(Runtime):
    name = "bubblewrap"
    host_memory = True  # bwrap's processes are host processes: one memory budget per sandbox

    def __init__(self, tree, limits=None, *, base_dir=None, expose=None):
        self.check()
        from rl.envs.swe.sandbox import Limits
        super().__init__(tree, limits or Limits(), base_dir=base_dir)
        self.expose = list(expose) if expose is not None else toolchain()

    @classmethod
    def check(cls) -> None:
        global _CHECKED
        if _CHECKED is None:
            _CHECKED = _probe()
        if _CHECKED:
            raise RuntimeUnavailable(f"runtime bubblewrap: {_CHECKED}")

    def _command(self, argv: list[str], env: dict[str, str]) -> list[str]:
        lim = self.limits
        cmd = [shutil.which("prlimit"), f"--cpu={lim.cpu_s}:{lim.cpu_s + 1}", f"--as={lim.memory_bytes}",
                f"--fsize={lim.fsize_bytes}", f"--nofile={lim.nofile}", "--core=0"]
        if self.uid is not None:
            cmd.append(f"--nproc={lim.nproc}")
        cmd += ["--"] + bwrap_argv(str(self.tree), self.expose, lim.tmp_bytes, self.uid is not None)
        cmd_env = {"PATH": f"{Path(sys.executable).parent}:/usr/local/bin:/usr/bin:/bin", "HOME": "/tmp",
                   "TMPDIR": "/tmp", "LANG": "C.UTF-8", "PYTHONDONTWRITEBYTECODE": "1",
                   "PYTHONUNBUFFERED": "1", **env}
        for k, v in cmd_env.items():
            cmd += ["--setenv", k, str(v)]
        return (cmd + ["--json-status-fd", STATUS_FD, "--"] + drop_to(self.uid, str(self.tree))
                + nproc_inside(self.uid, lim.nproc) + argv)

    def _result(self, returncode: int, status: str, out: str, err: str, seconds: float) -> Result:
        code = None
        for line in status.splitlines():
            try:
                rec = json.loads(line)
            except ValueError:
                continue
            if "exit-code" in rec:
                code = int(rec["exit-code"])
        if code is None:
            raise SandboxError(f"runtime bubblewrap: sandbox setup failed (bwrap exit {returncode}): "
                               f"{err.strip()[-2000:]}")
        return Result(-(code - 128) if 128 < code < 160 else code, out, err, False, seconds)


def drop_to(uid: int | None, tree: str = "/") -> list[str]:
    """The in-sandbox prefix that becomes the sandbox's own uid (root callers), with nothing kept, then
    enters the tree (only that uid may: it is mode 0700)."""
    if uid is None:
        return []
    return ["/usr/bin/setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "--inh-caps=-all",
            "--bounding-set=-all", "--no-new-privs", "--", "/usr/bin/env", f"--chdir={tree}", "--"]


def nproc_inside(uid: int | None, nproc: int) -> list[str]:
    """The in-sandbox prefix that sets the process limit for a non-root caller (see the module's doc:
    inside the user namespace it counts this sandbox alone); under root `prlimit` sets it outside."""
    if uid is not None:
        return []
    return [shutil.which("prlimit") or "/usr/bin/prlimit", f"--nproc={nproc}", "--"]


def bwrap_argv(tree: str, expose: list[str], tmp_bytes: int, as_root: bool) -> list[str]:
    """bwrap's own arguments for one command over `tree` (up to the environment and the argv).
    As root, bwrap runs privileged (it resolves binds as root, so a toolchain under a 0700 /root still
    binds), with every namespace but the user one and only the capabilities `drop_to` needs to become
    the sandbox uid; as a user, `--unshare-all` includes a user namespace."""
    a = [shutil.which("bwrap") or "bwrap"]
    if as_root:
        a += ["--unshare-ipc", "--unshare-pid", "--unshare-net", "--unshare-uts", "--unshare-cgroup-try",
              "--cap-drop", "ALL", "--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID",
              "--cap-add", "CAP_SETPCAP"]
    else:
        a += ["--unshare-all"]
    a += ["--die-with-parent", "--new-session", "--hostname", "sandbox", "--ro-bind", "/usr", "/usr"]
    for p in _TOP_LINKS:
        if os.path.islink(p):
            a += ["--symlink", os.readlink(p), p]
        elif os.path.isdir(p):
            a += ["--ro-bind", p, p]
    for p in _ETC:
        a += ["--ro-bind-try", p, p]
    # bwrap makes missing parents of a bind mode 0700 (owned by root): the sandbox uid could not reach
    # its tree or the toolchain, so every parent is made 0755 first (0711 where trees live: no listing)
    scratch = ("/tmp", "/var/tmp")
    parents = sorted({str(q) for p in [*expose, tree, *scratch] for q in Path(p).parents} - {"/", *scratch},
                     key=lambda q: q.count("/"))
    for q in parents:
        if not _under(q, scratch) and not _under(q, ["/usr"]):
            a += ["--perms", "0755", "--dir", q]
    a += ["--proc", "/proc", "--dev", "/dev"]
    for p in scratch:
        a += ["--perms", "1777", "--size", str(tmp_bytes), "--tmpfs", p]
    for q in parents:
        if _under(q, scratch):
            a += ["--perms", "0711", "--dir", q]
    for p in expose:
        a += ["--ro-bind", p, p]
    # bwrap's root tmpfs stays writable otherwise (to a non-root caller's uid, which owns it inside its
    # user namespace): read-only, as the inprocess runtime's, so only the tree and the tmpfs are writable
    a += ["--bind", tree, tree, "--remount-ro", "/"] + ([] if as_root else ["--chdir", tree]) + ["--clearenv"]
    return a


def _under(path: str, roots) -> bool:
    return any(path == r or path.startswith(r.rstrip("/") + "/") for r in roots)


def _probe() -> str:
    """Why bubblewrap cannot isolate here ("" if it can): run `true` in a full sandbox."""
    for prog, pkg in (("bwrap", "bubblewrap"), ("prlimit", "util-linux"), ("setpriv", "util-linux")):
        if shutil.which(prog) is None:
            return f"{prog} not found (Debian package {pkg})"
    root = os.geteuid() == 0
    try:  # bwrap_argv minus its tree bind and what follows: the namespaces and mounts are what is tried
        r = subprocess.run(bwrap_argv("/", [], 1 << 20, root)[:-(6 if root else 8)] + ["--"]
                           + drop_to(1999999999 if root else None) + ["true"], capture_output=True,
                           text=True, timeout=30)
    except subprocess.TimeoutExpired:
        return "bwrap did not start within 30 s"
    if r.returncode != 0:
        return f"bwrap cannot create its namespaces: {(r.stderr.strip().splitlines() or ['?'])[-1]}"
    global _CHECKED
    _CHECKED = ""  # the limits probe runs in a real sandbox of this runtime; check() then records it
    try:
        with BubblewrapRuntime(None, PROBE_LIMITS) as rt:
            return limits_verdict(rt.run(probe_argv(), timeout_s=30))
    except SandboxError as e:
        return str(e).splitlines()[0]
    finally:
        _CHECKED = None
