"""Sandbox runtimes behind one interface: where an episode's commands run, picked by `env.swe.runtime`.

Every runtime gives the SWE environment the same object: `open_runtime(name, tree, limits)` copies the
task's starting tree (or makes an empty one) into a private host directory, `.tree`; `.run(argv,
timeout_s, input, env)` runs one command with that tree as its working directory and returns a
`Result`; `.read_file` / `.write_file` / `.copy_out` move files across the boundary without following
links the agent planted; `.close()` deletes everything. It is the interface `rl.envs.swe.sandbox.Sandbox`
already had (`.tree`, `.run`, `.close`), so the tools and grading work under any runtime unchanged.

Why the tree always lives on the host, even for image runtimes: each command is a fresh sandbox (a new
bwrap, container or apptainer instance) over the same tree, so a wall-clock kill tears down everything
the command started, limits apply per command, and nothing of the sandbox outlives the command; the
episode's state is the tree alone. For an image whose repository lives inside it (SWE-bench's
/testbed), the image runtimes copy that directory out once when the sandbox is created.

Runtimes (docs/sandboxes.md compares them):
- `inprocess`: the namespace sandbox (unshare + pivot_root into an allowlisted root + setpriv + rlimits),
  for the embedded default.
- `bubblewrap`: no image; bwrap builds a filesystem from nothing but the node's toolchain (read-only)
  and the tree (rl/envs/swe/runtime_bwrap.py).
- `podman` (rootless) and `apptainer` (a SIF built once per image into `env.swe.image_cache`):
  rl/envs/swe/runtime_podman.py, rl/envs/swe/runtime_apptainer.py, imported only when picked.
A runtime whose program is missing or cannot isolate raises `RuntimeUnavailable` (one line naming the
runtime and what is missing) when it is opened; nothing ever falls back to a weaker runtime.

Sandbox starts are rate-limited per process (`StartLimiter`, a token bucket at
`env.swe.max_sandbox_starts_per_s`): a storm of hundreds of simultaneous starts (a new batch of episodes)
is what broke container runtimes at 128+ concurrent sandboxes elsewhere.
"""
from __future__ import annotations

import errno
import os
import random
import signal
import stat
import subprocess
import tempfile
import threading
import time
from pathlib import Path

from rl.contract import sandbox_runtimes
from rl.envs.swe import sandbox_limits, trees
from rl.envs.swe.sandbox import Limits, Result, Sandbox, SandboxError

# Where a runtime puts its status channel's fd in its own argv (`_command`). Substituted by identity,
# never by text: an argument of the agent's command that reads "{status_fd}" stays as it is.
STATUS_FD = type("_StatusFd", (str,), {})("{status_fd}")

RUNTIMES = sandbox_runtimes.NAMES  # the registry: rl.contract.sandbox_runtimes


class RuntimeUnavailable(SandboxError):
    """The picked runtime cannot run here, or cannot isolate: never a silent downgrade."""


class StartLimiter:
    """Token bucket: at most `rate` starts per second on average, bursts of `burst`. `acquire()` blocks
    until a token is free and returns the seconds it waited."""

    def __init__(self, rate: float, burst: int | None = None):
        if rate <= 0:
            raise ValueError(f"env.swe.max_sandbox_starts_per_s={rate}: must be positive")
        self.rate = float(rate)
        self.burst = max(1, int(burst if burst is not None else rate))
        self._tokens = float(self.burst)
        self._t = time.monotonic()
        self._lock = threading.Lock()

    def acquire(self) -> float:
        with self._lock:  # holding the lock while sleeping keeps the order of arrival
            now = time.monotonic()
            self._tokens = min(self.burst, self._tokens + (now - self._t) * self.rate)
            self._t = now
            wait = 0.0
            if self._tokens < 1:
                wait = (1 - self._tokens) / self.rate
                time.sleep(wait)
                self._t = time.monotonic()
                self._tokens = 1.0
            self._tokens -= 1
            return wait


_LIMITER: StartLimiter | None = None


def set_start_rate(rate: float) -> None:
    """The per-process start rate (from env.swe.max_sandbox_starts_per_s)."""
    global _LIMITER
    _LIMITER = StartLimiter(rate)


def _start_token() -> None:
    if _LIMITER is None:
        set_start_rate(8.0)  # SweConfig's default, for callers that never read the config
    _LIMITER.acquire()


# -- files across the boundary, never through a link --------------------------------------------------
def _parts(rel: str) -> list[str]:
    parts = [p for p in Path(rel).parts if p not in ("", ".")]
    if not parts or Path(rel).is_absolute() or ".." in parts:
        raise ValueError(f"path {rel!r}: must be relative to the tree, without '..'")
    return parts


def _open_beneath(root: Path, rel: str, flags: int, mode: int = 0o644, make_dirs: bool = False) -> int:
    """Open root/rel with every component opened O_NOFOLLOW relative to its parent's fd, so a symlink
    anywhere on the path (planted by the agent's code) is an error (ELOOP/ENOTDIR), never a way out."""
    parts = _parts(rel)
    fd = os.open(root, os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW)
    try:
        for name in parts[:-1]:
            try:
                nfd = os.open(name, os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=fd)
            except FileNotFoundError:
                if not make_dirs:
                    raise
                os.mkdir(name, 0o755, dir_fd=fd)
                nfd = os.open(name, os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=fd)
            os.close(fd)
            fd = nfd
        if make_dirs and flags & os.O_DIRECTORY:
            try:
                os.mkdir(parts[-1], 0o755, dir_fd=fd)
            except FileExistsError:
                pass
        return os.open(parts[-1], flags | os.O_NOFOLLOW | os.O_CLOEXEC, mode, dir_fd=fd)
    finally:
        os.close(fd)


class Runtime:
    """What every runtime offers; subclasses implement `_command` (the host argv that runs one command
    in a fresh sandbox over the tree) and may override `run`. The tree is at `.tree` on the host."""

    name = "runtime"
    host_memory = False  # its sandbox's processes are host processes: a cgroup (or the watch) bounds them

    def __init__(self, tree: Path | None, limits: Limits = Limits(), *, base_dir: Path | None = None):
        self.limits = limits
        self._root = Path(tempfile.mkdtemp(prefix=f"hetrl-{self.name}-", dir=base_dir))
        os.chmod(self._root, 0o711)  # the sandbox uid traverses to its tree, lists nothing else
        self.tree = self._root / "tree"
        self._memory = None
        try:
            if tree is None:
                self.tree.mkdir()
            else:  # a FIFO, device or socket, or absurd depth, is refused and nothing is left behind
                trees.copy_tree(tree, self.tree)
            if self.host_memory:
                try:
                    self._memory = sandbox_limits.open_memory(limits.memory_bytes, limits.nproc)
                except OSError as e:  # a cgroup that cannot be made: the sandbox cannot hold its limit
                    raise SandboxError(f"sandbox memory limit: {e}") from None
        except BaseException:
            trees.remove_tree(self._root)
            raise
        self.disk = sandbox_limits.DiskWatch(self.tree, limits.disk_bytes)
        self.uid = random.SystemRandom().randrange(1_000_000, 2_000_000_000) if os.geteuid() == 0 else None
        self.pass_fds: tuple[int, ...] = ()  # host fds the launcher must inherit

    @property
    def over_disk(self) -> bool:
        return self.disk.over_limit

    @classmethod
    def check(cls) -> None:
        """Raise RuntimeUnavailable (one line: the runtime, what is missing) unless it can isolate here."""

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def close(self):
        if getattr(self, "_memory", None) is not None:
            self._memory.close()
            self._memory = None
        trees.remove_tree(self._root)

    # files
    def read_file(self, rel: str) -> str | None:
        """Text of tree/rel, None if missing; a link anywhere on the path raises OSError, and so does
        anything but a regular file: a FIFO the agent planted is opened non-blocking and refused, so a
        host-side read (the service's /read, grading) cannot hang on it."""
        try:
            fd = _open_beneath(self.tree, rel, os.O_RDONLY | os.O_NONBLOCK)
        except FileNotFoundError:
            return None
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            raise OSError(errno.EINVAL, f"{rel}: not a regular file")
        with os.fdopen(fd, "rb") as f:
            return f.read(self.limits.fsize_bytes).decode("utf-8", "replace")

    def write_file(self, rel: str, text: str) -> None:
        """Replace tree/rel (a link there is removed, not followed); parent dirs are made as needed."""
        parent, name = os.path.split(rel.rstrip("/"))
        _parts(rel)
        if parent:
            os.close(_open_beneath(self.tree, parent, os.O_RDONLY | os.O_DIRECTORY, make_dirs=True))
        dfd = (_open_beneath(self.tree, parent, os.O_RDONLY | os.O_DIRECTORY) if parent else
               os.open(self.tree, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW))
        try:  # unlink first: a link, or a hard link to a host file, must not be written through
            if stat.S_ISDIR(os.stat(name, dir_fd=dfd, follow_symlinks=False).st_mode):
                raise IsADirectoryError(errno.EISDIR, f"{rel}: is a directory")
            os.unlink(name, dir_fd=dfd)
        except FileNotFoundError:
            pass
        finally:
            os.close(dfd)
        fd = _open_beneath(self.tree, rel, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        with os.fdopen(fd, "wb") as f:
            f.write(text.encode())
        self._own(self.tree / rel)

    def copy_out(self, dest: Path) -> Path:
        """Copy the tree to dest; links are copied as links, never followed; a FIFO, socket or device
        in it raises trees.TreeError (one line naming it) and leaves no partial copy."""
        trees.copy_tree(self.tree, dest)
        return dest

    # ownership: under root each sandbox runs as a uid of its own, which must own its tree
    def _own(self, path: Path | None = None):
        if self.uid is None:
            return
        for p in ([path] if path is not None else [self.tree]):
            os.lchown(p, self.uid, self.uid)
        if path is None:
            os.chmod(self.tree, 0o700)  # other sandboxes' uids cannot even list it
            for d, entries in trees.walk(self.tree):
                for name, _ in entries:
                    try:
                        os.lchown(os.path.join(self.tree, d, name), self.uid, self.uid)
                    except FileNotFoundError:
                        pass

    def tree_bytes(self) -> int:
        """Disk used by the tree (allocated blocks, each inode once, links not followed)."""
        return trees.tree_bytes(self.tree)

    # commands
    def _command(self, argv: list[str], env: dict[str, str]) -> list[str]:
        raise NotImplementedError

    def _kill(self, proc: subprocess.Popen) -> None:
        """Tear down everything a timed-out command started (default: the launcher's process group;
        the runtimes' pid namespaces then take every descendant with them)."""
        os.killpg(proc.pid, signal.SIGKILL)

    def run(self, argv: list[str], timeout_s: float, input: str | bytes | None = None,
            env: dict[str, str] | None = None) -> Result:
        if not argv:
            raise ValueError("empty argv")
        if self.over_disk:
            return Result(-signal.SIGXFSZ, "", sandbox_limits.refused_message(self.limits.disk_bytes),
                          False, 0.0)
        self._own()
        cmd = self._command(list(map(str, argv)), env or {})
        memory = self._memory
        if memory is not None:
            cmd = memory.prefix() + cmd
        data = input.encode() if isinstance(input, str) else (input or b"")
        with tempfile.TemporaryFile() as fin, tempfile.TemporaryFile() as fout, \
                tempfile.TemporaryFile() as ferr:
            fin.write(data)
            fin.seek(0)
            rfd, wfd = os.pipe()  # the runtime's own status channel: setup failure vs command failure
            t0 = time.monotonic()
            try:
                proc = subprocess.Popen([str(wfd) if c is STATUS_FD else c for c in cmd], stdin=fin,
                                        stdout=fout, stderr=ferr, start_new_session=True,
                                        pass_fds=(wfd, *self.pass_fds),
                                        env={"PATH": os.environ.get("PATH", "/usr/bin:/bin")})
            finally:
                os.close(wfd)
            timed_out, stop = sandbox_limits.supervise(proc, timeout_s, lambda: self._kill(proc), memory,
                                                       self.disk)
            seconds = time.monotonic() - t0
            with os.fdopen(rfd, "rb") as f:
                status = f.read().decode("utf-8", "replace")
            out, err = (self._read(f) for f in (fout, ferr))
        if timed_out:
            return Result(-signal.SIGKILL, out, err, True, seconds)
        if stop is None and memory is not None and memory.over(proc.pid):
            stop = "memory"
        if stop is None and self.disk.measure():
            stop = "disk"
        if stop is None:
            return self._result(proc.returncode, status, out, err, seconds)
        try:
            code = self._result(proc.returncode, status, out, err, seconds).returncode
        except SandboxError:  # killed before it could report: the limit is the reason
            code = 0
        note = (sandbox_limits.memory_message(self.limits.memory_bytes) if stop == "memory" else
                sandbox_limits.disk_message(self.limits.disk_bytes))
        return Result(code or (-signal.SIGKILL if stop == "memory" else -signal.SIGXFSZ), out,
                      (err.rstrip("\n") + "\n" + note).lstrip("\n"), False, seconds)

    def _result(self, returncode: int, status: str, out: str, err: str, seconds: float) -> Result:
        return Result(returncode, out, err, False, seconds)

    def _read(self, f) -> str:
        f.seek(0)
        return f.read(self.limits.output_chars * 4).decode("utf-8", "replace")[: self.limits.output_chars]


class InprocessRuntime(Runtime):
    """The namespace sandbox of rl/envs/swe/sandbox.py behind the runtime interface. It starts only in a
    mode whose probe showed every limit holding per sandbox (`Sandbox.capabilities()`)."""

    name = "inprocess"

    def __init__(self, tree: Path | None, limits: Limits = Limits(), *, base_dir: Path | None = None):
        self.check()
        self._sb = Sandbox(tree, limits, base_dir=base_dir)
        self.limits, self.tree, self._root, self.uid = limits, self._sb.tree, self._sb.tree.parent, None
        self.disk, self._memory = self._sb.disk, None  # the Sandbox holds its memory guard

    @classmethod
    def check(cls) -> None:
        caps = Sandbox.capabilities()
        if caps["mode"] == "none":  # no mode both isolates and holds its limits: say why, per mode
            why = "; ".join(f"{m}: {w}" for m, w in caps["unavailable_modes"].items()) or "unshare not run"
            raise RuntimeUnavailable(f"runtime inprocess: cannot isolate or enforce its limits here ({why}); "
                                     "run as root, or allow unprivileged user namespaces on Linux >= 5.14, "
                                     "or a container runtime with cgroup v2 limits (env.swe.runtime=podman)")

    def _own(self, path: Path | None = None):
        if path is not None and self._sb.mode == "root":
            os.lchown(path, self._sb.uid, self._sb.uid)

    def run(self, argv, timeout_s, input=None, env=None) -> Result:
        return self._sb.run(argv, timeout_s, input=input, env=env)

    def close(self):
        self._sb.close()


def runtime_class(name: str) -> type[Runtime]:
    """The class of a runtime, imported only when picked (podman/apptainer code is never loaded else)."""
    import importlib
    row = sandbox_runtimes.get(name)   # the registry names the module and class
    return getattr(importlib.import_module(row.module), row.cls)


def open_runtime(name: str, tree: Path | None = None, limits: Limits = Limits(), **kw) -> Runtime:
    """A fresh sandbox of runtime `name` over a copy of `tree` (image runtimes also take image=...,
    image_cache=...). Waits for a start token first; raises RuntimeUnavailable if it cannot isolate."""
    cls = runtime_class(name)
    cls.check()
    _start_token()
    return cls(tree, limits, **kw)


def from_config(swe) -> dict:
    """The runtime settings of a typed `env.swe` section, and the process's start rate set from it:
    {"name": ..., "image_cache": ...} to pass on to open_runtime."""
    set_start_rate(float(swe.max_sandbox_starts_per_s))
    out = {"name": str(swe.runtime)}
    if sandbox_runtimes.get(str(swe.runtime)).needs_image_cache:
        out["image_cache"] = str(swe.image_cache)
    return out

