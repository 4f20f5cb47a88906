"""Memory and disk limits per sandbox, not per process.

rlimits bound one process each: a sandbox of eight processes under RLIMIT_AS=1 GiB can hold 8 GiB
resident (a red-team probe held 1361 MB against 1024 MB), and nothing bounded what the inprocess
runtime wrote into its tree (160 MB against a 100 MB `disk_bytes`). Here every sandbox gets one budget
for all its processes together, enforced by the strongest mechanism this host offers, chosen once per
process (`memory_kind()`; `Sandbox.capabilities()["memory"]` and docs/sandboxes.md say which):

- "cgroup v2": a cgroup of its own (`hetrl-sbx-<pid>-<random>`) under a parent whose
  `cgroup.subtree_control` enables `memory` (the `HETRL_SANDBOX_CGROUP` directory, for a delegated
  cgroup, else this process's own cgroup when that is possible): `memory.max` = memory_bytes,
  `memory.swap.max` = 0, `memory.oom.group` = 1 (an OOM kill takes the whole sandbox), `pids.max` =
  nproc when the pids controller is there.
- "cgroup v1": the same with the v1 memory controller (`memory.limit_in_bytes`, and
  `memory.memsw.limit_in_bytes` where swap is accounted), under this process's own memory cgroup
  (hybrid hosts such as ours, where every controller is still on v1).
- "watch" (no writable cgroup: a non-root user without delegation): the host sums the proportional
  set size (PSS, so shared libraries count once) of the sandbox's processes every `WATCH_S` seconds and
  kills the sandbox past the limit. It can be overshot by what the sandbox allocates between two looks
  (each process stays bounded by RLIMIT_AS = memory_bytes), and /tmp's tmpfs pages are bounded by
  tmp_bytes, not here.
The launcher enters its cgroup before it execs anything (`prefix()`: `sh` writes 0 to the cgroup's
`cgroup.procs`, then execs), so nothing the command starts is ever outside it. A cgroup counts page
cache and tmpfs pages too; page cache is reclaimed before anything is killed. When the kernel's OOM
killer (or the watch) acts, the whole sandbox is killed and the command's result says so in one line:
"sandbox: killed: its processes together reached the memory limit (env.swe.limits.memory_bytes=N)".
`HETRL_SANDBOX_MEMORY` = auto (default) | cgroup (refuse to run without one) | watch (never a cgroup).

Disk (`DiskWatch`): the tree lives on the host's filesystem, which has no per-directory quota here, so
its size (`trees.tree_bytes`: allocated blocks, hard links once) is measured while the command runs,
every max(`DISK_WATCH_S`, 20 x the time one measurement takes) so that a big tree costs at most ~5% of
a core, and once more when it ends. Past `disk_bytes` the command is killed (exit -25, SIGXFSZ's
number, "sandbox: killed: the tree reached its disk limit ...") and every later command of that sandbox
is refused the same way. A command can overshoot by what it writes within one interval (each file
capped by fsize_bytes), never more.
"""
from __future__ import annotations

import os
import random
import signal
import subprocess
import time
from pathlib import Path

from rl.envs.swe import trees

ENV_KIND = "HETRL_SANDBOX_MEMORY"
ENV_PARENT = "HETRL_SANDBOX_CGROUP"
WATCH_S = 0.05           # the watch backend's look at the sandbox's memory
CGROUP_POLL_S = 0.1      # a look at the cgroup's OOM-kill count
DISK_WATCH_S = 0.25      # the shortest interval between two measurements of the tree
_PREFIX = "hetrl-sbx-"


def memory_message(limit: int) -> str:
    return (f"sandbox: killed: its processes together reached the memory limit "
            f"(env.swe.limits.memory_bytes={limit})")


def disk_message(limit: int) -> str:
    return f"sandbox: killed: the tree reached its disk limit (env.swe.limits.disk_bytes={limit})"


def refused_message(limit: int) -> str:
    return (f"sandbox: the tree is over its disk limit (env.swe.limits.disk_bytes={limit}); "
            "nothing runs")


# -- where a cgroup can go ----------------------------------------------------------------------------
def _mounts() -> list[tuple[str, str, str, str]]:
    """(root within the hierarchy, mount point, fstype, super options) of each cgroup mount."""
    out = []
    try:
        with open("/proc/self/mountinfo") as f:
            for line in f:
                left, _, right = line.partition(" - ")
                a, b = left.split(), right.split()
                if len(a) >= 5 and len(b) >= 3 and b[0] in ("cgroup", "cgroup2"):
                    out.append((a[3], a[4].encode().decode("unicode_escape"), b[0], b[2]))
    except OSError:
        pass
    return out


def _own_cgroups() -> dict[str, str]:
    """{"" (v2) or a v1 controller: this process's cgroup path}."""
    out = {}
    try:
        with open("/proc/self/cgroup") as f:
            for line in f:
                parts = line.rstrip("\n").split(":", 2)
                if len(parts) == 3:
                    for c in (parts[1].split(",") if parts[1] else [""]):
                        out[c] = parts[2]
    except OSError:
        pass
    return out


def _join(mount_root: str, point: str, path: str) -> Path | None:
    if mount_root != "/" and not (path == mount_root or path.startswith(mount_root.rstrip("/") + "/")):
        return None
    rel = path[len(mount_root):] if mount_root != "/" else path
    return Path(point + "/" + rel.lstrip("/")).resolve()


def _try_child(parent: Path, version: int) -> str:
    """"" if a child cgroup with a memory limit can be made under parent, else why not."""
    probe = parent / f"{_PREFIX}probe-{os.getpid()}-{random.randrange(1 << 30)}"
    try:
        probe.mkdir()
    except OSError as e:
        return f"cannot create a cgroup under {parent}: {e.strerror}"
    try:
        (probe / ("memory.max" if version == 2 else "memory.limit_in_bytes")).write_text(str(64 << 20))
        return ""
    except OSError as e:
        return f"cannot set a memory limit under {parent}: {e.strerror}"
    finally:
        try:
            probe.rmdir()
        except OSError:
            pass


def _v2_parent() -> tuple[Path | None, str]:
    own = _own_cgroups().get("")
    mounts = [(r, p) for r, p, t, _ in _mounts() if t == "cgroup2"]
    given = os.environ.get(ENV_PARENT)
    if given:
        cands = [Path(given)]
    elif own is not None and mounts:
        cands = [c for c in (_join(r, p, own) for r, p in mounts) if c is not None]
    else:
        return None, "no cgroup v2 hierarchy"
    for c in cands:
        ctl = c / "cgroup.subtree_control"
        try:
            enabled = ctl.read_text().split()
        except OSError as e:
            return None, f"{ctl}: {e.strerror}"
        if "memory" not in enabled:
            try:  # possible only where the cgroup holds no process itself (the v2 "no internal process" rule)
                ctl.write_text("+memory")
            except OSError as e:
                return None, f"{c}: the memory controller is not enabled for its children ({e.strerror})"
        why = _try_child(c, 2)
        return (c, "") if not why else (None, why)
    return None, "no cgroup v2 hierarchy holds this process"


def _v1_parent() -> tuple[Path | None, str]:
    own = _own_cgroups().get("memory")
    for root, point, fstype, opts in _mounts():
        if fstype == "cgroup" and "memory" in opts.split(",") and own is not None:
            c = _join(root, point, own)
            if c is None:
                continue
            why = _try_child(c, 1)
            return (c, "") if not why else (None, why)
    return None, "no cgroup v1 memory hierarchy"


_KIND: tuple[str, Path | None, str, str] | None = None  # (kind, parent, why, the wish it answers)


def memory_kind() -> tuple[str, Path | None, str]:
    """(kind, parent cgroup or None, why the cgroups were not used) for this process, found once:
    ("cgroup v2", dir, ""), ("cgroup v1", dir, "") or ("watch", None, reasons)."""
    global _KIND
    want = os.environ.get(ENV_KIND, "auto")
    if want not in ("auto", "cgroup", "watch"):
        raise ValueError(f"{ENV_KIND}={want!r}: must be auto, cgroup or watch")
    if _KIND is None or _KIND[3] != want:
        why = []
        got = None
        if want != "watch":
            for version, find in ((2, _v2_parent), (1, _v1_parent)):
                parent, reason = find()
                if parent is not None:
                    got = (f"cgroup v{version}", parent, "")
                    break
                why.append(f"v{version}: {reason}")
        if got is None:
            got = ("watch", None, "; ".join(why) if why else f"{ENV_KIND}=watch")
        _KIND = (*got, want)
    return _KIND[:3]


def _clean_stale(parent: Path) -> None:
    """Remove empty sandbox cgroups left by processes that died without closing them."""
    try:
        names = os.listdir(parent)
    except OSError:
        return
    for name in names:
        if not name.startswith(_PREFIX):
            continue
        pid = name[len(_PREFIX):].split("-", 1)[0]
        if pid.isdigit() and not os.path.exists(f"/proc/{pid}"):
            try:
                os.rmdir(parent / name)
            except OSError:
                pass


# -- one sandbox's memory ---------------------------------------------------------------------------
class CgroupMemory:
    """A cgroup of one sandbox; its launcher enters it before exec (`prefix`)."""

    def __init__(self, version: int, parent: Path, limit: int, nproc: int | None):
        self.version, self.limit = version, limit
        _clean_stale(parent)
        self.path = parent / f"{_PREFIX}{os.getpid()}-{random.SystemRandom().randrange(1 << 40):x}"
        self.path.mkdir(mode=0o755)
        try:
            if version == 2:
                self._write("memory.max", limit)
                self._write("memory.swap.max", 0, optional=True)
                self._write("memory.oom.group", 1, optional=True)
                if nproc:
                    self._write("pids.max", nproc, optional=True)
            else:
                self._write("memory.limit_in_bytes", limit)
                self._write("memory.memsw.limit_in_bytes", limit, optional=True)
        except BaseException:
            self.close()
            raise
        self._seen = self.oom_kills()

    def _write(self, name: str, value: int, optional: bool = False) -> None:
        p = self.path / name
        if optional and not p.exists():
            return
        p.write_text(str(value))

    def prefix(self) -> list[str]:
        return ["/bin/sh", "-c", 'echo 0 > "$0" && exec "$@"', str(self.path / "cgroup.procs")]

    def oom_kills(self) -> int:
        name = "memory.events" if self.version == 2 else "memory.oom_control"
        try:
            for line in (self.path / name).read_text().splitlines():
                k, _, v = line.partition(" ")
                if k == "oom_kill":
                    return int(v)
        except (OSError, ValueError):
            pass
        return 0

    def poll_s(self) -> float:
        return CGROUP_POLL_S

    def over(self, pid: int) -> bool:
        n = self.oom_kills()
        if n > self._seen:
            self._seen = n
            return True
        return False

    def kill(self) -> None:
        if self.version == 2 and (self.path / "cgroup.kill").exists():
            try:
                (self.path / "cgroup.kill").write_text("1")
                return
            except OSError:
                pass
        try:
            pids = (self.path / "cgroup.procs").read_text().split()
        except OSError:
            return
        for p in pids:
            try:
                os.kill(int(p), signal.SIGKILL)
            except (ProcessLookupError, ValueError):
                pass

    def close(self) -> None:
        for i in range(50):  # a killed sandbox's processes take a moment to leave
            try:
                self.path.rmdir()
                return
            except FileNotFoundError:
                return
            except OSError:
                if i == 10:
                    self.kill()
                time.sleep(0.02)


class WatchedMemory:
    """No cgroup: the sum of the PSS of the launcher's descendants, looked at every WATCH_S."""

    def __init__(self, limit: int):
        self.limit = limit

    def prefix(self) -> list[str]:
        return []

    def poll_s(self) -> float:
        return WATCH_S

    @staticmethod
    def _children(pid: int) -> list[int]:
        out = []
        try:
            tids = os.listdir(f"/proc/{pid}/task")
        except OSError:
            return out
        for tid in tids:
            try:
                with open(f"/proc/{pid}/task/{tid}/children") as f:
                    out += [int(x) for x in f.read().split()]
            except OSError:
                pass
        return out

    @staticmethod
    def _pss(pid: int) -> int:
        try:
            with open(f"/proc/{pid}/smaps_rollup") as f:
                for line in f:
                    if line.startswith("Pss:"):
                        return int(line.split()[1]) * 1024
        except OSError:
            pass
        try:
            with open(f"/proc/{pid}/statm") as f:
                return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        except (OSError, IndexError, ValueError):
            return 0

    def usage(self, pid: int) -> int:
        total, stack, seen = 0, [pid], set()
        while stack:
            p = stack.pop()
            if p in seen:
                continue
            seen.add(p)
            total += self._pss(p)
            stack += self._children(p)
        return total

    def over(self, pid: int) -> bool:
        return self.usage(pid) > self.limit

    def kill(self) -> None:
        pass  # the caller kills the launcher's group; the pid namespace takes the rest

    def close(self) -> None:
        pass


def open_memory(limit: int, nproc: int | None = None):
    """The memory guard of one new sandbox, by `memory_kind()`."""
    kind, parent, why = memory_kind()
    if kind == "watch" and os.environ.get(ENV_KIND) == "cgroup":
        raise OSError(f"{ENV_KIND}=cgroup, and no cgroup can be made here ({why})")
    if kind.startswith("cgroup"):
        return CgroupMemory(int(kind[-1]), parent, limit, nproc)
    return WatchedMemory(limit)


# -- one sandbox's disk -------------------------------------------------------------------------------
class DiskWatch:
    def __init__(self, tree: Path, limit: int):
        self.tree, self.limit = tree, limit
        self.interval = DISK_WATCH_S
        self.next = 0.0
        self.over_limit = False

    def measure(self) -> bool:
        """True if the tree is over the limit now (sets over_limit: later commands are refused)."""
        t0 = time.monotonic()
        try:
            used = trees.tree_bytes(self.tree)
        except OSError:
            used = 0  # a walk that cannot finish (deeper than it can go) is measured at the end again
        took = time.monotonic() - t0
        self.interval = max(DISK_WATCH_S, 20 * took)
        self.next = time.monotonic() + self.interval
        if used > self.limit:
            self.over_limit = True
        return self.over_limit


def supervise(proc: subprocess.Popen, timeout_s: float, kill, memory, disk: DiskWatch | None
              ) -> tuple[bool, str | None]:
    """Wait for proc, killing it (`kill()`, then the memory guard's own kill) at the wall-clock limit,
    at the memory limit or at the disk limit. Returns (timed_out, "memory" | "disk" | None)."""
    deadline = time.monotonic() + timeout_s
    if disk is not None:
        disk.next = time.monotonic() + DISK_WATCH_S
    tick = min(memory.poll_s() if memory is not None else DISK_WATCH_S, DISK_WATCH_S)
    while True:
        left = deadline - time.monotonic()
        try:
            proc.wait(timeout=max(0.0, min(tick, left)))
            return False, None
        except subprocess.TimeoutExpired:
            pass
        stop = None
        if time.monotonic() >= deadline:
            stop = "timeout"
        elif memory is not None and memory.over(proc.pid):
            stop = "memory"
        elif disk is not None and time.monotonic() >= disk.next and disk.measure():
            stop = "disk"
        if stop:
            kill()
            if memory is not None:
                memory.kill()
            proc.wait()
            return stop == "timeout", (None if stop == "timeout" else stop)
