"""Run commands of one episode in its own sandbox: a private copy of the task tree, no network, CPU /
memory / file-size / process limits, a wall-clock limit, and nothing outside the tree writable.

There are no containers or seccomp helpers to lean on here, so the sandbox is made of kernel
namespaces (`unshare` from util-linux), `setpriv` and rlimits; memory and disk are budgets for the whole
sandbox (rl/envs/swe/sandbox_limits.py: a cgroup of its own where the node allows one, else a watch of
its processes' memory; the tree measured while commands run). Three modes, strongest first; the
strongest one that works on this machine is chosen once per process (`Sandbox.capabilities()` says
which, and what is missing):

- "root" (the caller is root, as on our Debian 12 hosts): new mount, network, pid, ipc and uts
  namespaces; the command runs as a fresh unprivileged host uid (random, unique per sandbox), with no
  capabilities, no_new_privs, RLIMIT_NPROC counted for that uid alone. A uid of its own is stronger than
  a user namespace here: even a write that escaped the read-only mounts would be checked as "nobody".
- "userns" (an unprivileged caller, user namespaces allowed): the same namespaces inside a new user
  namespace; the command is uid 0 of that namespace (the caller's uid on the host) without any
  capability. RLIMIT_NPROC still holds per sandbox: since Linux 5.14 the kernel counts it per (user
  namespace, uid), so the sandbox's processes are counted apart from the caller's other processes.
- "none": only rlimits, a process group and the wall-clock kill. No network or filesystem isolation;
  the `inprocess` runtime refuses it, and the tests of those properties skip there, saying so.
A mode is chosen only after a probe sandbox showed, from inside, that every limit is in force and that
the process limit counts the sandbox alone (it forks until refused: `_limits_verdict`); a mode whose
process limit would not hold (an older kernel counting per host uid, for a non-root caller) is refused.

Inside a namespaced sandbox (see `_sandbox_init.py` for the steps) the filesystem is an allowlist built
on an empty tmpfs and entered with pivot_root, the old root detached: read-only /usr and the top-level
/bin, /lib..., a few /etc files (`SYSTEM_RO`), this Python's installation (`toolchain()`, or `expose`),
a minimal /dev, a /proc of the sandbox's own pid namespace, private size-limited tmpfs on /tmp,
/var/tmp and /dev/shm, and the tree read-write at its own path. Nothing else exists in there: not $HOME,
the hetrl checkout (hidden tests, reference patches), the run directory (config, secret), the task
rows, the repositories' clones (whose history holds the fix), /run or any other host socket, wherever
they live. The network namespace has only a loopback that is down, so every connect fails
(ENETUNREACH), to 127.0.0.1 of the host as much as to the internet. The wall-clock limit SIGKILLs the
launcher's process group; the kernel then kills the sandbox's pid 1 and with it every descendant,
including daemonized ones.

Output is written to unnamed host files (bounded by RLIMIT_FSIZE, so no pipe deadlocks and no unbounded
memory) and truncated to `Limits.output_chars` when read back.
"""
from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from rl.contract.config import SandboxLimitsConfig as _DEFAULTS
from rl.envs.swe import sandbox_limits, trees

_INIT = Path(__file__).with_name("_sandbox_init.py")
# The system part of the allowlist (bubblewrap binds the same): what python, git, patch and pytest read
# outside their own installation. Everything else of /etc (hostname, resolv.conf, gitconfig, ssh keys,
# cluster and scheduler configuration) stays out.
SYSTEM_RO = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
SYSTEM_ETC = ("/etc/ld.so.cache", "/etc/ld.so.conf", "/etc/ld.so.conf.d", "/etc/alternatives",
              "/etc/localtime", "/etc/passwd", "/etc/group", "/etc/nsswitch.conf", "/etc/hosts",
              "/etc/protocols", "/etc/services", "/etc/ssl/certs", "/etc/ca-certificates")
_NAMESPACES = ["--mount", "--net", "--pid", "--ipc", "--uts", "--fork", "--kill-child",
               "--propagation", "private"]


class SandboxError(RuntimeError):
    """The sandbox itself failed (setup, launcher), as opposed to the command failing inside it."""


@dataclass(frozen=True)
class Limits:
    """Per-command limits. cpu_s is CPU seconds (RLIMIT_CPU: SIGXCPU, then SIGKILL a second later);
    memory_bytes is each process's address space (RLIMIT_AS, so allocations beyond it fail with
    ENOMEM/MemoryError) and the budget of all the sandbox's processes together (sandbox_limits: past
    it the sandbox is killed); nproc counts processes of the sandbox uid; fsize_bytes caps any file
    written, stdout included; disk_bytes caps the tree (measured while commands run)."""
    cpu_s: int = _DEFAULTS.cpu_s          # defaults: the config's env.swe.limits (one set)
    memory_bytes: int = _DEFAULTS.memory_bytes
    nproc: int = _DEFAULTS.nproc
    fsize_bytes: int = _DEFAULTS.fsize_bytes
    nofile: int = _DEFAULTS.nofile
    tmp_bytes: int = _DEFAULTS.tmp_bytes
    disk_bytes: int = _DEFAULTS.disk_bytes
    output_chars: int = _DEFAULTS.output_chars


@dataclass(frozen=True)
class Result:
    returncode: int  # negative: killed by that signal (as subprocess does)
    stdout: str
    stderr: str
    timed_out: bool
    seconds: float


def _launcher(mode: str) -> list[str]:
    if mode == "root":
        return ["unshare", *_NAMESPACES]
    if mode == "userns":
        return ["unshare", "--user", "--map-root-user", *_NAMESPACES]
    return []


def _setpriv(mode: str, uid: int) -> list[str]:
    exe = shutil.which("setpriv")
    if exe is None:
        raise SandboxError("setpriv (util-linux) not found: it is needed to drop privileges")
    if mode == "root":
        return [exe, f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "--inh-caps=-all",
                "--bounding-set=-all", "--no-new-privs"]
    if mode == "userns":
        return [exe, "--inh-caps=-all", "--bounding-set=-all", "--no-new-privs"]
    return [exe, "--no-new-privs"]


def toolchain() -> list[str]:
    """Read-only paths a command needs besides /usr: this Python's prefixes (a venv and its base), both
    as named (scripts' shebangs name the venv path) and resolved."""
    paths = {os.path.realpath(p) for p in (sys.prefix, sys.base_prefix, sys.exec_prefix)}
    paths |= {sys.prefix, sys.exec_prefix}
    return sorted(p for p in paths if not p.startswith("/usr/") and p != "/usr")


# The probe every namespaced mode must pass before it is used: from inside, read the limits in force and
# fork (children wait on a pipe, so they stay counted) until the kernel refuses. Stdlib only, no site.
PROBE_NPROC = 8
PROBE_LIMITS = Limits(nproc=PROBE_NPROC)
_PROBE = ("import os, resource\n"
          "lim = [resource.getrlimit(getattr(resource, 'RLIMIT_' + n))[1] for n in "
          "('AS', 'FSIZE', 'NOFILE', 'NPROC')]\n"
          "r, w = os.pipe()\nn = 0\ntry:\n    for _ in range(%d):\n        if os.fork() == 0:\n"
          "            os.close(w); os.read(r, 1); os._exit(0)\n        n += 1\nexcept OSError:\n    pass\n"
          "print('PROBE', n, *lim)" % (8 * PROBE_NPROC))


def probe_argv() -> list[str]:
    return [sys.executable, "-I", "-S", "-c", _PROBE]


def limits_verdict(r: Result, limits: Limits = PROBE_LIMITS) -> str:
    """"" if the probe's output shows the memory, file and process limits in force and the process count
    the sandbox's own; else why not (one line). Forks refused before the limit means the count includes
    processes outside the sandbox (RLIMIT_NPROC counted per host uid, shared with the caller); forks
    beyond it, that nothing counts them."""
    words = r.stdout.split()
    if r.returncode != 0 or len(words) != 6 or words[0] != "PROBE":
        return (f"the limits probe failed (exit {r.returncode}): "
                f"{(r.stderr.strip().splitlines() or ['no output'])[-1][-300:]}")
    n, lim = int(words[1]), [int(w) for w in words[2:]]
    want = [limits.memory_bytes, limits.fsize_bytes, limits.nofile, limits.nproc]
    if lim != want:
        return f"limits not in force inside (address space, file size, files, processes: {lim}, want {want})"
    if n >= limits.nproc:
        return (f"the process limit does not hold: {n} forks with nproc={limits.nproc} (run as root, or "
                "on Linux >= 5.14, which counts processes per user namespace)")
    if n < limits.nproc - 4:
        return (f"the process limit is shared with processes outside the sandbox: only {n} forks with "
                f"nproc={limits.nproc} (RLIMIT_NPROC counted per host uid: run as root, or on Linux >= 5.14)")
    return ""


_CAPS: dict | None = None


class Sandbox:
    """One episode's sandbox. `Sandbox(tree, limits)` copies `tree` into a fresh private directory
    (`.tree`; the source is never touched); `.run(argv, timeout_s)` runs one command there; `close()`
    (or leaving the `with` block) deletes the copy. `expose` replaces the read-only paths shown besides
    the system allowlist (default: this Python's installation, `toolchain()`)."""

    def __init__(self, tree: Path | None, limits: Limits = Limits(), *, expose=None,
                 base_dir: Path | None = None, mode: str | None = None):
        self.limits = limits
        self.mode = mode or self.capabilities()["mode"]
        self._root = Path(tempfile.mkdtemp(prefix="hetrl-sbx-", dir=base_dir))
        os.chmod(self._root, 0o711)  # the sandbox uid must be able to traverse to its tree
        self.tree = self._root / "tree"
        self._newroot = self._root / "root"  # the sandbox's root tmpfs is mounted here, in its namespace
        self._newroot.mkdir(mode=0o700)
        self._memory = None
        try:
            if tree is None:
                self.tree.mkdir()
            else:  # a FIFO, device or socket, or absurd depth, is refused and nothing is left behind
                trees.copy_tree(tree, self.tree)
            # one memory budget for all the sandbox's processes (sandbox_limits: a cgroup, or a watch)
            try:
                self._memory = sandbox_limits.open_memory(limits.memory_bytes, limits.nproc)
            except OSError as e:  # a cgroup that cannot be made: the sandbox cannot hold its limit
                raise SandboxError(f"sandbox memory limit: {e}") from None
        except BaseException:
            self.close()
            raise
        self.disk = sandbox_limits.DiskWatch(self.tree, limits.disk_bytes)
        self.uid = random.SystemRandom().randrange(1_000_000, 2_000_000_000)
        self.expose = [str(p) for p in (expose if expose is not None else toolchain())]

    @classmethod
    def from_files(cls, files: dict[str, str], limits: Limits = Limits(), **kw) -> "Sandbox":
        """A sandbox whose tree holds `files` ({relative path: text})."""
        sb = cls(None, limits, **kw)
        for rel, text in files.items():
            p = sb.tree / rel
            p.parent.mkdir(parents=True, exist_ok=True)
            p.write_text(text)
        return sb

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def close(self):
        if self._memory is not None:
            self._memory.close()
            self._memory = None
        trees.remove_tree(self._root)

    def _own_tree(self):
        """Hand the tree to the sandbox uid (root mode): files the host wrote are then editable inside."""
        if self.mode != "root":
            return
        os.lchown(self.tree, self.uid, self.uid)
        os.chmod(self.tree, 0o700)  # another sandbox's uid cannot list or read it (TMPDIR may be shared)
        for d, entries in trees.walk(self.tree):
            for name, _ in entries:
                try:
                    os.lchown(os.path.join(self.tree, d, name), self.uid, self.uid)
                except FileNotFoundError:
                    pass

    def run(self, argv: list[str], timeout_s: float, input: str | bytes | None = None,
            env: dict[str, str] | None = None) -> Result:
        """Run argv (PATH-resolved inside) in the tree. Raises SandboxError if the sandbox could not be
        set up; the command's own failures are in the Result."""
        if not argv:
            raise ValueError("empty argv")
        if self.disk.over_limit:
            return Result(-signal.SIGXFSZ, "", sandbox_limits.refused_message(self.limits.disk_bytes),
                          False, 0.0)
        self._own_tree()
        cmd_env = {"PATH": f"{Path(sys.executable).parent}:/usr/local/bin:/usr/bin:/bin",
                   "HOME": "/tmp", "TMPDIR": "/tmp", "LANG": "C.UTF-8", "PYTHONDONTWRITEBYTECODE": "1",
                   "PYTHONUNBUFFERED": "1", **(env or {})}
        spec = {"mode": self.mode, "tree": str(self.tree), "argv": list(map(str, argv)), "env": cmd_env,
                "newroot": str(self._newroot), "ro": [*SYSTEM_RO, *SYSTEM_ETC, *self.expose],
                "tmp_bytes": self.limits.tmp_bytes, "limits": asdict(self.limits),
                "nproc": self.mode != "none",
                "setpriv": _setpriv(self.mode, self.uid)}
        data = input.encode() if isinstance(input, str) else (input or b"")
        with tempfile.TemporaryFile() as fin, tempfile.TemporaryFile() as fout, \
                tempfile.TemporaryFile() as ferr:
            fin.write(data)
            fin.seek(0)
            rfd, wfd = os.pipe()  # the init writes the command's status here: see _sandbox_init.py
            spec["status_fd"] = wfd
            # the launcher enters the sandbox's cgroup (if any) before it execs: nothing escapes it
            cmd = (self._memory.prefix() + _launcher(self.mode)
                   + [sys.executable, "-I", "-S", str(_INIT), json.dumps(spec)])
            t0 = time.monotonic()
            try:
                proc = subprocess.Popen(cmd, stdin=fin, stdout=fout, stderr=ferr, start_new_session=True,
                                        pass_fds=(wfd,),
                                        env={"PATH": os.environ.get("PATH", "/usr/bin:/bin")})
            finally:
                os.close(wfd)
            # unshare --kill-child takes the pid namespace down with the launcher's group
            timed_out, stop = sandbox_limits.supervise(
                proc, timeout_s, lambda: os.killpg(proc.pid, signal.SIGKILL), self._memory, self.disk)
            seconds = time.monotonic() - t0
            with os.fdopen(rfd) as f:
                status = f.read().split()
            out, err = (self._read(f) for f in (fout, ferr))
        if timed_out:
            return Result(-signal.SIGKILL, out, err, True, seconds)
        # after the command too: an OOM kill of one process that the command survived, a tree it left
        # over the limit as it ended
        if stop is None and self._memory.over(proc.pid):
            stop = "memory"
        if stop is None and self.disk.measure():
            stop = "disk"
        code = None
        if len(status) == 2:
            code = -int(status[1]) if status[0] == "signal" else int(status[1])
        if stop is not None:
            note = (sandbox_limits.memory_message(self.limits.memory_bytes) if stop == "memory" else
                    sandbox_limits.disk_message(self.limits.disk_bytes))
            default = -signal.SIGKILL if stop == "memory" else -signal.SIGXFSZ
            return Result(code or default, out, (err.rstrip("\n") + "\n" + note).lstrip("\n"), False,
                          seconds)
        if code is None:
            raise SandboxError(f"sandbox setup failed (launcher exit {proc.returncode}): "
                               f"{err.strip()[-2000:]}")
        return Result(code, out, err, False, seconds)

    def _read(self, f) -> str:
        f.seek(0)
        return f.read(self.limits.output_chars * 4).decode("utf-8", "replace")[: self.limits.output_chars]

    @staticmethod
    def capabilities() -> dict:
        """Which isolation works on this machine (probed once per process by running the limits probe
        in each mode, strongest first: it must start and show every limit holding) and what each
        property amounts to."""
        global _CAPS
        if _CAPS is not None:
            return _CAPS
        tried = {}
        modes = (["root"] if os.geteuid() == 0 else []) + ["userns"]
        mode = "none"
        for m in modes:
            if shutil.which("unshare") is None:
                tried[m] = "unshare (util-linux) not found"
                continue
            try:
                with Sandbox(None, PROBE_LIMITS, mode=m) as sb:
                    why = limits_verdict(sb.run(probe_argv(), timeout_s=30))
                if not why:
                    mode = m
                    break
                tried[m] = why
            except SandboxError as e:  # one line: its first and last (the failing mount, say)
                lines = str(e).strip().splitlines() or ["?"]
                tried[m] = lines[0] if len(lines) == 1 else f"{lines[0]} ... {lines[-1].strip()}"
        ns = mode != "none"
        _CAPS = {
            "mode": mode,
            "network": "network namespace, loopback down: no connection possible" if ns else "host network",
            "filesystem": ("an allowlist on a new root: /usr, a few /etc files and this Python read-only, "
                           "the tree and private tmpfs /tmp, /var/tmp, /dev/shm writable; nothing else "
                           "of the host") if ns else
                          "host filesystem with the caller's permissions",
            "user": {"root": "unique unprivileged host uid, no capabilities, no_new_privs",
                     "userns": "uid 0 of its own user namespace (the caller's uid on the host), no "
                               "capabilities, no_new_privs",
                     "none": "caller's uid, no_new_privs"}[mode],
            "processes": ("pid namespace: every descendant dies with the command or at the wall-clock "
                          "limit") if ns else "process group killed at the wall-clock limit (a setsid "
                                              "escapes it)",
            "rlimits": ["cpu", "address space", "file size", "open files", "core"]
                       + (["processes (counted per sandbox)"] if ns else []),
            "memory": _memory_text(),
            "disk": ("the tree measured while each command runs (every max(0.25 s, 20x one "
                     "measurement)) and after it: killed past env.swe.limits.disk_bytes, later commands "
                     "refused"),
            "missing": ([] if ns else ["per-sandbox process count limit"])
                       + ([] if ns else ["network isolation", "filesystem isolation", "pid isolation"])
                       + ["cgroup CPU accounting (RLIMIT_CPU bounds each process)",
                          "seccomp syscall filtering"],
            "unavailable_modes": tried,
        }
        return _CAPS


def _memory_text() -> str:
    kind, parent, why = sandbox_limits.memory_kind()
    if parent is not None:
        return (f"{kind}: one cgroup per sandbox under {parent}, memory limit for all its processes "
                "together (OOM kill ends the sandbox); RLIMIT_AS per process as well")
    return (f"watch: the PSS of the sandbox's processes summed every {sandbox_limits.WATCH_S}s, killed "
            f"past the limit (no cgroup: {why}); RLIMIT_AS per process as well")
